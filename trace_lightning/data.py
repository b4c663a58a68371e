"""TraceDataModule: each epoch, budgeted rollout trees from the current policy.

One epoch is one RL iteration (``reload_dataloaders_every_n_epochs=1``): ``train_dataloader``
syncs the policy's weights into the engine (checked; not again when the epoch's validation
already synced this step's), lets the allocator spend the step's budget over candidate
prompts and prefixes, grows the trees, and serves the flattened leaves as token-packed
micro-batches. ``val_dataloader`` runs the agent on each validation set and
serves the finished trajectories for the QA metrics. The engine is awake only for those
phases: after each one ``engine.sleep()`` hands the trainer its GPU memory (vLLM sleep mode)
or its CPU threads.

Under several processes every rank computes the same candidates, predictions and root plan
(the allocator's budget is global) and rolls out its share of the chosen prompts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import get_args

import lightning as L
import numpy as np
from torch.utils.data import DataLoader

from trace_lightning.allocation.allocators import Allocator
from trace_lightning.rollout.step import (OracleNodes, RolloutStep, StepSpec, collect_step,
                                          oracle_predict)
from trace_lightning.collectives import (all_gather_list, any_rank, fail_together, from_rank0,
                                         raise_together)
from trace_lightning.rollout.engines.config import EngineConfig
from trace_lightning.rollout.session import EngineSession
from trace_lightning.rollout.engines.base import SamplingConfig
from trace_lightning.training.batches import step_minibatches
from trace_lightning.training.checkpoints import local_checkpoint_meta
from trace_lightning.hub import local_model_dir
from trace_lightning.learner import learner_of
from trace_lightning.rollout.agent import AgentLoop, sample_trees
from trace_lightning.tasks.base import Example, Task, TaskData
from trace_lightning.tree import RolloutTree, write_jsonl
from trace_lightning.rollout.validation import resampled_loader, val_row

def headline_first(env: Task, task: TaskData) -> tuple[str, ...]:
    """``env``'s declared metrics with ``task.metric`` (what summaries and the progress bar
    show) first; a ValueError when the task's headline is not one of them."""
    if task.metric not in env.metrics:
        raise ValueError(f"{type(task).__name__}.metric is {task.metric!r}, which its task "
                         f"{type(env).__name__} does not score (its metrics: "
                         f"{', '.join(env.metrics)}); name one of them")
    return (task.metric, *[m for m in env.metrics if m != task.metric])


log = logging.getLogger(__name__)


class TraceDataModule(L.LightningDataModule):
    """Budgeted tree rollouts from a vLLM (or transformers) engine, each epoch.

    The task (what the agent does, its examples and resources) is ``task``: any ``TaskData``
    (``trace_lightning.tasks``): search QA's ``SearchQAData``, the arithmetic agent's
    ``CalcData``, the SQL agent's ``SqlData``.

    Args:
        task: the task's data and environment (``--data.task.class_path`` and its
            ``init_args``, which the task checks).
        policy_path: the policy's directory or hub id (linked from ``model.policy_path``).
        engine: the rollout engine.
        sampling: sampling of training rollouts (stop strings come from the task).
        val_temperature: sampling temperature of validation (0 = greedy).
        val_samples: rollouts per validation question; the metrics average over them
            (pass@1 estimated from ``val_samples`` samples; use 1 when greedy).
        allocator: how each step's budget is spread (``uniform``, ``random_tree``,
            ``prompt``, ``prefix``, ``trace``, ``oracle``).
        candidates_per_step: prompts the allocator chooses from each step.
        advantage: tree advantage (linked from ``model.advantage``).
        tree_packing: pack each tree as one sequence, mini-batches of whole trees (linked
            from ``model.tree_packing``); False: one row per leaf, mini-batches of leaves.
        max_tokens_per_microbatch: padded tokens per micro-batch (packing by token count;
            with ``tree_packing``, each tree's tokens counted once).
        minibatches_per_step: optimizer steps per pass over the epoch's leaves (PPO-style
            mini-batches).
        ppo_epochs: passes over the epoch's leaves, each split into mini-batches afresh
            (verl's ``ppo_epochs``): ``minibatches_per_step * ppo_epochs`` optimizer steps per
            RL step, every one clipped against the behaviour log-probs of the rollouts.
        train_limit: use only the first ``train_limit`` training questions.
        trees_dir: write every epoch's trees as JSONL here (None: don't).
        oracle_samples: extra rollouts per node that estimate true success (``oracle`` only).
        oracle_nodes: which nodes the oracle's probes estimate (``oracle`` only): ``all``, or
            one stage's, ``roots`` or ``prefixes``, the other stage's predictions coming from
            the shared predictor (a diagnostic: which stage's predictions the gain is in).
        seed: seed of candidate sampling and rollouts.
    """

    def __init__(self, task: TaskData, policy_path: str = "",
                 engine: EngineConfig | None = None, sampling: SamplingConfig | None = None,
                 val_temperature: float = 0.0, val_samples: int = 1,
                 allocator: Allocator | None = None,
                 candidates_per_step: int = 64, advantage: str = "tree_grpo",
                 tree_packing: bool = True, max_tokens_per_microbatch: int = 8192,
                 minibatches_per_step: int = 1, ppo_epochs: int = 1,
                 train_limit: int | None = None, trees_dir: str | None = None,
                 oracle_samples: int = 8, oracle_nodes: OracleNodes = "all", seed: int = 0):
        super().__init__()
        # a step without training sequences gives every rank an empty train loader
        self.allow_zero_length_dataloader_with_multiple_devices = True
        if not isinstance(task, TaskData):
            raise TypeError(f"--data.task must be a TaskData (a task's class_path and its "
                            f"init_args, e.g. trace_lightning.tasks.search_qa.SearchQAData); "
                            f"got {type(task).__name__}")
        self.task = task
        self.policy_path = policy_path
        self.policy_dir = policy_path  # a hub id becomes its cached snapshot in setup
        self.engine_cfg = engine or EngineConfig()
        self.sampling = sampling or SamplingConfig()
        self.val_temperature, self.val_samples = val_temperature, val_samples
        self.allocator = allocator or Allocator("trace", roots=16, continuations=1,
                                                max_rollouts_per_prompt=8, group_size=4)
        self.candidates_per_step, self.advantage = candidates_per_step, advantage
        self.tree_packing = tree_packing
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self.minibatches_per_step = minibatches_per_step
        self.ppo_epochs = ppo_epochs
        self.train_limit, self.trees_dir, self.seed = train_limit, trees_dir, seed
        self.oracle_samples, self.oracle_nodes = oracle_samples, oracle_nodes
        self._check_config()
        self.session = EngineSession(self.engine_cfg, seed)  # the engine and tokenizer
        self._prepare_error: Exception | None = None  # prepare_data's, raised in setup
        self._checkpoint: tuple[str | None, Exception | None] | None = None  # expect_checkpoint
        self._rng = np.random.default_rng(seed)
        self.last_step: RolloutStep | None = None  # read by the monitoring callbacks
        self.last_val_trees: dict[str, list[RolloutTree]] = {}
        # the task's validation metrics, its headline first (callbacks.QAAccuracy's default)
        self.task_metrics: tuple[str, ...] = ()
        self.last_val_step: int | None = None  # trainer.global_step the last validation scored
        self.timings: dict[str, float] = {}
        self._rollout_epoch: int | None = None  # the epoch of the last training rollout
        self._resumed_epoch: int | None = None  # the checkpoint's, until the first dataloader

    # ---- configuration checks (before any work) ------------------------------------------
    def _check_config(self) -> None:
        """The step's settings, refused before any work (the task checked its own)."""
        if self.train_limit is not None and self.train_limit < 0:
            raise ValueError(f"--data.train_limit ({self.train_limit}) must be >= 0 or null "
                             f"(all)")
        seq = self.task.max_seq_tokens  # the task's trajectory limit (one of its init_args)
        if self.max_tokens_per_microbatch < seq:
            raise ValueError(f"--data.max_tokens_per_microbatch ({self.max_tokens_per_microbatch})"
                             f" must be >= the task's max_seq_tokens ({seq}, a setting of "
                             f"--data.task.init_args) so any trajectory fits")
        if self.engine_cfg.max_model_len < seq + self.sampling.max_tokens:
            raise ValueError(
                f"--data.engine.max_model_len ({self.engine_cfg.max_model_len}) must be >= "
                f"the task's max_seq_tokens + --data.sampling.max_tokens "
                f"({seq} + {self.sampling.max_tokens}; max_seq_tokens is a setting of "
                f"--data.task.init_args)")
        if not self.sampling.temperature > 0 or self.sampling.top_p != 1.0:
            raise ValueError(
                f"--data.sampling.temperature ({self.sampling.temperature}) must be > 0 and "
                f"--data.sampling.top_p ({self.sampling.top_p}) 1.0: the update recomputes the "
                f"rollouts' log-probs as log_softmax(logits / temperature) over the whole "
                f"vocabulary, so a nucleus (or greedy sampling, whose leaves of one prompt "
                f"are all alike) would make its importance ratios wrong; sample with top_p "
                f"1.0 at a temperature above 0 (1.0 as in verl and Search-R1's RL runs)")
        if self.val_samples < 1 or (self.val_temperature == 0.0 and self.val_samples > 1):
            raise ValueError(f"--data.val_samples ({self.val_samples}) must be >= 1, and 1 when "
                             f"--data.val_temperature is 0 (greedy samples are all the same)")
        if self.minibatches_per_step < 1 or self.ppo_epochs < 1:
            raise ValueError(f"--data.minibatches_per_step ({self.minibatches_per_step}) and "
                             f"--data.ppo_epochs ({self.ppo_epochs}) must be >= 1: together "
                             f"they are the optimizer steps per RL step")
        if self.oracle_samples < 1:
            raise ValueError(f"--data.oracle_samples ({self.oracle_samples}) must be >= 1: the "
                             f"rollouts per node that estimate its success for 'oracle'")
        if self.oracle_nodes not in get_args(OracleNodes) or (
                self.oracle_nodes != "all" and self.allocator.kind != "oracle"):
            raise ValueError(f"--data.oracle_nodes ({self.oracle_nodes!r}) must be 'all', "
                             f"'roots' or 'prefixes', and is 'all' unless "
                             f"--data.allocator.kind is 'oracle' (it is "
                             f"{self.allocator.kind!r}): it says which nodes the oracle's "
                             f"probes estimate; leave it out for other allocators")
        needed = self.allocator.prompts_needed
        if self.candidates_per_step < needed:
            raise ValueError(f"--data.candidates_per_step ({self.candidates_per_step}) is smaller "
                             f"than the {needed} prompts allocator {self.allocator.kind!r} needs "
                             f"per step; raise it or lower --data.allocator.roots")
    # ---- Lightning hooks ----------------------------------------------------------------
    def prepare_data(self) -> None:
        # Lightning calls this on one process per node: what fails here is raised on every
        # process at the start of setup (the others would wait for this one in a barrier)
        self._prepare_error = None
        try:
            self._prepare()
        except Exception as e:  # noqa: BLE001 - raised in setup, on every process
            if self._rank[1] == 1:
                raise
            self._prepare_error = e

    def _prepare(self) -> None:
        fitting = self.trainer is None or self.trainer.state.fn == "fit"
        # the task's files, then what it builds (the demo's world and policy)
        self.task.prepare(self.policy_path, fitting)
        local_model_dir(self.policy_path)  # a hub id downloads here, once per node

    def expect_checkpoint(self, path: str | None, error: Exception | None = None) -> None:
        """The checkpoint this process is to load (``--ckpt_path`` as the CLI resolved it,
        None: none) or why it found none (``error``). ``setup`` checks it on every process:
        one that finds no file, or another one (``--ckpt_path last`` in log folders each
        node keeps for itself), would start from other weights than the rest, or fail
        alone while they wait for it in the load."""
        self._checkpoint = (None if path is None else str(path), error)

    def setup(self, stage: str) -> None:
        raise_together(self._prepare_error, self._any_failed,
                       "preparing the data (prepare_data)")
        with fail_together("setting up the data (the task's files and resources, the checkpoint)",
                           self._any_failed):
            self._setup(stage)
        self._agree_on_checkpoint()
        if not self.session.started:
            self.session.start(self.policy_dir, self._rank[1], self._any_failed)

    def _setup(self, stage: str) -> None:
        """Everything of ``setup`` that reads this process's files and services (no
        collective), before the engine starts."""
        # the tokenizer and the engine read a directory: a hub id's cached snapshot
        self.policy_dir = local_model_dir(self.policy_path)
        self._check_checkpoint()
        self.task.setup(stage == "fit", self.train_limit, self._rank[1],
                        self.allocator.prompts_needed)
        self._check_val_limit()
    def _check_checkpoint(self) -> None:
        """The checkpoint of ``expect_checkpoint`` is on this process's file system, and
        holds what this run will load (the learner checks it against its model)."""
        path, error = self._checkpoint or (None, None)
        if error is not None:
            raise error
        meta = local_checkpoint_meta(path) if path is not None else None
        if meta is not None and self.trainer is not None:
            learner_of(self.trainer).check_checkpoint(path, meta, self.policy_dir,
                                                      fitting=self.trainer.state.fn == "fit")

    def _check_val_limit(self) -> None:
        """No share of the validation batches (``--trainer.limit_val_batches`` 0.1): a pass
        rolls out every question of the process's share before the first batch, so a share
        would score only part of those rollouts, and on a process whose share rounds to no
        batch Lightning stops while the others wait for it in the rollouts' collectives."""
        limit = getattr(self.trainer, "limit_val_batches", None)
        if isinstance(limit, float) and 0.0 < limit < 1.0 and self.task.val_examples:
            raise ValueError(
                f"--trainer.limit_val_batches ({limit}): validation rolls out all of each "
                f"set's questions before scoring a batch, so a share of the batches would "
                f"waste the rest (and can leave one process with none, which stops alone); "
                f"limit the task's validation questions instead (its settings under "
                f"--data.task.init_args), or leave it at 1.0")

    def _agree_on_checkpoint(self) -> None:
        """Every process loads the same checkpoint (``expect_checkpoint``), or none does."""
        if self._checkpoint is None or self._rank[1] == 1:
            return
        paths = all_gather_list([self._checkpoint[0]], self.trainer)
        if len(set(paths)) > 1:
            each = "; ".join(f"process {r}: {p or 'none (it would start from --model.policy_path)'}"
                             for r, p in enumerate(paths))
            raise ValueError(
                f"--ckpt_path: the processes found different checkpoints ({each}), so they "
                f"would train or score different weights; keep the run's logs "
                f"(--trainer.default_root_dir and the logger's save_dir) on a file system "
                f"every node sees, or pass one checkpoint's path")

    @property
    def _rank(self) -> tuple[int, int]:
        t = self.trainer
        return (t.global_rank, t.world_size) if t is not None else (0, 1)

    @property
    def _any_rank(self) -> Callable[[list[bool]], list[bool]] | None:
        """``collectives.any_rank``; None on one process."""
        return None if self._rank[1] == 1 else any_rank

    @property
    def _any_failed(self) -> Callable[[bool], bool] | None:
        """A failure flag OR-ed over the processes (``collectives.raise_together``)."""
        agree = self._any_rank
        return None if agree is None else (lambda failed: agree([failed])[0])

    @property
    def engine(self):
        return self.session.engine

    @property
    def tokenizer(self):
        return self.session.tokenizer

    @property
    def sync_diff(self) -> float | None:
        """The last weight sync's largest engine-vs-policy log-prob difference."""
        return self.session.sync_diff

    def _sync(self) -> None:
        """The policy's weights into the engine (``EngineSession.sync``: once per step)."""
        self.session.sync(learner_of(self.trainer), self.trainer.global_step,
                          lambda: self._probe_prompt()[:64], self._any_failed)
        if self.session.sync_s is not None:
            self.timings["sync"] = self.session.sync_s

    def _probe_prompt(self) -> list[int]:
        """A prompt's token ids for the weight-sync check: the first training example's (a
        validate-only run: the first validation example's, with that set's task)."""
        if self.task.train_examples:
            return self.task.environment(self.tokenizer).prompt(self.task.train_examples[0])[0]
        for name, examples in self.task.val_examples.items():
            if examples:
                return self.task.environment(self.tokenizer, name).prompt(examples[0])[0]
        return self.tokenizer.encode("probe", add_special_tokens=False)

    def train_dataloader(self) -> DataLoader:
        resumed, self._resumed_epoch = self._resumed_epoch, None
        finished = self.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        if resumed is not None and self.trainer.current_epoch <= resumed and finished:
            # Resumed from a checkpoint saved at the end of this epoch (ModelCheckpoint saves
            # there): Lightning asks for its dataloader again to finish the epoch, whose
            # batches were trained before the checkpoint and run no more. Rolling out again
            # would cost a phase and draw the next epoch's prompts. (After a mid-epoch
            # checkpoint the epoch's remaining batches run: it is rolled out again.)
            log.info("epoch %d's rollout is in the checkpoint: not rolled out again",
                     self.trainer.current_epoch)
            self._rollout_epoch = resumed
            done = {"micro": [], "n_tokens": 0.0}  # never trained: the epoch's batches ran
            return DataLoader([done], batch_size=None, collate_fn=lambda b: b)
        tic = time.perf_counter()
        with self.session.turn(self._any_failed):
            step = self._rollout()
        self._rollout_epoch = step.epoch
        if self.allocator.predicts:
            # The predictor learns from the step only where the allocator reads it: a run of
            # GRPO (uniform) or random_tree pays for no predictor, as it would elsewhere. It
            # learns after the step's update, whose forwards read the features its
            # predictions did not compute.
            learner_of(self.trainer).receive_step(step)
        epoch, (rank, _) = self.trainer.current_epoch, self._rank
        if self.trees_dir:
            with fail_together("writing the step's trees (--data.trees_dir)", self._any_failed):
                write_jsonl(step.trees, Path(self.trees_dir) / f"epoch_{epoch}_rank_{rank}.jsonl")
        batches = self._batches(step)
        # at the step's start weights: what the update's rollout correction reads of them
        learner_of(self.trainer).prepare_update(batches)
        # the step's sampling phase: weight sync, rollouts and batching
        self.timings["sample"] = time.perf_counter() - tic
        return DataLoader(batches, batch_size=None, shuffle=False, collate_fn=lambda b: b)

    def _rollout(self) -> RolloutStep:
        """This epoch's tree rollouts from the synced engine."""
        module = learner_of(self.trainer)
        self._sync()
        epoch = self.trainer.current_epoch
        rank, world = self._rank
        # the same candidates on every rank: the allocator's budget is global
        examples = self.task.train_examples
        idx = self._rng.choice(len(examples), size=min(self.candidates_per_step, len(examples)),
                               replace=False)
        candidates = [examples[i] for i in idx]
        self.allocator.start_step(epoch, rank)
        bar = self._progress_bar(f"Rollout {epoch}", self.allocator.leaves_per_step // world)
        loop = AgentLoop(self.engine, self.task.environment(self.tokenizer), self.sampling,
                         on_leaves=bar.update if bar is not None else None,
                         describe=module.reads_prompt_features)

        def learned(trees: list[RolloutTree]) -> None:
            # the featuriser's forward passes run on the process's threads, not the engine's
            with self.engine.host_compute():
                module.predict_trees(trees)

        predict = learned
        if self.allocator.kind == "oracle":
            predict = oracle_predict(loop, self.oracle_samples, seed=self.seed + epoch,
                                     nodes=self.oracle_nodes,
                                     learned=None if self.oracle_nodes == "all" else learned)

        spec = StepSpec(epoch=epoch, predict=predict, advantage=self.advantage,
                        predictor_nodes_seen=module.predictor_nodes_seen,
                        # one expand samples with seed (the two-wave schedule's second with
                        # seed + 1): 2 * rank keeps every rank's streams apart
                        seed=int(self._rng.integers(2**31 - 1)) + 2 * rank,
                        shard=(rank, world), agree=from_rank0 if world > 1 else None,
                        any_rank=self._any_rank)
        step = collect_step(loop, self.allocator, candidates, spec)
        if bar is not None:
            bar.close()
        self.last_step = step
        return step

    def _progress_bar(self, desc: str, total: int):
        """A bar for the rollout phase beside Lightning's (rank 0, when bars are on)."""
        if self.trainer is None or self.trainer.progress_bar_callback is None or self._rank[0]:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit="leaf", leave=False, dynamic_ncols=True)

    def _batches(self, step: RolloutStep) -> list[dict]:
        """The step's mini-batches (``batches.step_minibatches``), equal counts on every
        rank."""
        device = self.trainer.strategy.root_device if self.trainer is not None else None
        return step_minibatches(step, self.tokenizer.pad_token_id, self.minibatches_per_step,
                                self.ppo_epochs, self.max_tokens_per_microbatch,
                                self.tree_packing, self.sampling.temperature, device)

    def val_dataloader(self) -> list[DataLoader]:
        """One loader per validation set; its rollouts are sampled when it is iterated.

        Lightning may build the validation loaders before training starts (for the progress
        bar) and reuse them for the first validation, so sampling here would score the
        policy from before the first epoch's updates. Each loader's sampler instead runs the
        rollouts with the current weights at the start of every pass.
        """
        rank, world = self._rank
        loaders = []
        for name, examples in self.task.val_examples.items():
            mine = examples[rank::world]
            loaders.append(resampled_loader(len(mine) * self.val_samples,
                                            lambda n=name, mine=mine: self._val_rows(n, mine)))
        return loaders

    def _val_rows(self, name: str, mine: list[Example]) -> list[dict]:
        """``val_samples`` rollouts at ``val_temperature`` per question of this rank's share
        of validation set ``name``, with the current weights (synced first if the policy
        changed)."""
        env = self.task.environment(self.tokenizer, name)
        with self.session.turn(self._any_failed):
            self._sync()
            tic = time.perf_counter()
            sampling = SamplingConfig(temperature=self.val_temperature, top_p=1.0,
                                      max_tokens=self.sampling.max_tokens, seed=self.seed)
            trees = sample_trees(self.engine, env, mine, n=self.val_samples,
                                 sampling=sampling, seed=self.seed, any_rank=self._any_rank)
        self.task_metrics = headline_first(env, self.task)
        self.last_val_trees[name] = trees
        self.last_val_step = self.trainer.global_step
        self.timings["validation_rollout"] = time.perf_counter() - tic
        return [val_row(t, leaf, env.calls_metric) for t in trees for leaf in t.leaves()]

    # ---- checkpointing: the sampler's RNG -----------------------------------------------
    def state_dict(self) -> dict:
        return {"rng": self._rng.bit_generator.state, "allocator": self.allocator.state_dict(),
                "rollout_epoch": self._rollout_epoch}

    def load_state_dict(self, state: dict) -> None:
        self._rng.bit_generator.state = state["rng"]
        self._resumed_epoch = state.get("rollout_epoch")  # see train_dataloader
        self.allocator.load_state_dict(state["allocator"])
        self.session.weights_changed()  # restored weights: sync them before sampling

    def teardown(self, stage: str) -> None:
        """Release the engine (its KV cache and weights) at the end of fit/validate, so a
        process that runs several (a notebook, a benchmark, the tests) does not keep each
        one's memory; the next ``setup`` builds a fresh engine."""
        self.session.close()

    def on_exception(self, exception: BaseException) -> None:
        """A fit/validate that fails gets no ``teardown`` from Lightning: release the engine
        here (a notebook would keep its GPU memory, and an in-process vLLM its process
        groups, which the next engine in the process would find stale). A failure to close
        is logged, never raised over the error being handled."""
        try:
            self.session.close()
        except Exception as e:  # noqa: BLE001 - the run's own error is the one to see
            log.warning("closing the rollout engine after %s failed: %s: %s",
                        type(exception).__name__, type(e).__name__, e)
