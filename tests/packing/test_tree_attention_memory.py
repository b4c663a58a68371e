"""Tree attention builds nothing of size T x T: its memory follows the tree.

A packed row of several small Search-R1-shaped trees is long (T tokens) while each node's
root path is short, so any tensor of T * T elements on a tree forward is a dense mask (ours, or
transformers' built from the packed position ids), never the tree's own attention. A
``TorchDispatchMode`` raises on any such tensor; the dense ``sdpa`` path (the reference) and a
tree forward without the mask placeholder trip it, so the check can fail. FlexAttention's
block mask is built block by block and equals ``create_block_mask``'s (dense) one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import Qwen3ForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from builders import REPO
from trace_lightning.math.advantage import assign_advantages
from trace_lightning.math.loss import weighted_policy_loss
from trace_lightning.models import tiny_qwen3_config
from trace_lightning.training.module import TraceModule
from trace_lightning.packing.attention import (TREE_SDPA, attention_inputs,
                                                     tree_block_mask)
from trace_lightning.packing.trees import WEIGHT_KEYS, collate_units, update_units

VOCAB = 97


def load_update_benchmark():
    spec = importlib.util.spec_from_file_location("bench_update",
                                                  REPO / "benchmarks" / "update.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class NoSquareTensors(TorchDispatchMode):
    """Raise on any op whose output's storage holds ``>= limit`` elements."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in tree_leaves(out):
            if isinstance(x, torch.Tensor) and x.layout == torch.strided:
                n = x.untyped_storage().nbytes() // x.element_size()
                if n >= self.limit:
                    raise AssertionError(f"{func} built a tensor of {tuple(x.shape)} "
                                         f"({n} >= {self.limit} elements)")
                self.largest = max(self.largest, n)
        return out


@pytest.fixture(scope="module")
def long_row() -> dict:
    """One packed row of 4 small Search-R1-shaped trees (20-token prompts, 3 turns of 10
    generated + 40 observation tokens, 4 bare rollouts and one continuation each): T about
    3,000 tokens, root paths of at most 170."""
    bench = load_update_benchmark()
    units = []
    for k, tree in enumerate(bench.search_r1_trees(VOCAB, seed=0, prompts=4, prompt_len=20,
                                                   generated=10, observed=40)):
        leaves = tree.flatten()
        for s, adv in zip(leaves, assign_advantages(leaves, [tree], "grpo")):
            s.token_advantages = adv
        units += update_units(tree, leaves, 100_000)
    mb = collate_units([units], pad_id=0)
    assert 2500 < mb["input_ids"].shape[1] < 4500
    return mb


def policy(attention: str) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(tiny_qwen3_config(VOCAB, attn_implementation=attention)).train()


def loss_of(model, mb: dict) -> torch.Tensor:
    logp, ent = TraceModule._logprobs(model, mb, with_entropy=True)  # (1, T) each
    return weighted_policy_loss(logp, mb["old_logprobs"], {k: mb[k] for k in WEIGHT_KEYS},
                                normalizer=float(mb["count"].sum()), entropy=ent)[0]


def test_a_tree_sdpa_forward_and_backward_build_no_t_squared_tensor(long_row, monkeypatch):
    t = long_row["input_ids"].shape[1]

    def no_mask(*args, **kwargs):
        raise AssertionError("transformers built a mask for a tree_sdpa forward")

    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, TREE_SDPA, no_mask)
    model = policy(TREE_SDPA)
    guard = NoSquareTensors(t * t)
    with guard:
        loss_of(model, long_row).backward()
    assert guard.largest > 0 and all(p.grad is not None for p in model.parameters())


def test_the_check_catches_a_dense_mask(long_row):
    """The dense reference (``sdpa``: our (B, 1, T, T) mask) and a tree_sdpa forward
    without the placeholder (transformers' mask from the packed position ids) trip it."""
    t = long_row["input_ids"].shape[1]
    with pytest.raises(AssertionError, match="elements"), NoSquareTensors(t * t):
        loss_of(policy("sdpa"), long_row)
    model = policy(TREE_SDPA)
    bare = {"position_ids": long_row["position_ids"], "tree_nodes": long_row["tree_nodes"]}
    with pytest.raises(AssertionError, match="elements"), NoSquareTensors(t * t):
        model(input_ids=long_row["input_ids"], use_cache=False, **bare)


def test_the_placeholder_without_a_plan_is_refused(long_row):
    model = policy(TREE_SDPA)
    with pytest.raises(ValueError, match="node plan"):
        model(input_ids=long_row["input_ids"][:, :8], use_cache=False,
              attention_mask=torch.empty(1, 1, 0, 0, dtype=torch.bool))


def test_the_block_mask_is_built_block_by_block(long_row, monkeypatch):
    """A FlexAttention policy's packed inputs at T = 3,000: no T x T tensor, and neither of
    torch's dense builders (``create_block_mask`` evaluates the mask at every pair)."""
    from torch.nn.attention import flex_attention

    def dense(*args, **kwargs):
        raise AssertionError("a dense block-mask builder ran")

    monkeypatch.setattr(flex_attention, "create_mask", dense)
    monkeypatch.setattr(flex_attention, "create_block_mask", dense)
    model = policy("flex_attention")
    t = long_row["subtree_end"].shape[1]
    with NoSquareTensors(t * t):
        mask = attention_inputs(model, long_row)["attention_mask"]
    assert mask.shape[-2:] == (t, t)
    assert int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()) < (t // 128) ** 2 / 2


@pytest.mark.parametrize("rows,width,block", [(1, 300, 16), (2, 200, 16), (1, 384, 128),
                                              (1, 3000, 128)])
def test_the_block_mask_equals_create_block_mask(long_row, rows, width, block):
    """Partial and full blocks, their counts and ordered indices as ``create_block_mask``
    finds them from the dense mask: rows cut from the long row (trees cut anywhere: a
    subtree may run past the cut, clamped) and whole."""
    from torch.nn.attention.flex_attention import create_block_mask

    end = long_row["subtree_end"][0]
    cuts = torch.stack([end[k * width:(k + 1) * width] - k * width for k in range(rows)])
    cuts = cuts.clamp(max=width)  # (R, width)
    ar = torch.arange(width)
    assert (cuts > ar).all()

    def mask_mod(b, h, q, kv):
        return (kv <= q) & (q < cuts[b, kv])

    want = create_block_mask(mask_mod, B=rows, H=None, Q_LEN=width, KV_LEN=width,
                             device="cpu", BLOCK_SIZE=block)
    got = tree_block_mask(cuts, block)
    torch.testing.assert_close(got.to_dense(), want.to_dense())
    for n, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        counts = getattr(got, n)
        assert torch.equal(counts.long(), getattr(want, n).long()), n
        for b in range(rows):
            for q in range(counts.shape[-1]):
                k = int(counts[b, 0, q])
                assert torch.equal(getattr(got, idx)[b, 0, q, :k].long(),
                                   getattr(want, idx)[b, 0, q, :k].long()), (idx, b, q)


def test_memory_by_tokens_quick_mode(tmp_path):
    """``benchmarks/update.py --memory`` at a short row, in a process of its own, merged into
    ``--out`` beside the keys already there, one JSON line at the end."""
    out = tmp_path / "update.json"
    out.write_text(json.dumps({"benchmark": "update", "search_r1_time_ratio": 0.9}) + "\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "update.py"), "--memory",
                           "--memory-tokens", "700", "--memory-repeats", "1", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    saved = json.loads(out.read_text())
    assert saved["search_r1_time_ratio"] == 0.9
    assert saved["memory_by_tokens"] == line["memory_by_tokens"]
    assert set(line["memory_by_tokens"]) == {"700"}
    row = line["memory_by_tokens_detail"]["rows"]["700"]
    assert row["tokens"] == 700  # the row is filled to exactly that length
    assert row["peak_rss_mb"] >= row["rss_before_forward_mb"] > 0


@pytest.mark.slow
def test_flex_attention_with_full_blocks_gives_the_dense_log_probs():
    """Two packed rows of full-size Search-R1-shaped trees (550-token nodes: many blocks of
    128 wholly inside a subtree, which FlexAttention runs without mask_mod; the shorter row
    padded): FlexAttention's log-probs (its forward, compiled; on CPU it has no backward)
    equal the dense ``sdpa`` mask's."""
    bench = load_update_benchmark()
    units = []
    for tree in bench.search_r1_trees(VOCAB, seed=1, prompts=2):
        leaves = tree.flatten()
        for s, adv in zip(leaves, assign_advantages(leaves, [tree], "grpo")):
            s.token_advantages = adv
        units += update_units(tree, leaves, 100_000)
    mb = collate_units([units[:1], units[1:]], pad_id=0)  # (2, T)
    mask = tree_block_mask(mb["subtree_end"])
    assert int(mask.full_kv_num_blocks.sum()) > 100 and int(mask.kv_num_blocks.sum()) > 100
    model = policy("sdpa")
    with torch.no_grad():
        want, _ = TraceModule._logprobs(model, mb)
        model.set_attn_implementation("flex_attention")
        got, _ = TraceModule._logprobs(model, mb)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
