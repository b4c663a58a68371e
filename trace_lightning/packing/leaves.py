"""Token-budget packing: mini-batches for PPO-style updates, micro-batches that fit memory.

- :func:`split_minibatches` splits a step's sequences into ``n`` mini-batches (one optimizer
  step each) in random order, each sequence going to the mini-batch with the fewest tokens so
  far: per-mini-batch token totals differ by at most the longest sequence
  (:func:`split_balanced`, which splits whole trees the same way for tree packing).
- :func:`leaf_minibatches`: one pass over a step's leaves as mini-batches of micro-batches
  (``packing.trees.tree_minibatches`` is its packed-tree counterpart).
- :func:`pack_microbatches` groups one mini-batch into micro-batches whose padded size
  ``n_seqs * longest`` stays within ``max_tokens``, longest first, so sequences of similar
  length share a micro-batch and padding stays small. A sequence longer than ``max_tokens``
  gets a micro-batch of its own (over budget: the budget is a packing target, not a hard
  memory limit; truncating would drop the tokens that earned the reward).
- :func:`collate` right-pads a micro-batch into ``(B, T)`` tensors aligned with ``input_ids``
  (see :mod:`trace_lightning.math.loss` for the alignment convention).
- :func:`equalise_over_ranks` pads every rank's mini-batches to the same micro-batch count
  and gives each the divisor of a token-mean over all ranks.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence

import torch

from trace_lightning.math.loss import token_weights
from trace_lightning.tree import LeafSequence


def pack_microbatches(seqs: Sequence[LeafSequence], max_tokens: int) -> list[list[int]]:
    """Indices of ``seqs`` grouped into micro-batches with ``len(batch) * longest <= max_tokens``
    (``pack_lengths`` of their lengths)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens ({max_tokens}) must be >= 1; set the micro-batch token "
                         f"budget to at least the longest sequence you expect")
    return pack_lengths([len(s.input_ids) for s in seqs], max_tokens)


def pack_lengths(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of sequences of these ``lengths`` grouped so that ``len(group) * longest <=
    max_tokens``, right-padded batches of similar lengths.

    Taken longest first (ties by index); a group is closed when the next sequence would
    overflow it, and a sequence longer than ``max_tokens`` sits alone. Every index appears
    exactly once.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:  # longest first: a group's first sequence is its longest
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def padding_share(batches: Sequence[Sequence[int]], seqs: Sequence[LeafSequence]) -> float:
    """Share of padded slots: ``1 - real tokens / sum(len(batch) * longest in batch)``."""
    real = padded = 0
    for b in batches:
        lengths = [len(seqs[i].input_ids) for i in b]
        if lengths:
            real += sum(lengths)
            padded += len(lengths) * max(lengths)
    return 1.0 - real / padded if padded else 0.0


def split_minibatches(seqs: Sequence[LeafSequence], n_minibatches: int,
                      seed: int = 0) -> list[list[int]]:
    """Split indices of ``seqs`` into ``n_minibatches`` random groups balanced by tokens
    (``split_balanced`` of their lengths)."""
    return split_balanced([len(s.input_ids) for s in seqs], n_minibatches, seed)


def split_balanced(sizes: Sequence[int], n_groups: int, seed: int = 0) -> list[list[int]]:
    """Split indices of items of these ``sizes`` into ``n_groups`` random groups balanced by
    size.

    Items are visited in a seeded random order and each goes to the group with the smallest
    total so far (ties: lowest group index); totals then differ by at most the largest item.
    Each group is returned in visiting order. With fewer items than ``n_groups`` (a rank's
    small shard) the extra groups are empty, so every rank still gets ``n_groups`` groups.
    """
    if n_groups < 1:
        raise ValueError(f"n_minibatches ({n_groups}) must be >= 1; set the number of "
                         f"optimizer steps per RL step to at least 1")
    order = list(range(len(sizes)))
    random.Random(seed).shuffle(order)
    heap = [(0, g) for g in range(n_groups)]  # (total, group)
    groups: list[list[int]] = [[] for _ in range(n_groups)]
    for i in order:
        total, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (total + sizes[i], g))
    return groups


def leaf_minibatches(seqs: Sequence[LeafSequence], n_minibatches: int, max_tokens: int,
                     pad_id: int, seed: int) -> list[dict]:
    """One pass over a step's leaves: ``n_minibatches`` mini-batches of loose leaves, each a
    list of right-padded micro-batches (``micro``) and its policy tokens (``n_tokens``)."""
    out = []
    for idx in split_minibatches(seqs, n_minibatches, seed=seed):
        mini = [seqs[i] for i in idx]
        groups = pack_microbatches(mini, max_tokens) if mini else []
        micro = [collate([mini[i] for i in g], pad_id,
                         advantages=[mini[i].token_advantages for i in g]) for g in groups]
        out.append({"micro": micro, "n_tokens": float(sum(sum(s.policy_mask) for s in mini))})
    return out


def collate(seqs: Sequence[LeafSequence], pad_id: int,
            advantages: Sequence[Sequence[float]] | None = None) -> dict[str, torch.Tensor]:
    """Right-pad sequences into tensors.

    Args:
        seqs: the micro-batch.
        pad_id: token id used for padding (masked out everywhere).
        advantages: per-token advantages aligned with each ``input_ids`` (as returned by
            :func:`trace_lightning.math.advantage.assign_advantages`); ``None`` spreads each
            ``seq.advantage`` over its policy tokens.

    Returns:
        ``input_ids`` (B, T) long, ``attention_mask`` (B, T) long (1 on real tokens),
        ``policy_mask`` (B, T) float (1 on policy tokens), ``old_logprobs`` (B, T) float,
        ``advantages`` (B, T) float (0 off policy tokens), ``rewards`` (B,) float,
        ``prev`` (B, T) long (the row whose hidden state predicts each token: ``t - 1``) and
        the (leaf, token) weights of ``loss.weighted_policy_loss`` (one pair per policy
        token: ``loss.token_weights``), the same keys a packed tree's micro-batch has
        (``packing.trees.collate_units``).
    """
    if not seqs:
        raise ValueError("collate got no sequences; pack_microbatches never yields an empty batch")
    if advantages is not None and len(advantages) != len(seqs):
        raise ValueError(f"advantages has {len(advantages)} rows for {len(seqs)} sequences; pass "
                         f"the per-token lists aligned with seqs")
    b, t = len(seqs), max(len(s.input_ids) for s in seqs)
    input_ids = torch.full((b, t), pad_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((b, t), dtype=torch.long)  # (B, T)
    policy_mask = torch.zeros((b, t), dtype=torch.float32)  # (B, T)
    old_logprobs = torch.zeros((b, t), dtype=torch.float32)  # (B, T)
    adv = torch.zeros((b, t), dtype=torch.float32)  # (B, T)
    for i, s in enumerate(seqs):
        n = len(s.input_ids)
        if not (len(s.policy_mask) == len(s.logprobs) == n):
            raise ValueError(f"sequence ({s.tree_id}, {s.leaf_id}) has {n} ids, "
                             f"{len(s.policy_mask)} mask entries and {len(s.logprobs)} log-probs; "
                             f"they must be aligned (RolloutTree.flatten makes them so)")
        if n and s.policy_mask[0]:
            raise ValueError(f"sequence ({s.tree_id}, {s.leaf_id}) starts with a policy token; "
                             f"the first token has no prediction, so every sequence must start "
                             f"with at least one prompt token")
        input_ids[i, :n] = torch.tensor(s.input_ids, dtype=torch.long)
        attention_mask[i, :n] = 1
        pm = torch.tensor(s.policy_mask, dtype=torch.float32)  # (n,)
        policy_mask[i, :n] = pm
        old_logprobs[i, :n] = torch.tensor(s.logprobs, dtype=torch.float32) * pm
        if advantages is None:
            adv[i, :n] = s.advantage * pm
        else:
            if len(advantages[i]) != n:
                raise ValueError(f"advantages[{i}] has {len(advantages[i])} entries for {n} "
                                 f"tokens of sequence ({s.tree_id}, {s.leaf_id})")
            adv[i, :n] = torch.tensor(advantages[i], dtype=torch.float32) * pm
    rewards = torch.tensor([s.reward for s in seqs], dtype=torch.float32)  # (B,)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "policy_mask": policy_mask,
            "old_logprobs": old_logprobs, "advantages": adv, "rewards": rewards,
            "prev": _prev(b, t), **token_weights(adv, policy_mask)}


def _prev(b: int, t: int) -> torch.Tensor:
    """``(B, T)``: in a per-leaf row token ``i`` is predicted by the hidden state at ``i - 1``
    (at 0 for token 0, which is never trained)."""
    return torch.arange(t).clamp(min=1).sub(1).repeat(b, 1)


def equalise_over_ranks(minibatches: list[dict], pad_id: int,
                        device: torch.device | None = None) -> list[dict]:
    """Make this rank's mini-batches fit a step taken by all ranks together.

    Each mini-batch is padded with empty (all-masked) micro-batches to the largest
    micro-batch count over ranks (collective ops, FSDP's and DDP's, need equal step counts),
    and gets ``normalizer``, the divisor of its token-mean loss: its policy tokens summed over
    ranks, divided by the number of ranks. DDP and FSDP average gradients over ranks, so
    every rank dividing its own sum by that gives the token-mean over the whole mini-batch,
    where every token weighs the same on whichever rank it was sampled (dividing by each
    rank's own ``n_tokens`` would weigh a token on a rank with a small share more). One
    process: ``normalizer`` = ``n_tokens``.
    """
    counts = torch.tensor([len(m["micro"]) for m in minibatches], dtype=torch.long)  # (S,)
    tokens = torch.tensor([m["n_tokens"] for m in minibatches], dtype=torch.float64)  # (S,)
    world = 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        counts, tokens = counts.to(device), tokens.to(device)
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX)
        torch.distributed.all_reduce(tokens, op=torch.distributed.ReduceOp.SUM)
        counts, tokens = counts.cpu(), tokens.cpu()
    for m, c, n in zip(minibatches, counts.tolist(), tokens.tolist()):
        while len(m["micro"]) < max(c, 1):
            m["micro"].append(_empty_microbatch(pad_id))
        m["normalizer"] = n / world
    return minibatches


def _empty_microbatch(pad_id: int) -> dict:
    z = torch.zeros(1, 2)
    return {"input_ids": torch.full((1, 2), pad_id, dtype=torch.long),
            "attention_mask": torch.ones(1, 2, dtype=torch.long),
            "policy_mask": z.clone(), "old_logprobs": z.clone(), "advantages": z.clone(),
            "prev": _prev(1, 2), **token_weights(z, z)}
