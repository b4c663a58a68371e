"""One agent's SQL session on a read-only SQLite database: the SQL task's ``ToolState``.

A session is a ``sqlite3`` connection to the database file opened read-only
(``file:...?mode=ro``); what the agent keeps between turns (``CREATE TEMP VIEW``,
``CREATE TEMP TABLE``, writes to its temporary tables) lives in the connection's ``temp``
schema, in memory, and nowhere else. Every statement passes four guards before and while it
runs, so hostile SQL is an error observation, never harm and never an exception:

- the file is opened read-only: SQLite itself refuses any write to it;
- an authorizer (``set_authorizer``) allows only reads, the functions in ``FUNCTIONS``,
  recursive CTEs, creating and dropping TEMP tables, views and their indexes, and writes to
  the ``temp`` schema; it denies ``PRAGMA``, ``ATTACH``/``DETACH`` (``VACUUM INTO`` is an
  attach), transactions, triggers, virtual tables and any write to the database, each with
  its reason in the observation;
- a progress handler counts the virtual machine's steps and interrupts a statement after
  ``max_steps`` (an endless recursive CTE, a cartesian product); it counts steps, not
  seconds, so a replayed statement stops where it stopped the first time. A wall-clock
  backstop (``max_seconds``) catches steps that are slow; no handler can stop a single
  step, hence no function whose one call can run long (``printf`` with a huge width);
- limits (``setlimit``): no attached database, strings and blobs of at most ``max_length``
  bytes, SQL text of at most ``max_sql_chars``, bounded expression depth and columns; the
  temporary space holds at most ``temp_pages`` pages of 1 KiB; at most ``max_fetch`` rows
  of a result are read (the count says "more than"), and the observation shows the first
  ``show_rows``. Memory is bounded by these together: a statement's sorter holds at most
  the rows its ``max_steps`` can make, each at most ``max_length`` bytes a value.

Extension loading stays off (``enable_load_extension(False)`` where the build has it; the
authorizer denies ``load_extension()`` anyway) and one call runs one statement (``sqlite3``
refuses two).

``fork`` copies the session: a new connection to the same file whose temp schema holds the
same tables (definitions and rows), views and indexes, made again in their original order.
Each definition is read from ``sqlite_temp_master`` (which stores ``CREATE TABLE``/``CREATE
VIEW`` without ``TEMP``, so the copy puts it back); rows are copied with their storage
classes. (CPython 3.11's ``Connection.deserialize(name="temp")`` does not work, hence the
copy.) ``dump`` lists the temp objects and their rows, to compare two sessions.
"""

from __future__ import annotations

import math
import re
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# Functions a query may call (the authorizer's allowlist): aggregates, window functions and
# deterministic scalars. Not ``random``/``randomblob`` (a replayed call would differ), nor
# ``printf``/``format`` (``printf('%.*c', 2000000000, 'x')`` runs for seconds in one step,
# past the progress handler), ``zeroblob``, ``load_extension``, nor anything that reads the
# connection's or the system's state.
FUNCTIONS = frozenset("""
    count sum total avg min max group_concat string_agg
    row_number rank dense_rank percent_rank cume_dist ntile lag lead first_value last_value
    nth_value
    abs round length lower upper substr substring trim ltrim rtrim replace instr coalesce
    ifnull nullif iif typeof like glob quote hex unicode char sign ceil
    ceiling floor trunc exp ln log log10 log2 pow power sqrt mod pi
    date time datetime julianday strftime unixepoch
""".split())

# Statements a call may start with; anything else (PRAGMA, ATTACH, VACUUM, BEGIN, ...) is
# refused by name before SQLite sees it (the authorizer would refuse it too).
_ALLOWED_FIRST = frozenset({"SELECT", "WITH", "VALUES", "CREATE", "DROP", "INSERT", "UPDATE",
                            "DELETE", "REPLACE"})
_COMMENTS = re.compile(r"(\s+|--[^\n]*(\n|$)|/\*.*?(\*/|$))", re.S)
_FIRST_WORD = re.compile(r"[A-Za-z_]+")

# Authorizer actions that only touch the temp schema's own objects (an index is made for a
# UNIQUE or PRIMARY KEY column, and REINDEXed when made).
_TEMP_DDL = {sqlite3.SQLITE_CREATE_TEMP_TABLE, sqlite3.SQLITE_CREATE_TEMP_VIEW,
             sqlite3.SQLITE_DROP_TEMP_TABLE, sqlite3.SQLITE_DROP_TEMP_VIEW,
             sqlite3.SQLITE_CREATE_TEMP_INDEX, sqlite3.SQLITE_DROP_TEMP_INDEX}
# The same in the temp schema named as such (``CREATE TABLE temp.t``, ``DROP VIEW temp.v``).
_TEMP_BY_NAME = {sqlite3.SQLITE_CREATE_TABLE, sqlite3.SQLITE_CREATE_VIEW,
                 sqlite3.SQLITE_DROP_TABLE, sqlite3.SQLITE_DROP_VIEW,
                 sqlite3.SQLITE_CREATE_INDEX, sqlite3.SQLITE_DROP_INDEX, sqlite3.SQLITE_REINDEX}
_WRITES = {sqlite3.SQLITE_INSERT, sqlite3.SQLITE_UPDATE, sqlite3.SQLITE_DELETE}
_REFUSED = {
    sqlite3.SQLITE_PRAGMA: "PRAGMA is not allowed",
    sqlite3.SQLITE_ATTACH: "ATTACH is not allowed (nor VACUUM INTO)",
    sqlite3.SQLITE_DETACH: "DETACH is not allowed",
    sqlite3.SQLITE_TRANSACTION: "transactions are not allowed (each statement stands alone)",
    sqlite3.SQLITE_SAVEPOINT: "savepoints are not allowed",
    sqlite3.SQLITE_CREATE_TEMP_TRIGGER: "triggers are not allowed",
    sqlite3.SQLITE_CREATE_VTABLE: "virtual tables are not allowed",
    sqlite3.SQLITE_ALTER_TABLE: "ALTER TABLE is not allowed",
    sqlite3.SQLITE_ANALYZE: "ANALYZE is not allowed",
    sqlite3.SQLITE_REINDEX: "REINDEX is not allowed",
}
_READ_ONLY = ("the database is read-only: keep results in TEMP tables or views "
              "(CREATE TEMP VIEW name AS SELECT ...)")


class SqlError(Exception):
    """A statement the session refused or SQLite failed: ``reason`` is the observation's."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Limits:
    """The bounds on one session (see the module docstring).

    Args:
        max_steps: virtual-machine steps of one statement before it is interrupted.
        max_seconds: wall seconds of one statement before it is interrupted (a backstop).
        max_fetch: rows of a result read at most.
        show_rows: rows an observation shows.
        max_cell_chars: characters of a value an observation shows.
        max_length: bytes of a string or blob.
        max_sql_chars: characters of one statement.
        temp_pages: 1 KiB pages of the session's temporary tables.
    """

    max_steps: int = 500_000
    max_seconds: float = 5.0
    max_fetch: int = 1000
    show_rows: int = 5
    max_cell_chars: int = 40
    max_length: int = 1000
    max_sql_chars: int = 4000
    temp_pages: int = 512


_PROGRESS_EVERY = 1000  # VM steps between progress-handler calls


class SqlSession:
    """One trajectory's SQL session on the database at ``path`` (read-only); a
    ``ToolState``.

    Args:
        path: the SQLite database file.
        limits: the session's bounds.
    """

    def __init__(self, path: str | Path, limits: Limits = Limits()):
        self.path, self.limits = Path(path), limits
        if not self.path.is_file():
            raise FileNotFoundError(f"SQL database {self.path} does not exist")
        self.con = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True,
                                   isolation_level=None, check_same_thread=False)
        # set up by our code, before the guards go on
        self.con.execute("PRAGMA temp_store = MEMORY")
        self.con.execute("PRAGMA temp.page_size = 1024")
        self.con.execute(f"PRAGMA temp.max_page_count = {int(limits.temp_pages)}")
        # A CPython built without --enable-loadable-sqlite-extensions (this venv's) has no
        # enable_load_extension and cannot load any; where it has one, it stays off.
        disable = getattr(self.con, "enable_load_extension", None)
        if disable is not None:
            disable(False)
        for limit, value in ((sqlite3.SQLITE_LIMIT_ATTACHED, 0),
                             (sqlite3.SQLITE_LIMIT_LENGTH, limits.max_length),
                             (sqlite3.SQLITE_LIMIT_SQL_LENGTH, limits.max_sql_chars),
                             (sqlite3.SQLITE_LIMIT_COLUMN, 100),
                             (sqlite3.SQLITE_LIMIT_EXPR_DEPTH, 100),
                             (sqlite3.SQLITE_LIMIT_COMPOUND_SELECT, 20),
                             (sqlite3.SQLITE_LIMIT_FUNCTION_ARG, 16),
                             (sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH, 200),
                             (sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 100),  # fork's inserts
                             (sqlite3.SQLITE_LIMIT_TRIGGER_DEPTH, 1)):
            self.con.setlimit(limit, value)
        self._denied: str | None = None  # the authorizer's reason for the current statement
        self._read_only = False  # answers may not change the session
        self._calls = 0  # progress-handler calls of the current statement
        self._deadline = math.inf
        self.con.set_authorizer(self._authorize)
        self.con.set_progress_handler(self._progress, _PROGRESS_EVERY)

    # ---- the guards ---------------------------------------------------------------------
    def _authorize(self, action: int, arg1, arg2, db_name, _trigger) -> int:
        ok = sqlite3.SQLITE_OK
        if action in (sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE):
            return ok
        if action == sqlite3.SQLITE_FUNCTION:
            if (arg2 or "").lower() in FUNCTIONS:
                return ok
            return self._deny(f"the function {arg2}() is not allowed")
        if self._read_only and (action in _TEMP_DDL or action in _WRITES
                                or action in _TEMP_BY_NAME):
            return self._deny("the answer must be a query (SELECT), not a statement that "
                              "changes the session")
        if action in _TEMP_DDL:
            return ok
        if db_name == "temp" and action in _TEMP_BY_NAME:
            return ok  # CREATE TABLE temp.t, a new temp index filled, AUTOINCREMENT's counter
        if action in _WRITES:
            if db_name == "temp":
                return ok
            if action == sqlite3.SQLITE_UPDATE and arg1 == "sqlite_master":  # pragma_*()
                return self._deny("table-valued functions are not allowed")
            return self._deny(_READ_ONLY)
        if action in _REFUSED:
            return self._deny(_REFUSED[action])
        return self._deny(_READ_ONLY)  # CREATE/DROP of tables, views, indexes in the file

    def _deny(self, reason: str) -> int:
        self._denied = self._denied or reason
        return sqlite3.SQLITE_DENY

    def _progress(self) -> int:
        self._calls += 1
        return int(self._calls * _PROGRESS_EVERY > self.limits.max_steps
                   or time.monotonic() > self._deadline)

    # ---- running statements -------------------------------------------------------------
    def query(self, sql: str, read_only: bool = False) -> tuple[list[str] | None, list[tuple],
                                                               bool]:
        """Run one statement: ``(columns, rows, more)`` (``columns`` None for a statement
        that returns no rows; ``rows`` at most ``max_fetch``, ``more`` when there were
        more). ``read_only`` refuses statements that would change the session (answers).
        Raises ``SqlError`` with the reason for anything refused or failed."""
        first = _FIRST_WORD.match(_COMMENTS.sub(" ", sql).strip())
        if first is None:
            raise SqlError("no SQL statement")
        if first.group(0).upper() not in _ALLOWED_FIRST:
            raise SqlError(f"{first.group(0).upper()} statements are not allowed: run one "
                           f"SELECT, or CREATE TEMP TABLE/VIEW")
        self._denied, self._read_only, self._calls = None, read_only, 0
        started = time.monotonic()
        self._deadline = started + self.limits.max_seconds
        cursor = None
        try:
            cursor = self.con.execute(sql)
            columns = ([d[0] for d in cursor.description]
                       if cursor.description is not None else None)
            rows = cursor.fetchmany(self.limits.max_fetch + 1)
        except (sqlite3.Error, ValueError, OverflowError, MemoryError) as e:
            raise SqlError(self._reason(e, time.monotonic() - started)) from None
        finally:
            if cursor is not None:
                cursor.close()
            self._deadline = math.inf
        more = len(rows) > self.limits.max_fetch
        return columns, rows[: self.limits.max_fetch], more

    def _reason(self, e: Exception, seconds: float) -> str:
        message = str(e)
        if self._denied:
            return self._denied
        if message == "interrupted":
            if seconds >= self.limits.max_seconds:
                return (f"the statement ran over {self.limits.max_seconds:g} s and was "
                        f"stopped; add a filter or a LIMIT")
            return (f"the statement ran over {self.limits.max_steps} steps and was stopped "
                    f"(an endless recursion or a huge join?); add a filter or a LIMIT")
        if "database or disk is full" in message:
            return (f"the session's temporary space is full ({self.limits.temp_pages} KiB); "
                    f"keep smaller TEMP tables")
        if "readonly" in message:
            return _READ_ONLY
        if "one statement at a time" in message:
            return "one statement per call"
        if isinstance(e, MemoryError):
            return "out of memory"
        return message

    def run(self, sql: str) -> str:
        """The observation's body for one statement: its result table (the first
        ``show_rows`` rows, the count stated), ``ok`` for a statement without rows, or
        ``error: REASON``."""
        try:
            columns, rows, more = self.query(sql)
        except SqlError as e:
            return f"error: {e.reason}"
        return format_result(columns, rows, more, self.limits)

    # ---- state --------------------------------------------------------------------------
    def _temp_objects(self) -> list[tuple[str, str, str]]:
        """(type, name, sql) of each temp table, view and index the agent made, in creation
        order (not SQLite's own: ``sqlite_sequence``, a constraint's automatic index)."""
        return self._internal("SELECT type, name, sql FROM sqlite_temp_master WHERE type IN "
                              "('table', 'view', 'index') AND sql IS NOT NULL AND name NOT "
                              "LIKE 'sqlite^_%' ESCAPE '^' ORDER BY rowid")

    @contextmanager
    def _unguarded(self) -> Iterator[None]:
        """Our own statements (reading and copying the temp schema), past the guards."""
        self.con.set_authorizer(None)
        self.con.set_progress_handler(None, 0)
        try:
            yield
        finally:
            self.con.set_authorizer(self._authorize)
            self.con.set_progress_handler(self._progress, _PROGRESS_EVERY)

    def _internal(self, sql: str, rows: list[tuple] | None = None) -> list[tuple]:
        with self._unguarded():
            if rows is not None:
                self.con.executemany(sql, rows)
                return []
            return self.con.execute(sql).fetchall()

    def _table_rows(self, name: str) -> tuple[list[str], list[tuple]]:
        """A temp table's stored columns (not generated ones) and its rows, in rowid order
        (key order for a table without rowid)."""
        info = self._internal(f"PRAGMA temp.table_xinfo({_quote(name)})")
        columns = [_quote(c[1]) for c in info if c[6] == 0]  # c[6]: hidden (2, 3 generated)
        select = f"SELECT {', '.join(columns)} FROM temp.{_quote(name)}"
        try:
            return columns, self._internal(select + " ORDER BY rowid")
        except sqlite3.OperationalError:  # WITHOUT ROWID: stored in key order
            return columns, self._internal(select)

    def dump(self) -> list[tuple[str, str, str, list[tuple]]]:
        """Each temp object as (type, name, definition, rows): a table's rows in rowid
        order, a view's result sorted (or its error, the query guarded as the agent's are).
        Two sessions hold the same state when their dumps are equal."""
        out = []
        for kind, name, sql in self._temp_objects():
            if kind == "table":
                rows = self._table_rows(name)[1]
            elif kind == "index":
                rows = []
            else:
                try:
                    rows = sorted(self.query(f"SELECT * FROM temp.{_quote(name)}", True)[1],
                                  key=repr)
                except SqlError as e:  # e.g. a view on a dropped table
                    rows = [("error", e.reason)]
            out.append((kind, name, sql, rows))
        if self._has_sequence():
            out.append(("sequence", "sqlite_sequence", "",
                        self._internal("SELECT name, seq FROM temp.sqlite_sequence "
                                       "ORDER BY name")))
        return out

    def _has_sequence(self) -> bool:
        """Whether an AUTOINCREMENT table made the temp counter table."""
        return bool(self._internal("SELECT 1 FROM sqlite_temp_master "
                                   "WHERE name = 'sqlite_sequence'"))

    def fork(self) -> SqlSession:
        """A new session on the same file holding a copy of this one's temp tables (rows
        included) and views, evolving apart from it. Objects are made again in their
        creation order (SQLite checks a view's tables only when it is read, so a view whose
        table was dropped is copied as it stands)."""
        copy = SqlSession(self.path, self.limits)
        for kind, name, sql in self._temp_objects():
            copy._internal(sql if kind == "index" else _as_temp(sql))  # an index is in its
            if kind == "table":                                          # table's schema
                columns, rows = self._table_rows(name)
                if rows:
                    copy._internal(f"INSERT INTO temp.{_quote(name)} ({', '.join(columns)}) "
                                   f"VALUES ({', '.join('?' * len(columns))})", rows)
        # AUTOINCREMENT counters, which the copied rows may not reproduce
        if self._has_sequence():
            sequence = self._internal("SELECT name, seq FROM temp.sqlite_sequence")
            copy._internal("DELETE FROM temp.sqlite_sequence")
            copy._internal("INSERT INTO temp.sqlite_sequence (name, seq) VALUES (?, ?)",
                           sequence)
        return copy

    def close(self) -> None:
        """Close the connection (the temp schema goes with it)."""
        self.con.close()


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


_CREATE = re.compile(r"^\s*CREATE\s+(TABLE|VIEW)\b", re.I)


def _as_temp(sql: str) -> str:
    """A ``sqlite_temp_master`` definition (``CREATE TABLE t ...``) as ``CREATE TEMP ...``."""
    out, n = _CREATE.subn(lambda m: f"CREATE TEMP {m.group(1)}", sql, count=1)
    assert n == 1, f"unexpected temp definition {sql!r}"
    return out


def format_value(value, max_chars: int) -> str:
    """One value as an observation shows it: NULL, a whole float without ``.0``, other
    floats to 6 significant digits, text on one line and cut at ``max_chars``."""
    if value is None:
        return "NULL"
    if isinstance(value, float):
        if math.isfinite(value) and value == int(value) and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.6g}"
    if isinstance(value, bytes):
        value = f"x'{value[:max_chars].hex()}'"
    text = " ".join(str(value).split())
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def format_result(columns: list[str] | None, rows: list[tuple], more: bool,
                  limits: Limits) -> str:
    """A result as an observation's body: the column names, then one line per shown row
    (each value after a space, `` | `` between them), then the count, e.g. ``(12 rows,
    first 5 shown)``; ``ok`` for a statement without rows."""
    if columns is None:
        return "ok"
    shown = rows[: limits.show_rows]
    lines = [" | ".join(format_value(c, limits.max_cell_chars) for c in columns)]
    lines += [" " + " | ".join(format_value(v, limits.max_cell_chars) for v in row)
              for row in shown]
    n = f"more than {limits.max_fetch}" if more else str(len(rows))
    count = f"({n} row{'' if n == '1' else 's'}"
    count += f", first {len(shown)} shown)" if more or len(rows) > len(shown) else ")"
    return "\n".join(lines + [count])
