"""The ``trace-lightning`` command: LightningCLI over TraceModule and TraceDataModule.

    trace-lightning fit --config configs/demo.yaml
    trace-lightning validate --config configs/demo.yaml --ckpt_path last

``main(args)`` takes the argument list so tests can run the CLI in-process; ``cli(args)``
does the same and returns the ``LightningCLI`` object.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # vLLM in-process (CPU, tests)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from lightning.pytorch.cli import LightningCLI  # noqa: E402

from trace_lightning.data import TraceDataModule  # noqa: E402
from trace_lightning.module import TraceModule  # noqa: E402


class TraceCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # one source for values that data and model share
        parser.link_arguments("model.policy_path", "data.policy_path")
        parser.link_arguments("model.advantage", "data.advantage")


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
        subclass_mode_model=False, subclass_mode_data=False,
    )


def main(args: list[str] | None = None) -> None:
    """The ``trace-lightning`` console script (returns None: exit status 0 on success)."""
    cli(args)


if __name__ == "__main__":
    main()
