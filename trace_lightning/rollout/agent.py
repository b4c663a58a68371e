"""The agent loop: many trajectories at once, grown into rollout trees.

Each turn makes one batched engine call for every live trajectory and one batched call of
the task's tool for every tool call among them (``Task.execute``: the searches of search
QA); the observation is appended as token ids. A trajectory
starts from a node of a tree: from the root it is a new bare rollout, from a turn node it is
a continuation that resumes that prefix's exact token ids (no re-tokenising: the
observations are already in the prefix).

A task whose tools keep state (``Task.continuation``) gets one ``ToolState`` per trajectory,
and a continuation starts from the state its prefix left: ``"fork"`` copies the state the
loop saved right after that prefix's turn, ``"replay"`` re-runs the prefix's tool calls on a
fresh state (batched by depth) and checks that each observation comes out as the prefix
holds it. Stateless tasks (``"none"``) skip all of it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from trace_lightning.collectives import log_failure, raise_failed
from trace_lightning.rollout.engines.base import Completion, RolloutEngine, SamplingConfig
from trace_lightning.tasks.base import Example, Task, ToolState, Turn
from trace_lightning.tree import Budget, RolloutTree


@dataclass
class _Live:
    tree: RolloutTree
    node: int  # the node the next turn is appended under
    rollout: int
    ids: list[int]  # the exact prefix token ids
    example: Example
    state: ToolState | None  # its tools' state (None for stateless tasks)


@dataclass
class Start:
    """Grow ``count`` trajectories from ``node`` of ``tree`` (0 = new bare rollouts)."""

    tree: RolloutTree
    node: int
    count: int


class AgentLoop:
    """Grows trees with an engine and a task.

    Args:
        engine: the rollout engine (vLLM or transformers).
        env: the task (prompt, parsing, tool calls, reward): ``SearchEnvironment`` for
            search QA.
        sampling: sampling settings of every turn (stop strings come from the task).
        on_leaves: called after every turn with the number of trajectories it finished
            (progress bars).
        describe: give every new tree the task's description of its prompt
            (``Task.prompt_features``), for a featuriser that reads it.
        continues: continuations may start from the prefixes this loop grows; a task with
            ``continuation == "fork"`` then keeps a copy of each prefix's tool state until
            ``release`` (bare-rollout-only callers, such as validation, pass False).
    """

    def __init__(self, engine: RolloutEngine, env: Task, sampling: SamplingConfig,
                 on_leaves: Callable[[int], None] | None = None, describe: bool = False,
                 continues: bool = True):
        if describe and not callable(getattr(env, "prompt_features", None)):
            raise ValueError(f"--model.featuriser.task_features asks for the task's description "
                             f"of each prompt, but {type(env).__name__} gives none (it has no "
                             f"prompt_features): set --model.featuriser.task_features 0")
        if env.continuation not in ("none", "fork", "replay"):
            raise ValueError(f"{type(env).__name__}.continuation is {env.continuation!r}; a task "
                             f"says 'none' (stateless tools), 'fork' or 'replay'")
        self.engine, self.env, self.describe = engine, env, describe
        self.sampling = replace(sampling, stop=list(env.stop))
        self.on_leaves = on_leaves  # told how many trajectories each turn finished
        self.engine_calls = 0  # turns run so far: one batched engine call each
        self.tool_s = 0.0  # wall seconds inside the task's tool calls so far
        self.saves_states = continues and env.continuation == "fork"
        # by id(tree): the tree (so its id is not reused) and its example
        self._examples: dict[int, tuple[RolloutTree, Example]] = {}
        self._saved: dict[tuple[int, int], ToolState] = {}  # (id(tree), node): its fork

    def example(self, tree: RolloutTree) -> Example:
        """The example ``tree`` was grown from (one rebuilt from the tree for a tree this loop
        did not start: its id, question, answers and dataset, no extras)."""
        kept = self._examples.get(id(tree))
        if kept is not None:
            return kept[1]
        return Example(tree.tree_id, tree.question, list(tree.answers), tree.dataset)

    def release(self) -> None:
        """Close the prefixes' saved tool states and forget the trees' examples: the step
        that grew them has ended (no continuation will start from them)."""
        for state in self._saved.values():
            state.close()
        self._saved.clear()
        self._examples.clear()

    def new_tree(self, example: Example) -> RolloutTree:
        ids, text = self.env.prompt(example)
        if len(ids) >= self.env.max_seq_tokens:  # every rollout would end empty, reward 0
            raise ValueError(
                f"the prompt of question {example.id!r} is {len(ids)} tokens, at or over the "
                f"task's max_seq_tokens ({self.env.max_seq_tokens}, a setting of "
                f"--data.task.init_args): no room for a turn; raise it (and "
                f"--data.engine.max_model_len) or shorten the task's instruction")
        tree = RolloutTree.new(example.id, example.question, example.answers, ids, text,
                               dataset=example.dataset,
                               prompt_features=(self.env.prompt_features(example)
                                                if self.describe else None))
        self._examples[id(tree)] = (tree, example)
        return tree

    def expand(self, starts: Sequence[Start], seed: int,
               any_rank: Callable[[list[bool]], list[bool]] | None = None) -> Budget:
        """Run every trajectory of ``starts`` to its end; returns what they spent.
        ``seed``, ``any_rank``: as ``grow``'s."""
        growth = Growth(self, starts, seed, any_rank, report=False)
        for _ in growth:
            pass
        return growth.budget

    def grow(self, starts: Sequence[Start], seed: int,
             any_rank: Callable[[list[bool]], list[bool]] | None = None) -> Growth:
        """The trajectories of ``starts``, grown one turn per iteration by the caller, who
        may add starts between turns (``Growth``). ``seed``: seed of the turns' sampling
        seeds; ``any_rank``: under several processes, ``any_rank(flags)`` is each flag
        OR-ed over the ranks (a collective, once per turn)."""
        return Growth(self, starts, seed, any_rank, report=True)

    def _start(self, starts: Sequence[Start]) -> list[_Live]:
        """One live trajectory per count of each start; a new bare rollout gets its tree's
        next free rollout index and a fresh tool state, a continuation the state its prefix
        left."""
        live: list[_Live] = []
        next_rollout: dict[int, int] = {}  # by id(tree): oracle probes share a tree_id
        for s in starts:
            node = s.tree.nodes[s.node]
            assert not node.finished, f"cannot continue leaf {s.node} of tree {s.tree.tree_id}"
            prefix = s.tree.prefix_ids(s.node)
            example = self.example(s.tree)
            for _ in range(s.count):
                if s.node == 0:
                    j = next_rollout.get(id(s.tree), len(s.tree.root.children))
                    next_rollout[id(s.tree)] = j + 1
                else:
                    j = node.rollout
                live.append(_Live(s.tree, s.node, j, prefix, example,
                                  self._state_at(s.tree, s.node, example)))
        if self.env.continuation == "replay":
            self._replay([t for t in live if t.node != 0])
        return live

    def _state_at(self, tree: RolloutTree, node: int, example: Example) -> ToolState | None:
        """The tool state a trajectory from ``node`` starts with: a fresh one from the root
        or to replay the prefix on, a fork of the saved one for a ``"fork"`` task."""
        if node == 0 or self.env.continuation != "fork":
            return self.env.start(example)
        saved = self._saved.get((id(tree), node))
        if saved is None:
            raise RuntimeError(
                f"no saved tool state for node {node} of tree {tree.tree_id}: "
                f"{type(self.env).__name__} continues prefixes by 'fork', so the loop that grew "
                f"the prefix must keep its states (AgentLoop(continues=True), and no release() "
                f"before the continuations start)")
        return saved.fork()

    def _replay(self, live: list[_Live]) -> None:
        """Re-run each continuation's prefix tool calls on its fresh state, one batched call
        per depth, checking every observation against the one the prefix holds."""
        paths = [[n for n in t.tree.path(t.node)[1:]] for t in live]
        for depth in range(max((len(p) for p in paths), default=0)):
            rows = [(t, p[depth]) for t, p in zip(live, paths) if depth < len(p)]
            calls = [Turn(n.action, n.argument) for _, n in rows]
            tic = time.perf_counter()
            observations = self.env.execute(calls, [t.state for t, _ in rows])
            self.tool_s += time.perf_counter() - tic
            for (t, n), (_, text) in zip(rows, observations):
                if text != n.observation:
                    raise RuntimeError(
                        f"replaying turn {n.depth} of tree {t.tree.tree_id} ({n.action} "
                        f"{n.argument[:80]!r}) gave another observation than the prefix holds "
                        f"({text[:80]!r}, not {n.observation[:80]!r}): "
                        f"{type(self.env).__name__}'s tools are not deterministic, so its "
                        f"continuations must fork the state (continuation 'fork'), not replay it")

    def _turn(self, live: list[_Live], seed: int, total: Budget) -> list[_Live]:
        self.engine_calls += 1
        outs: list[Completion] = [c[0] for c in self.engine.generate(
            [t.ids for t in live], replace(self.sampling, seed=seed))]
        room = [max(self.env.max_seq_tokens - len(t.ids), 0) for t in live]
        cut = [len(c.token_ids) > r for c, r in zip(outs, room)]  # hit the context limit
        gen = [list(c.token_ids[:r]) for c, r in zip(outs, room)]
        texts = [self.env.tokenizer.decode(g) for g in gen]
        # parsed up to the stop string: the token that completed it may carry more text
        actions = [self.env.parse(x) for x in texts]
        calling = [i for i, t in enumerate(live) if actions[i].calls_tool and not cut[i]
                   and t.tree.nodes[t.node].depth + 1 < self.env.max_turns]
        tic = time.perf_counter()
        observations = dict(zip(calling, self.env.execute([actions[i] for i in calling],
                                                          [live[i].state for i in calling])))
        self.tool_s += time.perf_counter() - tic
        still: list[_Live] = []
        for i, (t, c, g, a, text) in enumerate(zip(live, outs, gen, actions, texts)):
            obs_ids, obs_text = observations.get(i, ([], ""))
            spent = Budget(generated_tokens=len(g), prefill_tokens=len(t.ids),
                           cached_tokens=c.cached_tokens, tool_calls=int(i in observations))
            if cut[i]:
                finish = "max_tokens"
            elif not a.calls_tool:
                finish = a.kind  # "answer" or "invalid"
            elif i not in observations:
                finish = "max_turns"
            elif len(t.ids) + len(g) + len(obs_ids) >= self.env.max_seq_tokens:
                # the observation would not fit: the episode ends on the call and stays
                # within max_seq_tokens (tool_calls counts observations the trees hold)
                finish, obs_ids, obs_text = "max_tokens", [], ""
                spent.tool_calls = 0
            else:
                finish = ""
            node = t.tree.add_child(
                t.node, rollout=t.rollout, token_ids=g + list(obs_ids),
                logprobs=list(c.logprobs[: len(g)]) + [0.0] * len(obs_ids),
                policy_mask=[1] * len(g) + [0] * len(obs_ids),
                text=text, observation=obs_text, action=a.kind,
                argument=a.argument if a.kind != "invalid" else a.error,
                finished=bool(finish), finish_reason=finish)
            if finish:
                node.reward, node.metrics = self.env.score(a, t.example, t.state)
                if not math.isfinite(node.reward):
                    raise ValueError(
                        f"reward {node.reward} of tree {t.tree.tree_id} (question "
                        f"{t.tree.question!r}) is not finite; check the task's reward "
                        f"({type(self.env).__name__}.score): the step is not trained on")
                spent.leaves = 1
                if t.state is not None:
                    t.state.close()
            else:
                if self.saves_states:
                    self._saved[(id(t.tree), node.id)] = t.state.fork()
                still.append(_Live(t.tree, node.id, t.rollout, t.ids + node.token_ids,
                                   t.example, t.state))
            t.tree.budget.add(spent)
            total.add(spent)
        if self.on_leaves is not None:
            self.on_leaves(len(live) - len(still))
        return still


class Growth:
    """Trajectories grown turn by turn, driven by the caller.

    Each iteration runs one turn of every live trajectory and, when some trees of the
    starts have had all their trajectories end since the last report, yields them (each tree
    once); starts the caller ``add``s join the next turn beside the trajectories still
    running (a prompt's stage 2 need not wait for the other prompts' stage 1). ``budget``
    is what the turns spent.

    Under several processes (``any_rank``) every rank yields on the same turns (with no
    trees when none of its own ended), since the caller's work between turns may run
    collectives (the featuriser's forwards under FSDP), and the iteration ends when no rank
    has a trajectory running or a tree to report. A turn that fails on one rank (its
    retriever down, its engine), or the caller's work between turns inside ``guard()``
    (the oracle's probes, planning), stops every rank at the next turn's flags: the others
    raise ``RankFailed`` instead of waiting for it.
    """

    def __init__(self, loop: AgentLoop, starts: Sequence[Start], seed: int,
                 any_rank: Callable[[list[bool]], list[bool]] | None, report: bool):
        self.loop, self.any_rank = loop, any_rank
        self.rng = np.random.default_rng(seed)
        self.live = loop._start(starts)
        # the trees whose end is to be reported (each once), by first appearance
        self.waiting = list({id(s.tree): s.tree for s in starts}.values()) if report else []
        self.budget = Budget()
        self.error: Exception | None = None  # this rank's, raised once the ranks agree

    def add(self, starts: Sequence[Start]) -> None:
        """More trajectories, from the next turn on."""
        self.live += self.loop._start(starts)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """The caller's work between two turns: under several processes an error in it is
        raised on every rank at the next turn's flags (one process: at once)."""
        if self.any_rank is None:
            yield
            return
        try:
            yield
        except Exception as e:  # noqa: BLE001 - on every rank at the next turn's flags
            # ``more`` was true on every rank (a report was), so all come round again
            self.error = log_failure(e, "a rollout turn")

    def __iter__(self) -> Iterator[list[RolloutTree]]:
        while True:
            if self.live and self.error is None:
                try:
                    self.live = self.loop._turn(self.live, int(self.rng.integers(2**31 - 1)),
                                                self.budget)
                except Exception as e:  # noqa: BLE001 - raised below, on every rank
                    if self.any_rank is None:
                        raise
                    self.error = log_failure(e, "a rollout turn")
            running = {id(t.tree) for t in self.live}
            done = [t for t in self.waiting if id(t) not in running]
            self.waiting = [t for t in self.waiting if id(t) in running]
            report = bool(done)
            more, failed = bool(self.live or self.waiting or done), self.error is not None
            if self.any_rank is not None:
                report, more, failed = self.any_rank([report, more, failed])
            if failed:
                raise_failed(self.error, "a rollout turn")
            if report:
                yield done
            if not more:
                return


def sample_trees(engine: RolloutEngine, env: Task, examples: Sequence[Example],
                 n: int, sampling: SamplingConfig, seed: int,
                 any_rank: Callable[[list[bool]], list[bool]] | None = None
                 ) -> list[RolloutTree]:
    """``n`` bare rollouts per example, no branching; rewards and values computed.
    ``any_rank``: as ``AgentLoop.expand``'s (a turn failing on one rank stops every rank)."""
    loop = AgentLoop(engine, env, sampling, continues=False)
    trees = [loop.new_tree(e) for e in examples]
    loop.expand([Start(t, 0, n) for t in trees], seed, any_rank=any_rank)
    loop.release()
    for t in trees:
        t.compute_values()
    return trees
