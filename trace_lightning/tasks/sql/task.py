"""The SQL agent's format and its ``Task``.

The policy writes one action per turn: ``<sql> QUERY</sql>`` runs one statement in its
session (``sandbox.SqlSession``) and the task appends ``\\n<result> TABLE</result>\\n``: the
column names, the first rows (each value after a space, `` | `` between values) and the
count, ``(12 rows, first 5 shown)``; ``ok`` for a statement without rows (``CREATE TEMP
VIEW``), ``error: REASON`` for one the session refuses or SQLite fails (an observation,
never an exception). ``<answer> SELECT ...</answer>`` ends the episode: the query runs in
the same session, so it may read the session's temporary views, and may not change it.

The reward is execution match: 1 when the answer's result equals the gold query's, else 0.
Rows are compared as a multiset unless the gold query's order counts (``ordered``: it has
ORDER BY), then as a list; the column count must match, their names need not; numbers are
equal within a relative and absolute tolerance of 1e-6 (an integer 3 equals a float 3.0),
text exactly, NULL only NULL. A missing, malformed, failing or non-query answer earns 0.
The metrics are ``exec_match`` (the reward) and ``valid_sql`` (the answer ran without
error).

Each trajectory has its own session (``start``); a continuation gets its prefix's session by
``fork`` (a copy of its temporary tables and views) or by ``replay`` (a new session that
re-runs the prefix's queries; SQLite on a read-only file answers them the same way), as the
task is configured (``continuation``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from trace_lightning.tasks.base import (
    ANSWER,
    INVALID,
    Example,
    Turn,
    check_stop_strings,
    render_prompt,
    through_first_stop,
)
from trace_lightning.tasks.sql.sandbox import Limits, SqlError, SqlSession

SQL = "sql"  # the tool's name: a Turn's kind for a query
SQL_INSTRUCTION = ("Answer with SQL. Run a query with <sql> query</sql>, keep a step as a "
                   "TEMP VIEW if needed, then give <answer> SELECT ...</answer>.\n"
                   "Tables: {schema}\nQuestion: {question}\n")
SQL_TAGS = ["<sql>", "</sql>", "<result>", "</result>", "<answer>", "</answer>"]
STOP_STRINGS = ["</sql>", "</answer>"]
_TAG_RE = re.compile(r"</?(sql|answer|result)>")
_TOLERANCE = 1e-6


def parse_turn(text: str) -> Turn:
    """Parse one generated turn (already cut at its first stop string); never raises.

    Valid: untagged text, then exactly one ``<sql>query</sql>`` or ``<answer>query</answer>``,
    then nothing but whitespace. Everything else is ``invalid`` with the reason: no action,
    two actions, text after the action, an unclosed, nested or unopened tag, a ``<result>``
    written by the policy, an empty query. An empty answer is a (wrong) answer.
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
        return Turn(INVALID, error="no <sql> or <answer>")
    if text[end:].strip():
        return Turn(INVALID, error="text after the action")
    kind, argument = actions[0]
    argument = argument.strip()  # inside a query, whitespace may be part of a string
    if kind == SQL and not argument:
        return Turn(INVALID, error="empty <sql> query")
    return Turn(SQL if kind == SQL else ANSWER, argument)


# ---- execution match ----------------------------------------------------------------------
def _cell_key(value) -> tuple:
    """A value's sort key: NULL, then numbers, text, blobs (numbers rounded for sorting
    only; equality is ``_same_cell``'s)."""
    if value is None:
        return (0, 0.0, "")
    if isinstance(value, (int, float)):
        return (1, round(float(value), 6) if math.isfinite(value) else float(value), "")
    if isinstance(value, bytes):
        return (3, 0.0, value.hex())
    return (2, 0.0, str(value))


def _same_cell(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or math.isclose(a, b, rel_tol=_TOLERANCE, abs_tol=_TOLERANCE)
    return type(a) is type(b) and a == b


def same_result(gold: Sequence[tuple], answer: Sequence[tuple], ordered: bool) -> bool:
    """Whether ``answer``'s rows equal ``gold``'s: as lists when ``ordered``, else as
    multisets (both sorted by the same key first); values by ``_same_cell``; the rows must
    have as many columns."""
    if len(gold) != len(answer):
        return False
    if not ordered:
        gold = sorted(gold, key=lambda r: tuple(map(_cell_key, r)))
        answer = sorted(answer, key=lambda r: tuple(map(_cell_key, r)))
    return all(len(g) == len(a) and all(map(_same_cell, g, a)) for g, a in zip(gold, answer))


def check_settings(max_turns: int, max_seq_tokens: int, instruction: str,
                   continuation: str) -> None:
    """ValueError naming the ``--data.task.init_args`` flag of a setting ``SqlTask`` cannot
    use."""
    if "{question}" not in instruction:
        raise ValueError(f"--data.task.init_args.instruction must contain '{{question}}' (where "
                         f"the question goes); got {instruction[:80]!r}")
    for flag, value in (("max_turns", max_turns), ("max_seq_tokens", max_seq_tokens)):
        if value < 1:
            raise ValueError(f"--data.task.init_args.{flag} ({value}) must be >= 1")
    if continuation not in ("fork", "replay"):
        raise ValueError(f"--data.task.init_args.continuation ({continuation!r}) must be 'fork' "
                         f"(copy the prefix's session) or 'replay' (re-run its queries on a new "
                         f"session): a SQL session holds state")


class SqlTask:
    """Prompt, turn parsing, queries and reward of the SQL agent: a ``Task`` whose tool is
    ``sql``, whose state is one ``SqlSession`` per trajectory and whose metrics are
    ``exec_match`` and ``valid_sql``.

    An example's ``extras`` carry what the task reads: ``db`` (the database file),
    ``schema`` (the tables as the prompt shows them) and ``ordered`` (whether the gold
    result's row order counts); ``answers[0]`` is the gold query.

    Args:
        tokenizer: the policy's tokenizer (a transformers tokenizer).
        max_turns: turns before an episode is cut.
        max_seq_tokens: a trajectory's tokens before it is cut.
        instruction: the prompt, with ``{question}`` and optionally ``{schema}``.
        use_chat_template: wrap the prompt in the tokenizer's chat template when it has one.
        continuation: how a continuation gets its prefix's session: ``fork`` or ``replay``.
        limits: the bounds of every session (``sandbox.Limits``).
    """

    stop = STOP_STRINGS
    calls_metric = "queries"  # validation's count of the queries a trajectory ran
    metrics = ("exec_match", "valid_sql")

    def __init__(self, tokenizer, max_turns: int = 4, max_seq_tokens: int = 512,
                 instruction: str = SQL_INSTRUCTION, use_chat_template: bool = False,
                 continuation: Literal["fork", "replay"] = "fork", limits: Limits = Limits()):
        check_settings(max_turns, max_seq_tokens, instruction, continuation)
        self.tokenizer = tokenizer
        self.max_turns, self.max_seq_tokens = max_turns, max_seq_tokens
        self.instruction, self.use_chat_template = instruction, use_chat_template
        self.continuation, self.limits = continuation, limits
        self._gold: dict[tuple[str, str], list[tuple]] = {}  # (db, query) -> its rows
        check_stop_strings(tokenizer, self.stop)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt(self, example: Example) -> tuple[list[int], str]:
        """Token ids and text of the root prompt of ``example`` (its schema filled in)."""
        instruction = self.instruction.replace("{schema}", example.extras.get("schema", ""))
        return render_prompt(self.tokenizer, instruction, example.question,
                             self.use_chat_template)

    def parse(self, text: str) -> Turn:
        """One generated turn, cut at its first stop string, parsed (``parse_turn``)."""
        return parse_turn(through_first_stop(text, self.stop))

    def start(self, example: Example) -> SqlSession:
        """A new session on ``example``'s database (read-only, empty temp schema)."""
        return SqlSession(example.extras["db"], self.limits)

    def execute(self, calls: Sequence[Turn], states: Sequence[SqlSession | None]
                ) -> list[tuple[list[int], str]]:
        """Each query's observation, run in its trajectory's session (``states[i]``)."""
        out = []
        for call, state in zip(calls, states, strict=True):
            assert call.kind == SQL, f"SqlTask.execute got a {call.kind!r} turn"
            assert isinstance(state, SqlSession), "SqlTask.execute needs each call's session"
            text = f"\n<result> {state.run(call.argument)}</result>\n"
            out.append((self._encode(text), text))
        return out

    def gold_rows(self, example: Example) -> list[tuple]:
        """The gold query's rows on ``example``'s database (cached per database and query)."""
        key = (str(example.extras["db"]), example.answers[0])
        if key not in self._gold:
            session = SqlSession(key[0], self.limits)
            try:
                self._gold[key] = session.query(key[1], read_only=True)[1]
            finally:
                session.close()
        return self._gold[key]

    def score(self, final: Turn, example: Example, state: SqlSession | None = None
              ) -> tuple[float, dict[str, float]]:
        """(reward, {"exec_match", "valid_sql"}) of a trajectory that ended on ``final``:
        its answer run in ``state`` (its session; a new one when None, where the answer
        cannot read temp views) and compared with the gold query's result."""
        if final.kind != ANSWER or not final.argument.strip():
            return 0.0, {"exec_match": 0.0, "valid_sql": 0.0}
        session = state if state is not None else self.start(example)
        try:
            _, rows, more = session.query(final.argument, read_only=True)
        except SqlError:
            return 0.0, {"exec_match": 0.0, "valid_sql": 0.0}
        finally:
            if state is None:
                session.close()
        match = float(not more and same_result(self.gold_rows(example), rows,
                                               bool(example.extras.get("ordered"))))
        return match, {"exec_match": match, "valid_sql": 1.0}


def example_extras(db: str | Path, schema: str, ordered: bool) -> dict:
    """The ``extras`` an ``Example`` of the SQL task carries."""
    return {"db": str(db), "schema": schema, "ordered": ordered}
