"""RewardVariance: is the step's data contrastive? (``rollout/*``)

GRPO-style updates learn only from groups whose rewards differ. Each epoch this logs, over
the step's trees (all ranks'): the reward std per prompt group and per branched bare-rollout
subtree (mean/min/max), the share of zero-variance prompts with the whole allocation
(``rollout/zero_std_share``) and with the bare rollouts alone, i.e. what stage 1 would have
given (``rollout/zero_std_share_bare``), the effective ratio, the training leaves' reward,
EM and F1, and the share of leaves with a non-zero advantage. Definitions: ``callbacks._stats``.
"""

from __future__ import annotations

import lightning.pytorch as pl

from callbacks._common import RolloutCallback, epoch_summary, log_scalars
from callbacks._stats import reward_variance_metrics


class RewardVariance(RolloutCallback):
    """Reward contrast of each epoch's rollout trees (``rollout/*``), logged at epoch start.

    Args:
        every_n_epochs: log every n-th epoch (1 = every epoch).
    """

    def __init__(self, every_n_epochs: int = 1):
        if every_n_epochs < 1:
            raise ValueError(f"RewardVariance every_n_epochs ({every_n_epochs}) must be >= 1")
        self.every_n_epochs = every_n_epochs
        self.last_metrics: dict[str, float] = {}

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch % self.every_n_epochs:
            return
        summary = epoch_summary(trainer, "RewardVariance")
        if summary is None:
            return
        self.last_metrics = reward_variance_metrics(summary)
        log_scalars(trainer, self.last_metrics)
