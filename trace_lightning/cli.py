"""The ``trace-lightning`` command: LightningCLI over TraceModule and TraceDataModule.

    trace-lightning fit --config configs/demo.yaml
    trace-lightning validate --config configs/demo.yaml --ckpt_path last

``--ckpt_path last`` means the newest ``last*.ckpt`` that a run with the same logger (or
``ModelCheckpoint.dirpath``) saved before, in any of its versions: each run logs to a new
``version_<N>``, where Lightning's own lookup would find nothing and quietly use the initial
weights. ``validate`` without one is an error; ``fit`` without one starts from scratch.
With several processes, each resolves it in its own file system and the datamodule's setup
checks that all found the same checkpoint (``TraceDataModule.expect_checkpoint``).

``main(args)`` takes the argument list so tests can run the CLI in-process; ``cli(args)``
does the same and returns the ``LightningCLI`` object.
"""

from __future__ import annotations

import glob
import logging
import os
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # vLLM in-process (CPU, tests)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from lightning.pytorch import Trainer  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402

from callbacks._common import RolloutCallback  # noqa: E402
from trace_lightning.data import TraceDataModule  # noqa: E402
from trace_lightning.module import TraceModule  # noqa: E402

log = logging.getLogger(__name__)


class TraceCLI(LightningCLI):
    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """``fit`` and ``validate``: the module has no test or predict step (a test set is a
        validation set: ``validate --data.val=...``), so Lightning's ``test`` and ``predict``
        are not offered only to fail after the engine starts."""
        return {k: v for k, v in LightningCLI.subcommands().items() if k in ("fit", "validate")}

    def add_arguments_to_parser(self, parser) -> None:
        # one source for values that data and model share
        parser.link_arguments("model.policy_path", "data.policy_path")
        parser.link_arguments("model.advantage", "data.advantage")

    def before_fit(self) -> None:
        # the callbacks' own setup checks would run only after the datamodule's prepare_data
        # and setup (a demo world, a retrieval index, an engine): say what is missing first
        for callback in self.trainer.callbacks:
            if isinstance(callback, RolloutCallback):
                callback.check(self.trainer, self.datamodule)
        self._resolve_checkpoint(required=False)

    def before_validate(self) -> None:
        self._resolve_checkpoint(required=True)

    def _resolve_checkpoint(self, required: bool) -> None:
        """Replace ``--ckpt_path last`` by the path of the newest last checkpoint, and tell
        the datamodule which checkpoint this process loads: its setup checks that every
        process found the same one (``TraceDataModule.expect_checkpoint``)."""
        config = self.config_init[self.subcommand]
        path, error = config.get("ckpt_path"), None
        if path == "last":
            found, searched = last_checkpoint(self.trainer)
            if found is None and required:
                error = FileNotFoundError(
                    f"--ckpt_path last: no last checkpoint (last*.ckpt) in "
                    f"{', '.join(searched)}; train first (ModelCheckpoint(save_last=...), as in "
                    f"configs/demo.yaml, writes one there), pass a checkpoint's path, or leave "
                    f"--ckpt_path out to use --model.policy_path's weights")
                if self.trainer.world_size == 1:
                    raise error  # at once; with several processes, in setup on every one
            elif found is None:
                log.warning("--ckpt_path last: no last checkpoint in %s yet; training starts "
                            "from --model.policy_path", ", ".join(searched))
            else:
                log.info("--ckpt_path last: %s", found)
            path = config["ckpt_path"] = None if found is None else str(found)
        self.datamodule.expect_checkpoint(path, error)


def last_checkpoint(trainer: Trainer) -> tuple[Path | None, list[str]]:
    """The newest ``last*.ckpt`` (a file, or a folder for sharded FSDP checkpoints) that this
    trainer's checkpoint callbacks wrote in earlier runs, and the places searched (patterns).

    A ``ModelCheckpoint`` with a ``dirpath`` saves there; one without saves under the first
    logger's ``<save_dir>/<name>/<version>/checkpoints`` (every version is searched), or
    ``<default_root_dir>/checkpoints`` without a logger."""
    patterns: list[str] = []
    for cb in trainer.checkpoint_callbacks:
        if not isinstance(cb, ModelCheckpoint):
            continue
        if cb.dirpath is not None:
            patterns.append(str(Path(cb.dirpath) / "last*.ckpt"))
        elif trainer.loggers:
            logger = trainer.loggers[0]
            base = Path(logger.save_dir or trainer.default_root_dir)
            if logger.name:
                base = base / str(logger.name)
            patterns.append(str(base / "*" / "checkpoints" / "last*.ckpt"))
        else:
            patterns.append(str(Path(trainer.default_root_dir) / "checkpoints" / "last*.ckpt"))
    patterns = list(dict.fromkeys(patterns))
    found = [Path(p) for pattern in patterns for p in glob.glob(pattern)]
    broken = [p for p in found if not p.exists()]  # a link whose checkpoint was deleted
    if broken:
        log.warning("--ckpt_path last: skipping %s (links to deleted checkpoints)",
                    ", ".join(map(str, broken)))
    found = [p for p in found if p.exists()]
    if not found:
        return None, patterns
    return max(found, key=lambda p: p.stat().st_mtime), patterns


def cli(args: list[str] | None = None) -> TraceCLI:
    """Run the CLI on ``args`` (default: sys.argv) and return it: tests read its trainer,
    model and datamodule."""
    return TraceCLI(
        TraceModule, TraceDataModule,
        args=args,
        # the DataModule shards prompts over ranks itself: no DistributedSampler on top
        trainer_defaults={"reload_dataloaders_every_n_epochs": 1, "num_sanity_val_steps": 0,
                          "check_val_every_n_epoch": 1, "use_distributed_sampler": False},
        save_config_kwargs={"overwrite": True},
        # TraceModule builds its optimizers (policy, and the predictor's own) itself: no
        # --optimizer / --lr_scheduler, which would replace them with one over no parameters
        auto_configure_optimizers=False,
        subclass_mode_model=False, subclass_mode_data=False,
    )


def main(args: list[str] | None = None) -> None:
    """The ``trace-lightning`` console script (returns None: exit status 0 on success)."""
    cli(args)


if __name__ == "__main__":
    main()
