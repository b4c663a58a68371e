"""The SQL session's sandbox on real SQLite: hostile statements are error observations in
bounded time and memory and leave the database file's bytes unchanged; results are
truncated and counted; a fork holds the same temporary state as a fresh replay of the
same calls, and the two evolve apart."""

from __future__ import annotations

import hashlib
import inspect
import json
import subprocess
import sys
import time

import pytest

from builders.sql import ROWS
from trace_lightning.tasks.sql.sandbox import (
    FUNCTIONS,
    Limits,
    SqlError,
    SqlSession,
    format_result,
    format_value,
)

def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def session(shop):
    s = SqlSession(shop)
    yield s
    s.close()


# ---- results --------------------------------------------------------------------------
def test_a_query_shows_its_columns_rows_and_count(session):
    assert session.run("SELECT name, age FROM customers WHERE city = 'Oslo' ORDER BY age") == (
        "name | age\n Ana Silva | 30\n Chloe Costa | 50\n(2 rows)")
    assert session.run("SELECT COUNT(*) FROM orders") == "COUNT(*)\n 4\n(1 row)"
    assert session.run("SELECT id FROM customers WHERE name = 'Nobody'") == "id\n(0 rows)"
    # 1 / 8 + (2 + 1 + 3) quantities of Oslo customers: AVG(price) of toys is (10 + 5) / 2
    assert session.run("SELECT AVG(price) FROM products WHERE category = 'toys'") == (
        "AVG(price)\n 7.5\n(1 row)")


def test_results_are_truncated_and_the_truncation_stated(shop):
    s = SqlSession(shop, Limits(show_rows=2, max_fetch=10))
    assert s.run("SELECT id FROM orders") == "id\n 1\n 2\n(4 rows, first 2 shown)"
    # an endless result: 11 rows read (max_fetch + 1), the rest never computed
    endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c"
    assert s.run(endless) == "x\n 1\n 2\n(more than 10 rows, first 2 shown)"
    s.close()


@pytest.mark.parametrize("value, text", [
    (None, "NULL"), (3, "3"), (3.0, "3"), (2.5, "2.5"), (1 / 3, "0.333333"),
    (float("inf"), "inf"), ("a  b\nc", "a b c"), (b"\x00\xff", "x'00ff'"),
    ("x" * 50, "x" * 37 + "..."),
])
def test_values_are_shown_on_one_line(value, text):
    assert format_value(value, 40) == text


def test_a_statement_without_rows_says_ok(session):
    assert session.run("CREATE TEMP VIEW oslo AS SELECT id FROM customers "
                       "WHERE city = 'Oslo'") == "ok"
    assert format_result(None, [], False, Limits()) == "ok"
    assert session.run("SELECT COUNT(*) FROM oslo") == "COUNT(*)\n 2\n(1 row)"


# ---- hostile SQL ----------------------------------------------------------------------
ENDLESS = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
CARTESIAN = "SELECT COUNT(*) FROM " + ", ".join(f"orders o{k}" for k in range(12))

HOSTILE = [
    # writes to the database
    ("INSERT INTO customers VALUES (9, 'Eve', 'Oslo', 1)", "read-only"),
    ("UPDATE customers SET age = 0", "read-only"),
    ("DELETE FROM orders", "read-only"),
    ("DROP TABLE customers", "read-only"),
    ("CREATE TABLE x (a)", "read-only"),
    ("CREATE VIEW v AS SELECT 1", "read-only"),
    ("CREATE INDEX i ON customers (city)", "read-only"),
    ("REPLACE INTO customers VALUES (1, 'Eve', 'Oslo', 1)", "read-only"),
    ("WITH x AS (SELECT 1) DELETE FROM orders", "read-only"),
    ("INSERT INTO main.customers SELECT * FROM customers", "read-only"),
    # other databases and files, settings, transactions, schema changes
    ("ATTACH DATABASE ':memory:' AS m", "ATTACH statements are not allowed"),
    ("ATTACH 'evil.sqlite' AS evil", "ATTACH statements are not allowed"),
    ("DETACH DATABASE main", "DETACH statements are not allowed"),
    ("VACUUM INTO '/tmp/copy.sqlite'", "VACUUM statements are not allowed"),
    ("VACUUM", "VACUUM statements are not allowed"),
    ("PRAGMA writable_schema = 1", "PRAGMA statements are not allowed"),
    ("/* hidden */ PRAGMA temp.max_page_count = 1000000", "PRAGMA statements are not allowed"),
    ("SELECT * FROM pragma_table_info('customers')", "table-valued functions are not"),
    ("BEGIN", "BEGIN statements are not allowed"),
    ("SAVEPOINT s", "SAVEPOINT statements are not allowed"),
    ("ALTER TABLE customers RENAME TO c", "ALTER statements are not allowed"),
    ("ANALYZE", "ANALYZE statements are not allowed"),
    ("CREATE TEMP TRIGGER t AFTER INSERT ON customers BEGIN SELECT 1; END",
     "triggers are not allowed"),
    ("CREATE VIRTUAL TABLE temp.f USING fts5(x)", "virtual tables are not allowed"),
    # extensions and functions outside the allowlist
    ("SELECT load_extension('/tmp/evil.so')", "load_extension() is not allowed"),
    ("SELECT random()", "random() is not allowed"),
    ("SELECT randomblob(100)", "randomblob() is not allowed"),
    ("SELECT zeroblob(1000000000)", "zeroblob() is not allowed"),
    ("SELECT printf('%.*c', 2000000000, 'x')", "printf() is not allowed"),
    ("SELECT sqlite_version()", "sqlite_version() is not allowed"),
    # queries that never end, or end too late
    (ENDLESS + "SELECT COUNT(*) FROM c", "steps and was stopped"),
    (ENDLESS + "SELECT x FROM c ORDER BY x DESC", "steps and was stopped"),
    (CARTESIAN, "steps and was stopped"),
    ("CREATE TEMP TABLE big AS " + ENDLESS + "SELECT x FROM c", "steps and was stopped"),
    ("CREATE TEMP TABLE big AS " + ENDLESS.replace("FROM c)", "FROM c LIMIT 200000)")
     + "SELECT x, 'padding padding padding' FROM c", "temporary space is full"),
    # huge values
    ("SELECT replace('11111111', '1', '" + "x" * 200 + "')", "too big"),  # 1600 > 1000
    (ENDLESS.replace("FROM c)", "FROM c LIMIT 5000)") + "SELECT group_concat(x) FROM c",
     "too big"),
    # malformed or more than one statement
    ("SELEC name FROM customers", "SELEC statements are not allowed"),
    ("SELECT name FROM", "incomplete input"),
    ("SELECT nope FROM customers", "no such column: nope"),
    ("SELECT * FROM nowhere", "no such table: nowhere"),
    ("SELECT 1; SELECT 2", "one statement per call"),
    ("SELECT 1; DROP TABLE customers", "one statement per call"),
    ("SELECT ?", "Incorrect number of bindings"),
    ("SELECT 'a\x00b'", "null character"),
    ("SELECT char(55296)", "Could not decode"),
    ("-- nothing but a comment", "no SQL statement"),
    ("   ", "no SQL statement"),
    ("SELECT " + "(" * 200 + "1" + ")" * 200, "parser stack overflow"),
    ("SELECT " + " + ".join(["1"] * 200), "Expression tree is too large"),  # depth 200
    ("SELECT " + " + ".join(["1"] * 2000), "too large"),  # 7,000 characters of SQL
]


@pytest.mark.parametrize("sql, reason", HOSTILE, ids=[h[0][:40] for h in HOSTILE])
def test_hostile_sql_is_an_error_observation_in_bounded_time(shop, sql, reason):
    before = sha256(shop)
    s = SqlSession(shop)
    tic = time.perf_counter()
    text = s.run(sql)
    assert time.perf_counter() - tic < 2.0
    assert text.startswith("error: ") and reason in text, text
    # the session goes on working, its temp space intact
    assert s.run("SELECT COUNT(*) FROM customers") == "COUNT(*)\n 3\n(1 row)"
    s.close()
    assert sha256(shop) == before


def test_every_hostile_statement_of_one_session_leaves_the_file_unchanged(shop):
    before = sha256(shop)
    beside = sorted(shop.parent.iterdir())
    s = SqlSession(shop)
    s.run("CREATE TEMP TABLE keep AS SELECT * FROM customers")
    for sql, _ in HOSTILE:
        assert s.run(sql).startswith("error: ")
    assert s.dump()[0][3] == ROWS["customers"]  # its own temp table survived
    s.close()
    assert sha256(shop) == before
    assert sorted(shop.parent.iterdir()) == beside  # and nothing was written beside it


def test_answers_may_not_change_the_session(session):
    for sql in ("CREATE TEMP VIEW v AS SELECT 1", "CREATE TEMP TABLE t (a)"):
        with pytest.raises(SqlError, match="the answer must be a query"):
            session.query(sql, read_only=True)
    assert session.dump() == []
    assert session.query("SELECT COUNT(*) FROM customers", read_only=True)[1] == [(3,)]


def test_the_session_writes_only_its_temp_schema(session, shop):
    assert session.run("CREATE TEMP TABLE t (a INTEGER PRIMARY KEY AUTOINCREMENT, b UNIQUE)"
                       ) == "ok"
    assert session.run("INSERT INTO t (b) VALUES ('x'), ('y')") == "ok"
    assert session.run("UPDATE t SET b = 'z' WHERE a = 2") == "ok"
    assert session.run("CREATE INDEX tb ON t (b)") == "ok"  # on a temp table: a temp index
    assert session.run("SELECT b FROM t ORDER BY a") == "b\n x\n z\n(2 rows)"
    other = SqlSession(shop)  # another session sees none of it
    assert other.run("SELECT * FROM t") == "error: no such table: t"
    other.close()


def test_allowed_functions_exclude_the_dangerous_and_the_random():
    assert not FUNCTIONS & {"load_extension", "random", "randomblob", "zeroblob", "printf",
                            "format", "readfile", "writefile", "edit", "fts3_tokenizer"}


def test_a_huge_sort_stays_within_bounded_memory(shop):
    """A cartesian product sorted in memory is stopped by the step limit before it grows:
    the peak memory of a process of its own (which loads only the sandbox module) rises by
    at most 150 MB."""
    code = f"""
import importlib.util, json, resource, sys
spec = importlib.util.spec_from_file_location("sandbox", {inspect.getfile(SqlSession)!r})
sandbox = sys.modules["sandbox"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sandbox)
s = sandbox.SqlSession({str(shop)!r})
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
text = s.run("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
             "SELECT x, replace(substr(quote(hex(x)) || '{"a" * 300}', 1, 300), 'a', 'bbb') "
             "AS y FROM c ORDER BY y DESC")
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"text": text, "grew_mb": (after - before) / 1024}}))
"""
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True,
                                    text=True, check=True, timeout=60).stdout)
    assert "steps and was stopped" in out["text"]
    assert out["grew_mb"] < 150, out


# ---- fork and replay ------------------------------------------------------------------
CALLS = [
    "CREATE TEMP VIEW oslo AS SELECT id, name FROM customers WHERE city = 'Oslo'",
    "CREATE TEMP TABLE spend AS SELECT customer_id, SUM(quantity * price) AS total "
    "FROM orders JOIN products ON product_id = products.id GROUP BY customer_id",
    "INSERT INTO spend VALUES (99, 2.5)",
    "DELETE FROM spend WHERE customer_id = 2",
    "CREATE TEMP TABLE auto (k INTEGER PRIMARY KEY AUTOINCREMENT, v BLOB, w AS (k * 2))",
    "INSERT INTO auto (v) VALUES (x'00ff'), (NULL), ('text')",
    "CREATE TEMP TABLE keyed (k TEXT PRIMARY KEY, n REAL) WITHOUT ROWID",
    "INSERT INTO keyed VALUES ('b', 1.5), ('a', -2)",
    "CREATE INDEX spend_total ON spend (total)",
    "CREATE TEMP VIEW rich AS SELECT name, total FROM oslo JOIN spend ON id = customer_id",
    "CREATE TEMP TABLE gone (a)",
    "CREATE TEMP VIEW dangling AS SELECT a FROM gone",
    "DROP TABLE gone",
    "DROP VIEW oslo",
    "CREATE TEMP VIEW oslo AS SELECT id, name FROM customers WHERE city = 'Lyon'",
    "SELECT * FROM rich",
    "PRAGMA foo",  # refused: no change
    "CREATE TABLE temp.named (a)",  # the temp schema named, without TEMP
    "INSERT INTO temp.named VALUES (1)",
]


def replayed(shop, calls) -> SqlSession:
    s = SqlSession(shop)
    for sql in calls:
        s.run(sql)
    return s


def test_the_calls_build_a_varied_state(shop):
    s = replayed(shop, CALLS)
    dump = {name: (kind, rows) for kind, name, _, rows in s.dump()}
    # Ana (1): 2 * 10 + 1 * 25 = 45; Ben (2): 4 * 5 = 20, deleted; Chloe (3): 3 * 10 = 30
    assert dump["spend"] == ("table", [(1, 45), (3, 30), (99, 2.5)])
    assert dump["auto"] == ("table", [(1, b"\x00\xff"), (2, None), (3, "text")])
    assert dump["keyed"] == ("table", [("a", -2.0), ("b", 1.5)])
    assert dump["spend_total"] == ("index", [])
    assert dump["rich"] == ("view", [])  # oslo now holds Lyon's Ben, whose spend was deleted
    assert dump["dangling"][1][0][0] == "error"
    assert dump["sqlite_sequence"] == ("sequence", [("auto", 3)])
    assert dump["named"] == ("table", [(1,)])
    assert "gone" not in dump
    s.close()


@pytest.mark.parametrize("cut", [0, 1, 3, 6, 9, 13, len(CALLS)])
def test_a_fork_equals_a_fresh_replay_of_the_same_calls(shop, cut):
    source = replayed(shop, CALLS[:cut])
    fork = source.fork()
    fresh = replayed(shop, CALLS[:cut])
    assert fork.dump() == fresh.dump() == source.dump()
    # the rest of the calls give the same observations on both, and the same state after
    for sql in CALLS[cut:]:
        assert fork.run(sql) == fresh.run(sql)
    assert fork.dump() == fresh.dump()
    for s in (source, fork, fresh):
        s.close()


def test_a_fork_evolves_apart_from_its_source(shop):
    source = replayed(shop, CALLS[:6])
    fork = source.fork()
    assert fork.run("INSERT INTO auto (v) VALUES ('new')") == "ok"
    assert fork.run("SELECT k FROM auto WHERE v = 'new'") == "k\n 4\n(1 row)"  # the counter
    assert fork.run("DROP VIEW oslo") == "ok"
    assert source.run("SELECT COUNT(*) FROM auto") == "COUNT(*)\n 3\n(1 row)"
    assert source.run("SELECT COUNT(*) FROM oslo") == "COUNT(*)\n 2\n(1 row)"
    source.close()  # closing the source leaves the fork working
    assert fork.run("SELECT COUNT(*) FROM auto") == "COUNT(*)\n 4\n(1 row)"
    fork.close()


def test_a_missing_database_is_an_error_at_start(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SqlSession(tmp_path / "nothing.sqlite")
