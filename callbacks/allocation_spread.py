"""AllocationSpread: where did the step's budget go? (``alloc/*``)

Per epoch, over the step's trees (all ranks'): leaves per opened prompt (histogram, Gini,
normalised entropy, max), the Gini of the stage-1 rollouts per opened prompt, prompts opened
and filtered out (candidates given 0 rollouts), continuations per branched prefix and the
depth of branched prefixes (histograms; mean depth weighted by continuations), the pool of
continuations returned by prompts that could not use them, the cold-start flag, the
effective ratio, and what the step spent (leaves, generated tokens, tool calls).

Besides the step: how many of its opened prompts the run had never opened before
(``alloc/prompts_new``) and how many distinct prompts it has opened so far
(``alloc/prompts_distinct``). An allocator that keeps re-opening the prompts it knows to be
mixed raises the effective ratio while training on fewer questions; these say by how much.
The prompts seen are the callback's state, saved in checkpoints, so a resumed run counts on.
"""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np

from callbacks._common import (RolloutCallback, epoch_summary, log_scalars, log_step,
                               tensorboard_logger)
from callbacks._stats import allocation_metrics, integer_bins


class AllocationSpread(RolloutCallback):
    """How each epoch's sampling budget was spread (``alloc/*``), logged at epoch start.

    Args:
        histograms: also write TensorBoard histograms (needs a ``TensorBoardLogger``).
        every_n_epochs: log every n-th epoch (1 = every epoch).
    """

    def __init__(self, histograms: bool = True, every_n_epochs: int = 1):
        if every_n_epochs < 1:
            raise ValueError(f"AllocationSpread every_n_epochs ({every_n_epochs}) must be >= 1")
        self.histograms = histograms
        self.every_n_epochs = every_n_epochs
        self.last_metrics: dict[str, float] = {}
        self.seen: set[str] = set()  # prompts opened in earlier logged epochs of this run

    def tensorboard_for(self) -> str:
        if not self.histograms:
            return ""
        return "histograms (set `histograms: false` to log scalars only)"

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch % self.every_n_epochs:
            return
        summary = epoch_summary(trainer, "AllocationSpread")
        if summary is None:
            return
        scalars, hists = allocation_metrics(summary)
        opened = {t.prompt_id for t in summary.trees}
        scalars["alloc/prompts_new"] = float(len(opened - self.seen))
        self.seen |= opened
        scalars["alloc/prompts_distinct"] = float(len(self.seen))
        self.last_metrics = scalars
        log_scalars(trainer, scalars)
        tb = tensorboard_logger(trainer)
        if self.histograms and tb is not None and trainer.is_global_zero:
            for tag, values in hists.items():
                tb.experiment.add_histogram(tag, np.asarray(values), global_step=log_step(trainer),
                                            bins=integer_bins(values))

    def state_dict(self) -> dict:
        return {"seen": sorted(self.seen)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.seen = set(state_dict.get("seen", ()))
