"""The calculator agent's tiny policy: its tokenizer, and a warm start on gold trajectories.

A gold trajectory is built through the real task, as the agent loop builds a rollout: the
prompt's ids from ``CalcTask.prompt``, each turn's text tokenised, and after every
``<calc>`` turn the observation's ids from ``CalcTask.execute`` (the real calculator). Each
step's turn restates the step's sentence, then calls the calculator on the last result::

     First, she buys 7 more.<calc> 12 + 7</calc>
    <result> 19</result>
     Then, she gives away 5.<calc> 19 - 5</calc>
    <result> 14</result>
    <answer> 14</answer>

The restatement makes each step a copy a small model learns: the step's connective
(``First``, ``Then``, ``Next``, ``After that``) follows from the number of results so far,
the rest of the sentence is copied from the question after it, and the operation and the
operand are read from that copy a few tokens back rather than found among the question's
sentences.

The policy mask is 1 on the turns' tokens and 0 on the prompt's and the observations', so
only what the policy writes is trained on. The supervised loop is the search demo's
(``tasks/search_qa/demo/warm_start.py``: token-mean cross-entropy on policy tokens, AdamW,
linear warmup then a constant rate, an early stop on the loss).

Noisy demonstrations (a share ``noise`` of them) use one wrong operand at a random step that
is not a division, then follow the problem's operations from the wrong value to a wrong
answer: a policy trained on them makes that mistake at about that rate.
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
from trace_lightning.tasks.base import Example
from trace_lightning.tasks.calc.evaluator import evaluate_exact, format_number
from trace_lightning.tasks.calc.problems import Problem
from trace_lightning.tasks.calc.task import CALC, CALC_TAGS, CalcTask, parse_turn
from trace_lightning.tasks.sft import fit_demonstrations

log = logging.getLogger(__name__)
_DIGITS = re.compile(r"(?<=\d)(?=\d)")  # between two adjacent digits


@dataclass
class Demonstration:
    """One training sequence: its token ids and the policy mask (1 on turn tokens)."""

    input_ids: list[int]
    policy_mask: list[int]


def gold_turns(problem: Problem) -> list[str]:
    """The turns of ``problem``'s gold trajectory: per operation, its sentence restated and
    one ``<calc>``, then the answer."""
    return _turns(problem, problem.solution, problem.answer)


def _turns(problem: Problem, expressions: Sequence[str], answer) -> list[str]:
    # A turn restates its step's sentence first, after a space as in the question, so it
    # tokenises as there: the policy copies the sentence its connective starts ("Then,
    # she gives away 5."), then reads the operation and the operand from its own copy.
    sentences = problem.step_sentences
    assert len(sentences) == len(expressions), f"problem {problem.id}: steps != solution"
    return ([f" {s}<calc> {e}</calc>" for s, e in zip(sentences, expressions)]
            + [f"<answer> {answer}</answer>"])


def noisy_turns(problem: Problem, rng: random.Random) -> list[str]:
    """A trajectory with one wrong operand at a random step that is not a division (the
    gold one where every step divides), its operations followed from there."""
    steps = [e.split(" ") for e in problem.solution]  # [left, op, right]
    wrong = [k for k, (_, op, _) in enumerate(steps) if op != "/"]
    if not wrong:
        return gold_turns(problem)
    k = rng.choice(wrong)
    right = int(steps[k][2])
    choices = [n for n in (range(2, 10) if steps[k][1] == "*" else range(1, 61)) if n != right]
    expressions, value = [], None
    for j, (left, op, right_text) in enumerate(steps):
        left = left if value is None else format_number(value)
        right_text = str(rng.choice(choices)) if j == k else right_text
        expressions.append(f"{left} {op} {right_text}")
        value = evaluate_exact(expressions[-1])  # a later division may not divide
    return _turns(problem, expressions, format_number(value))


def demonstrations(task: CalcTask, problems: Sequence[Problem], noise: float = 0.0,
                   seed: int = 0) -> list[Demonstration]:
    """One sequence per problem, built through ``task`` (prompt, real observations)."""
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"warm start noise ({noise}) must be in [0, 1]")
    rng = random.Random(seed)
    out = []
    for p in problems:
        turns = noisy_turns(p, rng) if rng.random() < noise else gold_turns(p)
        ids, _ = task.prompt(Example(p.id, p.question, [str(p.answer)]))
        mask = [0] * len(ids)
        for text in turns:
            turn = parse_turn(text)
            assert turn.kind != "invalid", f"demonstration turn {text!r}: {turn.error}"
            gen = task.tokenizer.encode(text, add_special_tokens=False)
            obs = task.execute([turn])[0][0] if turn.kind == CALC else []
            ids, mask = ids + gen + obs, mask + [1] * len(gen) + [0] * len(obs)
        out.append(Demonstration(ids, mask))
    return out


def calc_tokenizer(problems: Sequence[Problem], vocab_size: int, instruction: str):
    """A byte-level BPE tokenizer trained on ``problems``' prompts and gold trajectories
    (with their results), the calculator tags as single non-special tokens.

    It is trained with a space between adjacent digits, so it learns no merge of two
    digits: every number is tokenised digit by digit, the first digit with its leading
    space (`` 47`` is `` 4``, ``7``). Each digit token is then seen in every number, where a
    merged ``47`` would be seen in few, and the policy copies a number digit by digit."""
    texts = []
    for p in problems:
        results = [f"\n<result> {format_number(evaluate_exact(e))}</result>\n"
                   for e in p.solution]
        turns = gold_turns(p)
        text = (instruction.replace("{question}", p.question)
                + "".join(t + r for t, r in zip(turns, results + [""])))
        texts.append(_DIGITS.sub(" ", text))
    return train_tokenizer(texts, vocab_size, CALC_TAGS)


def warm_start(model_dir: str | Path, task: CalcTask, problems: Sequence[Problem],
               steps: int, batch_size: int = 8, lr: float = 6e-3, noise: float = 0.0,
               stop_loss: float | None = None, seed: int = 0, log_every: int = 50,
               num_threads: int | None = None) -> dict:
    """Fine-tune the model in ``model_dir`` on ``problems``' demonstrations and save it back.

    Args:
        model_dir: a directory ``from_pretrained`` loads (the tiny model); overwritten with
            the trained weights.
        task: the task the demonstrations go through (its tokenizer is the model's).
        problems: the problems demonstrated (each once per pass).
        steps: optimizer steps, at most (0 saves nothing and returns at once).
        batch_size: demonstrations per step.
        lr: AdamW learning rate (20 warmup steps, then constant).
        noise: share of demonstrations with one wrong operand.
        stop_loss: stop once the mean loss of the last 50 steps is at most this (None: run
            all ``steps``).
        seed: seed of the noise, the batch order and torch.
        log_every: log the mean loss every this many steps (0: never).
        num_threads: torch CPU threads while training (restored after); None keeps torch's.

    Returns:
        ``{"losses": [...], "steps": int, "n_demos": int, "seconds": float}``.
    """
    start = time.perf_counter()
    seqs = demonstrations(task, problems, noise=noise, seed=seed)
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
