"""The SQL agent's tiny policy: its tokenizer, and a warm start on gold trajectories.

A gold trajectory is built through the real task, as the agent loop builds a rollout: the
prompt's ids from ``SqlTask.prompt``, each turn's text tokenised, and after every ``<sql>``
turn the observation's ids from ``SqlTask.execute`` run in the trajectory's own session
(real SQLite on the question's database)::

    <sql> SELECT id FROM customers WHERE name = 'Ana Silva'</sql>
    <result> id
     17
    (1 row)</result>
    <answer> SELECT COUNT(*) FROM orders WHERE customer_id = 17</answer>

so a lookup's id is read from a real result, and a TEMP VIEW made in one turn is read by
the answer in the next. The policy mask is 1 on the turns' tokens and 0 on the prompt's and
the observations'; the supervised loop is ``tasks/sft.py``'s.

Noisy demonstrations (a share ``noise`` of them) change one thing in the answer: a quoted
value into another of its pool, a number into another, or an aggregate or an order into
its opposite; a policy trained on them makes such mistakes at about that rate.
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from trace_lightning.models import train_tokenizer
from trace_lightning.tasks.sft import fit_demonstrations
from trace_lightning.tasks.sql.questions import ANSWER_TAG, Question
from trace_lightning.tasks.sql.sandbox import Limits, SqlSession
from trace_lightning.tasks.sql.task import SQL, SQL_TAGS, SqlTask, parse_turn
from trace_lightning.tasks.sql.world import FAMILIES, FIRST_NAMES, LAST_NAMES

log = logging.getLogger(__name__)
_DIGITS = re.compile(r"(?<=\d)(?=\d)")  # between two adjacent digits
_QUOTED = re.compile(r"'([^']*)'")
_NUMBER = re.compile(r"(?<![\w.])\d+(?![\w.])")
_SWAPS = {"MAX": "MIN", "MIN": "MAX", "SUM": "AVG", "AVG": "SUM", "DESC": "ASC", "ASC": "DESC"}
_SWAP_RE = re.compile(r"\b(" + "|".join(_SWAPS) + r")\b")


@dataclass
class Demonstration:
    """One training sequence: its token ids and the policy mask (1 on turn tokens)."""

    input_ids: list[int]
    policy_mask: list[int]


def turn_text(tag: str, query: str) -> str:
    """One action as the policy writes it: ``<sql> QUERY</sql>`` or ``<answer> ...</answer>``."""
    return f"<{tag}> {query}</{tag}>"


def gold_turns(question: Question) -> list[str]:
    """The turns of ``question``'s gold trajectory."""
    return [turn_text(tag, query) for tag, query in question.solution]


def _pool(question: Question, value: str) -> list[str]:
    """The values a quoted ``value`` of ``question`` could have been instead."""
    f = FAMILIES[question.family]
    for pool in (f.pcats, f.icats):
        if value in pool:
            return [v for v in pool if v != value]
    return [n for n in (f"{a} {b}" for a in FIRST_NAMES for b in LAST_NAMES) if n != value]


def noisy_turns(question: Question, rng: random.Random) -> list[str]:
    """The gold turns with one change in the answer (see the module docstring); the gold
    turns where the answer has nothing to change."""
    *steps, (tag, answer) = question.solution
    spots = ([("quoted", m) for m in _QUOTED.finditer(answer)]
             + [("number", m) for m in _NUMBER.finditer(answer)]
             + [("swap", m) for m in _SWAP_RE.finditer(answer)])
    if not spots:
        return gold_turns(question)
    what, m = rng.choice(spots)
    if what == "quoted":
        new = f"'{rng.choice(_pool(question, m.group(1)))}'"
    elif what == "number":
        n = int(m.group(0))
        new = str(rng.choice([k for k in range(max(1, n - 9), n + 10) if k != n]))
    else:
        new = _SWAPS[m.group(0)]
    wrong = answer[:m.start()] + new + answer[m.end():]
    return [turn_text(t, q) for t, q in steps] + [turn_text(tag, wrong)]


def demonstrations(task: SqlTask, questions: Sequence[Question], examples,
                   noise: float = 0.0, seed: int = 0) -> list[Demonstration]:
    """One sequence per question, built through ``task`` (prompt, real observations from a
    session of its own); ``examples[i]`` is ``questions[i]`` as the task's ``Example``."""
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"warm start noise ({noise}) must be in [0, 1]")
    rng = random.Random(seed)
    out = []
    for q, example in zip(questions, examples, strict=True):
        turns = noisy_turns(q, rng) if rng.random() < noise else gold_turns(q)
        ids, _ = task.prompt(example)
        mask = [0] * len(ids)
        session = task.start(example)
        try:
            for text in turns:
                turn = parse_turn(text)
                assert turn.kind != "invalid", f"demonstration turn {text!r}: {turn.error}"
                gen = task.tokenizer.encode(text, add_special_tokens=False)
                obs = task.execute([turn], [session])[0][0] if turn.kind == SQL else []
                ids, mask = ids + gen + obs, mask + [1] * len(gen) + [0] * len(obs)
        finally:
            session.close()
        out.append(Demonstration(ids, mask))
    return out


def sql_tokenizer(task_texts: Sequence[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on ``task_texts`` (prompts and gold trajectories
    with their results), the SQL tags as single non-special tokens.

    It is trained with a space between adjacent digits, so it learns no merge of two
    digits: every number is tokenised digit by digit, and a number reads the same in a
    question, a result and a query (an id copied from a result, a threshold from the
    question)."""
    return train_tokenizer([_DIGITS.sub(" ", t) for t in task_texts], vocab_size, SQL_TAGS)


def trajectory_text(question: Question, example, instruction: str, limits: Limits) -> str:
    """The prompt and gold trajectory of ``question`` (``example`` as the task's) as text,
    real results included: what the tokenizer is trained on."""
    text = instruction.replace("{schema}", example.extras["schema"]).replace(
        "{question}", question.question)
    session = SqlSession(example.extras["db"], limits)
    try:
        for tag, query in question.solution:
            text += turn_text(tag, query)
            if tag != ANSWER_TAG:
                text += f"\n<result> {session.run(query)}</result>\n"
    finally:
        session.close()
    return text


def warm_start(model_dir: str | Path, task: SqlTask, questions: Sequence[Question], examples,
               steps: int, batch_size: int = 8, lr: float = 3e-3, noise: float = 0.0,
               stop_loss: float | None = None, seed: int = 0, log_every: int = 50,
               num_threads: int | None = None) -> dict:
    """Fine-tune the model in ``model_dir`` on ``questions``' demonstrations and save it back.

    Args:
        model_dir: a directory ``from_pretrained`` loads (the tiny model); overwritten with
            the trained weights.
        task: the task the demonstrations go through (its tokenizer is the model's).
        questions: the questions demonstrated (each once per pass).
        examples: ``questions`` as the task's examples, in order.
        steps: optimizer steps, at most (0 saves nothing and returns at once).
        batch_size: demonstrations per step.
        lr: AdamW learning rate (20 warmup steps, then constant).
        noise: share of demonstrations with one change in the answer.
        stop_loss: stop once the mean loss of the last 50 steps is at most this (None: run
            all ``steps``).
        seed: seed of the noise, the batch order and torch.
        log_every: log the mean loss every this many steps (0: never).
        num_threads: torch CPU threads while training (restored after); None keeps torch's.

    Returns:
        ``{"losses": [...], "steps": int, "n_demos": int, "seconds": float}``.
    """
    start = time.perf_counter()
    seqs = demonstrations(task, questions, examples, noise=noise, seed=seed)
    stats = {"losses": [], "steps": 0, "n_demos": len(seqs), "seconds": 0.0}
    if steps == 0:
        return stats
    threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        fit_demonstrations(model_dir, seqs, stats, steps, batch_size, lr, 20, 0.0, 0.0,
                           stop_loss, seed, log_every, task.tokenizer.pad_token_id,
                           lr_flag="--data.task.init_args.warm_start_lr")
    finally:
        torch.set_num_threads(threads)
    stats["seconds"] = time.perf_counter() - start
    return stats
