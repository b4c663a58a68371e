"""Throughput: where each RL iteration's time and memory go (``perf/*``).

At epoch start (the step is ready, see ``callbacks._common``), over all ranks:

- ``perf/rollout_tokens_per_s``: generated tokens of every rank / the slowest rank's rollout
  seconds (ranks roll out in parallel);
- ``perf/<phase>_s`` for each phase the step timed (``rollout``, ``tools``,
  ``predict``);
  ``perf/sync_s``: the datamodule's latest weight sync; ``perf/sync_logprob_diff``: its
  largest engine-vs-policy log-prob difference (max over ranks);
- ``perf/prefix_cache_share``: prefill tokens served from the engine's prefix cache (0 for
  the ``hf`` engine, which has none);
- ``perf/rollout_engine_calls``: the step's turns, one batched engine call each (most of any
  rank): the longest chain of turns, which a prompt's stage 2 starting early keeps short;
- ``perf/sample_s``: the step's whole sampling phase (weight sync, rollouts, predictor
  calls, batching), slowest rank.

At epoch end: ``perf/train_s`` (time inside training batches, slowest rank: validation and
rollouts excluded; the predictor's fit after the last mini-batch included, which the module
logs as ``perf/predictor_fit_s``), ``perf/train_tokens_per_s`` (policy tokens, the ones the loss trains on,
of every rank, times the datamodule's ``ppo_epochs`` passes / ``train_s``),
``perf/train_all_tokens_per_s`` (all tokens of the leaves' sequences: the per-leaf work) and
``perf/train_forwarded_tokens_per_s`` (the tokens the forward passes read: with tree packing
each tree's once; all three only for an epoch with a rollout step), ``perf/step_s``
(``sample_s + train_s``: what the RL step costs, validation excluded), ``perf/epoch_s``
(wall time since the previous epoch ended: rollout + training + validation), ``perf/rss_gb`` and ``perf/peak_rss_gb`` (host memory of the
largest rank, current and peak), and on CUDA ``perf/cuda_max_allocated_gb`` /
``perf/cuda_max_reserved_gb`` (peak since start, largest rank).

Clip fraction, KL, entropy and the importance ratio are logged by the module (``train/*``).
"""

from __future__ import annotations

import math
import resource
import sys
import time

import lightning.pytorch as pl
import psutil
import torch

from callbacks._common import (RolloutCallback, check_datamodule, epoch_summary, gather,
                               log_scalars)
from callbacks._stats import ratio

GB = 2.0 ** 30


class Throughput(RolloutCallback):
    """Rollout and training speed, time split, weight-sync error and memory (``perf/*``).

    Args:
        every_n_epochs: log every n-th epoch (1 = every epoch).
    """

    def __init__(self, every_n_epochs: int = 1):
        if every_n_epochs < 1:
            raise ValueError(f"Throughput every_n_epochs ({every_n_epochs}) must be >= 1")
        self.every_n_epochs = every_n_epochs
        self.last_metrics: dict[str, float] = {}
        # (policy, all, forwarded) tokens trained on this epoch, every rank's; None: no step
        self._epoch_tokens: tuple[int, int, int] | None = None
        self._train_s = 0.0
        self._batch_tic: float | None = None
        self._sample_s: float | None = None  # this epoch's sampling phase, slowest rank
        self._last_epoch_end: float | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # the checks
        if stage == "fit":
            self._last_epoch_end = time.perf_counter()

    def _due(self, trainer: pl.Trainer) -> bool:
        return trainer.current_epoch % self.every_n_epochs == 0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._train_s = 0.0
        self._epoch_tokens = None
        self._sample_s = None
        if not self._due(trainer):
            return
        dm = check_datamodule(trainer.datamodule, "Throughput")
        summary = epoch_summary(trainer, "Throughput")
        sync_diffs = [d for d in gather(trainer, dm.sync_diff) if d is not None]
        sync_s = [s for s in gather(trainer, dm.timings.get("sync")) if s is not None]
        out: dict[str, float] = {}
        if summary is not None:
            # Lightning asks for the epoch's dataloader (the sampling phase) just before this
            sample_s = [s for s in gather(trainer, dm.timings.get("sample")) if s is not None]
            if sample_s:
                self._sample_s = max(sample_s)
                out["perf/sample_s"] = self._sample_s
            passes = getattr(dm, "ppo_epochs", 1)  # each pass trains on every leaf once
            # a packed tree's forward reads each of its tokens once
            forwarded = (summary.tree_tokens if getattr(dm, "tree_packing", False)
                         else summary.sequence_tokens)
            self._epoch_tokens = (summary.policy_tokens * passes,
                                  summary.sequence_tokens * passes, forwarded * passes)
            b, sec = summary.budget, summary.seconds
            out["perf/rollout_tokens_per_s"] = ratio(b.get("generated_tokens", 0),
                                                     sec.get("rollout", 0.0))
            out.update({f"perf/{k}_s": v for k, v in sec.items()})
            out["perf/rollout_engine_calls"] = float(summary.engine_calls)
            out["perf/prefix_cache_share"] = ratio(b.get("cached_tokens", 0),
                                                   b.get("prefill_tokens", 0))
        if sync_diffs:
            out["perf/sync_logprob_diff"] = max(sync_diffs)
        if sync_s:
            out["perf/sync_s"] = max(sync_s)
        self.last_metrics = dict(out)
        log_scalars(trainer, out)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch, batch_idx: int) -> None:
        self._batch_tic = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs,
                           batch, batch_idx: int) -> None:
        if self._batch_tic is not None:
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)
            self._train_s += time.perf_counter() - self._batch_tic
            self._batch_tic = None

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        now = time.perf_counter()
        epoch_s = now - self._last_epoch_end if self._last_epoch_end is not None else math.nan
        self._last_epoch_end = now
        if not self._due(trainer):
            return
        mine = {"train_s": self._train_s, "rss": _rss_gb(), "peak_rss": _peak_rss_gb(),
                "epoch_s": epoch_s}
        if pl_module.device.type == "cuda":
            mine["cuda_alloc"] = torch.cuda.max_memory_allocated(pl_module.device) / GB
            mine["cuda_reserved"] = torch.cuda.max_memory_reserved(pl_module.device) / GB
        parts = gather(trainer, mine)
        train_s = max(p["train_s"] for p in parts)
        out = {"perf/train_s": train_s,
               "perf/epoch_s": max(p["epoch_s"] for p in parts),
               "perf/rss_gb": max(p["rss"] for p in parts),
               "perf/peak_rss_gb": max(p["peak_rss"] for p in parts)}
        if self._sample_s is not None:  # the RL step without its validation
            out["perf/step_s"] = self._sample_s + train_s
        if self._epoch_tokens is not None:  # the same on every rank (gathered at start)
            out["perf/train_tokens_per_s"] = ratio(self._epoch_tokens[0], train_s)
            out["perf/train_all_tokens_per_s"] = ratio(self._epoch_tokens[1], train_s)
            out["perf/train_forwarded_tokens_per_s"] = ratio(self._epoch_tokens[2], train_s)
        if "cuda_alloc" in mine:
            out["perf/cuda_max_allocated_gb"] = max(p["cuda_alloc"] for p in parts)
            out["perf/cuda_max_reserved_gb"] = max(p["cuda_reserved"] for p in parts)
        self.last_metrics.update(out)
        log_scalars(trainer, out)


def _rss_gb() -> float:
    return psutil.Process().memory_info().rss / GB


def _peak_rss_gb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / GB if sys.platform == "darwin" else peak * 1024 / GB
