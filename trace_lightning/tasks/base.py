"""The seam between TRACE and an agent's task.

TRACE's allocation, predictor, tree advantages and update know nothing about what the agent
does: they see rollout trees of token ids and rewards. What a task decides lives behind two
small interfaces, and nothing else in the framework reads a task's specifics:

- ``Task``: one agent's environment. It turns an ``Example`` into prompt token ids, names the
  stop strings that end a turn, parses a generated turn into a tool call, a final answer or
  an invalid turn (``Turn``), executes a turn's tool calls in one batch (observations as
  token ids) and scores a finished trajectory against its example: a scalar reward and the
  task's declared metrics, which the tree stores and validation reports per dataset
  (``val/<set>/<metric>``).
- Tool state: a task whose tools keep state between turns (a SQL session's temporary tables,
  an interpreter's variables) opens one ``ToolState`` per trajectory (``Task.start``) and
  its calls run against it. TRACE continues trajectories from turn-level prefixes, so a
  continuation must start from the state its prefix left; the task says how
  (``Task.continuation``): ``"fork"`` copies the state saved after the prefix's last turn,
  ``"replay"`` re-runs the prefix's tool calls on a fresh state (deterministic tools; the
  loop checks each replayed observation against the one the prefix holds). A stateless task
  (search, a calculator) returns None from ``start`` and says ``"none"``.
- ``TaskData``: where a task's examples and resources come from. Its constructor checks its
  settings (before any work); it prepares what it needs on disk once per node (a generated
  world, a warm-started policy, an index), loads the training and validation examples, and
  builds the ``Task`` each set is rolled out with (a validation set may search its own
  corpus).

The agent loop (``AgentLoop``) runs any ``Task``; ``TraceDataModule`` takes any ``TaskData``
(``--data.task``). ``docs/extending.md`` walks through adding one.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

# A turn's kind besides its task's tool names: the episode ends on either.
ANSWER, INVALID = "answer", "invalid"


# How a continuation gets the tool state its prefix left (see the module docstring).
Continuation = Literal["none", "fork", "replay"]


@dataclass
class Example:
    """One prompt of a task: its text, every accepted answer (``answers[0]`` the gold one),
    the dataset it belongs to (a validation set's name in metric keys) and the per-example
    data its task defines (``extras``: search QA's ``supporting_titles``, a SQL question's
    database and gold query), which only that task reads."""

    id: str
    question: str
    answers: list[str]
    dataset: str = ""
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class Turn:
    """One generated turn, parsed. ``kind`` is a tool's name (a call whose input is
    ``argument``), ``"answer"`` (a final answer, ``argument``) or ``"invalid"`` (``error``
    says why); the episode ends on the last two."""

    kind: str
    argument: str = ""
    error: str = ""

    @property
    def calls_tool(self) -> bool:
        return self.kind not in (ANSWER, INVALID)


@runtime_checkable
class ToolState(Protocol):
    """One trajectory's tool state, opened by ``Task.start`` and passed back to
    ``Task.execute`` with each of its calls."""

    def fork(self) -> ToolState:
        """An independent copy: what this state holds now, evolving apart from it."""

    def close(self) -> None:
        """Release what the state holds (connections, temporary files); called once, when
        its trajectory has ended or the step no longer needs it."""


@runtime_checkable
class Task(Protocol):
    """One agent's environment (see the module docstring).

    Attributes:
        tokenizer: the policy's tokenizer (token ids in, text out).
        stop: strings that end a turn (the engines stop on them).
        max_turns: turns before an episode is cut (a tool call on the last turn ends it).
        max_seq_tokens: a trajectory's tokens before it is cut.
        calls_metric: the name under which validation counts a trajectory's tool calls
            (``searches`` for search QA).
        metrics: the names of the metrics ``score`` returns (search QA: ``("em", "f1")``);
            validation reports each per dataset and averages them over the sets.
        continuation: how a continuation gets its prefix's tool state: ``"none"``
            (stateless tools), ``"fork"`` or ``"replay"`` (see the module docstring).

    A task may also describe a prompt to the success predictor before any rollout:
    ``prompt_features(example) -> list[float]``, a fixed number of numbers per prompt that
    the policy's own features cannot hold (search QA: how findable its supporting documents
    are). ``--model.featuriser.task_features`` reads them; a task without it gives none.
    """

    tokenizer: Any
    stop: Sequence[str]
    max_turns: int
    max_seq_tokens: int
    calls_metric: str
    metrics: Sequence[str]
    continuation: Continuation

    def prompt(self, example: Example) -> tuple[list[int], str]:
        """Token ids and text of the root prompt of ``example``."""

    def parse(self, text: str) -> Turn:
        """One generated turn (cut at its first stop string), parsed; never raises."""

    def start(self, example: Example) -> ToolState | None:
        """A new trajectory's tool state for ``example`` (None for stateless tools)."""

    def execute(self, calls: Sequence[Turn], states: Sequence[ToolState | None]
                ) -> list[tuple[list[int], str]]:
        """The observation of each tool call, as token ids and text, in one batch; call i
        runs against ``states[i]`` (its trajectory's). A call that fails (a bad expression,
        a query the tool refuses) gets an error observation, never an exception for the
        step."""

    def score(self, final: Turn, example: Example, state: ToolState | None = None
              ) -> tuple[float, dict[str, float]]:
        """The reward of a trajectory of ``example`` that ended on ``final`` (0 unless it
        answered) and its ``metrics`` (search QA: ``{"em", "f1"}``). ``state`` is the
        trajectory's tool state as it ended (a SQL answer is a query run in its session)."""


class StatelessTools:
    """What a task whose tools keep no state between turns says about tool state: a mixin
    for ``Task`` classes (search, a calculator)."""

    continuation: Continuation = "none"

    def start(self, example: Example) -> None:
        return None


class TaskData(abc.ABC):
    """Where a task's examples and resources come from (see the module docstring): a task
    package subclasses it, and ``--data.task`` names the subclass (``class_path``) and its
    constructor's typed arguments (``init_args``), which the constructor checks: a setting
    it cannot use is one clear error before any work.

    Attributes (set by the subclass):
        train_examples: the training prompts (loaded by ``setup`` when fitting).
        val_examples: validation set name -> its prompts (``dataset`` set to the name).
        metric: the validation metric summaries and the progress bar show (``em``), one of
            its ``Task``'s ``metrics``.
        max_seq_tokens: a trajectory's tokens before it is cut (the engine's context and
            the micro-batches must hold one).
    """

    train_examples: list[Example]
    val_examples: dict[str, list[Example]]
    metric: str
    max_seq_tokens: int

    @abc.abstractmethod
    def prepare(self, policy_path: str, fitting: bool) -> None:
        """Once per node, before ``setup``: the files it names checked, then what the task
        builds or downloads (a generated world and its warm-started policy, which must then
        be ``policy_path``; an index)."""

    @abc.abstractmethod
    def setup(self, fitting: bool, train_limit: int | None, processes: int,
              prompts_needed: int) -> None:
        """On every process: read the examples (the training ones when ``fitting``, at least
        ``prompts_needed``; each validation set at least ``processes``) and open the
        resources (indexes, servers), failing before the engine starts."""

    @abc.abstractmethod
    def environment(self, tokenizer, val_set: str | None = None) -> Task:
        """The ``Task`` the training prompts (``val_set`` None) or a validation set roll out
        with."""


def through_first_stop(text: str, stops: Sequence[str]) -> str:
    """``text`` up to the end of its first stop string (all of it when there is none).

    Engines stop on the token that completes a stop string and keep that whole token, so a
    byte-level BPE turn can end ``</answer>.`` (``>.`` one token); the turn is what came
    before, and the rest of that token is not text after the action."""
    ends = [i + len(s) for s in stops if (i := text.find(s)) >= 0]
    return text[: min(ends)] if ends else text


def check_stop_strings(tokenizer, stop: Sequence[str]) -> None:
    """A ValueError when the tokenizer makes a stop string a special token: the engines
    decode without special tokens, so they would never see it and a turn would run on
    past its action."""
    for s in stop:
        ids = tokenizer.encode(s, add_special_tokens=False)
        if s not in tokenizer.decode(ids, skip_special_tokens=True):
            raise ValueError(
                f"the policy's tokenizer makes {s!r} a special token, so the engines "
                f"(which decode with skip_special_tokens) would never see the stop string "
                f"and a turn would run on past its action; add the agent tags as normal "
                f"tokens (tokenizer.add_tokens(tags, special_tokens=False)) or leave them "
                f"out of the vocabulary")


def render_prompt(tokenizer, instruction: str, question: str,
                  use_chat_template: bool) -> tuple[list[int], str]:
    """Token ids and text of a root prompt: ``instruction`` with ``{question}`` filled in (not
    ``str.format``: an instruction may hold other braces), in the tokenizer's chat template
    when asked and it has one."""
    text = instruction.replace("{question}", question.strip())
    if use_chat_template and tokenizer.chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False), text
