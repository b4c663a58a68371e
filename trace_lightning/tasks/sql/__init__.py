"""The SQL agent: generated SQLite databases, questions with gold queries, a sandboxed
read-only SQL session per trajectory (its temporary views are the state a continuation
inherits, by fork or replay), the ``<sql>``/``<answer>`` format, execution-match reward and
a warm-started tiny policy (``SqlData``, ``SqlTask``)."""

from trace_lightning.tasks.sql.data import SqlData
from trace_lightning.tasks.sql.questions import KINDS, Question, generate_questions
from trace_lightning.tasks.sql.sandbox import Limits, SqlError, SqlSession
from trace_lightning.tasks.sql.task import SQL_INSTRUCTION, SqlTask, parse_turn, same_result
from trace_lightning.tasks.sql.world import FAMILIES, build_database

__all__ = ["FAMILIES", "KINDS", "Limits", "Question", "SQL_INSTRUCTION", "SqlData",
           "SqlError", "SqlSession", "SqlTask", "build_database", "generate_questions",
           "parse_turn", "same_result"]
