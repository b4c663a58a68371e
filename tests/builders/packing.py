"""The packed update of a list of trees beside the per-leaf update of its leaves: what
``TraceModule.training_step`` sums over each, without an optimizer (tree packing must give
the per-leaf update exactly)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trace_lightning.math.advantage import assign_advantages
from trace_lightning.math.loss import weighted_policy_loss
from trace_lightning.packing.leaves import collate, pack_microbatches
from trace_lightning.packing.trees import WEIGHT_KEYS, collate_units, pack_rows, update_units
from trace_lightning.training.module import TraceModule


def sequences(trees, kind):
    """The trees' leaf sequences, with ``kind``'s per-token advantages."""
    seqs = [s for t in trees for s in t.flatten()]
    for s, adv in zip(seqs, assign_advantages(seqs, trees, kind)):
        s.token_advantages = adv
    return seqs


def packed_micro(trees, seqs, max_tokens: int) -> list[dict]:
    """The trees packed as update units (a tree's shared tokens once) into rows."""
    units = [u for t in trees for u in update_units(
        t, [s for s in seqs if s.tree_id == t.tree_id], max_tokens)]
    return [collate_units([[units[j] for j in row] for row in rows], pad_id=0)
            for rows in pack_rows([len(u) for u in units], max_tokens)]


def leaf_micro(seqs, max_tokens: int) -> list[dict]:
    """The leaf sequences packed one by one (the per-leaf update)."""
    return [collate([seqs[i] for i in g], pad_id=0,
                    advantages=[seqs[i].token_advantages for i in g])
            for g in pack_microbatches(seqs, max_tokens)]


def update(model, micro: list[dict], normalizer: float, **kw):
    """The training step's loss, statistics and gradients over ``micro`` (as
    ``TraceModule.training_step`` sums them), without an optimizer."""
    model.zero_grad(set_to_none=True)
    loss_sum, sums, ratio_max = 0.0, {}, 0.0
    for mb in micro:
        logp, ent = TraceModule._logprobs(model, mb, with_entropy=True)
        ref = (logp.detach() + 0.1 * mb["policy_mask"]).to(logp.dtype)  # a KL term that bites
        loss, stats = weighted_policy_loss(logp, mb["old_logprobs"].to(logp.dtype),
                                           {k: mb[k] for k in WEIGHT_KEYS},
                                           normalizer=normalizer, entropy=ent, ref_logprobs=ref,
                                           kl_coef=0.3, **kw)
        loss.backward()
        loss_sum += loss.item()
        w = float(stats.pop("tokens"))
        ratio_max = max(ratio_max, float(stats.pop("ratio_max")))
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + float(v) * w
        sums["tokens"] = sums.get("tokens", 0.0) + w
    stats = {k: v / sums["tokens"] for k, v in sums.items() if k != "tokens"}
    stats |= {"tokens": sums["tokens"], "ratio_max": ratio_max}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss_sum, stats, grads


def with_old_logprobs_near(model, trees) -> None:
    """Behaviour log-probs = the model's own plus noise, so ratios clip on both sides."""
    rng = np.random.default_rng(0)
    for t in trees:
        for leaf in t.leaves():
            ids = torch.tensor([t.prefix_ids(leaf.id)])
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
            lp = lp.gather(-1, ids[0, 1:, None])[:, 0]  # (T-1,)
            start = 0
            for n in t.path(leaf.id):
                for i, m in enumerate(n.policy_mask):
                    if m:
                        n.logprobs[i] = float(lp[start + i - 1]) + float(rng.normal(0, 0.3))
                start += len(n.token_ids)


def assert_packed_equals_per_leaf(model, trees, kind: str, rtol: float,
                                  max_tokens: int = 4096) -> dict:
    """The packed update of ``trees`` gives the per-leaf update's loss, statistics and
    gradients (plain and dual-clipped); returns the per-leaf statistics."""
    for t in trees:
        t.compute_values()
    seqs = sequences(trees, kind)
    pairs = float(sum(sum(s.policy_mask) for s in seqs))
    packed = packed_micro(trees, seqs, max_tokens)
    assert sum(float(mb["count"].sum()) for mb in packed) == pairs
    for clip in ({}, {"dual_clip": 1.1}):
        want_loss, want_stats, want_grads = update(model, leaf_micro(seqs, max_tokens), pairs,
                                                   **clip)
        loss, stats, grads = update(model, packed, pairs, **clip)
        assert loss == pytest.approx(want_loss, rel=rtol, abs=1e-12)
        assert stats.keys() == want_stats.keys()
        for k in want_stats:
            assert stats[k] == pytest.approx(want_stats[k], rel=rtol, abs=1e-12), k
        for name, g in want_grads.items():  # relative to each gradient's scale
            torch.testing.assert_close(grads[name], g, rtol=rtol,
                                       atol=rtol * float(g.abs().max()), msg=name)
    return want_stats
