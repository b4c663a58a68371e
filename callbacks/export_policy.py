"""ExportPolicy: the trained policy as a Hugging Face directory, written during the run.

``<dirpath>/last`` when training ends, and ``<dirpath>/epoch_<E>`` every ``every_n_epochs``
epochs: config, safetensors weights, tokenizer and ``trace_lightning.json`` (epochs trained,
the policy optimizer's steps), ready for ``AutoModelForCausalLM.from_pretrained`` or
``vllm serve``. Under FSDP the shards are gathered onto rank 0's CPU, which alone writes;
every rank takes part in the gather, and every rank raises when rank 0's write fails. For a
checkpoint after the fact: ``trace-lightning-export`` (``trace_lightning/training/export.py``).

An export folder already there (a resumed run's, or a new run given the same ``dirpath``) is
replaced only when it holds nothing but what an export wrote (the manifest in its
``trace_lightning.json``); files of one's own kept there are refused, never deleted: ``last``
at ``on_fit_start``, before training, ``epoch_<E>`` when it is written. Exports are swapped in
by renames from fresh temporary folders beside them, as ``trace_lightning/training/export.py`` says.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl

from trace_lightning.rollout.engines.sync import policy_weights
from trace_lightning.training.export import check_out, export_dtype, save_policy


def policy_optimizer_steps(trainer: pl.Trainer) -> int:
    """Steps taken by the policy's optimizer: Lightning's first (``TraceModule`` keeps the
    predictor's optimizer out of Lightning's).

    ``trainer.global_step`` is not that count under manual optimization: it counts every
    ``LightningOptimizer.step`` made inside ``training_step``, another optimizer's too
    wherever a module steps it there. The optimizer's own count does not depend on where it
    is stepped, and is checkpointed with it, so a resumed run continues it. Adam-family
    optimizers keep it per parameter (``state[p]["step"]``; a parameter without a gradient
    skips a step, so the largest). An optimizer that keeps none (plain SGD):
    ``trainer.global_step``, exact when it is the only one.
    """
    counts = [int(s["step"]) for s in trainer.optimizers[0].state.values() if "step" in s]
    return max(counts) if counts else trainer.global_step


class ExportPolicy(pl.Callback):
    """Write the policy with ``save_pretrained`` at the end of training (and every n epochs).

    Args:
        dirpath: where the exports go (default: ``<log_dir>/policy``, beside the logger's
            checkpoints).
        every_n_epochs: also export after every n-th epoch as ``epoch_<E>`` (0: only
            ``last``, when training ends).
        dtype: cast the exported weights, e.g. "bfloat16" for serving fp32-master runs
            (None: as trained); checked here, not after training.
    """

    def __init__(self, dirpath: str | None = None, every_n_epochs: int = 0,
                 dtype: str | None = None):
        if every_n_epochs < 0:
            raise ValueError(f"ExportPolicy every_n_epochs ({every_n_epochs}) must be >= 0 "
                             f"(0: only at the end of training)")
        export_dtype(dtype)  # a bad dtype fails now, not when training ends
        self.dirpath = dirpath
        self.every_n_epochs = every_n_epochs
        self.dtype = dtype
        self.exported: list[Path] = []  # directories written by this rank, in order

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A ``dirpath`` whose ``last`` is not replaceable (see ``check_out``: a file, or a
        folder holding files no export wrote) fails now, not after training."""
        root = self._root(trainer)  # every rank: log_dir is a broadcast
        error, problem = None, None
        if trainer.is_global_zero:
            try:
                check_out(root / "last", [pl_module.hparams.policy_path])
            except Exception as e:  # noqa: BLE001 - every rank must hear of it, then it is raised
                error, problem = e, f"{type(e).__name__}: {e}"
        # every rank stops (one left alone would wait in the next collective)
        self._raise_on_every_rank(trainer, error, problem, f"check {root / 'last'}")

    @staticmethod
    def _raise_on_every_rank(trainer: pl.Trainer, error: Exception | None,
                             problem: str | None, what: str) -> None:
        """Rank 0's ``error`` (``problem``: its text) raised there, and on the others as a
        RuntimeError naming it (a collective)."""
        problem = trainer.strategy.broadcast(problem)
        if error is not None:
            raise error
        if problem:
            raise RuntimeError(f"ExportPolicy: rank 0 could not {what}: {problem}")

    def _root(self, trainer: pl.Trainer) -> Path:
        return Path(self.dirpath) if self.dirpath else Path(
            trainer.log_dir or trainer.default_root_dir) / "policy"

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epoch = trainer.current_epoch
        if self.every_n_epochs and (epoch + 1) % self.every_n_epochs == 0:
            self.export(trainer, pl_module, f"epoch_{epoch}", epochs_done=epoch + 1)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the fit loop has counted the last epoch by now
        self.export(trainer, pl_module, "last", epochs_done=trainer.current_epoch)

    def export(self, trainer: pl.Trainer, pl_module: pl.LightningModule, name: str,
               epochs_done: int) -> Path:
        """Gather the policy (collective) and write ``<dirpath>/<name>`` on rank 0."""
        root = self._root(trainer)  # every rank: log_dir is a broadcast
        state = dict(policy_weights(pl_module.policy, rank0_cpu=True))
        out = root / name
        error, problem = None, None
        if trainer.is_global_zero:
            try:
                # global_step: Lightning's count, beside policy_steps for readers of exports
                # that record only global_step
                meta = {"epochs": epochs_done, "policy_steps": policy_optimizer_steps(trainer),
                        "global_step": trainer.global_step}
                save_policy(state, pl_module.hparams.policy_path, out, self.dtype, meta)
                self.exported.append(out)
            except Exception as e:  # noqa: BLE001 - every rank must hear of it, then it is raised
                error, problem = e, f"{type(e).__name__}: {e}"
        # every rank stops on a failed write, with its reason: ranks started outside
        # Lightning (torchrun, srun) would otherwise wait for rank 0 in a collective until
        # the process group's timeout (NCCL)
        self._raise_on_every_rank(trainer, error, problem, f"write {out}")
        return out
