"""What the DataModule asks of the LightningModule: one typed interface.

The LightningModule owns the policy and the shared success predictor (the design card);
the DataModule owns the engine and the RL step. Each epoch the step needs these things of
the module, and reaches them through this ``Learner`` protocol (``TraceModule`` implements
it), never through attributes looked up on ``trainer.lightning_module``:

- copy the policy's weights into the engine and check the copy (``sync_to_engine``);
- predict success on the trees' prefixes while allocating (``predict_trees``) and say how
  many nodes the predictor has learnt from (``predictor_nodes_seen``: the cold start);
- hand over the step's finished trees for the predictor to learn from (``receive_step``;
  only for an allocator that reads predictions: a GRPO run pays for no predictor). The
  module learns from them once the step's update has run (at the end of its last
  mini-batch), so the update's forwards can feed it;
- say whether a checkpoint holds what this run will load (``check_checkpoint``), before
  the engine starts;
- take the step's mini-batches before the update, at the step's start weights
  (``prepare_update``: the rollout correction's log-probs of the later mini-batches);
- say whether its predictions read the task's description of each prompt
  (``reads_prompt_features``: then new trees carry ``Task.prompt_features``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from trace_lightning.rollout.step import RolloutStep
    from trace_lightning.tree import RolloutTree


@runtime_checkable
class Learner(Protocol):
    """The policy and predictor's side of the RL step (see the module docstring)."""

    predictor_nodes_seen: int
    reads_prompt_features: bool

    def sync_to_engine(self, engine, probe: list[list[int]], atol: float,
                       any_failed: Callable[[bool], bool] | None = None) -> float:
        """Load the policy's weights into ``engine``; the largest engine-vs-policy log-prob
        difference on ``probe`` (raises above ``atol``)."""

    def predict_trees(self, trees: list[RolloutTree]) -> None:
        """Set ``node.prediction`` on every root and non-leaf turn of ``trees``."""

    def receive_step(self, step: RolloutStep) -> None:
        """Take the step's finished trees; the predictor learns from them once the step's
        update has run."""

    def check_checkpoint(self, path: str, meta: dict, policy_dir: str, fitting: bool) -> None:
        """A ValueError naming the settings when the checkpoint at ``path`` (``meta``: read
        without its tensors) does not hold what this run loads (``fitting``: the optimizer
        states and counters too, not only the weights)."""

    def prepare_update(self, batches: list[dict]) -> None:
        """Given the step's mini-batches before its update, at the step's start weights
        (the rollout correction's log-probs of the later mini-batches)."""


def learner_of(trainer) -> Learner:
    """The trainer's LightningModule as a ``Learner``; a TypeError naming what it lacks."""
    module = trainer.lightning_module
    if not isinstance(module, Learner):
        missing = [name for name in ("predictor_nodes_seen", "reads_prompt_features",
                                     "sync_to_engine", "predict_trees", "receive_step",
                                     "check_checkpoint", "prepare_update")
                   if not hasattr(module, name)]
        raise TypeError(f"TraceDataModule needs a LightningModule that implements "
                        f"trace_lightning.learner.Learner (as TraceModule does); "
                        f"{type(module).__name__} lacks {', '.join(missing)}")
    return module
