"""What the monitoring callbacks share: boundary checks, the epoch's step, gathering, logging.

When the epoch's rollout step is ready: with ``reload_dataloaders_every_n_epochs=1``
Lightning 2.6's ``_FitLoop`` requests the train dataloader in ``setup_data``, which runs at
the top of ``run`` (epoch 0, *before* ``on_train_start``) and again at the top of
``on_advance_start`` (epochs >= 1) just before ``on_train_epoch_start``. So
``on_train_epoch_start`` is the first callback hook of every epoch where
``datamodule.last_step`` holds that epoch's step; ``step.epoch == trainer.current_epoch``
is checked there.

Scalars go to every logger at Lightning's logging step (``trace_lightning.logs``), so all
curves share one x-axis with the module's ``train/*``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn

from callbacks._stats import StepSummary, merge_summaries, summarize_step
from trace_lightning.collectives import all_gather_list
from trace_lightning.logs import log_scalars, log_step  # noqa: F401 - the callbacks' own

if TYPE_CHECKING:
    from trace_lightning.rollout.step import RolloutStep

_TB_HINT = ("add `trainer.logger: {class_path: lightning.pytorch.loggers.TensorBoardLogger, "
            "init_args: {save_dir: runs}}` to the config (or pass "
            "`logger=TensorBoardLogger(...)` to the Trainer)")


@runtime_checkable
class RolloutData(Protocol):
    """What the callbacks read from the datamodule (``TraceDataModule`` provides it)."""

    last_step: RolloutStep | None
    last_val_trees: dict
    sync_diff: float | None
    timings: dict[str, float]


def check_datamodule(dm: Any, who: str) -> RolloutData:
    """``dm`` (the trainer's datamodule) as rollout data, or a ValueError that says what to
    configure."""
    if not isinstance(dm, RolloutData):
        got = "no datamodule" if dm is None else f"{type(dm).__name__}"
        raise ValueError(
            f"callbacks.{who} reads each epoch's rollout step from the datamodule, but the "
            f"trainer has {got}; use `data: {{class_path: trace_lightning.data.TraceDataModule"
            f"}}` (a datamodule with `last_step`, `last_val_trees`, `sync_diff` and `timings`) "
            f"or remove callbacks.{who} from `trainer.callbacks`")
    return dm


def check_logger(trainer: pl.Trainer, who: str, tensorboard_for: str = "") -> None:
    """Raise unless the trainer has a logger (a ``TensorBoardLogger`` when ``tensorboard_for``
    names what the callback writes that needs one)."""
    if tensorboard_for and tensorboard_logger(trainer) is None:
        got = ", ".join(type(lg).__name__ for lg in trainer.loggers) or "no logger"
        raise ValueError(f"callbacks.{who} writes {tensorboard_for} that need a "
                         f"TensorBoardLogger, but the trainer has {got}; {_TB_HINT}")
    if not trainer.loggers:
        raise ValueError(f"callbacks.{who} logs metrics but the trainer has no logger "
                         f"(`trainer.logger: false`); {_TB_HINT}")


class RolloutCallback(pl.Callback):
    """A callback that logs what the datamodule's rollout steps hold.

    ``check`` raises when its trainer lacks what it needs (a rollout datamodule, a logger):
    at ``setup``, and from ``trace-lightning fit`` before any data is prepared (Lightning
    runs the datamodule's ``prepare_data`` and ``setup`` before the callbacks' ``setup``).
    """

    def tensorboard_for(self) -> str:
        """What it writes that needs a ``TensorBoardLogger``; "" when it logs scalars only."""
        return ""

    def check(self, trainer: pl.Trainer, datamodule: Any) -> None:
        who = type(self).__name__
        check_datamodule(datamodule, who)
        check_logger(trainer, who, self.tensorboard_for())

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.check(trainer, trainer.datamodule)


def tensorboard_logger(trainer: pl.Trainer) -> TensorBoardLogger | None:
    return next((lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)


def current_step(trainer: pl.Trainer, dm: RolloutData, who: str) -> RolloutStep | None:
    """This epoch's step, or None (with a warning) when the datamodule has none for it."""
    step = dm.last_step
    if step is None or step.epoch != trainer.current_epoch:
        rank_zero_warn(f"callbacks.{who}: the datamodule holds no rollout step for epoch "
                       f"{trainer.current_epoch} (last_step is "
                       f"{'None' if step is None else f'from epoch {step.epoch}'}); nothing "
                       f"logged for it")
        return None
    return step


def gather(trainer: pl.Trainer, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (a one-element list on a single process):
    ``collectives.all_gather_list`` of one item, over the CPU group.

    Every rank must call it (it is a collective when the world has several processes).
    """
    return all_gather_list([obj], trainer)


def figure_to_chw(fig) -> np.ndarray:
    """Render a matplotlib ``Figure`` (Agg) to a CHW uint8 RGB array for ``add_image``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    rgba = np.asarray(canvas.buffer_rgba())  # (H, W, 4)
    return np.ascontiguousarray(rgba[..., :3].transpose(2, 0, 1))  # (3, H, W)


def epoch_summary(trainer: pl.Trainer, who: str) -> StepSummary | None:
    """This epoch's step summarised over all ranks, or None when there is none.

    A collective under several processes: every rank calls it in the same hook.
    """
    step = current_step(trainer, check_datamodule(trainer.datamodule, who), who)
    parts = gather(trainer, summarize_step(step) if step is not None else None)
    parts = [p for p in parts if p is not None]
    return merge_summaries(parts) if parts else None
