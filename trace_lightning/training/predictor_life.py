"""The shared success predictor's life beside the policy: what it predicts during the
rollout, what it learns after the update, its optimizer, and what of it a checkpoint keeps.

``TraceModule`` owns the predictor itself (an ``nn.Module``, so its weights travel in the
module's state dict as ``predictor.*``) and one ``PredictorLife`` for the rest: the
featuriser, the replay of recent steps' nodes, the root neighbours' memory, the prompt
history, the prefix posterior, the predictor's own AdamW and its counters. The predictor
steers allocation only; it never enters the policy gradient.

One step's order:

1. ``predict``: during the rollout, features of the trees' nodes (kept for the fit) and
   the predictions, adjusted by the root neighbours, the prefix posterior and the prompt
   history, in that order.
2. ``receive``: the step's finished trees, to learn from after the update.
3. ``update_features``: the update's packed forwards read the final hidden states of the
   nodes the predictions did not featurise (the continuations) into this dict: the fit's
   features for free.
4. ``fit``: after the update, on all ranks' nodes plus the replay.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from trace_lightning.allocation.features import Featuriser
from trace_lightning.allocation.history import PromptHistory
from trace_lightning.allocation.neighbours import RootNeighbours, root_rows
from trace_lightning.allocation.posterior import PrefixPosterior
from trace_lightning.allocation.predictor import (ReplayBuffer, SuccessPredictor, fit_predictor,
                                                  predict_nodes, training_batch)
from trace_lightning.collectives import all_gather_batch, all_gather_list

if TYPE_CHECKING:
    from trace_lightning.rollout.step import RolloutStep
    from trace_lightning.tree import RolloutTree


class PredictorLife:
    """Everything of the shared predictor but its weights (see the module docstring).

    Args:
        featuriser: how prefixes become the predictor's features.
        hidden: width of the predictor's hidden layer.
        lr: the predictor's learning rate (its own AdamW).
        epochs: most passes over the replay per step (early-stopped on ``holdout``).
        batch_size: mini-batch size of the fit, in tree nodes.
        holdout: share of the replay held out to stop the fit early (0: none).
        replay_steps: steps of tree nodes kept for the fit.
        history: update root predictions with each prompt's own past outcomes (None: off).
        prefix_outcomes: update each prefix's prediction with its own bare rollout's and its
            siblings' outcomes (a ``PrefixPosterior`` over the last ``replay_steps`` steps).
        neighbours: update root predictions with the outcomes of the most similar prompts
            rolled out before (None: off).
    """

    def __init__(self, featuriser: Featuriser, hidden: int, lr: float, epochs: int,
                 batch_size: int, holdout: float, replay_steps: int,
                 history: PromptHistory | None = None, prefix_outcomes: bool = False,
                 neighbours: RootNeighbours | None = None):
        self.featuriser, self.hidden, self.lr = featuriser, hidden, lr
        self.epochs, self.batch_size, self.holdout = epochs, batch_size, holdout
        self.replay = ReplayBuffer(replay_steps)
        self.history = history
        self.neighbours = neighbours
        self.posterior = PrefixPosterior(window=replay_steps) if prefix_outcomes else None
        self.nodes_seen = 0  # tree nodes the predictor has learnt from (the cold start)
        self.stats: dict[str, float] = {}  # the last fit's predictor/* figures
        # (global step, {(tree_id, node_id): (D,)}): the features ``predict`` computed in this
        # step's rollout, with these weights; ``receive`` takes them
        self._features: tuple[int, dict] | None = None
        # (step, its predictions' features, final hidden states the update's forwards read
        # at the other nodes): the step the predictor learns from after the update
        self._pending: tuple[RolloutStep, dict, dict] | None = None
        self._opt: torch.optim.Optimizer | None = None
        self._opt_restore: dict | None = None  # a checkpoint's, loaded on first use

    def new_predictor(self, config) -> SuccessPredictor:
        """A fresh predictor for a policy of this ``config`` (its width is the featuriser's)."""
        return SuccessPredictor(self.featuriser.feature_dim(config), hidden=self.hidden)

    @property
    def reads_prompt_features(self) -> bool:
        """Whether the featuriser appends the task's description of each prompt."""
        return self.featuriser.task_features > 0

    def optimizer(self, predictor: SuccessPredictor) -> torch.optim.Optimizer:
        """The predictor's AdamW, made on first use (a resumed run's state loaded into it).

        Kept out of Lightning's optimizers, its state travelling in ``checkpoint["trace"]``:
        the predictor is updated identically on every rank outside any strategy wrapper, and
        FSDP's sharded checkpoints would restore its state as shards of a model FSDP does not
        own; a 16-mixed loss scaler would unscale (and step on) gradients it never scaled.
        """
        if self._opt is None:
            opt = torch.optim.AdamW(predictor.parameters(), lr=self.lr)
            if self._opt_restore is not None:
                opt.load_state_dict(self._opt_restore)
                self._opt_restore = None
                for group in opt.param_groups:  # this run's lr, as for the policy
                    group["lr"] = self.lr
            self._opt = opt
        return self._opt

    # ---- one step -----------------------------------------------------------------------
    def forget_features(self) -> None:
        """Drop the features kept from predictions (computed with other weights)."""
        self._features = None

    def _known(self, step: int) -> dict:
        """This step's features so far (computed with the current weights), or none."""
        kept = self._features
        return kept[1] if kept is not None and kept[0] == step else {}

    @torch.no_grad()
    def predict(self, predictor: SuccessPredictor, policy, trees: list[RolloutTree],
                step: int, epoch: int) -> None:
        """Set ``node.prediction`` on every root and non-leaf turn of ``trees``.

        The features are kept for the fit, and a path whose nodes all have one already is
        not run again (stage 2 predicts trees whose roots stage 1 did)."""
        feats = self.featuriser.nodes(policy, trees, known=self._known(step))
        self._features = (step, feats)
        predict_nodes(predictor, trees, feats)
        if self.neighbours is not None:
            self.neighbours.adjust(trees, feats)
        if self.posterior is not None:
            self.posterior.adjust(trees)
        if self.history is not None:
            self.history.adjust(trees, epoch)

    def receive(self, rollout: RolloutStep, step: int) -> None:
        """Take the step's finished trees; ``fit`` learns from them after the update.

        Waiting costs the predictor nothing and saves a forward pass: the features of the
        nodes the predictions did not featurise (the continuations) are read from the
        update's own packed forwards (``update_features``), at the weights of their
        mini-batch. The predictor is first used after the update anyway."""
        self._pending = (rollout, self._known(step), {})
        self._features = None

    def update_features(self) -> dict | None:
        """The dict the update's forwards read the nodes' final hidden states into (None:
        nothing to learn from, or a featuriser that reads no hidden states)."""
        if self._pending is None or self.featuriser.kind != "hidden":
            return None
        return self._pending[2]

    @property
    def pending(self) -> bool:
        """A received step waits for its fit."""
        return self._pending is not None

    def fit(self, predictor: SuccessPredictor, policy, trainer, epoch: int) -> dict[str, float]:
        """Train the predictor on the received step's tree values (all ranks' nodes) plus
        the replay; returns the figures to log (``predictor/*``, ``perf/predictor_fit_s``),
        none when no step waits.

        Only the nodes whose features neither the predictions nor the update's forwards
        computed run through the policy, at its weights after the update: with tree packing
        none (every node is in some mini-batch) unless a run resumed mid-step skipped some;
        per-leaf rows read no nodes."""
        if self._pending is None:
            return {}
        rollout, known, hidden = self._pending
        self._pending = None
        tic = time.perf_counter()
        with torch.no_grad():
            feats = self.featuriser.nodes(policy, rollout.trees, known=known, hidden=hidden)
        batch = all_gather_batch(training_batch(rollout.trees, feats), trainer)
        self.replay.add(batch)
        self.nodes_seen += len(batch.value)
        if self.history is not None:
            self.history.record(all_gather_list(
                PromptHistory.outcomes_of(rollout.trees, rollout.epoch), trainer))
        if self.neighbours is not None:
            self.neighbours.record(all_gather_list(root_rows(rollout.trees, feats), trainer))
        gen = torch.Generator().manual_seed(1000 * epoch + 17)
        self.stats = fit_predictor(predictor, self.optimizer(predictor), self.replay,
                                   self.epochs, self.batch_size, generator=gen,
                                   holdout=self.holdout)
        if self.history is not None:
            self.stats["predictor/history_prompts"] = float(len(self.history))
        if self.neighbours is not None:
            self.stats["predictor/neighbours_memory"] = float(len(self.neighbours))
        if self.posterior is not None:
            self.stats.update(self.posterior.fit(
                all_gather_list(self.posterior.scored(rollout.trees), trainer)))
        return {**self.stats, "perf/predictor_fit_s": time.perf_counter() - tic}

    # ---- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a checkpoint keeps of it (``checkpoint["trace"]``)."""
        return {"replay": self.replay.state_dict(),
                "predictor_nodes_seen": self.nodes_seen,
                "predictor_stats": self.stats,
                "predictor_optimizer": (self._opt_restore if self._opt is None
                                        else self._opt.state_dict()),
                "history": self.history.state_dict() if self.history is not None else None,
                "posterior": (self.posterior.state_dict()
                              if self.posterior is not None else None),
                "neighbours": (self.neighbours.state_dict()
                               if self.neighbours is not None else None)}

    def load_state_dict(self, state: dict, optimizer_states: list | None = None) -> None:
        """Restore ``state_dict``'s; ``optimizer_states``: the checkpoint's Lightning
        optimizer states, where older checkpoints kept the predictor's as the second."""
        self._features = None  # features of the weights before these
        opt_state = state.get("predictor_optimizer")
        if opt_state is None and optimizer_states is not None and len(optimizer_states) == 2:
            opt_state = optimizer_states.pop()
        if opt_state is not None:  # loaded on first use
            self._opt, self._opt_restore = None, opt_state
        self.replay.load_state_dict(state["replay"])
        self.nodes_seen = state["predictor_nodes_seen"]
        self.stats = state["predictor_stats"]
        if self.history is not None and state.get("history") is not None:
            self.history.load_state_dict(state["history"])
        if self.posterior is not None and state.get("posterior") is not None:
            self.posterior.load_state_dict(state["posterior"])
        if self.neighbours is not None and state.get("neighbours") is not None:
            self.neighbours.load_state_dict(state["neighbours"])
