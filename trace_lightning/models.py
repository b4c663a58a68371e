"""Tiny Qwen3 models and a byte-level BPE tokenizer, built from scratch.

No weights or tokenizers can be downloaded at run time, so tests, benchmarks and the CPU demo
train a tokenizer on real text and build a randomly initialised Qwen3 of a few hundred
thousand parameters. ``build_tiny_model`` saves model and tokenizer into one directory with
``save_pretrained``; transformers and vLLM both load that directory.

The tokenizer mirrors Qwen's conventions: ``<|im_start|>``/``<|im_end|>`` chat markers,
``<|im_end|>`` as end of sequence and ``<|endoftext|>`` as padding.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
CONTROL_TOKENS = [PAD_TOKEN, "<|im_start|>", EOS_TOKEN]

# Qwen-style chat template, without tools or thinking switches.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int,
                    special_tokens: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with a chat template.

    Args:
        texts: training text (any iterable of strings).
        vocab_size: target vocabulary size, control tokens and ``special_tokens`` included.
        special_tokens: strings kept whole as one token each, e.g. an agent's tags. They are
            added as *non-special* added tokens so that decoding (which by default skips
            special tokens, in vLLM too) keeps them and stop strings such as ``</search>``
            can match. The chat control tokens (``CONTROL_TOKENS``) are always added and
            are special.

    Returns:
        A fast tokenizer with ``eos_token`` = ``<|im_end|>``, ``pad_token`` =
        ``<|endoftext|>`` and a chat template; ``save_pretrained`` writes a directory that
        transformers' ``AutoTokenizer`` and vLLM load.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    extra = [t for t in special_tokens if t not in CONTROL_TOKENS]
    trainer = trainers.BpeTrainer(
        vocab_size=max(vocab_size - len(extra), 256 + len(CONTROL_TOKENS)),
        special_tokens=CONTROL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
    )


def tiny_qwen3_config(vocab_size: int, hidden_size: int = 64, layers: int = 2, heads: int = 4,
                      kv_heads: int = 2, intermediate: int = 128, max_position: int = 2048,
                      tie_word_embeddings: bool = True, head_dim: int = 32,
                      **extra) -> Qwen3Config:
    """A small Qwen3 config.

    Args:
        vocab_size: the tokenizer's ``len(tokenizer)``.
        hidden_size: model width.
        layers: number of decoder layers.
        heads: query heads.
        kv_heads: key/value heads (grouped-query attention).
        intermediate: MLP width.
        max_position: longest sequence.
        tie_word_embeddings: share the embedding and the LM head.
        head_dim: per-head width; vLLM's CPU attention supports 32, 64, 80, ... only, so
            it is decoupled from ``hidden_size / heads``.
        **extra: any other ``Qwen3Config`` field (e.g. ``initializer_range``).
    """
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=max_position,
        tie_word_embeddings=tie_word_embeddings,
        head_dim=head_dim,
        **extra,
    )


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path, seed: int = 0,
                     dtype: torch.dtype = torch.float32, **config) -> Path:
    """Build a random tiny Qwen3 for ``tokenizer`` and save model + tokenizer to ``out_dir``.

    Args:
        tokenizer: from ``train_tokenizer``.
        out_dir: directory to write (created if missing).
        seed: torch seed of the random initialisation.
        dtype: parameter dtype saved (and loaded by vLLM with ``dtype="auto"``).
        **config: forwarded to ``tiny_qwen3_config``.

    Returns:
        ``out_dir`` as a ``Path``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_qwen3_config(
        len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **config,
    )
    cfg.dtype = dtype
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).to(dtype)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
