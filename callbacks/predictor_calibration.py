"""PredictorCalibration: does the shared predictor know which prefixes will succeed?
(``predictor/*``)

On each epoch's trees (all ranks'), every node with a prediction (roots, and the prefixes of
bare rollouts under ``trace``/``oracle``) is scored against its realised value (the mean
reward of the leaves below it, continuations included), weighted by its leaf count. The
predictions were made *before* the predictor trained on this step, so this is out-of-sample.
Logged: Brier score, the constant-mean baseline on the same outcomes and the skill
``1 - brier / baseline``, ECE, Spearman rank correlation, counts, and a reliability diagram
(image ``predictor/reliability``); skill, rank correlation and means again for the roots
alone (``predictor/roots/*``: what stage 1 reads) and the prefixes alone
(``predictor/prefixes/*``: stage 2), and each part's skill against the last logged step's
mean outcome (``*/brier_skill_vs_previous``), a constant known beforehand where the step's
own mean is known only in hindsight. Nothing is logged for an epoch without predictions
(``uniform``/``random_tree`` allocators, cold start). Formulas: ``trace_lightning.math.calibration``.

The module itself logs the predictor's training loss (``predictor/loss``,
``predictor/loss_before``); this callback does not touch those keys.
"""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np

from callbacks._common import (RolloutCallback, check_datamodule, current_step,
                               figure_to_chw, gather, log_scalars, log_step,
                               tensorboard_logger)
from callbacks._stats import CalibrationPoints, calibration_metrics, calibration_points
from trace_lightning.math.calibration import reliability_curve


class PredictorCalibration(RolloutCallback):
    """Calibration of the success predictor on each epoch's trees, logged at epoch start.

    Args:
        bins: equal-width bins of the ECE and the reliability diagram.
        diagram: also write the reliability diagram as an image (needs a TensorBoardLogger).
        every_n_epochs: log every n-th epoch (1 = every epoch).
    """

    def __init__(self, bins: int = 10, diagram: bool = True, every_n_epochs: int = 1):
        if bins < 1:
            raise ValueError(f"PredictorCalibration bins ({bins}) must be >= 1")
        if every_n_epochs < 1:
            raise ValueError(f"PredictorCalibration every_n_epochs ({every_n_epochs}) must "
                             f"be >= 1")
        self.bins = bins
        self.diagram = diagram
        self.every_n_epochs = every_n_epochs
        self.last_metrics: dict[str, float] = {}
        # the last logged step's mean outcome per part: the next step's prior constant
        self.previous: dict[str, float] = {}

    def tensorboard_for(self) -> str:
        return ("the reliability diagram as an image (set `diagram: false` to log scalars "
                "only)" if self.diagram else "")

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch % self.every_n_epochs:
            return
        dm = check_datamodule(trainer.datamodule, "PredictorCalibration")
        step = current_step(trainer, dm, "PredictorCalibration")
        pts = CalibrationPoints()
        for part in gather(trainer, calibration_points(step.trees) if step is not None else None):
            if part is not None:
                pts.extend(part)
        self.last_metrics = calibration_metrics(pts, bins=self.bins, previous=self.previous)
        if not self.last_metrics:
            return
        self.previous = {k: v for k, v in self.last_metrics.items()
                         if k.endswith("/outcome_mean")}
        log_scalars(trainer, self.last_metrics)
        tb = tensorboard_logger(trainer)
        if self.diagram and tb is not None and trainer.is_global_zero:
            image = figure_to_chw(reliability_figure(pts, self.bins, trainer.current_epoch))
            tb.experiment.add_image("predictor/reliability", image, global_step=log_step(trainer))


    def state_dict(self) -> dict:
        return {"previous": dict(self.previous)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.previous = dict(state_dict.get("previous", {}))


def reliability_figure(pts: CalibrationPoints, bins: int, epoch: int):
    """Reliability diagram (mean outcome vs. mean prediction per bin, roots and prefixes
    apart) above the leaf weight per bin."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.5, 5.0), dpi=100)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    top.plot([0, 1], [0, 1], color="0.6", linestyle="--", linewidth=1, label="perfect")
    p, y, w = np.asarray(pts.p), np.asarray(pts.y), np.asarray(pts.w)
    root = np.asarray(pts.is_root, dtype=bool)
    mean_p, mean_y, weight = reliability_curve(p, y, w, bins)
    keep = weight > 0
    top.plot(mean_p[keep], mean_y[keep], color="C0", linewidth=2, zorder=2)
    top.scatter(mean_p[keep], mean_y[keep], s=20 + 200 * weight[keep] / weight.sum(),
                color="C0", label="all (size: leaves)", zorder=3)
    if root.any() and not root.all():  # roots and prefixes apart, as hollow markers
        for mask, label, marker, colour in ((root, "roots", "^", "C1"),
                                            (~root, "prefixes", "s", "C2")):
            mp, my, wt = reliability_curve(p[mask], y[mask], w[mask], bins)
            k = wt > 0
            top.scatter(mp[k], my[k], s=45, marker=marker, facecolors="none",
                        edgecolors=colour, linewidths=1.5, label=label, zorder=4)
    top.set_xlim(0, 1)
    top.set_ylim(-0.02, 1.02)
    top.set_ylabel("realised value (mean leaf reward)")
    top.set_title(f"predictor reliability, epoch {epoch} ({len(p)} nodes)", fontsize=10)
    top.legend(loc="upper left", fontsize=8)
    edges = np.linspace(0, 1, bins + 1)
    bottom.bar(edges[:-1], weight, width=1.0 / bins, align="edge", color="C0", alpha=0.6,
               edgecolor="white")
    bottom.set_xlabel("prediction")
    bottom.set_ylabel("leaves")
    fig.tight_layout()
    return fig
