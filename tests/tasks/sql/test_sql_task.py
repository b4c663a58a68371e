"""The SQL task: parsing, execution match by hand, its observations and reward on a
hand-made database, the generated databases and questions (every gold trajectory, run in a
real session, gives its gold query's result), the demonstrations, the settings refused on
construction, one tiny build, and real trajectories of a tiny warm-started policy grown into
trees through the agent loop: each continuation's session holds what a fresh replay of its
prefix holds, fork and replay grow the same trees, and the database files are unchanged."""

from __future__ import annotations

import hashlib
import json
import random

import pytest

from trace_lightning.tasks.base import Example, Task, TaskData, Turn
from trace_lightning.tasks.sql import (
    FAMILIES,
    KINDS,
    SQL_INSTRUCTION,
    SqlData,
    SqlSession,
    SqlTask,
    generate_questions,
    parse_turn,
    same_result,
)
from trace_lightning.tasks.sql.data import database_hashes
from trace_lightning.tasks.sql.sandbox import Limits
from trace_lightning.tasks.sql.questions import Database, Question
from trace_lightning.tasks.sql.task import SQL_TAGS, example_extras
from trace_lightning.tasks.sql.warm_start import (
    demonstrations,
    gold_turns,
    noisy_turns,
    sql_tokenizer,
    trajectory_text,
)
from trace_lightning.tasks.sql.world import Size, build_database, database_rows

SCHEMA = FAMILIES["shop"].schema


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Six small generated databases (two per family) and 60 questions on them."""
    root = tmp_path_factory.mktemp("world")
    dbs = []
    for k, (name, family) in enumerate(FAMILIES.items()):
        for j in range(2):
            rel = f"db/{name}-{j}.sqlite"
            build_database(root / rel, family, 10 * k + j)
            dbs.append(Database(family, root / rel, rel))
    return root, dbs, generate_questions(3, 60, dbs)


def as_example(root, q: Question, dataset: str = "t") -> Example:
    return Example(q.id, q.question, [q.gold], dataset,
                   example_extras(root / q.db, FAMILIES[q.family].schema, q.ordered))


@pytest.fixture(scope="module")
def tokenizer(world):
    root, _, questions = world
    texts = [trajectory_text(q, as_example(root, q), SQL_INSTRUCTION, Limits())
             for q in questions]
    return sql_tokenizer(texts, 400)


@pytest.fixture(scope="module")
def task(tokenizer):
    return SqlTask(tokenizer, max_turns=4, max_seq_tokens=512)


def shop_example(gold: str, ordered: bool = False, shop_path=None) -> Example:
    return Example("q", "?", [gold], "t", example_extras(shop_path, SCHEMA, ordered))


# ---- parsing ----------------------------------------------------------------------------
@pytest.mark.parametrize("text, kind, argument", [
    ("<sql> SELECT 1</sql>", "sql", "SELECT 1"),
    ("first the id <sql>SELECT id FROM t</sql>\n", "sql", "SELECT id FROM t"),
    ("<sql> SELECT 'a  b'\n FROM t </sql>", "sql", "SELECT 'a  b'\n FROM t"),  # kept inside
    ("<answer> SELECT COUNT(*) FROM t</answer>", "answer", "SELECT COUNT(*) FROM t"),
    ("<answer></answer>", "answer", ""),  # an empty answer is a wrong answer
    ("<sql> DROP TABLE t</sql>", "sql", "DROP TABLE t"),  # the session, not the parser, refuses
])
def test_parse_valid_turns(text, kind, argument):
    assert parse_turn(text) == Turn(kind, argument)


@pytest.mark.parametrize("text, error", [
    ("", "no <sql> or <answer>"),
    ("SELECT 1", "no <sql> or <answer>"),
    ("<sql> SELECT 1", "never closed"),
    ("<sql> SELECT 1</answer>", "nested or unclosed"),
    ("<sql> <sql> 1</sql>", "nested or unclosed"),
    ("SELECT 1</sql>", "without an opening tag"),
    ("<sql> SELECT 1</sql><sql> SELECT 2</sql>", "two actions"),
    ("<sql> SELECT 1</sql><answer> SELECT 1</answer>", "two actions"),
    ("<answer> SELECT 1</answer> done", "text after the action"),
    ("<result> 1</result>", "wrote a <result>"),
    ("<sql>  </sql>", "empty <sql>"),
])
def test_parse_invalid_turns(text, error):
    turn = parse_turn(text)
    assert turn.kind == "invalid" and error in turn.error


def test_parse_never_raises():
    rng = random.Random(0)
    pieces = ["<sql>", "</sql>", "<answer>", "</answer>", "<result>", "</result>", "<sql",
              "SELECT", " 1", "'", ";", " ", "\n", "</", ">", "<"]
    for _ in range(2000):
        turn = parse_turn("".join(rng.choice(pieces) for _ in range(rng.randint(0, 12))))
        assert turn.kind in ("sql", "answer", "invalid")
        assert (turn.kind == "invalid") == bool(turn.error)


def test_task_parse_cuts_at_the_first_stop(task):
    assert task.parse("<answer> SELECT 1</answer>.") == Turn("answer", "SELECT 1")
    assert task.parse("<sql> SELECT 1</sql><answer> x</answer>") == Turn("sql", "SELECT 1")


# ---- execution match by hand ----------------------------------------------------------------
@pytest.mark.parametrize("gold, answer, ordered, same", [
    ([(1,), (2,)], [(2,), (1,)], False, True),  # a multiset: order free
    ([(1,), (2,)], [(2,), (1,)], True, False),  # ORDER BY in the gold: order counts
    ([(1,), (1,), (2,)], [(1,), (2,), (2,)], False, False),  # multiplicities count
    ([(1,), (2,)], [(1,)], False, False),
    ([(3,)], [(3.0,)], False, True),  # an integer equals its float
    ([(7.5,)], [(7.5000001,)], False, True),  # within 1e-6 relative
    ([(7.5,)], [(7.501,)], False, False),
    ([(0.0,)], [(1e-9,)], False, True),  # within 1e-6 absolute
    ([("Oslo",)], [("oslo",)], False, False),  # text exactly
    ([("3",)], [(3,)], False, False),  # text is not a number
    ([(None,)], [(None,)], False, True),
    ([(None,)], [(0,)], False, False),
    ([("Oslo", 2)], [("Oslo",)], False, False),  # column count
    ([("Oslo", 2), ("Lyon", 1)], [("Lyon", 1), ("Oslo", 2)], False, True),
    ([("a", None), ("a", 1)], [("a", 1), ("a", None)], False, True),  # mixed types sort
    ([], [], False, True),
])
def test_same_result_by_hand(gold, answer, ordered, same):
    assert same_result(gold, answer, ordered) is same


# ---- the task on a hand-made database -------------------------------------------------------
def test_execute_runs_each_call_in_its_own_session(task, shop, tokenizer):
    a, b = SqlSession(shop), SqlSession(shop)
    calls = [Turn("sql", "CREATE TEMP VIEW oslo AS SELECT id FROM customers WHERE city = "
                         "'Oslo'"),
             Turn("sql", "SELECT COUNT(*) FROM oslo"), Turn("sql", "DROP TABLE customers")]
    out = task.execute(calls, [a, a, b])
    assert [text for _, text in out] == [
        "\n<result> ok</result>\n", "\n<result> COUNT(*)\n 2\n(1 row)</result>\n",
        "\n<result> error: the database is read-only: keep results in TEMP tables or views "
        "(CREATE TEMP VIEW name AS SELECT ...)</result>\n"]
    assert task.execute([Turn("sql", "SELECT COUNT(*) FROM oslo")], [b])[0][1] == (
        "\n<result> error: no such table: oslo</result>\n")  # b never made the view
    for ids, text in out:
        assert ids == tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    assert task.execute([], []) == []
    a.close(), b.close()


# Oslo's customers are 1 (Ana) and 3 (Chloe); their orders' quantities 2 + 1 + 3 = 6
VIEW = "CREATE TEMP VIEW oslo AS SELECT id FROM customers WHERE city = 'Oslo'"
GOLD = ("SELECT SUM(quantity) FROM orders WHERE customer_id IN "
        "(SELECT id FROM customers WHERE city = 'Oslo')")


@pytest.mark.parametrize("answer, reward, valid", [
    ("SELECT SUM(quantity) FROM orders WHERE customer_id IN (SELECT id FROM oslo)", 1.0, 1.0),
    ("SELECT 6", 1.0, 1.0),  # execution match: the value, not the query
    ("SELECT 6.0000001", 1.0, 1.0),
    ("SELECT SUM(quantity) FROM orders", 0.0, 1.0),  # 10
    ("SELECT SUM(quantity), 1 FROM orders WHERE customer_id IN (1, 3)", 0.0, 1.0),
    ("SELECT SUM(quantity) FROM orders WHERE customer_id IN (SELECT id FROM lyon)", 0.0, 0.0),
    ("CREATE TEMP VIEW six AS SELECT 6", 0.0, 0.0),  # an answer may not change the session
    ("DROP TABLE orders", 0.0, 0.0),
    ("SELEC 6", 0.0, 0.0),
    ("", 0.0, 0.0),
])
def test_score_runs_the_answer_in_its_session(task, shop, answer, reward, valid):
    example = shop_example(GOLD, shop_path=shop)
    assert task.gold_rows(example) == [(6,)]
    session = task.start(example)
    assert task.execute([Turn("sql", VIEW)], [session])[0][1] == "\n<result> ok</result>\n"
    assert task.score(Turn("answer", answer), example, session) == (
        reward, {"exec_match": reward, "valid_sql": valid})
    session.close()


def test_an_answer_reads_only_its_own_sessions_views(task, shop):
    example = shop_example(GOLD, shop_path=shop)
    answer = Turn("answer", "SELECT SUM(quantity) FROM orders WHERE customer_id IN "
                            "(SELECT id FROM oslo)")
    assert task.score(answer, example, task.start(example))[0] == 0.0  # a new session
    assert task.score(answer, example)[0] == 0.0  # none: a new one too


@pytest.mark.parametrize("answer, ordered, reward", [
    ("SELECT name FROM products ORDER BY price DESC LIMIT 2", True, 1.0),
    ("SELECT name FROM products WHERE price >= 10 ORDER BY price DESC", True, 1.0),
    ("SELECT name FROM products WHERE price >= 10 ORDER BY price ASC", True, 0.0),
    ("SELECT name FROM products WHERE price >= 10 ORDER BY price ASC", False, 1.0),
])
def test_order_counts_only_where_the_gold_orders(task, shop, answer, ordered, reward):
    # prices: Red Drum 25, Blue Lamp 10, Small Ball 5
    example = shop_example("SELECT name FROM products ORDER BY price DESC LIMIT 2", ordered,
                           shop_path=shop)
    assert task.score(Turn("answer", answer), example)[0] == reward


def test_only_answers_earn(task, shop):
    example = shop_example("SELECT 1", shop_path=shop)
    for final in (Turn("sql", "SELECT 1"), Turn("invalid", error="no <sql> or <answer>")):
        assert task.score(final, example) == (0.0, {"exec_match": 0.0, "valid_sql": 0.0})


def test_prompt_stop_strings_and_protocol(task, tokenizer, shop):
    ids, text = task.prompt(Example("q", "How many customers?", ["SELECT 1"], "t",
                                    example_extras(shop, SCHEMA, False)))
    assert text == SQL_INSTRUCTION.replace("{schema}", SCHEMA).replace(
        "{question}", "How many customers?")
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert isinstance(task, Task)
    assert task.stop == ["</sql>", "</answer>"] and task.calls_metric == "queries"
    assert task.metrics == ("exec_match", "valid_sql") and task.continuation == "fork"
    for tag in SQL_TAGS:
        assert len(tokenizer.encode(tag, add_special_tokens=False)) == 1
    assert all(sum(c.isdigit() for c in t) <= 1 for t in tokenizer.get_vocab())


def test_task_refuses_settings_it_cannot_use(tokenizer):
    with pytest.raises(ValueError, match=r"continuation \('none'\) must be 'fork'"):
        SqlTask(tokenizer, continuation="none")
    with pytest.raises(ValueError, match="must contain '{question}'"):
        SqlTask(tokenizer, instruction="Tables: {schema}")


# ---- databases and questions ----------------------------------------------------------------
def test_databases_have_keys_unique_names_and_seeded_rows(tmp_path):
    f = FAMILIES["school"]
    rows = database_rows(f, 5, Size(people=10, items=6, links=20))
    assert rows == database_rows(f, 5, Size(people=10, items=6, links=20))
    assert rows != database_rows(f, 6, Size(people=10, items=6, links=20))
    people, items, links = rows[f.people], rows[f.items], rows[f.links]
    assert len({p[1] for p in people}) == 10 and len({i[3] for i in items}) == 6
    assert all(1 <= x[1] <= 10 and 1 <= x[2] <= 6 for x in links)  # foreign keys resolve
    path = build_database(tmp_path / "s.sqlite", f, 5, Size(people=10, items=6, links=20))
    s = SqlSession(path)
    assert s.query(f"SELECT COUNT(*) FROM {f.links} JOIN {f.people} ON "
                   f"{f.pkey} = {f.people}.id")[1] == [(20,)]
    s.close()


def test_every_gold_trajectory_gives_its_gold_result(world):
    """The gold turns run in a real session (a lookup's id read from its result, a view
    kept between turns) answer what the gold query answers; without the session's views the
    answer of a view question fails."""
    root, _, questions = world
    assert {q.kind for q in questions} == set(KINDS)
    for q in questions:
        session = SqlSession(root / q.db)
        gold = session.query(q.gold)[1]
        assert gold and gold[0][0] is not None, q  # a real answer, never empty
        *steps, (tag, answer) = q.solution
        assert tag == "answer"
        for _, sql in steps:
            text = session.run(sql)
            assert not text.startswith("error"), (q, sql, text)
            if sql.startswith("SELECT id"):  # a lookup: its id is the answer's key
                assert f" = {text.splitlines()[1].strip()}" in answer
        assert same_result(gold, session.query(answer, read_only=True)[1], q.ordered), q
        session.close()
        if "picked" in answer or "joined" in answer:
            fresh = SqlSession(root / q.db)
            assert "no such table" in fresh.run(answer)  # the state matters
            fresh.close()


def test_questions_are_seeded_and_never_repeat_on_a_database(world):
    root, dbs, questions = world
    assert generate_questions(3, 60, dbs) == questions
    assert generate_questions(4, 60, dbs) != questions
    assert len({(q.db, q.question) for q in questions}) == 60
    assert all(Question.from_record(json.loads(json.dumps(q.record("t")))) == q
               for q in questions)
    with pytest.raises(ValueError, match="expected some of"):
        generate_questions(3, 5, dbs, kinds=("joins",))
    with pytest.raises(ValueError, match="could draw only"):
        generate_questions(3, 20, dbs[:1], kinds=("group",))  # 10 texts on one database


# ---- demonstrations -------------------------------------------------------------------------
def test_demonstrations_train_on_turns_and_read_real_results(task, tokenizer, world):
    root, _, questions = world
    examples = [as_example(root, q) for q in questions]
    for q, e, d in zip(questions, examples, demonstrations(task, questions, examples)):
        prompt_ids, _ = task.prompt(e)
        assert d.input_ids[:len(prompt_ids)] == prompt_ids
        policy = tokenizer.decode([t for t, m in zip(d.input_ids, d.policy_mask) if m])
        assert policy == "".join(gold_turns(q))
        rest = tokenizer.decode([t for t, m in zip(d.input_ids[len(prompt_ids):],
                                                   d.policy_mask[len(prompt_ids):]) if not m])
        session = SqlSession(root / q.db)
        assert rest == "".join(f"\n<result> {session.run(sql)}</result>\n"
                               for tag, sql in q.solution if tag == "sql")
        session.close()


def test_noisy_turns_change_one_thing_in_the_answer(world):
    _, _, questions = world
    rng = random.Random(0)
    for q in questions:
        gold, noisy = gold_turns(q), noisy_turns(q, rng)
        assert gold[:-1] == noisy[:-1]
        if gold[-1] == noisy[-1]:  # nothing to change: no value, aggregate or order
            assert q.kind == "group" and "COUNT(*)" in gold[-1]
            continue
        assert parse_turn(noisy[-1]).kind == "answer"
        g, n = gold[-1].split(" "), noisy[-1].split(" ")
        assert len(g) != len(n) or sum(a != b for a, b in zip(g, n)) <= 2  # one value


# ---- SqlData --------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, flag", [
    ({"eval_seed": 0}, "--data.task.init_args.seed (0), eval_seed (0)"),
    ({"warm_seed": 1}, "warm_seed (1) must differ"),
    ({"n_eval": 0}, "--data.task.init_args.n_eval (0)"),
    ({"n_train": 0}, "--data.task.init_args.n_train (0)"),
    ({"questions_per_db": 0}, "--data.task.init_args.questions_per_db (0)"),
    ({"kinds": ["count", "joins"]}, "--data.task.init_args.kinds (['count', 'joins'])"),
    ({"max_turns": 2}, "--data.task.init_args.max_turns (2)"),
    ({"max_seq_tokens": 0}, "--data.task.init_args.max_seq_tokens (0)"),
    ({"instruction": "no placeholder"}, "--data.task.init_args.instruction"),
    ({"continuation": "none"}, "--data.task.init_args.continuation ('none')"),
    ({"max_query_steps": 100}, "--data.task.init_args.max_query_steps (100)"),
    ({"show_rows": 0}, "--data.task.init_args.show_rows (0)"),
    ({"vocab_size": 100}, "--data.task.init_args.vocab_size (100)"),
    ({"warm_start_lr": 0.0}, "--data.task.init_args.warm_start_lr (0.0)"),
    ({"warm_start_noise": 1.5}, "--data.task.init_args.warm_start_noise (1.5)"),
    ({"warm_start_stop_loss": 0.0}, "--data.task.init_args.warm_start_stop_loss (0.0)"),
])
def test_sql_data_refuses_bad_settings(kwargs, flag):
    with pytest.raises(ValueError) as e:
        SqlData(**kwargs)
    assert flag in str(e.value)


def test_prepare_requires_its_own_policy(tmp_path):
    data = SqlData(out_dir=str(tmp_path / "sql"))
    with pytest.raises(ValueError, match=r"--model.policy_path \('other/model'\)"):
        data.prepare("other/model", fitting=True)
    assert not (tmp_path / "sql").exists()  # refused before any work


TINY_MODEL = {"hidden_size": 32, "layers": 1, "heads": 1, "kv_heads": 1, "intermediate": 64,
              "max_position": 512}


def test_prepare_builds_once_and_setup_reads_the_sets(tmp_path):
    out = tmp_path / "sql"
    kwargs = dict(out_dir=str(out), n_train=12, n_eval=6, n_warm=12, questions_per_db=4,
                  vocab_size=400, warm_start_steps=2, warm_start_batch=4, model=TINY_MODEL)
    data = SqlData(**kwargs)
    assert isinstance(data, TaskData) and data.metric == "exec_match"
    data.prepare(str(out / "model"), fitting=True)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["settings"] == data.settings()
    assert manifest["warm_start"]["steps"] == 2 and manifest["warm_start"]["n_demos"] == 12
    # one database per family and set (ceil(12 / (3 * 4)) = 1), each hashed
    assert sorted(manifest["databases"]) == sorted(
        f"db/{s}-{f}-0.sqlite" for s in ("sql", "sql_heldout", "warm") for f in FAMILIES)
    assert manifest["databases"] == database_hashes(out)
    weights = out / "model" / "model.safetensors"
    built = weights.stat().st_mtime_ns
    SqlData(**kwargs).prepare(str(out / "model"), fitting=False)  # up to date: no rebuild
    assert weights.stat().st_mtime_ns == built

    data.setup(fitting=True, train_limit=10, processes=2, prompts_needed=8)
    assert len(data.train_examples) == 10
    assert {e.dataset for e in data.train_examples} == {"sql"}
    (held,) = data.val_examples.values()
    assert list(data.val_examples) == ["sql_heldout"] and len(held) == 6
    assert {e.extras["db"] for e in held}.isdisjoint(e.extras["db"] for e in data.train_examples)
    assert all(e.extras["db"].startswith(str(out.resolve())) for e in held)
    with pytest.raises(ValueError, match="fewer than the 7 processes"):
        data.setup(fitting=False, train_limit=None, processes=7, prompts_needed=0)
    with pytest.raises(ValueError, match="fewer than the 13 prompts"):
        data.setup(fitting=True, train_limit=None, processes=1, prompts_needed=13)

    from transformers import AutoTokenizer
    env = data.environment(AutoTokenizer.from_pretrained(out / "model"), "sql_heldout")
    assert isinstance(env, SqlTask) and env.max_turns == data.max_turns
    assert env.score(Turn("answer", held[0].answers[0]), held[0])[0] == 1.0
    with pytest.raises(ValueError, match="one validation set"):
        data.environment(env.tokenizer, "other")

    (out / "db" / "sql_heldout-shop-0.sqlite").unlink()
    with pytest.raises(FileNotFoundError, match=r"names 1 database\(s\) that do not exist"):
        data.setup(fitting=False, train_limit=None, processes=1, prompts_needed=0)

    SqlData(**{**kwargs, "seed": 5}).prepare(str(out / "model"), fitting=True)  # rebuilt
    assert json.loads((out / "manifest.json").read_text())["settings"]["seed"] == 5
    assert not list(tmp_path.glob("sql/model.*"))  # no staging or set-aside folder left


# ---- real trajectories through the agent loop ------------------------------------------------
@pytest.fixture(scope="module")
def grown_world(tmp_path_factory):
    """A tiny policy warm-started (for seconds) on questions whose answers read a view
    or a looked-up id, so its rollouts make views and look ids up."""
    out = tmp_path_factory.mktemp("loop") / "sql"
    data = SqlData(out_dir=str(out), n_train=4, n_eval=2, n_warm=24, questions_per_db=8,
                   kinds=["view_sum", "lookup_view", "view_top"], vocab_size=400,
                   warm_start_steps=150, warm_start_batch=8, warm_start_lr=1e-2,
                   model=TINY_MODEL)
    data.prepare(str(out / "model"), fitting=True)
    data.setup(fitting=True, train_limit=None, processes=1, prompts_needed=4)
    return data


class Recording:
    """A ``SqlTask`` whose ``execute`` and ``score`` also record, per call or answer, the
    query and the dump of the session it ran on (composition: everything else is the
    task's)."""

    def __init__(self, task: SqlTask):
        self.task, self.seen, self.with_state = task, set(), 0
        self.scores_see_state = False

    def __getattr__(self, name):
        return getattr(self.task, name)

    def execute(self, calls, states):
        for call, state in zip(calls, states):
            dump = state.dump()
            self.seen.add((call.argument, repr(dump)))
            self.with_state += bool(dump)
        return self.task.execute(calls, states)

    def score(self, final, example, state=None):
        self.scores_see_state |= state is not None
        if state is not None and final.kind == "answer":
            dump = state.dump()
            self.seen.add((final.argument, repr(dump)))
            self.with_state += bool(dump)
        return self.task.score(final, example, state)


def grow(data: SqlData, continuation: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trace_lightning.rollout.agent import AgentLoop, Start
    from trace_lightning.rollout.engines import HFEngine, SamplingConfig

    tokenizer = AutoTokenizer.from_pretrained(data.model_dir)
    task = Recording(SqlTask(tokenizer, max_turns=data.max_turns,
                             max_seq_tokens=data.max_seq_tokens, continuation=continuation))
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(data.model_dir),
                      tokenizer=tokenizer, batch_size=64)
    loop = AgentLoop(engine, task, SamplingConfig(temperature=1.0, max_tokens=48))
    trees = [loop.new_tree(e) for e in data.train_examples]
    loop.expand([Start(t, 0, 2) for t in trees], seed=0)
    starts = [Start(t, p.id, 2) for t in trees for p in t.prefixes()]
    loop.expand(starts, seed=1)
    loop.release()
    return trees, starts, task


def test_continuations_start_from_their_prefixs_session(grown_world):
    data = grown_world
    before = database_hashes(data.out_dir)
    grown = {}
    for continuation in ("fork", "replay"):
        trees, starts, task = grow(data, continuation)
        assert len(starts) >= 2
        # the rollouts made views and looked ids up: the sessions held state
        assert any("CREATE TEMP VIEW" in n.argument and n.observation.endswith("ok</result>\n")
                   for t in trees for n in t.nodes)
        # every call (and every answer, where the loop hands score the session) ran on a
        # session holding exactly what a fresh replay of the calls before it on its path holds
        expected = set()
        for t in trees:
            for node in t.nodes[1:]:
                if not node.observation and not (task.scores_see_state
                                                 and node.action == "answer"):
                    continue
                fresh = SqlSession(_db_of(data, t))
                for earlier in t.path(node.id)[1:-1]:
                    fresh.run(earlier.argument)
                expected.add((node.argument, repr(fresh.dump())))
                fresh.close()
        assert task.seen == expected
        assert task.with_state > 0  # some ran on a session holding a view
        grown[continuation] = [[(n.parent, n.token_ids, n.observation, n.reward)
                                for n in t.nodes] for t in trees]
    assert grown["fork"] == grown["replay"]
    assert database_hashes(data.out_dir) == before  # the files' bytes, unchanged


def _db_of(data: SqlData, tree) -> str:
    return next(e.extras["db"] for e in data.train_examples if e.id == tree.tree_id)


def test_database_files_are_unchanged_by_sessions(grown_world):
    manifest = json.loads((grown_world.out_dir / "manifest.json").read_text())
    for rel, digest in manifest["databases"].items():
        path = grown_world.out_dir / rel
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
