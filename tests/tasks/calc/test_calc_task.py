"""The calculator task: the evaluator by hand and by refusing what is not arithmetic, the
generator's answers by evaluating each gold solution, parsing, the tool's observations,
scoring, the settings refused on construction, and one tiny build of its policy."""

from __future__ import annotations

import ast
import inspect
import json
import random
import re
from fractions import Fraction

import pytest

from trace_lightning.models import train_tokenizer
from trace_lightning.tasks.base import Example, Task, TaskData, Turn
from trace_lightning.tasks.calc import (
    CALC_INSTRUCTION,
    CalcData,
    CalcError,
    CalcTask,
    evaluate,
    format_number,
    generate_problems,
    parse_turn,
)
from trace_lightning.tasks.calc import evaluator
from trace_lightning.tasks.calc.evaluator import MAX_CHARS, MAX_NODES
from trace_lightning.tasks.calc.problems import MAX_VALUE, STEPS
from trace_lightning.tasks.calc.task import CALC_TAGS
from trace_lightning.tasks.calc.warm_start import (
    calc_tokenizer,
    demonstrations,
    gold_turns,
    noisy_turns,
)


@pytest.fixture(scope="module")
def tokenizer():
    return calc_tokenizer(generate_problems(5, 60), 320, CALC_INSTRUCTION)


@pytest.fixture(scope="module")
def task(tokenizer):
    return CalcTask(tokenizer, max_turns=5, max_seq_tokens=512)


# ---- the evaluator ----------------------------------------------------------------------
@pytest.mark.parametrize("expr, value", [
    ("2 + 3 * 4", 14),  # precedence: 3 * 4 = 12, + 2
    ("(2 + 3) * 4", 20),
    ("7 / 2", 3.5),
    ("10 / 4 * 2", 5),  # 2.5 * 2, whole: an int
    ("(1 / 3) * 3", 1),  # exact: 1/3 * 3 is 1, not 0.999...
    ("0.1 + 0.2", 0.3),  # 1/10 + 2/10 = 3/10 (floats would give 0.30000000000000004)
    ("-(3 - 5)", 2),
    ("+4 - -1", 5),
    ("  12 + 7  ", 19),
    ("1.5 * 2", 3),
    ("((((1 + 2))))", 3),
    ("100 - 2 * 3 * 4 / 8 + 1", 98),  # 2*3*4 = 24, / 8 = 3; 100 - 3 + 1
    ("-7 / 2", -3.5),
])
def test_evaluate_by_hand(expr, value):
    got = evaluate(expr)
    assert got == value
    assert isinstance(got, int) == isinstance(value, int)  # whole values come back as ints


@pytest.mark.parametrize("value, text", [
    (4.0, "4"), (4, "4"), (Fraction(8, 2), "4"), (3.5, "3.5"), (-2, "-2"),
    (Fraction(1, 3), "0.333333"), (Fraction(-22, 3), "-7.33333"), (0.0, "0"),
])
def test_format_number(value, text):
    assert format_number(value) == text


@pytest.mark.parametrize("expr, reason", [
    ("__import__('os')", "function calls"),
    ("__import__('os').system('true')", "not allowed"),
    ("x + 1", "names"),
    ("abs(-1)", "function calls"),
    ("(1).real", "attributes"),
    ("2**100", "'**'"),
    ("2 ** 3", "'**'"),
    ("7 // 2", "'//'"),
    ("7 % 2", "'%'"),
    ("1 < 2", "comparisons"),
    ("True + 1", "bool"),
    ("'a' * 3", "str"),
    ("[1, 2]", "not allowed"),
    ("lambda: 1", "not allowed"),
    ("not 1", "'not'"),
    ("1j", "complex"),
    ("9" * 20, "too large"),  # a 20-digit literal, beyond 10**12
    ("1e300", "too large"),
    # 10**12 * 10**6 is beyond the bound, though the whole is 10**6: intermediates count too
    ("1000000 * 1000000 * 1000000 / 1000000000000", "too large"),
    ("1 / 0", "division by zero"),
    ("1 / (2 - 2)", "division by zero"),
    ("(" * 100 + "1" + ")" * 100, "too long"),  # 201 characters
    ("-" * 40 + "1", "too long"),  # 40 nested negations: 82 AST nodes
    ("1" + " + 1" * 30, "too long"),  # 31 terms: 123 AST nodes, 121 characters
    ("", "empty"),
    ("1 +", "not a valid expression"),
    ("1; 2", "not a valid expression"),
    ("import os", "not a valid expression"),
    ("1\x00", "not a valid expression"),
])
def test_evaluate_refuses(expr, reason):
    with pytest.raises(CalcError) as e:
        evaluate(expr)
    assert reason in e.value.reason


def test_size_bounds_are_the_ones_tested():
    assert len("(" * 100 + "1" + ")" * 100) > MAX_CHARS
    assert len("1" + " + 1" * 30) <= MAX_CHARS
    assert sum(1 for _ in ast.walk(ast.parse("1" + " + 1" * 30, mode="eval"))) > MAX_NODES


def test_evaluator_never_calls_eval_or_exec():
    tree = ast.parse(inspect.getsource(evaluator))
    called = {n.func.id for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert not called & {"eval", "exec", "compile", "__import__"}


# ---- the problems -----------------------------------------------------------------------
def test_every_gold_solution_evaluates_to_its_answer():
    """Brute force over seeds: each step starts from the previous result, stays a whole
    number in 1..MAX_VALUE, and its operand is written in the step's own sentence."""
    seen_ops = set()
    for seed in range(40):
        for p in generate_problems(seed, 100):
            assert 1 <= p.n_ops <= 4
            seen_ops.add(p.n_ops)
            sentences = p.step_sentences
            assert [s.split(",")[0] for s in sentences] == STEPS[:p.n_ops]
            left, op, right = p.solution[0].split(" ")
            assert f" {left} " in f" {p.question.split('.')[0]} "  # the opening's number
            value = None
            for expr, sentence in zip(p.solution, sentences):
                left, op, right = expr.split(" ")
                if value is not None:
                    assert int(left) == value  # the previous result, read back
                assert re.findall(r"\d+", sentence) == [right]  # the step's only number
                value = evaluate(expr)
                assert isinstance(value, int) and 1 <= value <= MAX_VALUE, (p, expr)
            assert value == p.answer
            assert p.example("s").answers == [str(p.answer)]
    assert seen_ops == {1, 2, 3, 4}


def test_problems_are_deterministic_and_seeded():
    a, b = generate_problems(3, 200), generate_problems(3, 200)
    assert a == b
    other = generate_problems(4, 200)
    assert [p.question for p in a] != [p.question for p in other]
    assert len({p.question for p in a}) == 200  # no repeats within a set
    assert len({p.id for p in a}) == 200


def test_problems_mix_one_to_max_ops():
    counts = [sum(p.n_ops == k for p in generate_problems(0, 400)) for k in (1, 2, 3, 4)]
    assert all(c > 60 for c in counts), counts  # about 100 each
    assert {p.n_ops for p in generate_problems(0, 200, max_ops=2)} == {1, 2}
    with pytest.raises(ValueError, match="max_ops"):
        generate_problems(0, 10, max_ops=5)


def test_exclude_keeps_other_sets_out():
    first = generate_problems(1, 50)
    again = generate_problems(1, 50, exclude={p.question for p in first})
    assert not {p.question for p in first} & {p.question for p in again}
    # one-operation problems repeat across seeds more easily: still none shared
    ones = generate_problems(7, 300, max_ops=1)
    held = generate_problems(8, 300, max_ops=1, exclude={p.question for p in ones})
    assert not {p.question for p in ones} & {p.question for p in held}


def test_train_and_heldout_sets_share_no_problem():
    data = CalcData(out_dir="unused", n_train=2000, n_eval=200, n_warm=2000)
    train, warm, held = data.problem_sets()
    questions = [{p.question for p in s} for s in (train, warm, held)]
    assert [len(q) for q in questions] == [2000, 2000, 200]
    assert not questions[0] & questions[2]
    assert not questions[1] & questions[2]
    assert not questions[0] & questions[1]


# ---- parsing ----------------------------------------------------------------------------
@pytest.mark.parametrize("text, kind, argument", [
    ("<calc> 12 + 7</calc>", "calc", "12 + 7"),
    (" First, she buys 7 more.<calc> 12 + 7</calc>", "calc", "12 + 7"),
    ("<calc>(1 +\n 2)</calc>\n", "calc", "(1 + 2)"),
    ("<answer> 14</answer>", "answer", "14"),
    ("so it is <answer>14</answer>  ", "answer", "14"),
    ("<answer></answer>", "answer", ""),  # an empty answer is a wrong answer, not malformed
    ("<calc> x + 1</calc>", "calc", "x + 1"),  # the calculator, not the parser, refuses it
])
def test_parse_valid_turns(text, kind, argument):
    assert parse_turn(text) == Turn(kind, argument)


@pytest.mark.parametrize("text, error", [
    ("", "no <calc> or <answer>"),
    ("the answer is 14", "no <calc> or <answer>"),
    ("<calc> 1 + 2", "never closed"),
    ("<answer> 3", "never closed"),
    ("<calc> 1 <answer> 2</answer></calc>", "nested or unclosed"),
    ("<calc> 1 </answer>", "nested or unclosed"),
    ("1 + 2</calc>", "without an opening tag"),
    ("<calc> 1</calc><calc> 2</calc>", "two actions"),
    ("<calc> 1</calc><answer> 1</answer>", "two actions"),
    ("<answer> 3</answer> apples", "text after the action"),
    ("<result> 3</result>", "wrote a <result>"),
    ("<calc>   </calc>", "empty <calc>"),
])
def test_parse_invalid_turns(text, error):
    turn = parse_turn(text)
    assert turn.kind == "invalid" and error in turn.error


def test_task_parse_cuts_at_the_first_stop(task):
    # the engine keeps the whole token that completed a stop string, and stops there
    assert task.parse("<answer> 3</answer>.") == Turn("answer", "3")
    assert task.parse("<calc> 1 + 1</calc><answer> 2</answer>") == Turn("calc", "1 + 1")


def test_parse_never_raises():
    rng = random.Random(0)
    pieces = ["<calc>", "</calc>", "<answer>", "</answer>", "<result>", "</result>", "<calc",
              "calc>", "1", " + ", "(", ")", " ", "\n", "x", "</", ">", "<"]
    for _ in range(2000):
        turn = parse_turn("".join(rng.choice(pieces) for _ in range(rng.randint(0, 12))))
        assert turn.kind in ("calc", "answer", "invalid")
        assert (turn.kind == "invalid") == bool(turn.error)


# ---- the tool and the reward ------------------------------------------------------------
def test_execute_gives_results_and_error_observations(task, tokenizer):
    calls = [Turn("calc", "12 + 7"), Turn("calc", "7 / 2"), Turn("calc", "1 / 0"),
             Turn("calc", "__import__('os')"), Turn("calc", "2**100")]
    out = task.execute(calls)
    texts = [text for _, text in out]
    assert texts[:3] == ["\n<result> 19</result>\n", "\n<result> 3.5</result>\n",
                         "\n<result> error: division by zero</result>\n"]
    assert texts[3].startswith("\n<result> error: function calls are not allowed")
    assert texts[4].startswith("\n<result> error: '**' is not allowed")
    for ids, text in out:
        assert ids == tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    assert task.execute([]) == []


@pytest.mark.parametrize("final, reward", [
    (Turn("answer", "14"), 1.0),
    (Turn("answer", "14.0"), 1.0),
    (Turn("answer", "+14"), 1.0),
    (Turn("answer", " 14 "), 1.0),
    (Turn("answer", "15"), 0.0),
    (Turn("answer", "14 apples"), 0.0),
    (Turn("answer", "1.4e1"), 0.0),  # a plain number only
    (Turn("answer", ""), 0.0),
    (Turn("calc", "14"), 0.0),  # cut on a tool call: never answered
    (Turn("invalid", error="no <calc> or <answer>"), 0.0),
])
def test_score(task, final, reward):
    assert task.score(final, Example("q", "?", ["14"])) == (reward, {"correct": reward})


def test_prompt_and_stop_strings(task, tokenizer):
    ids, text = task.prompt(Example("q", "Ana has 3 apples. How many?", ["3"]))
    assert text == CALC_INSTRUCTION.replace("{question}", "Ana has 3 apples. How many?")
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert isinstance(task, Task)
    assert task.stop == ["</calc>", "</answer>"] and task.calls_metric == "calcs"
    for tag in CALC_TAGS:
        assert len(tokenizer.encode(tag, add_special_tokens=False)) == 1


def test_task_refuses_a_tokenizer_whose_stop_string_is_special():
    tok = train_tokenizer(["Ana has 3 apples. <calc> 1 + 2</calc>"], 300)
    tok.add_special_tokens({"additional_special_tokens": ["</calc>"]})
    with pytest.raises(ValueError, match="special token"):
        CalcTask(tok)


def test_tokenizer_splits_numbers_into_digits(tokenizer):
    assert all(sum(c.isdigit() for c in token) <= 1 for token in tokenizer.get_vocab())
    # a number is the same tokens in the question, an expression, and a result
    ids = tokenizer.encode(" 47", add_special_tokens=False)
    turn = tokenizer.encode("<calc> 47 + 1</calc>", add_special_tokens=False)
    assert turn[1:1 + len(ids)] == ids


# ---- demonstrations ---------------------------------------------------------------------
def test_demonstrations_train_on_turns_and_read_real_results(task, tokenizer):
    problems = generate_problems(11, 20)
    for p, d in zip(problems, demonstrations(task, problems)):
        assert len(d.input_ids) == len(d.policy_mask)
        prompt_ids, _ = task.prompt(p.example("x"))
        assert d.input_ids[:len(prompt_ids)] == prompt_ids
        # the masked-in text is exactly the gold turns; the rest after the prompt are the
        # calculator's results, each the next step's left operand
        policy = tokenizer.decode([t for t, m in zip(d.input_ids, d.policy_mask) if m])
        assert policy == "".join(gold_turns(p))
        rest = [t for t, m in zip(d.input_ids[len(prompt_ids):],
                                  d.policy_mask[len(prompt_ids):]) if not m]
        results = [f"\n<result> {e.split(' ')[0]}</result>\n" for e in p.solution[1:]]
        assert tokenizer.decode(rest) == "".join(results + [f"\n<result> {p.answer}</result>\n"])


def test_noisy_turns_misread_one_operand():
    rng = random.Random(0)
    changed = 0
    for p in generate_problems(12, 200):
        gold, noisy = gold_turns(p), noisy_turns(p, rng)
        assert len(gold) == len(noisy)
        assert all(parse_turn(t).kind != "invalid" for t in noisy)
        exprs = [(parse_turn(g).argument, parse_turn(n).argument)
                 for g, n in zip(gold[:-1], noisy[:-1])]
        first = next((k for k, (g, n) in enumerate(exprs) if g != n), None)
        if first is None:  # every step divides: nothing to misread
            assert all(" / " in g for g, _ in exprs)
            continue
        changed += 1
        g_left, g_op, g_right = exprs[first][0].split(" ")
        n_left, n_op, n_right = exprs[first][1].split(" ")
        assert (g_left, g_op) == (n_left, n_op) and g_right != n_right
    assert changed > 150


# ---- CalcData ---------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, flag", [
    ({"eval_seed": 0}, "--data.task.init_args.eval_seed (0)"),
    ({"warm_seed": 1}, "--data.task.init_args.warm_seed (1)"),
    ({"n_eval": 0}, "--data.task.init_args.n_eval (0)"),
    ({"n_train": 0}, "--data.task.init_args.n_train (0)"),
    ({"max_ops": 5}, "--data.task.init_args.max_ops (5)"),
    ({"max_ops": 0}, "--data.task.init_args.max_ops (0)"),
    ({"max_turns": 4}, "--data.task.init_args.max_turns (4)"),  # 4 ops need 5 turns
    ({"max_seq_tokens": 0}, "--data.task.init_args.max_seq_tokens (0)"),
    ({"instruction": "no placeholder"}, "--data.task.init_args.instruction"),
    ({"vocab_size": 100}, "--data.task.init_args.vocab_size (100)"),
    ({"warm_start_lr": 0.0}, "--data.task.init_args.warm_start_lr (0.0)"),
    ({"warm_start_noise": 1.5}, "--data.task.init_args.warm_start_noise (1.5)"),
    ({"warm_start_stop_loss": 0.0}, "--data.task.init_args.warm_start_stop_loss (0.0)"),
])
def test_calc_data_refuses_bad_settings(kwargs, flag):
    with pytest.raises(ValueError) as e:
        CalcData(**kwargs)
    assert flag in str(e.value)


def test_calc_data_accepts_a_warm_seed_equal_to_seed_without_a_warm_start():
    CalcData(warm_seed=0, warm_start_steps=0)


def test_prepare_requires_its_own_policy(tmp_path):
    data = CalcData(out_dir=str(tmp_path / "calc"))
    with pytest.raises(ValueError, match=r"--model.policy_path \('other/model'\)"):
        data.prepare("other/model", fitting=True)
    assert not (tmp_path / "calc").exists()  # refused before any work


def test_prepare_builds_once_and_setup_reads_the_sets(tmp_path):
    out = tmp_path / "calc"
    kwargs = dict(out_dir=str(out), n_train=12, n_eval=6, n_warm=24, vocab_size=320,
                  warm_start_steps=3, warm_start_batch=4,
                  model={"hidden_size": 32, "layers": 1, "heads": 1, "kv_heads": 1,
                         "intermediate": 64, "max_position": 512})
    data = CalcData(**kwargs)
    assert isinstance(data, TaskData) and data.metric == "correct" and data.max_seq_tokens == 512
    data.prepare(str(out / "model"), fitting=True)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["settings"] == data.settings()
    assert manifest["warm_start"]["steps"] == 3 and manifest["warm_start"]["n_demos"] == 24
    weights = out / "model" / "model.safetensors"
    built = weights.stat().st_mtime_ns
    CalcData(**kwargs).prepare(str(out / "model"), fitting=False)  # up to date: no rebuild
    assert weights.stat().st_mtime_ns == built

    data.setup(fitting=True, train_limit=10, processes=2, prompts_needed=8)
    assert len(data.train_examples) == 10
    assert {e.dataset for e in data.train_examples} == {"calc"}
    (held,) = data.val_examples.values()
    assert list(data.val_examples) == ["calc_heldout"] and len(held) == 6
    assert {e.dataset for e in held} == {"calc_heldout"}
    assert not {e.question for e in held} & {e.question for e in data.train_examples}
    with pytest.raises(ValueError, match="fewer than the 7 processes"):
        data.setup(fitting=False, train_limit=None, processes=7, prompts_needed=0)
    with pytest.raises(ValueError, match="fewer than the 13 prompts"):
        data.setup(fitting=True, train_limit=None, processes=1, prompts_needed=13)

    from transformers import AutoTokenizer
    env = data.environment(AutoTokenizer.from_pretrained(out / "model"), "calc_heldout")
    assert isinstance(env, CalcTask) and env.max_turns == data.max_turns
    assert env.score(Turn("answer", held[0].answers[0]), held[0])[0] == 1.0

    CalcData(**{**kwargs, "seed": 5}).prepare(str(out / "model"), fitting=True)  # rebuilt
    assert json.loads((out / "manifest.json").read_text())["settings"]["seed"] == 5
    assert not list(tmp_path.glob("calc/model.*"))  # no staging or set-aside folder left


def test_an_agent_loop_describing_prompts_needs_a_task_that_describes_them(task):
    from trace_lightning.rollout.agent import AgentLoop
    from trace_lightning.rollout.engines.base import SamplingConfig
    with pytest.raises(ValueError, match=r"--model.featuriser.task_features asks for the task's "
                                         r"description of each prompt, but CalcTask gives none"):
        AgentLoop(None, task, SamplingConfig(), describe=True)
    tree = AgentLoop(None, task, SamplingConfig()).new_tree(Example("p", "1 + 2", ["3"]))
    assert tree.prompt_features == []
