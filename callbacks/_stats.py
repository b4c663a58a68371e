"""Pure statistics behind the monitoring callbacks: plain lists in, floats out.

A step is first reduced to a small, picklable :class:`StepSummary` (per-tree reward lists,
allocation counts, budget, timings; no tokens), so several processes can gather their
summaries and compute one set of metrics over all ranks' trees (:func:`merge_summaries`).

Definitions (every std is the population std, ``ddof=0``, so a group of one has std 0):

- **Prompt group**: all leaves of a tree. **Subtree group**: the leaves of one bare rollout's
  subtree (``Node.rollout``); only subtrees with >= 2 leaves (i.e. branched) count.
- **Zero-variance share (after allocation)**: share of the step's trees whose leaves all
  have the same reward; equals ``1 - effective ratio``.
- **Zero-variance share of the bare rollouts (before allocation)**: the same over each tree's
  bare rollouts only (the first rollouts sampled from the root, each followed down its own
  first-child chain, i.e. without the stage-2 continuations): what stage 1 alone would have
  given. The gap between the two is the contrast the prefix expansion found.
- **Effective ratio**: share of trees holding two different leaf rewards (``tree.mixed``).
- **Informative leaf**: a training sequence whose (scalar) advantage is non-zero
  (``|A| > 1e-6``).
- **Gini** of non-negative counts ``x`` (n entries, mean ``mu``):
  ``G = sum_i sum_j |x_i - x_j| / (2 n^2 mu)``; 0 when all equal (or all zero).
- **Normalised entropy**: ``H(x / sum x) / ln n`` with ``0 ln 0 = 0``; 1 for an even spread;
  defined as 1 for a single entry.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from trace_lightning.tree import bare_end
from trace_lightning.math.calibration import (brier, brier_baseline, brier_skill,
                                         expected_calibration_error, spearman)
from trace_lightning.tree import RolloutTree
from trace_lightning.packing.trees import unique_tokens

if TYPE_CHECKING:
    from trace_lightning.rollout.step import RolloutStep

ADV_ATOL = 1e-6


# ---- generic ---------------------------------------------------------------------------------
def gini(x: Sequence[float]) -> float:
    """Gini coefficient of non-negative values; NaN for no values, 0 when they sum to 0."""
    a = np.asarray(x, dtype=np.float64)  # (n,)
    if a.size == 0:
        return float("nan")
    if np.any(a < 0):
        raise ValueError("gini needs non-negative values")
    total = a.sum()
    if total == 0:
        return 0.0
    diffs = np.abs(a[:, None] - a[None, :]).sum()  # sum over ordered pairs
    return float(diffs / (2.0 * a.size * total))  # = / (2 n^2 mean)


def normalized_entropy(x: Sequence[float]) -> float:
    """Entropy of ``x / sum(x)`` over ``ln(len(x))``; NaN when empty or all zero."""
    a = np.asarray(x, dtype=np.float64)  # (n,)
    if a.size == 0 or a.sum() <= 0:
        return float("nan")
    if a.size == 1:
        return 1.0
    p = a[a > 0] / a.sum()
    return float(-(p * np.log(p)).sum() / math.log(a.size))


def population_std(x: Sequence[float]) -> float:
    return float(np.std(np.asarray(x, dtype=np.float64))) if len(x) else float("nan")


def summary(x: Sequence[float], prefix: str) -> dict[str, float]:
    """``{prefix_mean, prefix_min, prefix_max}``; empty when ``x`` is."""
    if not len(x):
        return {}
    a = np.asarray(x, dtype=np.float64)
    return {f"{prefix}_mean": float(a.mean()), f"{prefix}_min": float(a.min()),
            f"{prefix}_max": float(a.max())}


def mean(x: Sequence[float]) -> float:
    return float(np.mean(x)) if len(x) else float("nan")


def ratio(num: float, den: float) -> float:
    return num / den if den else float("nan")


def integer_bins(values: Sequence[float]) -> np.ndarray:
    """Histogram edges centred on the integers from min to max (one bar per integer)."""
    lo, hi = int(min(values)), int(max(values))
    return np.arange(lo, hi + 2, dtype=np.float64) - 0.5


# ---- trees -----------------------------------------------------------------------------------
def bare_rewards(tree: RolloutTree, stage1: int | None = None) -> list[float]:
    """Each stage-1 bare rollout's own terminal reward (``tree.bare_end``: the
    first-child chain from the root's child); chains that stop unfinished or unscored are
    skipped. ``stage1``: the planned bare rollouts (indices below it); later ones re-spent
    budget no prefix could take, so they are not what stage 1 alone gave (None: every bare
    rollout)."""
    out = []
    for start in tree.bare_rollouts():
        if stage1 is not None and tree.nodes[start].rollout >= stage1:
            continue
        node = bare_end(tree, start)
        if node.finished and node.reward is not None:
            out.append(float(node.reward))
    return out


@dataclass
class TreeSummary:
    """What the monitors need from one tree (plain lists: cheap to gather across ranks)."""

    leaf_rewards: list[float]
    subtree_rewards: list[list[float]]  # per bare rollout, its leaves' rewards
    bare_rewards: list[float]
    metrics: dict[str, list[float]]  # the task's per-leaf metrics (search QA: em, f1)
    branch_continuations: list[int]  # per branched prefix (continuations > 0)
    branch_depths: list[int]  # its depth (1 = after the first turn)
    mixed: bool
    prompt_id: str = ""  # the tree's prompt (``RolloutTree.tree_id``, stable across steps)


def leaf_metrics(leaves) -> dict[str, list[float]]:
    """Each task metric's values over the leaves that have it."""
    out: dict[str, list[float]] = {}
    for n in leaves:
        for k, v in (n.metrics or {}).items():
            if v is not None:
                out.setdefault(k, []).append(float(v))
    return out


def summarize_tree(tree: RolloutTree, stage1: int | None = None) -> TreeSummary:
    leaves = tree.leaves()
    by_rollout: dict[int, list[float]] = {}
    for n in leaves:
        by_rollout.setdefault(n.rollout, []).append(float(n.reward or 0.0))
    branched = [n for n in tree.nodes if n.continuations > 0]
    return TreeSummary(
        leaf_rewards=[float(n.reward or 0.0) for n in leaves],
        subtree_rewards=[by_rollout[k] for k in sorted(by_rollout)],
        bare_rewards=bare_rewards(tree, stage1),
        metrics=leaf_metrics(leaves),
        branch_continuations=[n.continuations for n in branched],
        branch_depths=[n.depth for n in branched],
        mixed=tree.mixed, prompt_id=tree.tree_id)


@dataclass
class StepSummary:
    """One rank's step (or, merged, all ranks'), reduced to what the monitors need."""

    epoch: int
    trees: list[TreeSummary]
    advantages: list[float]  # per training sequence (leaf)
    policy_tokens: int  # sum over sequences of policy tokens (what the loss trains on)
    sequence_tokens: int  # sum over sequences of all tokens (a per-leaf forward reads them)
    candidates: int
    root_plan: list[int]  # global: rollouts per candidate (0 = filtered out)
    pool_returned: int
    budget: dict[str, int]
    seconds: dict[str, float] = field(default_factory=dict)
    cold_start: bool = False
    engine_calls: int = 0  # turns of the step (merged: the most of any rank)
    tree_tokens: int = 0  # tokens of the trees' leaf paths, each once (a packed forward's)
    trust: dict[str, float] = field(default_factory=dict)  # per stage; empty: not measured


def summarize_step(step: RolloutStep) -> StepSummary:
    return StepSummary(
        epoch=step.epoch,
        trees=[summarize_tree(t, m) for t, m in
               zip(step.trees, step.stage1 or [None] * len(step.trees), strict=True)],
        advantages=[float(s.advantage) for s in step.sequences],
        policy_tokens=sum(sum(s.policy_mask) for s in step.sequences),
        sequence_tokens=sum(len(s.input_ids) for s in step.sequences),
        candidates=step.candidates, root_plan=list(step.root_plan),
        pool_returned=step.pool_returned, budget=asdict(step.budget),
        seconds=dict(step.seconds), cold_start=step.cold_start,
        engine_calls=step.engine_calls, trust=dict(step.trust),
        tree_tokens=sum(unique_tokens(t) for t in step.trees if t.leaves()))


def merge_summaries(parts: Sequence[StepSummary]) -> StepSummary:
    """All ranks' summaries as one: trees and counts add up; the root plan, candidates and
    cold start are global (every rank plans the same), so rank 0's are kept, and so is its
    trust (measured on its own trees); phase times
    are the slowest rank's (ranks roll out in parallel)."""
    first = parts[0]
    budget: dict[str, int] = {}
    seconds: dict[str, float] = {}
    for p in parts:
        for k, v in p.budget.items():
            budget[k] = budget.get(k, 0) + v
        for k, v in p.seconds.items():
            seconds[k] = max(seconds.get(k, 0.0), v)
    return StepSummary(
        epoch=first.epoch, trees=[t for p in parts for t in p.trees],
        advantages=[a for p in parts for a in p.advantages],
        policy_tokens=sum(p.policy_tokens for p in parts),
        sequence_tokens=sum(p.sequence_tokens for p in parts),
        candidates=first.candidates, root_plan=first.root_plan,
        pool_returned=sum(p.pool_returned for p in parts), budget=budget, seconds=seconds,
        cold_start=first.cold_start, engine_calls=max(p.engine_calls for p in parts),
        tree_tokens=sum(p.tree_tokens for p in parts), trust=dict(first.trust))


# ---- metric sets -----------------------------------------------------------------------------
def reward_variance_metrics(s: StepSummary) -> dict[str, float]:
    """``rollout/*`` (see the module docstring for the definitions)."""
    trees = s.trees
    rewards = [r for t in trees for r in t.leaf_rewards]
    out: dict[str, float] = {}
    if rewards:
        out["rollout/reward_mean"] = mean(rewards)
        out["rollout/reward_std"] = population_std(rewards)
    out.update(summary([population_std(t.leaf_rewards) for t in trees if t.leaf_rewards],
                       "rollout/prompt_reward_std"))
    out.update(summary([population_std(g) for t in trees for g in t.subtree_rewards
                        if len(g) >= 2], "rollout/subtree_reward_std"))
    with_leaves = [t for t in trees if t.leaf_rewards]
    if with_leaves:
        out["rollout/effective_ratio"] = mean([t.mixed for t in with_leaves])
        out["rollout/zero_std_share"] = 1.0 - out["rollout/effective_ratio"]
    bare = [t.bare_rewards for t in trees if t.bare_rewards]
    if bare:
        out["rollout/zero_std_share_bare"] = mean([len(set(b)) <= 1 for b in bare])
    by_metric: dict[str, list[float]] = {}
    for t in trees:
        for k, values in t.metrics.items():
            by_metric.setdefault(k, []).extend(values)
    for k in sorted(by_metric):  # the task's metrics over every leaf (search QA: em, f1)
        out[f"rollout/{k}"] = mean(by_metric[k])
    if s.advantages:
        out["rollout/informative_leaf_share"] = mean(
            [abs(a) > ADV_ATOL for a in s.advantages])
    return out


def allocation_metrics(s: StepSummary) -> tuple[dict[str, float], dict[str, list[float]]]:
    """``alloc/*`` scalars and histogram values.

    Spread statistics are over the *opened* prompts (filtering is reported separately by
    ``alloc/prompts_filtered``), so a uniform schedule reads Gini 0, entropy 1.
    """
    leaves = [len(t.leaf_rewards) for t in s.trees]
    opened_m = [m for m in s.root_plan if m > 0]
    conts = [c for t in s.trees for c in t.branch_continuations]
    depths = [d for t in s.trees for d in t.branch_depths]
    out = {"alloc/candidates": float(s.candidates),
           "alloc/prompts_opened": float(len(opened_m)),
           "alloc/prompts_filtered": float(sum(m == 0 for m in s.root_plan)),
           "alloc/root_gini": gini(opened_m),
           "alloc/branched_prefixes": float(len(conts)),
           "alloc/pool_returned": float(s.pool_returned),
           "alloc/cold_start": float(s.cold_start),
           "alloc/leaves": float(s.budget.get("leaves", 0)),
           "alloc/generated_tokens": float(s.budget.get("generated_tokens", 0)),
           "alloc/tool_calls": float(s.budget.get("tool_calls", 0))}
    for stage, w in s.trust.items():
        out[f"alloc/trust_{stage}"] = float(w)
    if leaves:
        out.update({"alloc/leaves_per_prompt_gini": gini(leaves),
                    "alloc/leaves_per_prompt_entropy": normalized_entropy(leaves),
                    "alloc/leaves_per_prompt_max": float(max(leaves))})
        out["alloc/effective_ratio"] = mean([t.mixed for t in s.trees])
    if conts:
        out["alloc/branch_depth_mean"] = float(np.average(depths, weights=conts))
    hists = {"alloc/leaves_per_prompt": [float(x) for x in leaves],
             "alloc/continuations_per_prefix": [float(x) for x in conts],
             "alloc/branch_depth": [float(x) for x in depths]}
    return out, {k: v for k, v in hists.items() if v}


# ---- predictor calibration -------------------------------------------------------------------
@dataclass
class CalibrationPoints:
    """Nodes with a prediction and a realised value: (p, y, w = n_leaves, is_root)."""

    p: list[float] = field(default_factory=list)
    y: list[float] = field(default_factory=list)
    w: list[float] = field(default_factory=list)
    is_root: list[bool] = field(default_factory=list)

    def extend(self, other: CalibrationPoints) -> CalibrationPoints:
        for k in ("p", "y", "w", "is_root"):
            getattr(self, k).extend(getattr(other, k))
        return self


def calibration_points(trees: Sequence[RolloutTree]) -> CalibrationPoints:
    pts = CalibrationPoints()
    for t in trees:
        for n in t.nodes:
            if n.prediction is None or n.value is None or n.n_leaves <= 0:
                continue
            pts.p.append(float(n.prediction))
            pts.y.append(float(n.value))
            pts.w.append(float(n.n_leaves))
            pts.is_root.append(n.parent is None)
    return pts


def calibration_metrics(pts: CalibrationPoints, bins: int = 10,
                        previous: Mapping[str, float] | None = None) -> dict[str, float]:
    """``predictor/*``: leaf-weighted Brier vs. the constant-mean baseline, skill, ECE,
    unweighted Spearman, counts; the same per part as ``predictor/roots/*`` (what stage 1
    reads) and ``predictor/prefixes/*`` (stage 2). Empty when no node has a prediction.

    Each part's ``brier_skill`` beats the part's own mean outcome, a constant known only in
    hindsight (it knows which prompts the step drew); ``brier_skill_vs_previous`` beats the
    constant ``previous[<outcome_mean key>]`` (the last logged step's mean outcome of that
    part), which a predictor knowing only the past could have said. Absent without
    ``previous`` for that part.
    """
    if not pts.p:
        return {}
    out = {"predictor/brier": brier(pts.p, pts.y, pts.w),
           "predictor/brier_baseline": brier_baseline(pts.y, pts.w),
           "predictor/brier_skill": brier_skill(pts.p, pts.y, pts.w),
           "predictor/ece": expected_calibration_error(pts.p, pts.y, pts.w, bins=bins),
           "predictor/spearman": spearman(pts.p, pts.y),
           "predictor/prediction_mean": mean(pts.p),
           "predictor/nodes": float(len(pts.p)),
           "predictor/roots": float(sum(pts.is_root))}
    root = np.asarray(pts.is_root, dtype=bool)
    p, y, w = np.asarray(pts.p), np.asarray(pts.y), np.asarray(pts.w)
    for prefix, mask in (("predictor", np.ones_like(root)), ("predictor/roots", root),
                         ("predictor/prefixes", ~root)):
        if not mask.any():
            continue
        if prefix != "predictor":
            out[f"{prefix}/brier_skill"] = brier_skill(p[mask], y[mask], w[mask])
            out[f"{prefix}/spearman"] = spearman(p[mask], y[mask])
            out[f"{prefix}/prediction_mean"] = mean(p[mask])
        out[f"{prefix}/outcome_mean"] = (float(np.sum(w[mask] * y[mask]) / np.sum(w[mask]))
                                         if np.sum(w[mask]) > 0 else float("nan"))
        reference = (previous or {}).get(f"{prefix}/outcome_mean")
        if reference is not None and math.isfinite(reference):
            out[f"{prefix}/brier_skill_vs_previous"] = brier_skill(p[mask], y[mask], w[mask],
                                                                   reference=reference)
    return out