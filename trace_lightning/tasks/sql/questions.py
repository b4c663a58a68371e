"""Questions about the generated databases, each with a gold query and a gold trajectory.

Nine kinds cover filters, aggregates, grouping, ordering and joins; the last four take more
than one turn, and three of them keep a step in the session as a TEMP VIEW that later turns
read (the state a continuation must inherit): the answer always, a query in ``view_top``. On a shop database (``world.FAMILIES``)::

    count       How many customers have city 'Oslo'?
                <answer> SELECT COUNT(*) FROM customers WHERE city = 'Oslo'</answer>
    above       Which products have price above 120?
                <answer> SELECT name FROM products WHERE price > 120</answer>
    aggregate   What is the average price of products with category 'toys'?
                <answer> SELECT AVG(price) FROM products WHERE category = 'toys'</answer>
    group       What is the highest age of customers for each city?
                <answer> SELECT city, MAX(age) FROM customers GROUP BY city</answer>
    top         Name the 2 products with the lowest price.
                <answer> SELECT name FROM products ORDER BY price ASC LIMIT 2</answer>
    lookup      How many orders does customer 'Ana Silva' have?
                <sql> SELECT id FROM customers WHERE name = 'Ana Silva'</sql>
                (<result> id / 17 / (1 row)</result>: the id is read from the result)
                <answer> SELECT COUNT(*) FROM orders WHERE customer_id = 17</answer>
    view_sum    What is the total quantity of orders for customers with city 'Oslo'?
                <sql> CREATE TEMP VIEW picked AS SELECT id FROM customers WHERE city = 'Oslo'</sql>
                <answer> SELECT SUM(quantity) FROM orders WHERE customer_id IN
                         (SELECT id FROM picked)</answer>
    view_top    Which category has the most orders?
                <sql> CREATE TEMP VIEW joined AS SELECT category FROM orders JOIN products
                      ON product_id = products.id</sql>
                <sql> SELECT category, COUNT(*) FROM joined GROUP BY category
                      ORDER BY COUNT(*) DESC</sql>  (the counts, read from the view)
                <answer> SELECT category FROM joined GROUP BY category
                         ORDER BY COUNT(*) DESC LIMIT 1</answer>
    lookup_view What is the total quantity of customer 'Ana Silva' for products with category
                'toys'?  (three turns: the id, a view of the category's products, the answer)

The gold query (``gold``) answers the question on its own, without the session; the reward
compares the agent's answer with it by execution. A question's values come from its
database's rows, so every gold result is non-empty (and a "most" question has one winner).

Questions are drawn from ``random.Random(seed)`` over the databases of their set; a set
never repeats a (database, question) pair. Sets differ by their databases (each set's are
drawn from its own seed), not by their question texts: "How many customers are there for
each city?" is asked in every set, of other rows.
"""

from __future__ import annotations

import random
import sqlite3
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from trace_lightning.tasks.sql.world import Family

KINDS = ("count", "above", "aggregate", "group", "top", "lookup", "view_sum", "view_top",
         "lookup_view")
AGGREGATES = {"average": "AVG", "highest": "MAX", "lowest": "MIN", "total": "SUM"}
SQL, ANSWER_TAG = "sql", "answer"


@dataclass
class Question:
    """One question: its text, its database (a path relative to the task's ``out_dir``), its
    family and kind, the gold query (``ordered`` when the answer's row order counts) and the
    gold trajectory's actions, ``[(tag, query), ...]`` ending with the answer."""

    id: str
    question: str
    db: str
    family: str
    kind: str
    gold: str
    ordered: bool
    solution: list[tuple[str, str]]

    def record(self, dataset: str) -> dict:
        """One JSON line (``from_record`` reads it back): the QA fields (``answers``: the
        gold query) plus the SQL ones."""
        return {"id": self.id, "question": self.question, "answers": [self.gold],
                "dataset": dataset, "db": self.db, "family": self.family, "kind": self.kind,
                "ordered": self.ordered, "solution": [list(s) for s in self.solution]}

    @classmethod
    def from_record(cls, r: dict) -> Question:
        return cls(id=str(r["id"]), question=r["question"], db=r["db"], family=r["family"],
                   kind=r["kind"], gold=r["answers"][0], ordered=bool(r["ordered"]),
                   solution=[(t, q) for t, q in r["solution"]])


@dataclass(frozen=True)
class Database:
    """A built database of a set: its family, its file and its path relative to
    ``out_dir`` (what a question stores)."""

    family: Family
    path: Path
    rel: str


def _rows(con: sqlite3.Connection, sql: str) -> list[tuple]:
    return con.execute(sql).fetchall()


def read_tables(db: Database, con: sqlite3.Connection) -> tuple[list, list, list]:
    """The people, items and links of ``db`` (``con`` reads it), as (id, name, category,
    number) and (id, person id, item id, number) rows."""
    f = db.family
    return (_rows(con, f"SELECT id, name, {f.pcat}, {f.pnum} FROM {f.people}"),
            _rows(con, f"SELECT id, name, {f.icat}, {f.inum} FROM {f.items}"),
            _rows(con, f"SELECT id, {f.pkey}, {f.ikey}, {f.lnum} FROM {f.links}"))


def draw_question(rng: random.Random, kind: str, db: Database, con: sqlite3.Connection,
                  tables: tuple[list, list, list], qid: str) -> Question | None:
    """One question of ``kind`` on ``db`` (``con`` reads it, ``tables`` are its rows,
    ``read_tables``), or None where its draw has no single answer (a "most" question
    whose top is tied)."""
    f = db.family
    P, I, L = f.people, f.items, f.links
    people, items, links = tables
    steps: list[tuple[str, str]] = []
    ordered = False
    if kind == "count":
        v = rng.choice(people)[2]
        text = f"How many {P} have {f.pcat} '{v}'?"
        gold = f"SELECT COUNT(*) FROM {P} WHERE {f.pcat} = '{v}'"
    elif kind == "above":
        values = sorted((row[3] for row in items), reverse=True)
        n = values[rng.randint(1, 4)]  # 1 to 4 items lie above it
        text = f"Which {I} have {f.inum} above {n}?"
        gold = f"SELECT name FROM {I} WHERE {f.inum} > {n}"
    elif kind == "aggregate":
        word, agg = rng.choice(list(AGGREGATES.items()))
        v = rng.choice(items)[2]
        text = f"What is the {word} {f.inum} of {I} with {f.icat} '{v}'?"
        gold = f"SELECT {agg}({f.inum}) FROM {I} WHERE {f.icat} = '{v}'"
    elif kind == "group":
        table, cat, num = rng.choice([(P, f.pcat, f.pnum), (I, f.icat, f.inum)])
        word = rng.choice(["count"] + list(AGGREGATES))
        if word == "count":
            text = f"How many {table} are there for each {cat}?"
            gold = f"SELECT {cat}, COUNT(*) FROM {table} GROUP BY {cat}"
        else:
            text = f"What is the {word} {num} of {table} for each {cat}?"
            gold = f"SELECT {cat}, {AGGREGATES[word]}({num}) FROM {table} GROUP BY {cat}"
    elif kind == "top":
        k = rng.randint(1, 3)
        word, order = rng.choice([("highest", "DESC"), ("lowest", "ASC")])
        text = f"Name the {k} {I} with the {word} {f.inum}."
        gold = f"SELECT name FROM {I} ORDER BY {f.inum} {order} LIMIT {k}"
        ordered = True
    elif kind == "lookup":
        pid, name = rng.choice([p for p in people if any(x[1] == p[0] for x in links)])[:2]
        steps.append((SQL, f"SELECT id FROM {P} WHERE name = '{name}'"))
        if rng.random() < 0.5:
            text = f"How many {L} does {f.person} '{name}' have?"
            answer = f"SELECT COUNT(*) FROM {L} WHERE {f.pkey} = {pid}"
            gold = (f"SELECT COUNT(*) FROM {L} WHERE {f.pkey} = "
                    f"(SELECT id FROM {P} WHERE name = '{name}')")
        else:
            text = f"What is the total {f.lnum} of {L} of {f.person} '{name}'?"
            answer = f"SELECT SUM({f.lnum}) FROM {L} WHERE {f.pkey} = {pid}"
            gold = (f"SELECT SUM({f.lnum}) FROM {L} WHERE {f.pkey} = "
                    f"(SELECT id FROM {P} WHERE name = '{name}')")
        steps.append((ANSWER_TAG, answer))
    elif kind == "view_sum":
        link = rng.choice(links)
        if rng.random() < 0.5:
            table, cat, key = P, f.pcat, f.pkey
            v = next(p[2] for p in people if p[0] == link[1])
        else:
            table, cat, key = I, f.icat, f.ikey
            v = next(i[2] for i in items if i[0] == link[2])
        text = f"What is the total {f.lnum} of {L} for {table} with {cat} '{v}'?"
        where = f"SELECT id FROM {table} WHERE {cat} = '{v}'"
        steps += [(SQL, f"CREATE TEMP VIEW picked AS {where}"),
                  (ANSWER_TAG, f"SELECT SUM({f.lnum}) FROM {L} WHERE {key} IN "
                               f"(SELECT id FROM picked)")]
        gold = f"SELECT SUM({f.lnum}) FROM {L} WHERE {key} IN ({where})"
    elif kind == "view_top":
        table, cat, key = rng.choice([(P, f.pcat, f.pkey), (I, f.icat, f.ikey)])
        join = f"SELECT {cat} FROM {L} JOIN {table} ON {key} = {table}.id"
        counts = Counter(row[0] for row in _rows(con, join)).most_common(2)
        if len(counts) > 1 and counts[0][1] == counts[1][1]:
            return None  # a tie: no single answer
        text = f"Which {cat} has the most {L}?"
        steps += [(SQL, f"CREATE TEMP VIEW joined AS {join}"),
                  (SQL, f"SELECT {cat}, COUNT(*) FROM joined GROUP BY {cat} "
                        f"ORDER BY COUNT(*) DESC"),
                  (ANSWER_TAG, f"SELECT {cat} FROM joined GROUP BY {cat} "
                               f"ORDER BY COUNT(*) DESC LIMIT 1")]
        gold = f"{join} GROUP BY {cat} ORDER BY COUNT(*) DESC LIMIT 1"
    elif kind == "lookup_view":
        link = rng.choice(links)
        pid, name = next(p[:2] for p in people if p[0] == link[1])
        v = next(i[2] for i in items if i[0] == link[2])
        text = f"What is the total {f.lnum} of {f.person} '{name}' for {I} with {f.icat} '{v}'?"
        where = f"SELECT id FROM {I} WHERE {f.icat} = '{v}'"
        steps += [(SQL, f"SELECT id FROM {P} WHERE name = '{name}'"),
                  (SQL, f"CREATE TEMP VIEW picked AS {where}"),
                  (ANSWER_TAG, f"SELECT SUM({f.lnum}) FROM {L} WHERE {f.pkey} = {pid} AND "
                               f"{f.ikey} IN (SELECT id FROM picked)")]
        gold = (f"SELECT SUM({f.lnum}) FROM {L} WHERE {f.pkey} = (SELECT id FROM {P} WHERE "
                f"name = '{name}') AND {f.ikey} IN ({where})")
    else:
        raise ValueError(f"unknown question kind {kind!r}; expected one of {KINDS}")
    if not steps:
        steps = [(ANSWER_TAG, gold)]
    return Question(qid, text, db.rel, f.name, kind, gold, ordered, steps)


def generate_questions(seed: int, n: int, databases: list[Database],
                       kinds: tuple[str, ...] = KINDS, prefix: str = "sql") -> list[Question]:
    """``n`` questions drawn from ``seed`` over ``databases`` (each question's database
    and kind uniform), no (database, question) pair twice.

    Args:
        seed: seed of the draw (the same seed and databases give the same questions).
        n: questions wanted.
        databases: the set's built databases.
        kinds: the kinds drawn from (``KINDS``).
        prefix: ids are ``<prefix>-<seed>-<k>``.
    """
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        raise ValueError(f"question kinds {sorted(unknown) or '(none)'}: expected some of "
                         f"{KINDS}")
    rng = random.Random(seed)
    cons = {db.rel: sqlite3.connect(f"{db.path.resolve().as_uri()}?mode=ro", uri=True)
            for db in databases}
    try:
        tables = {db.rel: read_tables(db, cons[db.rel]) for db in databases}
        seen: set[tuple[str, str]] = set()
        out: list[Question] = []
        for _ in range(50 * n + 1000):
            if len(out) == n:
                break
            db, kind = rng.choice(databases), rng.choice(kinds)
            q = draw_question(rng, kind, db, cons[db.rel], tables[db.rel],
                              f"{prefix}-{seed}-{len(out)}")
            if q is not None and (q.db, q.question) not in seen:
                seen.add((q.db, q.question))
                out.append(q)
    finally:
        for con in cons.values():
            con.close()
    if len(out) < n:
        raise ValueError(f"could draw only {len(out)} distinct questions from seed {seed} "
                         f"over {len(databases)} databases; ask for fewer or add databases")
    return out
