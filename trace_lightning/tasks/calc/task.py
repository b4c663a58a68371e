"""The calculator agent's format and its ``Task``.

The policy writes one action per turn, optionally after untagged reasoning:
``<calc> EXPRESSION</calc>`` runs the calculator (``evaluator.evaluate``) and the task
appends ``\\n<result> VALUE</result>\\n``, or ``\\n<result> error: REASON</result>\\n`` for an
expression the calculator refuses (an error observation, never an exception);
``<answer> N</answer>`` ends the episode. A turn ends at a stop string (``</calc>``,
``</answer>``), EOS or the token limit.

The result is written after a space, as the gold turns write numbers (``<calc> 19 - 5``) and
the questions do (``has 19``): a byte-level BPE tokenizer then gives a number the same
tokens in the question, in a result and in the next expression, so a policy copies it
token for token.

The reward is 1 when the answer is a number (``14``, ``14.0``, ``+14``) equal to the gold
integer, else 0; a missing, malformed or non-numeric answer earns 0.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction

from trace_lightning.tasks.base import (
    ANSWER,
    INVALID,
    Example,
    StatelessTools,
    Turn,
    check_stop_strings,
    render_prompt,
    through_first_stop,
)
from trace_lightning.tasks.calc.evaluator import CalcError, evaluate, format_number

CALC = "calc"  # the tool's name: a Turn's kind for a calculator call
CALC_INSTRUCTION = ("Work it out with <calc> expression </calc>, one step at a time, then "
                    "give <answer> number </answer>.\nQuestion: {question}\n")
CALC_TAGS = ["<calc>", "</calc>", "<result>", "</result>", "<answer>", "</answer>"]
STOP_STRINGS = ["</calc>", "</answer>"]
_TAG_RE = re.compile(r"</?(calc|answer|result)>")
_NUMBER_RE = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)")


def parse_turn(text: str) -> Turn:
    """Parse one generated turn (already cut at its first stop string); never raises.

    Valid: untagged reasoning, then exactly one ``<calc>expr</calc>`` or
    ``<answer>a</answer>``, then nothing but whitespace. Everything else is ``invalid``
    with the reason: no action, two actions, text after the action, an unclosed, nested or
    unopened tag, a ``<result>`` written by the policy, an empty expression. An empty
    answer is a (wrong) answer, not a malformed turn.
    """
    open_tag: str | None = None
    start = end = 0
    actions: list[tuple[str, str]] = []
    for m in _TAG_RE.finditer(text):
        tag, closing = m.group(1), m.group(0).startswith("</")
        if open_tag is None:
            if closing:
                return Turn(INVALID, error=f"</{tag}> without an opening tag")
            if tag == "result":
                return Turn(INVALID, error="the policy wrote a <result> block")
            if actions:
                return Turn(INVALID, error=f"<{tag}> after the action (two actions)")
            open_tag, start = tag, m.end()
        else:
            if not closing or tag != open_tag:
                return Turn(INVALID, error=f"{m.group(0)} inside <{open_tag}> (nested or "
                                           f"unclosed tags)")
            actions.append((tag, text[start:m.start()]))
            open_tag = None
        end = m.end()
    if open_tag is not None:
        return Turn(INVALID, error=f"<{open_tag}> is never closed")
    if not actions:
        return Turn(INVALID, error="no <calc> or <answer>")
    if text[end:].strip():
        return Turn(INVALID, error="text after the action")
    kind, argument = actions[0]
    argument = " ".join(argument.split())
    if kind == CALC and not argument:
        return Turn(INVALID, error="empty <calc> expression")
    return Turn(CALC if kind == CALC else ANSWER, argument)


def answer_value(answer: str) -> Fraction | None:
    """The number an answer states (``14``, ``-3``, ``14.0``, ``+14``), or None when it is
    not a plain number (``14 apples``, ``1e3``, ``fourteen``)."""
    text = answer.strip()
    return Fraction(text) if _NUMBER_RE.fullmatch(text) else None


def check_settings(max_turns: int, max_seq_tokens: int, instruction: str) -> None:
    """ValueError naming the ``--data.task.init_args`` flag of a setting ``CalcTask``
    cannot use."""
    if "{question}" not in instruction:
        raise ValueError(f"--data.task.init_args.instruction must contain '{{question}}' (where "
                         f"the problem goes); got {instruction[:80]!r}")
    for flag, value in (("max_turns", max_turns), ("max_seq_tokens", max_seq_tokens)):
        if value < 1:
            raise ValueError(f"--data.task.init_args.{flag} ({value}) must be >= 1")


class CalcTask(StatelessTools):
    """Prompt, turn parsing, calculator calls and reward of the arithmetic agent: a ``Task``
    whose tool is ``calc`` and whose metric is ``correct``.

    Args:
        tokenizer: the policy's tokenizer (a transformers tokenizer).
        max_turns: turns before an episode is cut (a problem of k operations needs k + 1).
        max_seq_tokens: a trajectory's tokens before it is cut.
        instruction: the prompt, with ``{question}``.
        use_chat_template: wrap the prompt in the tokenizer's chat template when it has one.
    """

    stop = STOP_STRINGS
    calls_metric = "calcs"  # validation's count of the calculator calls a trajectory made
    metrics = ("correct",)

    def __init__(self, tokenizer, max_turns: int = 6, max_seq_tokens: int = 512,
                 instruction: str = CALC_INSTRUCTION, use_chat_template: bool = False):
        check_settings(max_turns, max_seq_tokens, instruction)
        self.tokenizer = tokenizer
        self.max_turns, self.max_seq_tokens = max_turns, max_seq_tokens
        self.instruction, self.use_chat_template = instruction, use_chat_template
        check_stop_strings(tokenizer, self.stop)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt(self, example: Example) -> tuple[list[int], str]:
        """Token ids and text of the root prompt of ``example``."""
        return render_prompt(self.tokenizer, self.instruction, example.question,
                             self.use_chat_template)

    def parse(self, text: str) -> Turn:
        """One generated turn, cut at its first stop string, parsed (``parse_turn``)."""
        return parse_turn(through_first_stop(text, self.stop))

    def execute(self, calls: Sequence[Turn], states: Sequence[None] = ()
                ) -> list[tuple[list[int], str]]:
        """The calculator's observation of each call: its result, or the reason it refused
        the expression (the calculator keeps no state: ``states`` is unused)."""
        out = []
        for call in calls:
            assert call.kind == CALC, f"CalcTask.execute got a {call.kind!r} turn"
            try:
                body = format_number(evaluate(call.argument))
            except CalcError as e:
                body = f"error: {e.reason}"
            text = f"\n<result> {body}</result>\n"
            out.append((self._encode(text), text))
        return out

    def score(self, final: Turn, example: Example, state: None = None
              ) -> tuple[float, dict[str, float]]:
        """(reward, {"correct"}) of a trajectory of ``example`` that ended on ``final``: 1 when
        it answered a number equal to a gold answer, else 0."""
        value = answer_value(final.argument) if final.kind == ANSWER else None
        golds = [g for g in (answer_value(a) for a in example.answers) if g is not None]
        correct = float(value is not None and value in golds)
        return correct, {"correct": correct}
