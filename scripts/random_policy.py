"""A random-weight policy of Qwen3-0.6B's shape, for measuring a step's seconds and memory.

    python scripts/random_policy.py --corpus CORPUS.jsonl --out runs/random_qwen3_0.6b

Nothing is downloaded: the tokenizer is a byte-level BPE trained on the corpus (aimed at Qwen's
151,669 entries; a small corpus supports fewer), then filled with reserved entries up
to Qwen3-0.6B's 151,936 embedding rows, so the embedding and the tied LM head have the real
model's size and every id the policy can sample decodes (a reserved one to its own name).
The layers are Qwen3-0.6B's (28 layers of width 1024, 16 query and 8 key/value heads of 128,
MLP 3072), randomly initialised and saved in float32 with the tokenizer (``save_pretrained``),
a directory that ``--model.policy_path`` takes. Such a policy has the real one's cost per
token, not its behaviour: it never writes a valid action, so its episodes end after one turn.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Qwen3-0.6B's config.json (hub id Qwen/Qwen3-0.6B), the fields that fix its shape and numerics
QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, vocab_size=151_936)
QWEN_TOKENIZER_ENTRIES = 151_669  # len() of Qwen3's own tokenizer
THINK_TAGS = ["<think>", "</think>"]  # single tokens in Qwen3's tokenizer too


def build_tokenizer(corpus: str | Path, vocab_size: int,
                    bpe_entries: int = QWEN_TOKENIZER_ENTRIES, passages: int | None = None):
    """A BPE tokenizer trained on ``corpus`` (at most ``bpe_entries`` entries), filled to
    exactly ``vocab_size`` entries with reserved ones (``<|reserved_N|>``: plain vocabulary
    entries that no merge produces, so text never encodes to them and each decodes to its
    name; as added tokens, 27k of them made transformers load the tokenizer in 25 s).
    Returns the tokenizer and its trained entries."""
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from trace_lightning.models import CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN, train_tokenizer
    from trace_lightning.tasks.search_qa.tiny_policy import read_corpus_texts

    texts = read_corpus_texts(corpus, passages if passages is not None else 10**12)
    trained_tok = train_tokenizer(texts, min(bpe_entries, vocab_size), THINK_TAGS)
    trained = len(trained_tok)
    if trained > vocab_size:
        raise ValueError(f"the tokenizer has {trained} entries, more than the model's "
                         f"{vocab_size} rows; lower --bpe-entries")
    spec = json.loads(trained_tok.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    base = len(vocab)  # the agent tags come after the BPE's own entries: move them to the end
    vocab.update({f"<|reserved_{i}|>": base + i for i in range(vocab_size - trained)})
    outside = [t for t in spec["added_tokens"] if t["content"] not in vocab]
    for k, token in enumerate(outside):
        token["id"] = len(vocab) + k
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN, chat_template=CHAT_TEMPLATE, padding_side="left")
    assert len(tokenizer) == vocab_size, (len(tokenizer), vocab_size)
    return tokenizer, trained


def build(corpus: str | Path, out: str | Path, seed: int = 0,
          bpe_entries: int = QWEN_TOKENIZER_ENTRIES, passages: int | None = None,
          **shape) -> dict:
    """Train the tokenizer, build the random Qwen3 (``QWEN3_0_6B`` with ``shape`` on top: tests
    build a small one) and save both to ``out``; returns what was built."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = {**QWEN3_0_6B, **shape}
    tokenizer, trained = build_tokenizer(corpus, fields["vocab_size"], bpe_entries, passages)
    config = Qwen3Config(**fields, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).float()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"out": str(out), "parameters": sum(p.numel() for p in model.parameters()),
            "vocab_size": fields["vocab_size"], "bpe_entries": trained,
            "reserved_entries": fields["vocab_size"] - trained}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--corpus", required=True,
                        help="corpus JSONL the tokenizer is trained on ({title, text} or "
                             "{contents} per line)")
    parser.add_argument("--out", required=True, help="directory to write (model + tokenizer)")
    parser.add_argument("--seed", type=int, default=0, help="torch seed of the random weights")
    parser.add_argument("--bpe-entries", type=int, default=QWEN_TOKENIZER_ENTRIES,
                        help="most entries of the trained BPE (the rest are reserved tokens)")
    args = parser.parse_args(argv)
    built = build(args.corpus, args.out, seed=args.seed, bpe_entries=args.bpe_entries)
    print(" ".join(f"{k}={v}" for k, v in built.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
