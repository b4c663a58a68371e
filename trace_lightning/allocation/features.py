"""Features of prefix histories for the success predictor (``Featuriser``).

- ``hidden`` (default): the policy's last hidden state (after the final norm, before
  ``lm_head``) at the last token of a node's prefix: the prompt's last token for the root,
  the last token of a turn (after its observation) for a turn node. A causal model's state at
  position i depends only on the tokens it attends to, so one forward pass over a tree
  packed as one sequence (``tree_packing``) gives the feature of every node of the tree
  (``node_features``).
- ``bag_of_tokens``: a hashed, L1-normalised bag of the prefix's token ids; no policy forward.

With ``confidence=True`` either kind is followed by the policy's confidence in the turns it
generated along the prefix (``confidence_features``): statistics of the behaviour log-probs
the engine returned with the samples, so no forward pass. A hidden state says what the policy
read; how sure it was of what it wrote is a separate signal (a policy that hesitates over its
query or its answer fails more often), which the hidden state at the prefix's last token
need not carry.

With ``task_features=N`` every vector ends with the task's N numbers describing the node's
prompt (``RolloutTree.prompt_features``, from ``Task.prompt_features``; search QA: how findable
its supporting documents are): what the corpus makes hard is beyond the policy's features of
the text.

Depth is not part of the feature vector; it enters through the predictor's depth embedding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import SimpleNamespace
from typing import Literal

import torch
from torch import Tensor
from transformers import PreTrainedModel, PretrainedConfig

from trace_lightning.packing.leaves import pack_lengths
from trace_lightning.tree import RolloutTree
from trace_lightning.packing.attention import attention_inputs
from trace_lightning.packing.trees import TreeUnit, collate_units, layout, pack_rows, split_ends

NodeKey = tuple[str, int]  # (tree_id, node_id)
FeaturiserKind = Literal["hidden", "bag_of_tokens"]

# ---- features: hidden ----------------------------------------------------------------------
@torch.no_grad()
def _hidden_states(policy: PreTrainedModel, batches: list[dict[str, Tensor]],
                   take: Callable[[int, Tensor], None]) -> None:
    """Run the policy's decoder on each batch and hand ``take(i, hidden (B, T, D))`` the final
    hidden states (after the final norm, before ``lm_head``) of batch ``i``.

    A batch holds ``input_ids`` and, for packed trees, what ``packing.attention.attention_inputs``
    reads. Runs the decoder body (``policy.get_decoder()``): no vocabulary-sized logits. A
    policy wrapped whole by FSDP runs through its wrapper instead (the wrapper gathers the
    embedding and final norm it owns), reads ``hidden_states[-1]`` and keeps the LM head to
    the last row (``logits_to_keep=1``).

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
    forwards = len(batches)
    if isinstance(policy, FSDP) and dist.is_initialized() and dist.get_world_size() > 1:
        most = torch.tensor([forwards], device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        forwards = int(most.item())
    try:
        for _ in range(forwards - len(batches)):  # to match other ranks' collectives
            decoder(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
        for i, batch in enumerate(batches):
            batch = {k: _to(v, device) for k, v in batch.items()}
            hidden = decoder(input_ids=batch["input_ids"], use_cache=False,
                             **attention_inputs(policy, batch)).last_hidden_state  # (B, T, D)
            take(i, hidden)
    finally:
        policy.train(was_training)


def _to(value, device):
    """A batch value on ``device``: a tensor, or the tensors of a ``tree_nodes`` plan."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    return value


def _last_hidden_at(policy: PreTrainedModel, sequences: list[list[int]],
                    positions: list[list[int]], batch_tokens: int) -> list[Tensor]:
    """The policy's last hidden state of ``sequences[i]`` at each of ``positions[i]``: one
    float32 CPU tensor (len(positions[i]), D) per sequence.

    Batches are right-padded and passed without an attention mask: under causal attention a
    real token never sees the padding after it, so its hidden state is the same (tested), and
    SDPA takes its causal fast path (the module's training forward does the same).
    """
    out: list[Tensor] = [torch.empty(0)] * len(sequences)
    groups = pack_lengths([len(s) for s in sequences], batch_tokens)
    batches = []
    for group in groups:
        ids = torch.zeros(len(group), max(len(sequences[i]) for i in group),
                          dtype=torch.long)  # (B, T) right-padded
        for row, i in enumerate(group):
            ids[row, :len(sequences[i])] = torch.tensor(sequences[i])
        batches.append({"input_ids": ids})

    def take(g: int, hidden: Tensor) -> None:
        for row, i in enumerate(groups[g]):
            pos = torch.tensor(positions[i], device=hidden.device)  # (K,)
            out[i] = hidden[row, pos].float().cpu()  # (K, D)

    _hidden_states(policy, batches, take)
    return out


def _tips(tree: RolloutTree) -> list[int]:
    """Nodes without children (leaves, and unfinished ends such as a bare root), in id order."""
    return [n.id for n in tree.nodes if not n.children]


def take_node_features(hidden: Tensor, batch: dict, into: dict[NodeKey, Tensor]) -> None:
    """Read the features of a packed micro-batch's nodes (``packing.trees.collate_units``)
    from its final hidden states ``hidden`` ``(R, T, D)`` into ``into``: {(tree_id, node_id):
    (D,) float32, on ``hidden``'s device: no host sync inside a forward; ``on_cpu`` moves
    them in one copy}. A node already in ``into`` keeps its value, so a node in several units
    of a split tree is read from the first, and features computed earlier stay. The update's
    forward reads the same positions (``TraceModule._logprobs``)."""
    # tuples again: a DataLoader's default conversion turns them into lists
    keys = [(tree_id, int(node_id)) for tree_id, node_id in batch["node_keys"]]
    new = [i for i, k in enumerate(keys) if k not in into]
    if not new:
        return
    pick = batch["node_ends"].to(hidden.device)[torch.tensor(new, device=hidden.device)]
    feats = hidden[pick[:, 0], pick[:, 1]].detach().float()  # (K, D)
    for i, f in zip(new, feats):
        into.setdefault(keys[i], f)  # (D,)


def on_cpu(feats: dict[NodeKey, Tensor]) -> dict[NodeKey, Tensor]:
    """``feats`` with every vector on the CPU, those elsewhere moved in one copy."""
    away = [k for k, v in feats.items() if v.device.type != "cpu"]
    if not away:
        return feats
    moved = torch.stack([feats[k] for k in away]).cpu()  # (K, D)
    return {**feats, **dict(zip(away, moved))}


def node_features(policy: PreTrainedModel, trees: list[RolloutTree], batch_tokens: int,
                  known: Mapping[NodeKey, Tensor] | None = None) -> dict[NodeKey, Tensor]:
    """``hidden`` features of every node of ``trees``: {(tree_id, node_id): (D,) float32}.

    One forward pass per tree, packed as one sequence (``tree_packing``: every node's tokens
    once, positions along each path, an attention mask of ancestors); every node is read at
    its prefix's last token. A tree longer than ``batch_tokens`` splits at subtree boundaries
    (a node in several parts is read from the first). Nodes in ``known`` are not recomputed,
    and a tree's branches whose nodes are all known are left out (pass the stage-2 features
    back in after the continuations).

    Args:
        policy: a causal LM; run in eval mode without gradients, its mode restored after.
        trees: rollout trees; every root must hold at least one token.
        batch_tokens: most padded tokens (rows x longest row) per forward.
        known: features already computed with the same weights; returned unchanged.
    """
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens ({batch_tokens}) must be >= 1")
    out: dict[NodeKey, Tensor] = dict(known or {})
    units: list[TreeUnit] = []
    for tree in trees:
        if not tree.root.token_ids:
            raise ValueError(f"tree {tree.tree_id} has an empty prompt; the hidden featuriser "
                             f"reads the prompt's last token")
        tips = [tip for tip in _tips(tree)
                if any((tree.tree_id, n.id) not in out for n in tree.path(tip))]
        if tips:
            units += [layout(tree, ends) for ends in split_ends(tree, tips, batch_tokens)]
    batches = [collate_units([[units[j] for j in row] for row in rows], pad_id=0)
               for rows in pack_rows([len(u) for u in units], batch_tokens)]
    inputs = [{k: b[k] for k in ("input_ids", "position_ids", "subtree_end", "tree_nodes")}
              for b in batches]  # what the forward reads
    _hidden_states(policy, inputs, lambda g, hidden: take_node_features(hidden, batches[g], out))
    return on_cpu(out)


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


# ---- features: the policy's confidence -----------------------------------------------------
CONFIDENCE_DIM = 4
LOW_LOGPROB = -0.6931471805599453  # log(1/2): a token the policy gave less than even odds


def confidence_of(turns: Sequence[Sequence[float]]) -> Tensor:
    """Confidence statistics of one prefix from its turns' policy-token log-probs: (4,).

    ``turns[k]`` holds the behaviour log-probs of the tokens the policy generated in turn k
    (observations excluded). The statistics:

        [mean log-prob over all the prefix's policy tokens,
         mean log-prob of its last turn,
         lowest turn mean,
         share of tokens below log(1/2)]

    All zeros for a prefix without policy tokens (a root, or turns of observations only).
    """
    turns = [list(t) for t in turns if len(t)]
    if not turns:
        return torch.zeros(CONFIDENCE_DIM)
    tokens = [lp for t in turns for lp in t]
    means = [sum(t) / len(t) for t in turns]
    low = sum(lp < LOW_LOGPROB for lp in tokens) / len(tokens)
    return torch.tensor([sum(tokens) / len(tokens), means[-1], min(means), low])  # (4,)


def confidence_features(trees: list[RolloutTree]) -> dict[NodeKey, Tensor]:
    """``confidence_of`` every node's prefix: {(tree_id, node_id): (4,) float32}."""
    out: dict[NodeKey, Tensor] = {}
    for tree in trees:
        paths: list[list[list[float]]] = []  # per node: its prefix's turns' log-probs
        for n in tree.nodes:  # a parent always comes before its children
            own = [lp for lp, m in zip(n.logprobs, n.policy_mask) if m]
            paths.append((paths[n.parent] if n.parent is not None else []) + [own])
            out[(tree.tree_id, n.id)] = confidence_of(paths[-1])
    return out


class Featuriser:
    """Turns tree nodes and candidate prompts into feature vectors for the predictor.

    Args:
        kind: ``"hidden"`` (the policy's last hidden state at the prefix's last token) or
            ``"bag_of_tokens"`` (hashed bag of the prefix's token ids; no policy forward).
        batch_tokens: most padded tokens per policy forward (``hidden`` only).
        buckets: number of hash buckets (``bag_of_tokens`` only).
        confidence: append the policy's confidence in its own turns along the prefix
            (``confidence_features``, 4 numbers from the sampled log-probs) to each vector;
            candidate prompts, which have no turns yet, get zeros there as roots do.
        task_features: append the task's description of each node's prompt
            (``RolloutTree.prompt_features``), this many numbers (search QA: 3); 0: none.
    """

    def __init__(self, kind: FeaturiserKind = "hidden", batch_tokens: int = 16384,
                 buckets: int = 256, confidence: bool = False, task_features: int = 0) -> None:
        if kind not in ("hidden", "bag_of_tokens"):
            raise ValueError(f"featuriser kind {kind!r}: expected one of 'hidden', "
                             f"'bag_of_tokens'")
        if batch_tokens < 1:
            raise ValueError(f"featuriser batch_tokens ({batch_tokens}) must be >= 1")
        if buckets < 1:
            raise ValueError(f"featuriser buckets ({buckets}) must be >= 1")
        if not isinstance(confidence, bool):
            raise ValueError(f"featuriser confidence ({confidence!r}) must be true or false")
        if isinstance(task_features, bool) or not isinstance(task_features, int) \
                or task_features < 0:
            raise ValueError(f"featuriser task_features ({task_features!r}) must be a count >= 0: "
                             f"the numbers the task describes each prompt with (search QA: 3), "
                             f"or 0 for none")
        self.kind = kind
        self.batch_tokens = batch_tokens
        self.buckets = buckets
        self.confidence = confidence
        self.task_features = task_features

    def feature_dim(self, config: PretrainedConfig | None) -> int:
        """The width of a feature vector (``hidden``: the policy's, from its ``config``)."""
        width = config.get_text_config().hidden_size if self.kind == "hidden" else self.buckets
        return width + (CONFIDENCE_DIM if self.confidence else 0) + self.task_features

    def nodes(self, policy: PreTrainedModel | None, trees: list[RolloutTree],
              known: Mapping[NodeKey, Tensor] | None = None,
              hidden: Mapping[NodeKey, Tensor] | None = None) -> dict[NodeKey, Tensor]:
        """Features of every node of ``trees`` ({(tree_id, node_id): (D,)}); those in
        ``known`` are returned unchanged. ``hidden`` (kind ``hidden`` only): the policy's
        final hidden states already read at some nodes' prefix ends (``take_node_features``
        on the update's forward); those nodes run no forward and get the same extras as
        fresh ones."""
        known = known or {}
        if self.kind == "hidden":
            out = node_features(policy, trees, self.batch_tokens,
                                known={**(hidden or {}), **known})
        else:
            out = {**bag_node_features(trees, self.buckets), **known}
        if self.confidence:
            conf = confidence_features(trees)
            out = {k: v if k in known else torch.cat([v, conf[k]]) for k, v in out.items()}
        if self.task_features:
            described = {t.tree_id: self._described(t) for t in trees}
            out = {k: v if k in known else torch.cat([v, described[k[0]]])
                   for k, v in out.items()}
        return out

    def _described(self, tree: RolloutTree) -> Tensor:
        """The task's description of ``tree``'s prompt: (task_features,)."""
        if len(tree.prompt_features) != self.task_features:
            raise ValueError(
                f"tree {tree.tree_id} carries {len(tree.prompt_features)} prompt features but "
                f"--model.featuriser.task_features is {self.task_features}: set it to the "
                f"number the task gives (search QA: 3), or 0 where the task describes no "
                f"prompts")
        return torch.tensor(tree.prompt_features, dtype=torch.float32)

    def prompts(self, policy: PreTrainedModel | None, prompt_ids: list[list[int]]) -> Tensor:
        """Features of candidate prompts: (P, D)."""
        if self.task_features:
            raise ValueError("Featuriser.prompts has no trees to read the task's description "
                             "from; with task_features, featurise candidates as bare trees "
                             "(nodes)")
        if self.kind == "hidden":
            feats = prompt_features(policy, prompt_ids, self.batch_tokens)  # (P, H)
        else:
            feats = bag_prompt_features(prompt_ids, self.buckets)  # (P, buckets)
        if self.confidence:  # no turns yet: a root's confidence
            feats = torch.cat([feats, torch.zeros(len(feats), CONFIDENCE_DIM)], dim=1)
        return feats  # (P, D)


__all__ = [
    "CONFIDENCE_DIM", "Featuriser", "FeaturiserKind", "NodeKey", "bag_node_features",
    "bag_prompt_features", "confidence_features", "confidence_of", "node_features",
    "on_cpu", "prompt_features", "take_node_features",
]
