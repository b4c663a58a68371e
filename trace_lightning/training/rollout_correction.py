"""Rollout correction in the update: where the trainer's start-weight log-probs come from,
and how a micro-batch's (leaf, token) pairs get their weights.

The formulas are ``trace_lightning.math.rollout_correction``'s. Here:

- **The step's start weights.** The mismatch is ``pi_old / pi_rollout`` with ``pi_old`` the
  policy at the step's start. The step's first mini-batch runs its forward at those weights,
  so its log-probs (detached) are ``pi_old``: the mismatch is measured there every step at no
  cost. With correction on, the loss is verl's decoupled one (ratio ``pi / pi_old``, weights
  ``pi_old / pi_rollout``), which needs ``pi_old`` on every token of the step: the later
  mini-batches' are computed before the update starts (``start_logprobs``: one no-grad
  forward over every mini-batch but the first, ``ppo_epochs * minibatches_per_step - 1`` of
  them; with one mini-batch per step, nothing).
- **Pairs.** A sequence-level weight is per leaf, and a packed tree's shared token stands for
  one pair per leaf through it. A packed micro-batch lists its pairs (``pair_row``,
  ``pair_pos``, ``pair_leaf``, ``pair_adv``; ``collate_pairs``); a per-leaf one is a leaf per
  row and lists none (``packing.pairs.microbatch_pairs`` reads them off its policy tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trace_lightning.packing.pairs import microbatch_pairs
from trace_lightning.math.rollout_correction import (ROLLOUT_IS_LEVELS, ROLLOUT_RS_LEVELS,
                                                     RolloutIS, RolloutRS, correction_weights,
                                                     fold_pair_weights, log_ratios,
                                                     mismatch_stats)

PREFIX = "rollout_correction/"


@dataclass(frozen=True)
class RolloutCorrection:
    """The update's rollout-correction settings (``TraceModule``'s ``rollout_*`` arguments,
    named as in verl's ``algorithm.rollout_correction``)."""

    rollout_is: RolloutIS | None = None
    rollout_is_threshold: float = 2.0
    rollout_rs: RolloutRS | None = None
    rollout_rs_threshold: float | None = None
    rollout_rs_threshold_lower: float | None = None
    rollout_token_veto_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.rollout_is is not None and self.rollout_is not in ROLLOUT_IS_LEVELS:
            raise ValueError(f"--model.rollout_is ({self.rollout_is!r}): expected one of "
                             f"{', '.join(map(repr, ROLLOUT_IS_LEVELS))} or null (no IS weights)")
        if self.rollout_rs is not None and self.rollout_rs not in ROLLOUT_RS_LEVELS:
            raise ValueError(f"--model.rollout_rs ({self.rollout_rs!r}): expected one of "
                             f"{', '.join(map(repr, ROLLOUT_RS_LEVELS))} or null (no rejection)")
        if not self.rollout_is_threshold > 0:
            raise ValueError(f"--model.rollout_is_threshold ({self.rollout_is_threshold}) must "
                             f"be > 0 (verl's default 2.0): IS weights are cut at it and the "
                             f"mismatch's share_past_bound counts ratios outside [1/C, C]")
        hi = (self.rollout_rs_threshold if self.rollout_rs_threshold is not None
              else self.rollout_is_threshold)
        if not hi > 0:
            raise ValueError(f"--model.rollout_rs_threshold ({self.rollout_rs_threshold}) must "
                             f"be > 0 or null (then rollout_is_threshold)")
        lo = self.rollout_rs_threshold_lower
        if lo is not None and not 0 < lo <= hi:
            raise ValueError(f"--model.rollout_rs_threshold_lower ({lo}) must be in (0, {hi}] "
                             f"(the upper threshold) or null (then 1 / upper)")
        veto = self.rollout_token_veto_threshold
        if veto is not None and not 0 < veto < 1:
            raise ValueError(f"--model.rollout_token_veto_threshold ({veto}) must be in (0, 1) "
                             f"(verl suggests 1e-4) or null (no veto)")

    @property
    def on(self) -> bool:
        """Whether the loss is corrected (else the mismatch is only measured)."""
        return self.rollout_is is not None or self.rollout_rs is not None \
            or self.rollout_token_veto_threshold is not None

    def apply(self, mb: dict, logp: torch.Tensor, first: bool,
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None, dict[str, torch.Tensor]]:
        """The loss's old log-probs and weights for micro-batch ``mb``, and the statistics.

        Args:
            mb: a collated micro-batch (``old_logprobs`` are the sampler's).
            logp: ``(B, T)`` this forward's log-probs.
            first: whether this is the step's first mini-batch (its forward is at the
                step's start weights).

        Returns:
            ``old (B, T)`` (the sampler's when off; ``pi_old``'s when on), the corrected
            weights (None: unchanged) and detached stats keyed ``rollout_correction/...``:
            the mismatch where ``pi_old`` is known (means over pairs and ``max_ratio`` /
            ``min_ratio``), and the weights' shares when on.
        """
        rollout, count = mb["old_logprobs"], mb["count"]  # (B, T) each
        if first:
            start = logp.detach()  # (B, T): the step's start weights
        elif "start_logprobs" in mb:
            start = mb["start_logprobs"]  # (B, T)
        elif self.on:
            raise RuntimeError("rollout correction is on but a micro-batch after the step's "
                               "first mini-batch has no start_logprobs; the DataModule must "
                               "call the module's prepare_update on the step's batches")
        else:
            return rollout, None, {}
        log_rho = log_ratios(start, rollout, count)  # (B, T)
        stats = {PREFIX + k: v for k, v in
                 mismatch_stats(log_rho, count, self.rollout_is_threshold).items()}
        if not self.on:
            return rollout, None, stats
        row, pos, leaf, adv = microbatch_pairs(mb)  # (P,) each
        n_leaves = int(leaf.max()) + 1 if leaf.numel() else 0
        w, wstats = correction_weights(
            log_rho[row, pos], leaf, n_leaves, rollout_is=self.rollout_is,
            rollout_is_threshold=self.rollout_is_threshold, rollout_rs=self.rollout_rs,
            rollout_rs_threshold=self.rollout_rs_threshold,
            rollout_rs_threshold_lower=self.rollout_rs_threshold_lower,
            rollout_token_veto_threshold=self.rollout_token_veto_threshold)  # (P,)
        from trace_lightning.packing.trees import WEIGHT_KEYS

        weights = fold_pair_weights(w, row, pos, adv, {k: mb[k] for k in WEIGHT_KEYS})
        # shares over pairs, the same pairs the mismatch counts
        stats |= {PREFIX + k: v for k, v in wstats.items()}
        old = torch.where(count > 0, start, rollout.to(start.dtype))  # (B, T)
        return old, weights, stats


@torch.no_grad()
def start_logprobs(logprobs, batches: Sequence[dict], device: torch.device) -> int:
    """Set ``start_logprobs`` ``(B, T)`` on every micro-batch of ``batches`` after the first
    mini-batch (whose own forward gives them), with the weights ``logprobs`` runs now: the
    step's start weights, before its first optimizer step. Returns the micro-batches run.

    Args:
        logprobs: ``(micro-batch on device, temperature) -> (B, T)`` the policy's log-probs.
        batches: the step's mini-batches, in training order (each with ``micro`` and its
            sampling ``temperature``).
        device: where the policy runs.
    """
    from lightning.fabric.utilities.apply_func import move_data_to_device

    ran = 0
    for m in batches[1:]:
        tau = float(m.get("temperature", 1.0))
        for mb in m["micro"]:
            lp = logprobs(move_data_to_device(mb, device), tau)  # (B, T)
            mb["start_logprobs"] = lp.float().to(mb["old_logprobs"].device)  # (B, T)
            ran += 1
    return ran
