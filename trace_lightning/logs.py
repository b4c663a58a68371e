"""Scalars written straight to the trainer's loggers, once, at Lightning's logging step.

For values that describe an RL step (one per epoch) rather than an optimizer step:
``self.log(on_step=True)`` would write them again at every later logging step of the epoch
(Lightning repeats an on-step key's last value until it is logged anew).

The step is ``trainer.fit_loop.epoch_loop._batches_that_stepped``: the one Lightning's
``self.log`` (the module's ``train/*``) and its ``LearningRateMonitor`` use, so all curves
share one x-axis. (``trainer.global_step`` counts optimizer steps; a module that also steps
another optimizer through Lightning would move it off that axis.)
"""

from __future__ import annotations

import math

import lightning.pytorch as pl


def log_step(trainer: pl.Trainer) -> int:
    """The x-axis of Lightning's own ``self.log`` calls."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def log_scalars(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    """Finite values to every logger, on global rank 0; NaN/inf (undefined) are left out."""
    metrics = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(v)}
    if not metrics or not trainer.is_global_zero:
        return
    step = log_step(trainer)
    for lg in trainer.loggers:
        lg.log_metrics(metrics, step=step)
