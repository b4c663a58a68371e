"""Root predictions of new prompts from the outcomes of similar prompts already rolled out.

A prompt never rolled out has no history of its own; what the policy's states say of its
difficulty has to be learnt from other prompts. A probe or the shared predictor fitted on
the last few steps sees too few prompts to do that; the outcomes of the prompt's nearest
neighbours in the policy's hidden-state space need no fit and use every prompt kept
(``docs/results.md``, "What a predictor can know of new prompts"). So each root prediction
becomes a posterior: the shared predictor's prediction ``p`` counts as ``strength``
rollouts, and the bare rollouts of the ``k`` most similar prompts in memory are added:

    v = (strength * p + sum_j s_j) / (strength + sum_j n_j)

where neighbour j had ``s_j`` successes in ``n_j`` bare rollouts. What stage 1 needs of a
prompt is the chance that its group is mixed, and a neighbourhood of prompts that always
fail or always succeed can have the same mean as one of prompts at 0.5: ranked by a point
prediction near 0.5, such prompts look best and are not. So, with ``belief``, the posterior
reaches the root solver as a belief ``Beta(v c, (1 - v) c)`` whose count ``c`` is read from
the neighbours' spread (method of moments: a Beta with mean ``v`` and variance ``s2`` has
``c = v (1 - v) / s2 - 1``), where ``s2`` is the variance of the neighbours' success rates
(weighted by their rollouts) less its binomial noise, ``v (1 - v) k / sum_j n_j``. A
neighbourhood split between 0 and 1 gives a small ``c`` (a group there is rarely mixed), one
of prompts all near ``v`` a large one.

Similarity is the cosine of the root features (the featuriser's vector at the prompt's last
token), each dimension standardised by the memory's mean and spread so that no few large
dimensions decide it.
The prompt's own earlier rows are never its neighbours: its own past is the prompt
history's evidence (``PromptHistory``, applied after this one).

The memory keeps the last ``capacity`` prompt observations (one per prompt and step, from
every rank, in the same order on each); older ones go first, as the policy they were
rolled out with moves on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from trace_lightning.allocation.features import NodeKey
from trace_lightning.tree import RolloutTree, bare_rewards

# (prompt id, root features (D,), successes, bare rollouts)
Row = tuple[str, Tensor, float, float]


def root_rows(trees: Iterable[RolloutTree], features: Mapping[NodeKey, Tensor]) -> list[Row]:
    """One step's memory rows: each tree's root features and its bare rollouts' outcome
    (trees without root features or bare rollouts give none)."""
    rows = []
    for t in trees:
        x = features.get((t.tree_id, t.root.id))
        rewards = bare_rewards(t)
        if x is not None and rewards:
            rows.append((t.tree_id, x.detach().float().cpu(), float(sum(rewards)),
                         float(len(rewards))))
    return rows


# bounds of a belief's count: a neighbourhood all at 0 and 1, and one without spread
MIN_COUNT, MAX_COUNT = 0.05, 1000.0


def neighbour_posterior(x: Tensor, memory: Tensor, s: Tensor, n: Tensor, same: Tensor,
                        prior: Tensor, k: int, strength: float) -> tuple[Tensor, Tensor]:
    """Posterior success of each query from its ``k`` nearest memory rows, and the count of
    the belief the neighbours' spread gives it (see the module).

    x: (Q, D) queries; memory: (M, D); s, n: (M,) successes and bare rollouts per row;
    same: (Q, M) bool, True where a row is the query's own prompt (never a neighbour);
    prior: (Q,) the shared predictor's predictions. Returns ``(v, c)``, each (Q,)."""
    mu = memory.mean(0)  # (D,)
    sd = memory.std(0, unbiased=False).clamp_min(1e-6)  # (D,)
    a = torch.nn.functional.normalize((memory - mu) / sd, dim=1)  # (M, D)
    b = torch.nn.functional.normalize((x - mu) / sd, dim=1)  # (Q, D)
    sim = (b @ a.T).masked_fill(same, -math.inf)  # (Q, M)
    top = sim.topk(min(k, memory.shape[0]), dim=1)  # (Q, k)
    valid = torch.isfinite(top.values)  # (Q, k): fewer other rows than k leave -inf
    s_j, n_j = s[top.indices] * valid, n[top.indices] * valid  # (Q, k)
    s_k, n_k = s_j.sum(1), n_j.sum(1)  # (Q,)
    v = (strength * prior + s_k) / (strength + n_k)  # (Q,)
    rate = s_k / n_k.clamp_min(1e-9)  # (Q,) the neighbours' own rate
    spread = (n_j * (s_j / n_j.clamp_min(1e-9) - rate[:, None]) ** 2).sum(1) \
        / n_k.clamp_min(1e-9)  # (Q,) rollout-weighted variance of their rates
    noise = rate * (1 - rate) * valid.sum(1) / n_k.clamp_min(1e-9)  # (Q,) its binomial part
    s2 = (spread - noise).clamp_min(1e-9)  # (Q,)
    c = (v * (1 - v) / s2 - 1).clamp(MIN_COUNT, MAX_COUNT)  # (Q,)
    return v, c


class RootNeighbours:
    """A memory of rolled-out prompts' root features and outcomes, and the root posterior
    it gives (see the module).

    Args:
        k: neighbours per prediction (>= 1).
        strength: the shared predictor's root prediction counts as this many rollouts (> 0).
        capacity: prompt observations kept, the newest (>= k).
        belief: hand the root solver each posterior as a belief whose count is read from
            the neighbours' spread (``Node.prediction_count``); False: as exact.
    """

    def __init__(self, k: int = 25, strength: float = 4.0, capacity: int = 2048,
                 belief: bool = True) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"--model.neighbours.k ({k!r}) must be a whole number >= 1: the "
                             f"prompts whose outcomes inform a root prediction")
        if not strength > 0 or not math.isfinite(strength):
            raise ValueError(f"--model.neighbours.strength ({strength}) must be a finite number "
                             f"> 0: the rollouts the shared predictor's prediction counts as")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < k:
            raise ValueError(f"--model.neighbours.capacity ({capacity!r}) must be a whole number "
                             f">= k ({k}): the prompt observations kept")
        self.k, self.strength, self.capacity, self.belief = k, strength, capacity, belief
        self.ids: list[str] = []
        self.features = torch.zeros(0, 0)  # (M, D)
        self.s = torch.zeros(0)  # (M,)
        self.n = torch.zeros(0)  # (M,)

    def __len__(self) -> int:
        return len(self.ids)

    def record(self, rows: list[Row]) -> None:
        """Add rows (``root_rows``, possibly gathered from every rank); keep the newest
        ``capacity``."""
        if not rows:
            return
        ids, feats, s, n = zip(*rows)
        new = torch.stack(feats).float()  # (R, D)
        if len(self) and new.shape[1] != self.features.shape[1]:
            raise ValueError(f"neighbours: root features of width {new.shape[1]} against the "
                             f"memory's {self.features.shape[1]}; a memory belongs to one "
                             f"featuriser and policy width")
        keep = self.capacity
        self.ids = (self.ids + list(ids))[-keep:]
        self.features = torch.cat([self.features.reshape(-1, new.shape[1]), new])[-keep:]
        self.s = torch.cat([self.s, torch.tensor(s, dtype=torch.float32)])[-keep:]
        self.n = torch.cat([self.n, torch.tensor(n, dtype=torch.float32)])[-keep:]

    def adjust(self, trees: Iterable[RolloutTree], features: Mapping[NodeKey, Tensor]) -> None:
        """Replace each root's ``prediction`` by its neighbours' posterior and, with
        ``belief``, set its ``prediction_count`` (roots without a prediction or features, and
        every root while the memory is empty, are left)."""
        roots = [t for t in trees if t.root.prediction is not None
                 and (t.tree_id, t.root.id) in features]
        if not roots or not len(self):
            return
        x = torch.stack([features[(t.tree_id, t.root.id)] for t in roots]).float()  # (Q, D)
        index = {}
        for j, pid in enumerate(self.ids):
            index.setdefault(pid, []).append(j)
        same = torch.zeros(len(roots), len(self), dtype=torch.bool)  # (Q, M)
        for q, t in enumerate(roots):
            same[q, index.get(t.tree_id, [])] = True
        prior = torch.tensor([t.root.prediction for t in roots], dtype=torch.float32)  # (Q,)
        v, c = neighbour_posterior(x, self.features, self.s, self.n, same, prior, self.k,
                                   self.strength)
        for t, vi, ci in zip(roots, v.tolist(), c.tolist()):
            t.root.prediction = vi
            if self.belief:
                t.root.prediction_count = ci

    def state_dict(self) -> dict:
        return {"k": self.k, "strength": self.strength, "capacity": self.capacity,
                "belief": self.belief,
                "ids": list(self.ids), "features": self.features.clone(),
                "s": self.s.clone(), "n": self.n.clone()}

    def load_state_dict(self, state: dict) -> None:
        """The memory comes back (the newest ``capacity`` of it); the settings stay as
        configured."""
        keep = self.capacity
        self.ids = list(state["ids"])[-keep:]
        self.features = state["features"].float()[-keep:]
        self.s, self.n = state["s"].float()[-keep:], state["n"].float()[-keep:]


__all__ = ["MAX_COUNT", "MIN_COUNT", "RootNeighbours", "neighbour_posterior", "root_rows"]
