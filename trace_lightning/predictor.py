"""The shared success predictor ``V(H)``: P(success | prefix history H).

One small model scores roots (the prompt alone, including prompts never rolled out) and
turn-level prefixes alike. It steers allocation only (stage 1 reads ``V(root)``, stage 2 reads
``V(prefix)``) and never enters the policy gradient: its inputs are detached features.

Features (swappable, ``Featuriser.kind``):

- ``hidden`` (default): the policy's last hidden state (after the final norm, before
  ``lm_head``) at the last token of a node's prefix: the prompt's last token for the root,
  the last token of a turn (after its observation) for a turn node. A causal model's state at
  position i depends only on tokens <= i, so one forward pass over a root-to-leaf sequence
  gives the feature of every prefix on that path (``node_features``).
- ``bag_of_tokens``: a hashed, L1-normalised bag of the prefix's token ids; no policy forward.

Depth is not part of the feature vector; it enters through the predictor's depth embedding.

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
from types import SimpleNamespace
from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from trace_lightning.tree import RolloutTree

NodeKey = tuple[str, int]  # (tree_id, node_id)
FeaturiserKind = Literal["hidden", "bag_of_tokens"]


# ---- features: hidden ----------------------------------------------------------------------
def _pack(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Indices of sequences grouped so that ``len(group) * max_len <= batch_tokens``.

    Longest first (less padding); a sequence longer than ``batch_tokens`` runs alone.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= batch_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@torch.no_grad()
def _last_hidden_at(policy: PreTrainedModel, sequences: list[list[int]],
                    positions: list[list[int]], batch_tokens: int) -> list[Tensor]:
    """The policy's last hidden state of ``sequences[i]`` at each of ``positions[i]``.

    Returns one float32 CPU tensor (len(positions[i]), D) per sequence. Runs the decoder body
    (``policy.get_decoder()``), not ``lm_head``: no vocabulary-sized logits are computed.
    A policy wrapped whole by FSDP runs through its wrapper instead (the wrapper gathers
    the embedding and final norm it owns), reads ``hidden_states[-1]`` and keeps the LM
    head to the last row (``logits_to_keep=1``).

    Batches are right-padded and passed without an attention mask: under causal attention a
    real token never sees the padding after it, so its hidden state is the same (tested), and
    SDPA takes its causal fast path (7% less time here on CPU for 256 sequences of 40-400
    tokens; the module's training forward does the same).

    Under FSDP every forward is a collective (each wrapped layer gathers its shards), yet each
    rank featurises its own trees: ranks agree on the most forwards any of them needs, and
    one with fewer (or none) runs one-token forwards to match.
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    was_training = policy.training
    policy.eval()
    if isinstance(policy, FSDP):
        def decoder(**kw):
            # logits_to_keep=1: the LM head runs on one row per sequence, not (B, T, V)
            out = policy(**kw, output_hidden_states=True, logits_to_keep=1)
            return SimpleNamespace(last_hidden_state=out.hidden_states[-1])
        device = next(policy.parameters()).device
    else:
        decoder = policy.get_decoder()
        device = policy.device
    out: list[Tensor] = [torch.empty(0)] * len(sequences)
    groups = _pack([len(s) for s in sequences], batch_tokens)
    forwards = len(groups)
    if isinstance(policy, FSDP) and dist.is_initialized() and dist.get_world_size() > 1:
        most = torch.tensor([forwards], device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        forwards = int(most.item())
    try:
        for _ in range(forwards - len(groups)):  # to match other ranks' collectives
            decoder(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
        for group in groups:
            max_len = max(len(sequences[i]) for i in group)
            ids = torch.zeros(len(group), max_len, dtype=torch.long)  # (B, T) right-padded
            for row, i in enumerate(group):
                ids[row, :len(sequences[i])] = torch.tensor(sequences[i])
            hidden = decoder(input_ids=ids.to(device),
                             use_cache=False).last_hidden_state  # (B, T, D)
            for row, i in enumerate(group):
                pos = torch.tensor(positions[i], device=hidden.device)  # (K,)
                out[i] = hidden[row, pos].float().cpu()  # (K, D)
    finally:
        policy.train(was_training)
    return out


def _tips(tree: RolloutTree) -> list[int]:
    """Nodes without children (leaves, and unfinished ends such as a bare root), in id order."""
    return [n.id for n in tree.nodes if not n.children]


def node_features(policy: PreTrainedModel, trees: list[RolloutTree], batch_tokens: int,
                  known: Mapping[NodeKey, Tensor] | None = None) -> dict[NodeKey, Tensor]:
    """``hidden`` features of every node of ``trees``: {(tree_id, node_id): (D,) float32}.

    One forward pass per root-to-tip path (a tip is a node without children: every leaf, and
    a root or prefix nothing was sampled from yet); every node on the path is read off the
    same pass at its last token. A node on several paths is taken from the first (tips in id
    order). Paths whose nodes are all in ``known`` are skipped, and ``known`` nodes are not
    recomputed (pass the stage-2 features back in after the continuations).

    Args:
        policy: a causal LM; run in eval mode without gradients, its mode restored after.
        trees: rollout trees; every root must hold at least one token.
        batch_tokens: most padded tokens (rows x longest row) per forward.
        known: features already computed with the same weights; returned unchanged.
    """
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens ({batch_tokens}) must be >= 1")
    out: dict[NodeKey, Tensor] = dict(known or {})
    sequences: list[list[int]] = []
    positions: list[list[int]] = []
    keys: list[list[NodeKey]] = []
    done: dict[str, set[int]] = {}
    for tree_id, node_id in out:
        done.setdefault(tree_id, set()).add(node_id)
    for tree in trees:
        if not tree.root.token_ids:
            raise ValueError(f"tree {tree.tree_id} has an empty prompt; the hidden featuriser "
                             f"reads the prompt's last token")
        taken = done.get(tree.tree_id, set())
        for tip in _tips(tree):
            path = tree.path(tip)
            if all(n.id in taken for n in path):
                continue
            ends = torch.tensor([len(n.token_ids) for n in path]).cumsum(0) - 1  # (L,)
            pos, ks = [], []
            for n, end in zip(path, ends.tolist()):
                if n.id not in taken:
                    taken.add(n.id)
                    pos.append(end)
                    ks.append((tree.tree_id, n.id))
            sequences.append([t for n in path for t in n.token_ids])
            positions.append(pos)
            keys.append(ks)
    for ks, feats in zip(keys, _last_hidden_at(policy, sequences, positions, batch_tokens)):
        for k, f in zip(ks, feats):
            out[k] = f  # (D,)
    return out


def prompt_features(policy: PreTrainedModel, prompt_ids: list[list[int]],
                    batch_tokens: int) -> Tensor:
    """``hidden`` features of candidate prompts (roots before any rollout): (P, D) float32."""
    if any(not p for p in prompt_ids):
        raise ValueError("an empty prompt has no last token to read; drop it from the candidates")
    if not prompt_ids:
        return torch.zeros(0, policy.config.get_text_config().hidden_size)
    feats = _last_hidden_at(policy, prompt_ids, [[len(p) - 1] for p in prompt_ids], batch_tokens)
    return torch.cat(feats)  # (P, D)


# ---- features: bag of tokens ---------------------------------------------------------------
def _bag(token_ids: Sequence[int], buckets: int) -> Tensor:
    """Unnormalised hashed counts of ``token_ids``: (buckets,)."""
    ids = torch.tensor(list(token_ids), dtype=torch.long)  # (T,)
    hashed = (ids * 2654435761) % (1 << 32) % buckets  # (T,) Knuth multiplicative hash
    return torch.bincount(hashed, minlength=buckets).float()  # (buckets,)


def bag_node_features(trees: list[RolloutTree], buckets: int) -> dict[NodeKey, Tensor]:
    """``bag_of_tokens`` features of every node: the prefix's hashed counts over their sum."""
    out: dict[NodeKey, Tensor] = {}
    for tree in trees:
        counts: list[Tensor] = []
        for n in tree.nodes:  # a parent always comes before its children
            c = _bag(n.token_ids, buckets)  # (buckets,)
            if n.parent is not None:
                c = c + counts[n.parent]
            counts.append(c)
            out[(tree.tree_id, n.id)] = c / c.sum().clamp(min=1.0)  # (buckets,)
    return out


def bag_prompt_features(prompt_ids: list[list[int]], buckets: int) -> Tensor:
    """``bag_of_tokens`` features of candidate prompts: (P, buckets)."""
    bags = [_bag(p, buckets) for p in prompt_ids]
    if not bags:
        return torch.zeros(0, buckets)
    c = torch.stack(bags)  # (P, buckets)
    return c / c.sum(-1, keepdim=True).clamp(min=1.0)  # (P, buckets)


class Featuriser:
    """Turns tree nodes and candidate prompts into feature vectors for the predictor.

    Args:
        kind: ``"hidden"`` (the policy's last hidden state at the prefix's last token) or
            ``"bag_of_tokens"`` (hashed bag of the prefix's token ids; no policy forward).
        batch_tokens: most padded tokens per policy forward (``hidden`` only).
        buckets: number of hash buckets (``bag_of_tokens`` only).
    """

    def __init__(self, kind: FeaturiserKind = "hidden", batch_tokens: int = 16384,
                 buckets: int = 256) -> None:
        if kind not in ("hidden", "bag_of_tokens"):
            raise ValueError(f"featuriser kind {kind!r}: expected one of 'hidden', "
                             f"'bag_of_tokens'")
        if batch_tokens < 1:
            raise ValueError(f"featuriser batch_tokens ({batch_tokens}) must be >= 1")
        if buckets < 1:
            raise ValueError(f"featuriser buckets ({buckets}) must be >= 1")
        self.kind = kind
        self.batch_tokens = batch_tokens
        self.buckets = buckets

    def feature_dim(self, policy: PreTrainedModel | None) -> int:
        if self.kind == "hidden":
            return policy.config.get_text_config().hidden_size
        return self.buckets

    def nodes(self, policy: PreTrainedModel | None, trees: list[RolloutTree],
              known: Mapping[NodeKey, Tensor] | None = None) -> dict[NodeKey, Tensor]:
        """Features of every node of ``trees`` ({(tree_id, node_id): (D,)})."""
        if self.kind == "hidden":
            return node_features(policy, trees, self.batch_tokens, known=known)
        return {**bag_node_features(trees, self.buckets), **(known or {})}

    def prompts(self, policy: PreTrainedModel | None, prompt_ids: list[list[int]]) -> Tensor:
        """Features of candidate prompts: (P, D)."""
        if self.kind == "hidden":
            return prompt_features(policy, prompt_ids, self.batch_tokens)
        return bag_prompt_features(prompt_ids, self.buckets)


# ---- the model -----------------------------------------------------------------------------
class SuccessPredictor(nn.Module):
    """Small MLP on [standardised features, depth embedding] -> success probability.

    Features are standardised with per-dimension ``feature_mean``/``feature_std`` buffers
    (identity at init; ``fit_predictor`` sets them from the replay before each fit), which
    tames the outlier dimensions of LLM hidden states. The output layer starts at zero, so
    the initial prediction is exactly 0.5.

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

    def logits(self, features: Tensor, depth: Tensor) -> Tensor:
        x = (features - self.feature_mean) / self.feature_std  # (N, D)
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
        self.feature_std.copy_(std.clamp(min=1e-6))  # (D,)


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
            if "group" not in s:  # checkpoints before prompt groups: one group per node
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
    (Without this the MLP memorises a few hundred nodes: measured on the demo, 20 passes left
    a Brier score worse than the constant mean on the next step's nodes, and TRACE then
    filtered out most prompts as certain.) Holding out whole prompts measures
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
    if n_held:  # the kept pass's weights, and the optimizer's moments as they were then
        predictor.load_state_dict(best_state)
        optimizer.load_state_dict(best_moments)
    predictor.train(was_training)
    after = loss_on()
    assert math.isfinite(after), "predictor loss is not finite"
    out = {"predictor/loss_before": before, "predictor/loss": after,
           "predictor/epochs_kept": float(kept), "predictor/entries": float(n),
           "predictor/updates": float(updates)}
    if n_held:
        out["predictor/holdout_loss"] = best
    return out


__all__ = [
    "Featuriser", "FeaturiserKind", "NodeKey", "PredictorBatch", "ReplayBuffer",
    "SuccessPredictor", "bag_node_features", "bag_prompt_features", "fit_predictor",
    "node_features", "node_targets", "predict_nodes", "prompt_features", "prompt_group",
    "training_batch", "weighted_squared_error",
]
