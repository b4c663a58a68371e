"""benchmarks/gpu.py: the CPU smoke run, and the equivalence of the tuned log-prob path."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu.py"


def load_gpu_module():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
    sections = ["model", "padding", "logprobs", "plain", "ours",
                "ours_tuned", "ours_fp32_master", "generation", "ours_auto",
                "plain_unchunked", "hf_generate"]
    for name in sections:
        assert name in results, name
        r = results[name]
        assert "error" not in r and "skipped" not in r, (name, r)
    for name in ("plain", "ours", "ours_tuned", "ours_fp32_master", "ours_auto"):
        r = results[name]
        assert r["tokens_per_s"] > 0 and r["mfu"] > 0
        assert r["weight_updated_frac"] > 0.5  # fp32 weights at lr 1e-6: nearly all change
    assert results["ours_tuned"]["fsdp_root"] == "FullyShardedDataParallel"
    assert results["ours_fp32_master"]["precision"] == "bf16-mixed"
    lp = results["logprobs"]
    for k in ("chunked", "masked"):
        assert lp[k]["max_abs_logp_diff"] < 1e-4 and lp[k]["grad_hidden_rel_err"] < 1e-4
    pad = results["padding"]
    assert 0 <= pad["packed"] < pad["fixed_batch"] < pad["pad_to_seq"] < 1
    assert 0.45 < pad["policy_token_share"] < 0.75
    assert results["generation"]["new_tokens"] == 4 * 8  # gen batch 4, 8 new tokens each
    assert "ours_tuned/ours" in results["ratios"]


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


def test_tuned_logprobs_equal_module_logprobs_on_policy_tokens(tmp_path):
    """PolicyLogprobs (no attention mask, LM head on policy rows) gives TraceModule's
    log-probs on every policy token of a right-padded micro-batch, and the same gradient to
    every policy parameter for a loss over policy tokens."""
    gpu = load_gpu_module()
    s = gpu.Setup(gpu.parse_args(["--tiny"]))
    gpu.build_model(s, tmp_path / "policy")
    items = gpu.synth_minibatches(s, 1, random.Random(0))
    mb = max(items[0]["micro"], key=lambda m: m["input_ids"].shape[0])
    assert (mb["attention_mask"] == 0).any()  # there is right padding to get wrong
    mask = mb["policy_mask"]
    results = []
    for tuned in (False, True):
        policy = gpu.load_model(s, tmp_path / "policy").train()
        if tuned:
            logp, ent = gpu.PolicyLogprobs(policy)(mb["input_ids"], mask, True)
        else:
            logp, ent = gpu.TraceModule._logprobs(policy, mb, with_entropy=True)
        up = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
        (logp * up * mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
        results.append((logp.detach() * mask, ent * mask, grads))
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    torch.testing.assert_close(lp1, lp0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ent1, ent0, rtol=1e-4, atol=1e-5)
    assert g0.keys() == g1.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-3, atol=1e-6, msg=name)
