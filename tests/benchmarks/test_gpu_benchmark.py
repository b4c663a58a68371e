"""benchmarks/gpu.py: the CPU smoke run and its FLOP count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from builders import load_benchmark

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu.py"


def load_gpu_module():
    return load_benchmark("gpu")


@pytest.mark.slow
def test_gpu_benchmark_tiny_runs_every_section(tmp_path):
    """``--tiny`` on CPU runs every section (FSDP1 over gloo) and ends with one JSON line.

    In a subprocess: the FSDP sections start a gloo process group, which must not outlive the
    run in the test process."""
    out = tmp_path / "gpu.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--steps", "1",
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    results = json.loads(last)
    assert json.loads(out.read_text()) == results
    sections = ["model", "padding", "logprobs", "plain", "ours", "ours_fp32_master",
                "generation", "ours_auto", "plain_unchunked", "hf_generate"]
    for name in sections:
        assert name in results, name
        r = results[name]
        assert "error" not in r and "skipped" not in r, (name, r)
    for name in ("plain", "ours", "ours_fp32_master", "ours_auto"):
        r = results[name]
        assert r["tokens_per_s"] > 0 and r["mfu"] > 0
        assert r["weight_updated_frac"] > 0.5  # fp32 weights at lr 1e-6: nearly all change
    assert results["ours"]["fsdp_root"] == "FullyShardedDataParallel"
    assert results["ours_fp32_master"]["precision"] == "bf16-mixed"
    lp = results["logprobs"]
    for k in ("chunked", "masked"):
        assert lp[k]["max_abs_logp_diff"] < 1e-4 and lp[k]["grad_hidden_rel_err"] < 1e-4
    pad = results["padding"]
    assert 0 <= pad["packed"] < pad["fixed_batch"] < pad["pad_to_seq"] < 1
    assert 0.45 < pad["policy_token_share"] < 0.75
    assert results["generation"]["new_tokens"] == 4 * 8  # gen batch 4, 8 new tokens each
    assert "ours/plain" in results["ratios"]
    assert results["flop_ratios"]["ours/plain"] == pytest.approx(
        results["ours"]["mfu"] / results["plain"]["mfu"])


def test_flops_per_token_of_qwen3_0_6b():
    """Qwen3-0.6B: N = 28 layers x (q,o 1024x2048 x2 + k,v 1024x1024 x2 + MLP 3x1024x3072
    + norms 2x128 + 2x1024) + final norm 1024 + LM head 151936x1024 = 596,049,920, which is
    the unique parameter count (tied embeddings); attention: 12 x 28 x (16 heads x 128)."""
    gpu = load_gpu_module()
    config = gpu.Qwen3Config(**gpu.QWEN3_0_6B)
    n, attn = gpu.flop_terms(config)
    assert n == 596_049_920
    assert attn == 12 * 28 * 2048
    with torch.device("meta"):
        model = gpu.AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == n


CHECK = REPO / "benchmarks" / "gpu_check.py"


def load_gpu_check():
    return load_benchmark("gpu_check")


@pytest.mark.slow
def test_gpu_check_tiny_runs_every_section(tmp_path):
    """``gpu_check.py --tiny`` on CPU: the demo fit under FSDP1 (gloo) with the HF engine
    for 2 steps, packed against per-leaf in float32 and bfloat16, the packed update; one
    JSON line, also in ``--out``; exit 0 only when every section passed."""
    out = tmp_path / "gpu.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(CHECK), "--tiny", "--out", str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == results and results["passed"]
    fit = results["fit"]
    assert fit["exit"] == 0
    assert fit["scalars"]["perf/train_s"][0] == 2  # two RL steps, each trained
    eq = results["equivalence"]
    assert eq["float32_ok"] and eq["bfloat16_ok"]
    assert eq["float32"]["grad_max"] <= 1e-5 and eq["float32"]["loss"] <= 1e-5
    assert eq["packed_tokens"] < eq["leaf_tokens"]  # the trees share prefixes in their rows
    assert eq["bfloat16"]["leaf_vs_float32"]["grad_all"] > 1e-4  # bf16 rounding is there
    up = results["update"]
    assert up["tokens_per_s"] > 0 and up["mfu"] > 0 and up["forwarded_share"] < 1
    assert up["fsdp_root"] == "FullyShardedDataParallel"
    for name in ("fit", "equivalence", "update"):
        assert results[name]["recompiles"] == 0  # nothing is compiled on CPU
    assert results["recompiles"]["total"] == 0


def test_gpu_check_errors_by_hand_and_a_missing_world_is_named():
    """Loss 1.1 against 1.0: 0.1 relative; gradients a = (3, 4) against (3, 0): |(0, 4)| / 3;
    b = (1, 0) against (1, 0): 0; all together |(0, 4, 0, 0)| / |(3, 0, 1, 0)| = 4 / sqrt(10)."""
    check = load_gpu_check()
    got = (1.1, {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([1.0, 0.0])})
    want = (1.0, {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([1.0, 0.0])})
    err = check.errors(got, want)
    assert err["loss"] == pytest.approx(0.1)
    assert err["grad_max"] == pytest.approx(4 / 3) and err["grad_max_param"] == "a"
    assert err["grad_all"] == pytest.approx(4 / 10 ** 0.5)
    with pytest.raises(ValueError, match="--world is required"):
        check.parse_args([])
    with pytest.raises(ValueError, match=r"--sections \('fit,train'\)"):
        check.parse_args(["--tiny", "--sections", "fit,train"])
    assert check.parse_args(["--sections", "equivalence,update"]).world is None
