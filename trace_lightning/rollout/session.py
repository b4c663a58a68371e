"""The rollout engine's life in a run: started once per fit or validate, awake only while it
syncs and samples, given the policy's weights (checked) once per optimizer step, closed at
the end.

Under several processes a failure on one stops every process (``fail_together``): the
tokenizer, the device the engine is to take (another job on one GPU), the start itself where
it runs no collective of its own (vLLM on GPUs under several processes does:
``EngineConfig.starts_together``; there a failure inside ends its own process only), waking
it, and the weight sync.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from trace_lightning.collectives import fail_together
from trace_lightning.rollout.engines.config import EngineConfig

if TYPE_CHECKING:
    from trace_lightning.learner import Learner
    from trace_lightning.rollout.engines.base import RolloutEngine

AnyFailed = Callable[[bool], bool] | None  # a failure flag OR-ed over the processes


class EngineSession:
    """One run's engine and tokenizer (see the module docstring).

    Args:
        config: the engine's settings (``--data.engine``).
        seed: the engine's sampling seed.
    """

    def __init__(self, config: EngineConfig, seed: int):
        self.config, self.seed = config, seed
        self.engine: RolloutEngine | None = None
        self.tokenizer = None
        self.sync_diff: float | None = None  # the last sync's largest log-prob difference
        self.sync_s: float | None = None  # the last sync's seconds
        self._synced_step: int | None = None  # the optimizer step whose weights it holds

    @property
    def started(self) -> bool:
        return self.engine is not None

    def start(self, policy_dir: str, world_size: int, any_failed: AnyFailed) -> None:
        """Load the tokenizer and start the engine on this process's device."""
        from transformers import AutoTokenizer

        device = "cuda" if torch.cuda.is_available() else "cpu"
        with fail_together("loading the tokenizer and checking the engine's device "
                           "(--data.engine)", any_failed):
            self.tokenizer = AutoTokenizer.from_pretrained(policy_dir)
            self.config.check_device(device)
        together = self.config.starts_together(device, world_size)
        with fail_together("starting the rollout engine (--data.engine)",
                           None if together else any_failed):
            self.engine = self.config.build(policy_dir, self.seed, device)

    @contextlib.contextmanager
    def turn(self, any_failed: AnyFailed) -> Iterator[RolloutEngine]:
        """The engine, awake for the block: the trainer gets the accelerator back after each
        rollout or validation phase (``engine.sleep``)."""
        with fail_together("waking the rollout engine", any_failed):
            self.engine.wake_up()
        try:
            yield self.engine
        finally:
            self.engine.sleep()

    def sync(self, learner: Learner, step: int, probe: Callable[[], list[int]],
             any_failed: AnyFailed) -> None:
        """Copy the policy's weights into the engine and check the copy on the log-probs of
        the token ids ``probe()`` gives, unless it already holds optimizer step ``step``'s (a validation at the end
        of an epoch synced the weights the next epoch's rollout samples with; the engine keeps
        them while it sleeps)."""
        if self._synced_step == step:
            return
        tic = time.perf_counter()
        self.sync_diff = learner.sync_to_engine(self.engine, [probe()], self.config.sync_atol,
                                                any_failed=any_failed)
        self.sync_s = time.perf_counter() - tic
        self._synced_step = step

    def weights_changed(self) -> None:
        """The policy's weights changed outside an optimizer step (a checkpoint restored
        them): sync before the next sampling."""
        self._synced_step = None

    def close(self) -> None:
        """Release the engine (its KV cache and weights). The next engine starts from the
        policy path's weights, so it is synced whatever the step (validate does not move the
        step, so the step alone cannot tell)."""
        self._synced_step = None
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.close()
