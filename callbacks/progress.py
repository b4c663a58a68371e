"""RLProgressBar: Lightning's progress bar, carrying what an RL step did.

Lightning's bar shows the module's ``prog_bar`` values and the logger's version. An RL run
is judged by other figures: the step's mean reward, its effective ratio (the share of trees
whose leaves' rewards differ, the ones GRPO learns from) and the last held-out accuracy.
This bar shows those instead of the version, read from the callbacks that compute them
(``RewardVariance``, ``QAAccuracy``), and writes them as one line at the end of every epoch,
so a log file (where no bar is drawn) holds them too.
"""

from __future__ import annotations

import logging
import time

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar

from callbacks.qa_accuracy import QAAccuracy
from callbacks.reward_variance import RewardVariance
from trace_lightning.console import duration

log = logging.getLogger(__name__)


class RLProgressBar(RichProgressBar):
    """Lightning's rich progress bar with the step's reward, effective ratio and the last
    held-out accuracy, and one line per epoch with them.

    Args:
        leave: keep each epoch's bar on the screen when the next starts.
    """

    def __init__(self, leave: bool = False):
        super().__init__(leave=leave)
        self._since = time.perf_counter()

    def rl_figures(self, trainer: pl.Trainer) -> dict[str, str]:
        """The figures shown, by label: ``reward`` and ``effective`` from ``RewardVariance``
        (this epoch's rollouts), ``held-out <metric>`` from ``QAAccuracy`` (its first overall
        metric, at the last validation). A callback missing from the trainer, or a value not
        computed yet, is left out."""
        figures: dict[str, str] = {}
        for callback in trainer.callbacks:
            if isinstance(callback, RewardVariance):
                m = callback.last_metrics
                if "rollout/reward_mean" in m:
                    figures["reward"] = f"{m['rollout/reward_mean']:.3f}"
                if "rollout/effective_ratio" in m:
                    figures["effective"] = f"{m['rollout/effective_ratio']:.2f}"
            elif isinstance(callback, QAAccuracy) and callback.overall:
                metric = callback.overall[0]
                value = callback.last_metrics.get(f"{callback.prefix}/{metric}")
                if value is not None:
                    figures[f"held-out {metric}"] = f"{value:.4f}"
        return figures

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)  # the log folder's version: said once at the start
        return {**items, **self.rl_figures(trainer)}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._since = time.perf_counter()  # before the first epoch's rollouts

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if not trainer.is_global_zero:
            return
        now = time.perf_counter()
        figures = ", ".join(f"{k} {v}" for k, v in self.rl_figures(trainer).items())
        of = f"/{trainer.max_epochs}" if (trainer.max_epochs or 0) > 0 else ""
        log.info("epoch %d%s: %s (%s)", trainer.current_epoch + 1, of,
                 figures or "no rollout figures (RewardVariance, QAAccuracy not configured)",
                 duration(now - self._since))
        self._since = now
