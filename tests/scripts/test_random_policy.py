"""scripts/random_policy.py: the random-weight policy of Qwen3-0.6B's shape that
docs/your_data.md measures, built here at a small shape on a real corpus."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import random_policy  # noqa: E402

CORPUS = Path("/work/shared/data/2wikimultihopqa/corpus.jsonl")


def test_help():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "random_policy.py"), "--help"],
                          capture_output=True, text=True, check=True)
    assert "--corpus" in proc.stdout and "--out" in proc.stdout


def test_shape_is_qwen3_0_6b():
    # Qwen/Qwen3-0.6B's config.json
    assert random_policy.QWEN3_0_6B == dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        vocab_size=151_936)


def test_every_row_of_the_embedding_is_a_token_that_decodes(tmp_path):
    """The tokenizer fills the model's rows exactly: every id the policy can sample decodes
    to text, text never encodes to a reserved entry, and the agent's think tags stay one
    token each."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    built = random_policy.build(CORPUS, tmp_path, bpe_entries=1000, passages=300,
                                hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                vocab_size=2048)
    assert built["vocab_size"] == 2048 and built["bpe_entries"] <= 1000
    assert built["reserved_entries"] == 2048 - built["bpe_entries"]
    tok = AutoTokenizer.from_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert len(tok) == model.get_input_embeddings().weight.shape[0] == 2048
    assert all(tok.decode([i]) for i in range(len(tok)))
    text = "<think> Who wrote it? </think> <|reserved_0|>"
    ids = tok(text).input_ids
    assert not any(tok.convert_ids_to_tokens(i).startswith("<|reserved_") for i in ids)
    assert len(tok("<think>").input_ids) == 1 and len(tok("</think>").input_ids) == 1
