"""Prefix predictions updated by what stage 2 has already seen: the prompt's bare outcomes.

When stage 2 plans a prompt, its bare rollouts have ended. Each prefix's own rollout went on
from that very prefix and succeeded or failed; its sibling rollouts did from the same prompt.
Both are evidence about the prefix's chance of success that the shared predictor's features
do not carry, and on prompts never seen they are most of the evidence there is
(``benchmarks/predictability.py``). The posterior is a logistic correction of the shared
predictor's prediction ``p``:

    p' = sigmoid(a logit(p) + b (2 r - 1) + c (2 s - 1) + d)

with ``r`` the reward of the prefix's own bare rollout and ``s`` the mean reward of the
prompt's other bare rollouts (0.5 when it has none). It starts as the identity
(``a = 1, b = c = d = 0``) and is fitted online, after every step, on the prefixes given
continuations over the last ``window`` steps: the target is their continuations' success
rate (weighted by their number), which the prefix's own outcome is not part of. A predictor
trained on tree values could not learn this weight itself: a prefix's value includes its own
rollout's reward, so reading ``r`` would teach it to copy the label.

The fit (``fit_logistic``) is Newton's method on the weighted cross-entropy with soft
targets plus ``l2 / 2 |theta - identity|^2``: four numbers, deterministic, no engine.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import numpy as np

from trace_lightning.tree import RolloutTree, bare_end

IDENTITY = np.array([1.0, 0.0, 0.0, 0.0])  # (a, b, c, d): p' = p
_EPS = 1e-4


def _logit(p: float) -> float:
    p = min(max(p, _EPS), 1.0 - _EPS)
    return math.log(p / (1.0 - p))


def inputs(p: float, own: float, siblings: Sequence[float]) -> list[float]:
    """``[logit(p), 2 r - 1, 2 s - 1, 1]``: the posterior's inputs for one prefix."""
    s = sum(siblings) / len(siblings) if siblings else 0.5
    return [_logit(p), 2.0 * own - 1.0, 2.0 * s - 1.0, 1.0]


def apply(theta: np.ndarray, x: np.ndarray) -> np.ndarray:
    """theta (4,), x (N, 4) -> p' (N,)."""
    return 1.0 / (1.0 + np.exp(-(x @ theta)))  # (N,)


def fit_logistic(x: np.ndarray, y: np.ndarray, w: np.ndarray, l2: float,
                 prior: np.ndarray = IDENTITY, iterations: int = 50) -> np.ndarray:
    """Minimise ``sum_i w_i CE(y_i, sigmoid(x_i theta)) / sum_i w_i + l2/2 |theta - prior|^2``.

    x (N, K), y (N,) soft targets in [0, 1], w (N,) > 0; Newton's method (the objective is
    convex, strictly with ``l2 > 0``). Returns theta (K,)."""
    theta = prior.astype(float).copy()  # (K,)
    W = w / w.sum()  # (N,)
    for _ in range(iterations):
        p = apply(theta, x)  # (N,)
        grad = x.T @ (W * (p - y)) + l2 * (theta - prior)  # (K,)
        hess = (x * (W * p * (1 - p))[:, None]).T @ x + l2 * np.eye(len(theta))  # (K, K)
        step = np.linalg.solve(hess, grad)  # (K,)
        theta -= step
        if np.abs(step).max() < 1e-10:
            break
    return theta


class PrefixPosterior:
    """The correction, the scored prefixes it is fitted on, and the inputs it read this step.

    Args:
        window: steps of scored prefixes the fit uses (>= 1).
        l2: pull of the coefficients toward the identity (>= 0).
        min_rows: fewest scored prefixes before the first fit (the identity until then).
    """

    def __init__(self, window: int = 4, l2: float = 0.01, min_rows: int = 20) -> None:
        if window < 1 or l2 < 0 or min_rows < 1:
            raise ValueError(f"prefix posterior: window ({window}) and min_rows ({min_rows}) "
                             f"must be >= 1 and l2 ({l2}) >= 0")
        self.window, self.l2, self.min_rows = window, l2, min_rows
        self.theta = IDENTITY.copy()
        self.steps: deque[list[list[float]]] = deque(maxlen=window)  # rows [x..., y, w]
        # this step's inputs per prefix node (the node is held, so its id stays its own)
        self._read: dict[int, tuple[object, list[float]]] = {}

    def adjust(self, trees: Sequence[RolloutTree]) -> None:
        """Replace the prediction of every prefix whose prompt's bare rollouts have all
        ended (what stage 2 plans from) by its posterior; other nodes are left."""
        for t in trees:
            starts = t.bare_rollouts()
            ends = [bare_end(t, i) for i in starts]
            if not ends or not all(e.finished and e.reward is not None for e in ends):
                continue
            rewards = {t.nodes[i].rollout: float(e.reward) for i, e in zip(starts, ends)}
            for node in t.prefixes():
                if node.prediction is None or node.rollout not in rewards:
                    continue
                if id(node) not in self._read:  # predicted again: the first read stands
                    self._read[id(node)] = (node, inputs(
                        node.prediction, rewards[node.rollout],
                        [r for j, r in rewards.items() if j != node.rollout]))
                x = self._read[id(node)][1]
                node.prediction = float(apply(self.theta, np.array([x]))[0])

    def scored(self, trees: Sequence[RolloutTree]) -> list[list[float]]:
        """This step's rows ``[inputs..., continuations' success rate, their number]`` for
        the prefixes it adjusted and gave continuations; forgets the step's inputs."""
        from trace_lightning.allocation.trust import continuation_rewards

        rows = []
        for t in trees:
            for node in t.prefixes():
                read = self._read.get(id(node))
                rewards = continuation_rewards(t, node.id) if read is not None else []
                if rewards:
                    rows.append([*read[1], sum(rewards) / len(rewards), float(len(rewards))])
        self._read = {}
        return rows

    def fit(self, rows: list[list[float]]) -> dict[str, float]:
        """Add a step's rows (every rank's) and refit on the window; returns the fitted
        coefficients as ``predictor/posterior_*`` statistics."""
        self.steps.append(rows)
        data = np.array([r for s in self.steps for r in s], dtype=float).reshape(-1, 6)
        if len(data) >= self.min_rows:
            self.theta = fit_logistic(data[:, :4], data[:, 4], data[:, 5], self.l2)
        return {f"predictor/posterior_{k}": float(v)
                for k, v in zip(("prediction", "own", "siblings", "bias"), self.theta)}

    def state_dict(self) -> dict:
        return {"theta": self.theta.tolist(), "steps": [list(s) for s in self.steps]}

    def load_state_dict(self, state: dict) -> None:
        self.theta = np.array(state["theta"], dtype=float)
        self.steps = deque((list(s) for s in state["steps"]), maxlen=self.window)
        self._read = {}


__all__ = ["IDENTITY", "PrefixPosterior", "apply", "fit_logistic", "inputs"]
