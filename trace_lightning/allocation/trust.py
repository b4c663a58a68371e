"""How far the allocator follows its predictions: as far as their measured skill goes.

A predictor with no skill on the prompts a run actually sees (new ones, mostly) would have
trace concentrate its budget on noise. So every step, the predictions that steered the step
are scored against what then happened, and the next step's plan is a mixture: a share
``w`` of each stage's budget is planned from the predictions, the rest as ``random_tree``
plans it (``G`` rollouts per prompt drawn at random; continuations from prefixes drawn at
random), the rule that reads no prediction and branches like trace does:

    w = clip(skill / full_trust_skill, 0, 1)        per stage (roots, prefixes)

where ``skill`` is the Brier skill (``1 - Brier / Brier of the constant mean``) of the
stage's predictions over the last ``window`` steps, pooled:

- roots: each opened prompt's prediction (as stage 1 read it, history included) against the
  success rate of its stage-1 bare rollouts, weighted by their number;
- prefixes: each prefix given continuations, its prediction against their success rate,
  weighted by their number (the bare rollout's own outcome is not counted: it was known when
  the prefix was planned).

With no measurement yet (the first informed step) ``w`` is 0: trust is earned. At ``w = 0``
trace's plan is ``random_tree``'s in distribution; at ``w = 1`` it is the solvers' alone.
Predictions are made and scored whatever ``w`` is, so the measurement never stops.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Literal

import numpy as np

from trace_lightning.math.calibration import brier_skill
from trace_lightning.tree import RolloutTree, bare_reward

Stage = Literal["roots", "prefixes"]


def trust_weight(skill: float, full_trust_skill: float) -> float:
    """``clip(skill / full_trust_skill, 0, 1)``; 0 for a skill not measured (NaN)."""
    if not math.isfinite(skill):
        return 0.0
    return min(max(skill / full_trust_skill, 0.0), 1.0)


def continuation_rewards(tree: RolloutTree, node_id: int) -> list[float]:
    """Rewards of the leaves below the continuations of ``node_id`` (its children after the
    first, which is its bare rollout's own next turn)."""
    out, stack = [], list(tree.nodes[node_id].children[1:])
    while stack:
        n = tree.nodes[stack.pop()]
        if n.finished and n.reward is not None:
            out.append(float(n.reward))
        stack.extend(n.children)
    return out


def outcomes(trees: Sequence[RolloutTree], stage1: Sequence[int]
             ) -> dict[str, list[tuple[float, float, float]]]:
    """The step's ``(prediction, outcome, weight)`` triples per stage (see the module)."""
    out: dict[str, list[tuple[float, float, float]]] = {"roots": [], "prefixes": []}
    for tree, m in zip(trees, stage1):
        if tree.root.prediction is not None and m > 0:
            rates = [bare_reward(tree, j) for j in range(m)]
            out["roots"].append((float(tree.root.prediction), sum(rates) / m, float(m)))
        for node in tree.prefixes():
            if node.prediction is None or node.continuations <= 0:
                continue
            leaves = continuation_rewards(tree, node.id)
            if leaves:
                out["prefixes"].append((float(node.prediction), sum(leaves) / len(leaves),
                                        float(len(leaves))))
    return out


class Trust:
    """The last ``window`` steps' scored predictions, and the trust they earn.

    Args:
        full_trust_skill: the Brier skill at which the predictions plan a whole stage (> 0).
        window: steps whose predictions are pooled (>= 1).
    """

    def __init__(self, full_trust_skill: float, window: int = 4) -> None:
        if not full_trust_skill > 0:
            raise ValueError(f"--data.allocator.full_trust_skill ({full_trust_skill}) must be "
                             f"> 0 (the Brier skill at which predictions are followed fully), "
                             f"or null to always follow them")
        if window < 1:
            raise ValueError(f"--data.allocator.skill_window ({window}) must be >= 1 step")
        self.full_trust_skill = full_trust_skill
        self.window = window
        self.steps: deque[dict[str, list[tuple[float, float, float]]]] = deque(maxlen=window)

    def record(self, trees: Sequence[RolloutTree], stage1: Sequence[int]) -> None:
        """Score one step's predictions (trees complete, ``stage1`` bare rollouts each)."""
        self.steps.append(outcomes(trees, stage1))

    def skill(self, stage: Stage) -> float:
        """Pooled Brier skill of ``stage``'s predictions over the window (NaN: none, or
        outcomes all equal)."""
        rows = [r for s in self.steps for r in s[stage]]
        if len(rows) < 2:
            return float("nan")
        p, y, w = (np.array(c, dtype=float) for c in zip(*rows))
        return brier_skill(p, y, w)

    def weight(self, stage: Stage) -> float:
        """The share of ``stage``'s budget planned from predictions."""
        return trust_weight(self.skill(stage), self.full_trust_skill)

    def state_dict(self) -> dict:
        return {"steps": [{k: [list(r) for r in v] for k, v in s.items()} for s in self.steps]}

    def load_state_dict(self, state: dict) -> None:
        self.steps = deque(({k: [tuple(r) for r in v] for k, v in s.items()}
                            for s in state["steps"]), maxlen=self.window)


__all__ = ["Stage", "Trust", "continuation_rewards", "outcomes", "trust_weight"]
