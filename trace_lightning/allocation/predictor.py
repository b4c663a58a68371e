"""The shared success predictor ``V(H)``: P(success | prefix history H).

One small model scores roots (the prompt alone, including prompts never rolled out) and
turn-level prefixes alike. It steers allocation only (stage 1 reads ``V(root)``, stage 2 reads
``V(prefix)``) and never enters the policy gradient: its inputs are detached features from a
swappable ``Featuriser`` (``trace_lightning.allocation.features``: the policy's hidden states by
default); depth enters through the predictor's own depth embedding.

Targets (``node_targets``): the bottom-up tree values. A node's value is the mean reward of the
leaves below it, weighted by their count ``n_leaves``. Loss (``weighted_squared_error``):

    L = sum_i w_i (p_i - y_i)^2 / sum_i w_i,    w_i = n_leaves_i,  y_i = value_i

Leaves are excluded from the targets by default: a leaf never gets continuations, and its
"prefix" contains the final answer, so its success is all but observable from the features
and would only teach the predictor to read answers. ``include_leaves=True`` adds them.

Training is online over a short replay of recent steps (``ReplayBuffer``). Deviation to note:
features in the replay were computed with the policy of their own step, so older entries are
slightly stale under the ``hidden`` featuriser; keep the replay short.
"""

from __future__ import annotations

import copy
import math
import zlib
from collections import deque
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import Tensor, nn

from trace_lightning.allocation.features import NodeKey
from trace_lightning.tree import RolloutTree


# ---- the model -----------------------------------------------------------------------------
class SuccessPredictor(nn.Module):
    """Small MLP on [standardised features, depth embedding] -> success probability.

    Features are standardised with per-dimension ``feature_mean``/``feature_std`` buffers
    (identity at init; ``fit_predictor`` sets them from the replay before each fit), which
    tames the outlier dimensions of LLM hidden states. A dimension constant over the replay
    keeps scale 1 (its weights never trained: divided by a tiny std, a new prompt's small
    value there would saturate the output), and standardised values are clipped to
    +-``CLIP`` standard deviations. The output layer starts at zero, so the initial
    prediction is exactly 0.5.

    Args:
        feature_dim: size of the feature vector (``Featuriser.feature_dim``).
        hidden: width of the hidden layer.
        depth_embed: size of the depth embedding.
        max_depth: deepest depth with its own embedding; deeper nodes share the last one.
        dropout: dropout after the hidden layer.
    """

    def __init__(self, feature_dim: int, hidden: int = 256, depth_embed: int = 16,
                 max_depth: int = 16, dropout: float = 0.0) -> None:
        super().__init__()
        self.max_depth = max_depth
        self.register_buffer("feature_mean", torch.zeros(feature_dim))  # (D,)
        self.register_buffer("feature_std", torch.ones(feature_dim))  # (D,)
        self.depth = nn.Embedding(max_depth + 1, depth_embed)
        self.mlp = nn.Sequential(
            nn.Linear(feature_dim + depth_embed, hidden), nn.GELU(), nn.Dropout(dropout),
            nn.Linear(hidden, 1),
        )
        nn.init.zeros_(self.mlp[-1].weight)
        nn.init.zeros_(self.mlp[-1].bias)

    CLIP = 10.0

    def logits(self, features: Tensor, depth: Tensor) -> Tensor:
        x = (features - self.feature_mean) / self.feature_std  # (N, D)
        x = x.clamp(-self.CLIP, self.CLIP)  # (N, D)
        d = self.depth(depth.long().clamp(0, self.max_depth))  # (N, E)
        return self.mlp(torch.cat([x, d], dim=-1)).squeeze(-1)  # (N,)

    def forward(self, features: Tensor, depth: Tensor) -> Tensor:
        """features (N, D), depth (N,) -> success probability (N,) in [0, 1]."""
        return torch.sigmoid(self.logits(features, depth))  # (N,)

    @torch.no_grad()
    def predict(self, features: Tensor, depth: Tensor) -> Tensor:
        """Eval-mode, gradient-free ``forward`` on the predictor's device; (N,) on CPU."""
        was_training = self.training
        self.eval()
        device = self.feature_mean.device
        p = self(features.to(device, torch.float32), depth.to(device))  # (N,)
        self.train(was_training)
        return p.float().cpu()  # (N,)

    @torch.no_grad()
    def set_normalisation(self, features: Tensor) -> None:
        """Per-dimension mean and std of ``features`` (N, D) become the standardisation."""
        features = features.to(self.feature_mean.device, torch.float32)  # (N, D)
        self.feature_mean.copy_(features.mean(0))  # (D,)
        std = features.std(0, correction=0) if len(features) > 1 else torch.ones_like(
            self.feature_std)  # (D,)
        self.feature_std.copy_(torch.where(std > 1e-6, std, 1.0))  # (D,): constant -> 1


def predict_nodes(predictor: SuccessPredictor, trees: list[RolloutTree],
                  features: Mapping[NodeKey, Tensor]) -> dict[NodeKey, float]:
    """Predict the root and every non-leaf turn of ``trees``; also stored in ``node.prediction``.

    Nodes without an entry in ``features`` are skipped.
    """
    keys = [(t.tree_id, n.id) for t in trees for n in t.nodes
            if not n.finished and (t.tree_id, n.id) in features]
    if not keys:
        return {}
    by_id = {t.tree_id: t for t in trees}
    depth = torch.tensor([by_id[k[0]].nodes[k[1]].depth for k in keys])  # (N,)
    probs = predictor.predict(torch.stack([features[k] for k in keys]), depth)  # (N,)
    out = {}
    for k, p in zip(keys, probs.tolist()):
        by_id[k[0]].nodes[k[1]].prediction = p
        out[k] = p
    return out


# ---- targets, replay, training -------------------------------------------------------------
class PredictorBatch(NamedTuple):
    """One step's training data for the predictor (CPU tensors)."""

    features: Tensor  # (N, D) float32
    depth: Tensor  # (N,) long
    value: Tensor  # (N,) float32, bottom-up mean leaf reward in [0, 1]
    weight: Tensor  # (N,) float32, n_leaves
    group: Tensor  # (N,) long, the prompt a node belongs to (``prompt_group``)


def prompt_group(tree_id: str) -> int:
    """A stable integer id of a prompt (CRC-32 of its tree id): the early-stopping holdout
    splits by prompt, so a prompt's root and prefixes fall on the same side."""
    return zlib.crc32(tree_id.encode("utf-8"))


def node_targets(trees: list[RolloutTree], include_leaves: bool = False
                 ) -> tuple[list[NodeKey], Tensor, Tensor, Tensor]:
    """Targets over roots and non-leaf turns (and leaves with ``include_leaves``).

    Returns ``(keys, depth (N,), value (N,), weight (N,))``; nodes without leaves below
    (``value is None``: call ``tree.compute_values()`` first) are skipped.
    """
    keys, depth, value, weight = [], [], [], []
    for tree in trees:
        for n in tree.nodes:
            if n.value is None or (n.finished and not include_leaves):
                continue
            keys.append((tree.tree_id, n.id))
            depth.append(n.depth)
            value.append(n.value)
            weight.append(n.n_leaves)
    return (keys, torch.tensor(depth, dtype=torch.long),  # (N,)
            torch.tensor(value, dtype=torch.float32),  # (N,)
            torch.tensor(weight, dtype=torch.float32))  # (N,)


def training_batch(trees: list[RolloutTree], features: Mapping[NodeKey, Tensor],
                   include_leaves: bool = False) -> PredictorBatch:
    """``node_targets`` joined with their features: one step's ``ReplayBuffer`` entry."""
    keys, depth, value, weight = node_targets(trees, include_leaves)
    missing = [k for k in keys if k not in features]
    if missing:
        raise KeyError(f"no features for {len(missing)} target nodes (first {missing[0]}); "
                       f"compute them with Featuriser.nodes on the finished trees")
    dim = next(iter(features.values())).shape[-1] if features else 0
    feats = torch.stack([features[k] for k in keys]) if keys else torch.zeros(0, dim)  # (N, D)
    group = torch.tensor([prompt_group(k[0]) for k in keys], dtype=torch.long)  # (N,)
    return PredictorBatch(feats.float(), depth, value, weight, group)


class ReplayBuffer:
    """The last ``max_steps`` steps' ``PredictorBatch`` entries (CPU tensors).

    Args:
        max_steps: how many recent steps to keep (1 = the current step only).
    """

    def __init__(self, max_steps: int) -> None:
        if max_steps < 1:
            raise ValueError(f"replay max_steps ({max_steps}) must be >= 1; use 1 to train "
                             f"the predictor on the current step only")
        self.max_steps = max_steps
        self.steps: deque[PredictorBatch] = deque(maxlen=max_steps)

    def __len__(self) -> int:
        return sum(len(s.value) for s in self.steps)

    def add(self, step: PredictorBatch) -> None:
        self.steps.append(PredictorBatch(*(t.detach().cpu() for t in step)))

    def sample_all(self) -> PredictorBatch:
        """All kept entries, concatenated (oldest step first)."""
        if not self.steps:
            raise ValueError("the replay buffer is empty; add a step before fitting")
        return PredictorBatch(*(torch.cat(ts) for ts in zip(*self.steps)))

    def state_dict(self) -> dict:
        return {"max_steps": self.max_steps, "steps": [s._asdict() for s in self.steps]}

    def load_state_dict(self, state: dict) -> None:
        """The kept steps come back, the newest ``max_steps`` as configured now (a resumed
        run may keep more or fewer steps than the one that saved them)."""
        steps = []
        for s in state["steps"]:
            if "group" not in s:  # a step saved without prompt groups: one group per node
                s = {**s, "group": torch.arange(len(s["value"]))}
            steps.append(PredictorBatch(**s))
        self.steps = deque(steps, maxlen=self.max_steps)


def weighted_squared_error(p: Tensor, y: Tensor, w: Tensor) -> Tensor:
    """``sum(w (p - y)^2) / sum(w)`` over (N,) tensors; 0 when ``sum(w) == 0``."""
    return (w * (p - y) ** 2).sum() / w.sum().clamp(min=1e-12)  # ()


def fit_predictor(predictor: SuccessPredictor, optimizer: torch.optim.Optimizer,
                  buffer: ReplayBuffer, epochs: int, batch_size: int,
                  generator: torch.Generator | None = None,
                  holdout: float = 0.2) -> dict[str, float]:
    """Weighted squared error over the replay, stopped early on a held-out share of it.

    A random ``holdout`` share of the replay's prompts (``group``) is set aside with all their
    nodes; after each pass over the rest the held-out loss is measured and the predictor
    keeps the weights of the best pass, or stays as it was before the fit (weights and feature
    standardisation; the passes start by standardising on the replay) when no pass beat it.
    Without it the MLP memorises a few hundred nodes: its predictions on the next step's
    nodes can be worse than the constant mean, and TRACE would then filter out most prompts
    as certain. Holding out whole prompts measures
    what allocation needs, success on prompts the predictor has not fitted: a root and its
    prefixes share the question, so a node-level split rewards memorising questions.
    ``holdout=0``, a replay of under 10 entries or of one prompt, trains on everything for
    ``epochs`` passes.

    Resets the predictor's feature standardisation to the replay's statistics first. Only
    the predictor's parameters receive gradients (features are detached data). Returns
    ``predictor/loss_before`` and ``predictor/loss`` (weighted MSE over the whole replay
    before and after, eval mode), ``predictor/holdout_loss`` (of the kept weights; absent
    when ``holdout=0``), ``predictor/epochs_kept``, ``predictor/entries`` and
    ``predictor/updates``.

    Args:
        epochs: most passes over the training share.
        generator: split and shuffling RNG (CPU); pass one seeded identically on every rank
            to keep replicas equal.
        holdout: share of prompts held out for early stopping, in [0, 1).
    """
    if epochs < 0 or batch_size < 1 or not 0.0 <= holdout < 1.0:
        raise ValueError(f"fit_predictor needs epochs >= 0, batch_size >= 1 and holdout in "
                         f"[0, 1), got epochs={epochs}, batch_size={batch_size}, "
                         f"holdout={holdout}")
    data = buffer.sample_all()
    device = predictor.feature_mean.device
    feats, depth, value, weight, group = (t.to(device) for t in data)  # (N, D), 4 x (N,)
    n = len(value)
    groups = group.unique()  # (G,) sorted
    groups = groups[torch.randperm(len(groups), generator=generator).to(device)]  # (G,)
    k = min(int(round(holdout * len(groups))), len(groups) - 1) if n >= 10 else 0
    held_groups = groups[:k]  # (K,) at least one prompt stays in training
    is_held = torch.isin(group, held_groups)  # (N,)
    held, train = is_held.nonzero().squeeze(-1), (~is_held).nonzero().squeeze(-1)  # (H,), (N-H,)
    n_held = len(held)

    def loss_on(idx: Tensor | None = None) -> float:
        f, d, v, w = ((feats, depth, value, weight) if idx is None
                      else (feats[idx], depth[idx], value[idx], weight[idx]))
        return weighted_squared_error(predictor.predict(f, d), v.cpu(), w.cpu()).item()

    # the predictor as it steered this step (its own standardisation) is the one to beat
    before = loss_on()
    best = loss_on(held) if n_held else math.inf
    best_state, kept = copy.deepcopy(predictor.state_dict()), 0
    best_moments = copy.deepcopy(optimizer.state_dict())  # restored with the weights
    start_state, start_moments = best_state, best_moments  # (best_* are replaced, not changed)
    predictor.set_normalisation(feats)
    was_training = predictor.training
    updates = 0
    for epoch in range(1, epochs + 1):
        predictor.train()
        order = train[torch.randperm(len(train), generator=generator).to(device)]  # (N-H,)
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]  # (B,)
            if weight[idx].sum() <= 0:
                continue
            p = predictor(feats[idx], depth[idx])  # (B,)
            loss = weighted_squared_error(p, value[idx], weight[idx])  # ()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            updates += 1
        if n_held:
            held_loss = loss_on(held)
            if held_loss < best:
                best, kept = held_loss, epoch
                best_state = copy.deepcopy(predictor.state_dict())
                best_moments = copy.deepcopy(optimizer.state_dict())
        else:
            kept = epoch
    if n_held or not updates:  # the kept pass's weights and the optimizer's moments as they
        # were then; no update at all (epochs=0): the predictor as it was, standardisation too
        predictor.load_state_dict(best_state)
        optimizer.load_state_dict(best_moments)
    predictor.train(was_training)
    after = loss_on()
    if not math.isfinite(after):
        lr = optimizer.param_groups[0]["lr"]
        predictor.load_state_dict(start_state)
        optimizer.load_state_dict(start_moments)
        raise FloatingPointError(
            f"the predictor's fit diverged: its loss over the replay is {after} after "
            f"{updates} updates at learning rate {lr} (--model.predictor_lr); the predictor "
            f"is left as it was before the fit. Lower --model.predictor_lr")
    out = {"predictor/loss_before": before, "predictor/loss": after,
           "predictor/epochs_kept": float(kept), "predictor/entries": float(n),
           "predictor/updates": float(updates)}
    if n_held:
        out["predictor/holdout_loss"] = best
    return out


__all__ = [
    "PredictorBatch", "ReplayBuffer", "SuccessPredictor", "fit_predictor", "node_targets",
    "predict_nodes", "prompt_group", "training_batch", "weighted_squared_error",
]
