"""A tiny policy for the search agent: a tokenizer trained on a corpus's passages with the
Search-R1 tags kept whole, and a randomly initialised tiny Qwen3 for it
(``trace_lightning.models``), for tests and benchmarks of the search task on real text."""

from __future__ import annotations

import json
from pathlib import Path

from trace_lightning.models import build_tiny_model, train_tokenizer

AGENT_TAGS = ["<think>", "</think>", "<search>", "</search>", "<answer>", "</answer>",
              "<information>", "</information>"]


def build_tiny_from_corpus(corpus: str | Path, out_dir: str | Path, vocab_size: int = 1024,
                           passages: int = 300, seed: int = 0, **config) -> Path:
    """Train a tokenizer on the first ``passages`` passages of a JSONL corpus plus the agent
    tags, and save a tiny Qwen3 for it in ``out_dir`` (see ``build_tiny_model``)."""
    texts = read_corpus_texts(corpus, passages) + [" ".join(AGENT_TAGS)]
    tokenizer = train_tokenizer(texts, vocab_size, AGENT_TAGS)
    return build_tiny_model(tokenizer, out_dir, seed=seed, **config)


def read_corpus_texts(path: str | Path, limit: int) -> list[str]:
    """The first ``limit`` passages (``title. text``) of a JSONL corpus
    (``{"title", "text"}`` or FlashRAG's ``{"contents"}``)."""
    texts: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if len(texts) >= limit:
                break
            rec = json.loads(line)
            if "contents" in rec:
                texts.append(rec["contents"])
            else:
                texts.append(f"{rec['title']}. {rec['text']}")
    return texts
