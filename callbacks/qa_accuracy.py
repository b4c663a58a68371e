"""QAAccuracy: the task's accuracy per validation set (``val/<dataset>/*``, ``val/em``).

Validation batches (``TraceModule.validation_step`` returns them) are dicts with
``dataset`` (list[str], one name per rollout: a question, or one of its
``val_samples`` samples) and a float tensor per field of the task's validation rows
(``validation.val_row``): its metrics (search QA: ``em``, ``f1``), ``reward``, its tool-call
count (``searches``) and ``malformed``. Per dataset a torchmetrics ``Metric`` keeps the sums
and the question count (``dist_reduce_fx="sum"``), so under several processes the logged
value is the mean over the union of every rank's questions, however unevenly they are split.

Values are logged with ``pl_module.log`` in ``on_validation_epoch_end`` (already reduced,
so ``sync_dist=False``; Lightning's advice to set ``sync_dist=True``, given whenever
``torch.distributed`` is up, as vLLM makes it even in one process, is silenced for these
keys): they land in ``trainer.callback_metrics`` (monitorable by
``ModelCheckpoint``), in the list ``trainer.validate`` returns, and in every logger.
``val/<metric>`` for each of ``overall`` (``em`` and ``f1``) is the unweighted mean over
datasets (each set counts once).
"""

from __future__ import annotations

import math
import re
import warnings

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.warnings import PossibleUserWarning
from torchmetrics import Metric

from callbacks._common import gather

REQUIRED = ("reward", "malformed")  # every task's rows hold these


class DatasetMeans(Metric):
    """Means of the ``fields`` of one dataset's questions, summed across processes."""

    full_state_update = False

    def __init__(self, fields: tuple[str, ...]) -> None:
        super().__init__()
        self.fields = fields
        self.add_state("sums", default=torch.zeros(len(fields), dtype=torch.float64),
                       dist_reduce_fx="sum")
        self.add_state("count", default=torch.zeros((), dtype=torch.float64),
                       dist_reduce_fx="sum")

    def update(self, values: torch.Tensor) -> None:
        """``values``: (N, len(fields)), one row per rollout (N may be 0)."""
        self.sums += values.to(self.sums).sum(dim=0)  # (F,)
        self.count += values.shape[0]

    def compute(self) -> dict[str, float]:
        n = float(self.count)
        out = {k: (float(v) / n if n else float("nan")) for k, v in zip(self.fields, self.sums)}
        out["questions"] = n
        return out


class QAAccuracy(pl.Callback):
    """The task's metrics (search QA: EM, F1), reward, tool calls per question and
    malformed-answer share per validation set.

    Args:
        prefix: the metric namespace (``<prefix>/<dataset>/em``, ``<prefix>/em``).
        overall: the metrics also averaged over the sets (``<prefix>/em``); None: the task's
            declared metrics, its headline first (the datamodule's ``task_metrics``:
            ``em``, ``f1`` for search QA, ``correct`` for arithmetic), which the progress bar
            shows the first of.
    """

    def __init__(self, prefix: str = "val", overall: tuple[str, ...] | None = None):
        self.prefix = prefix
        self.overall: tuple[str, ...] = tuple(overall or ())
        self._task_overall = overall is None  # resolved from the task at the first validation
        self.fields: tuple[str, ...] | None = None  # the rows' fields, from the first batch
        warnings.filterwarnings(
            "ignore", category=PossibleUserWarning,
            message=rf"It is recommended to use `self.log\('{re.escape(prefix)}/.*sync_dist=True")
        self.metrics: dict[str, DatasetMeans] = {}
        self.last_metrics: dict[str, float] = {}

    def _metric(self, name: str, device: torch.device) -> DatasetMeans:
        if name not in self.metrics:
            self.metrics[name] = DatasetMeans(self.fields).to(device)
        return self.metrics[name]

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # only the sets this validation sees: one from an earlier run would log its 0 count
        self.metrics.clear()

    def _resolve_overall(self, trainer: pl.Trainer) -> None:
        """``overall`` None: the task's metrics, as the datamodule read them from the task
        its validation rolled out with."""
        if self._task_overall:
            datamodule = getattr(trainer, "datamodule", None)
            self.overall = tuple(getattr(datamodule, "task_metrics", ()) or ())

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                outputs, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        if not isinstance(outputs, dict) or "dataset" not in outputs or any(
                k not in outputs for k in REQUIRED):
            got = sorted(outputs) if isinstance(outputs, dict) else type(outputs).__name__
            raise ValueError(
                f"callbacks.QAAccuracy needs validation_step to return the batch dict with "
                f"'dataset', {', '.join(repr(k) for k in REQUIRED)} and the task's metrics "
                f"(as TraceModule does); got {got}")
        fields = tuple(sorted(k for k in outputs if k != "dataset"))
        if self.fields is None:
            self.fields = fields
        elif fields != self.fields:
            raise ValueError(f"callbacks.QAAccuracy: a validation batch has fields {fields}, "
                             f"an earlier one {self.fields}; every validation set's rows must "
                             f"come from the same task")
        names = [n or "unnamed" for n in outputs["dataset"]]
        values = torch.stack([torch.as_tensor(outputs[k], dtype=torch.float64).reshape(-1)
                              for k in fields], dim=1)  # (N, F)
        if values.shape[0] != len(names):
            raise ValueError(f"callbacks.QAAccuracy: batch has {len(names)} dataset names but "
                             f"{values.shape[0]} rows of {', '.join(fields)}")
        for name in dict.fromkeys(names):
            rows = torch.tensor([i for i, n in enumerate(names) if n == name],
                                device=values.device)
            self._metric(name, pl_module.device).update(values[rows])

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # every rank must compute the same datasets in the same order (each compute syncs),
        # with the same fields (a rank that saw no batch learns them from the others)
        parts = gather(trainer, (sorted(self.metrics), self.fields))
        names = sorted({n for part, _ in parts for n in part})
        self.fields = self.fields or next((f for _, f in parts if f is not None), None)
        out: dict[str, float] = {}
        for name in names:
            m = self._metric(name, pl_module.device)
            if m.update_count == 0:
                m.update(torch.zeros(0, len(self.fields)))  # no batch of this set here
            for k, v in m.compute().items():
                out[f"{self.prefix}/{name}/{k}"] = v
            m.reset()
        self._resolve_overall(trainer)
        for k in self.overall:
            per_set = [out[f"{self.prefix}/{n}/{k}"] for n in names
                       if f"{self.prefix}/{n}/{k}" in out]
            per_set = [v for v in per_set if math.isfinite(v)]
            if per_set:
                out[f"{self.prefix}/{k}"] = sum(per_set) / len(per_set)
        out = {k: v for k, v in out.items() if math.isfinite(v)}
        self.last_metrics = out
        for k, v in out.items():
            pl_module.log(k, v, on_step=False, on_epoch=True, sync_dist=False,
                          add_dataloader_idx=False)
