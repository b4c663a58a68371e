"""One RL step's trees as the update's mini-batches: token-packed micro-batches of whole trees
(each forwarded once) or of loose leaves, ``ppo_epochs`` passes each split afresh."""

from __future__ import annotations

import torch

from trace_lightning.packing.leaves import equalise_over_ranks, leaf_minibatches
from trace_lightning.packing.trees import tree_minibatches, update_units
from trace_lightning.rollout.step import RolloutStep


def step_minibatches(step: RolloutStep, pad: int, minibatches: int, ppo_epochs: int,
                     max_tokens: int, tree_packing: bool, temperature: float,
                     device: torch.device | None = None) -> list[dict]:
    """``ppo_epochs`` passes over the step's trees (``tree_packing``: whole trees, split at
    subtree boundaries where one exceeds ``max_tokens`` padded tokens) or leaves, each pass
    split afresh into ``minibatches`` mini-batches of micro-batches; every mini-batch carries
    the ``temperature`` the rollouts were sampled at (the update recomputes their log-probs
    at it). Under several processes the ranks get equal counts (``equalise_over_ranks``,
    which runs a collective: every rank calls this)."""
    if tree_packing:
        leaves: dict[str, list] = {}
        for s in step.sequences:
            leaves.setdefault(s.tree_id, []).append(s)
        units = [update_units(t, leaves[t.tree_id], max_tokens)
                 for t in step.trees if t.tree_id in leaves]
    out = []
    for e in range(ppo_epochs):
        seed = step.epoch * ppo_epochs + e  # ppo_epochs=1: the step's epoch
        if tree_packing:
            out += tree_minibatches(units, minibatches, max_tokens, pad, seed)
        else:
            out += leaf_minibatches(step.sequences, minibatches, max_tokens, pad, seed)
    for m in out:
        m["temperature"] = temperature
    return equalise_over_ranks(out, pad, device)
