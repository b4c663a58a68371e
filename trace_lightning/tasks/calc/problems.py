"""Generated arithmetic word problems with gold tool solutions.

A problem follows one person's pile of things through 1 to ``max_ops`` operations (add,
subtract, multiply, divide), one sentence each, worded from a few templates per operation
and led by its place's connective (``First``, ``Then``, ``Next``, ``After that``)::

    Ana has 12 apples. First, she buys 7 more. Then, she gives away 5. How many apples does
    Ana have now?

Its gold solution is one calculator expression per operation, each on the previous result
(``12 + 7``, ``19 - 5``), so a demonstration must read each tool result back. Every value
along the way is a whole number in 1..9999: a subtraction leaves at least 1, a division is
by a divisor of the current value, a multiplication stays under 10,000.

Problems are drawn from ``random.Random(seed)``: one seed always gives the same problems.
A set never repeats a question, and ``exclude`` keeps another set's questions out (the
held-out set excludes the training and warm-start sets, so no held-out problem was ever
trained on, whatever the seeds).
"""

from __future__ import annotations

import random
import re
from collections.abc import Collection
from dataclasses import dataclass

from trace_lightning.tasks.base import Example

MAX_OPS = 4  # the templates chain up to this many operations
MAX_VALUE = 9999  # every value along a solution is in 1..MAX_VALUE

# (name, subject pronoun, object pronoun)
PEOPLE = [("Ana", "she", "her"), ("Ben", "he", "him"), ("Chloe", "she", "her"),
          ("Dev", "he", "him"), ("Eva", "she", "her"), ("Farid", "he", "him"),
          ("Grace", "she", "her"), ("Hugo", "he", "him"), ("Iris", "she", "her"),
          ("Jonas", "he", "him"), ("Kira", "she", "her"), ("Leo", "he", "him"),
          ("Maya", "she", "her"), ("Nico", "he", "him"), ("Olga", "she", "her"),
          ("Pablo", "he", "him")]
ITEMS = ["apples", "marbles", "stickers", "coins", "cards", "pencils", "shells", "stamps",
         "books", "beads", "cookies", "buttons"]

OPENINGS = ["{name} has {n} {items}.", "{name} starts with {n} {items}.",
            "There are {n} {items} in {name}'s bag."]
# per operation: sentences about the pile ({Sub}: the capitalised subject pronoun)
TEMPLATES = {
    "+": ["{Sub} buys {n} more.", "{Sub} finds {n} more.", "A friend gives {obj} {n} more."],
    "-": ["{Sub} gives away {n}.", "{Sub} sells {n}.", "{Sub} loses {n}."],
    "*": ["{Sub} ends up with {n} times as many.", "The number of {items} grows {n} times.",
          "Each one is swapped for {n} new ones."],
    "/": ["{Sub} packs them equally into {n} boxes and keeps one box.",
          "{Sub} splits them into {n} equal piles and keeps one pile.",
          "{Sub} shares them equally among {n} friends and keeps one share."],
}
# the connective of each operation's sentence, by its place: the k-th step is findable
STEPS = ["First", "Then", "Next", "After that"]
QUESTIONS = ["How many {items} does {name} have now?", "How many {items} are there now?",
             "How many {items} does {sub} have in the end?"]


@dataclass
class Problem:
    """One word problem: its text, its integer answer and its gold solution (one
    calculator expression per operation, in order)."""

    id: str
    question: str
    answer: int
    solution: list[str]

    @property
    def n_ops(self) -> int:
        return len(self.solution)

    @property
    def step_sentences(self) -> list[str]:
        """The sentence of each operation, in order (the question's sentences between the
        opening one and the final question)."""
        return re.split(r"(?<=\.) ", self.question)[1:1 + self.n_ops]

    def example(self, dataset: str) -> Example:
        """The problem as a task ``Example`` of ``dataset``."""
        return Example(id=self.id, question=self.question, answers=[str(self.answer)],
                       dataset=dataset)

    def record(self, dataset: str) -> dict:
        """One JSON line in the QA schema (``datasets.load_qa`` reads it too) plus the gold
        solution; ``from_record`` reads it back."""
        return {"id": self.id, "question": self.question, "answers": [str(self.answer)],
                "dataset": dataset, "solution": list(self.solution)}

    @classmethod
    def from_record(cls, record: dict) -> Problem:
        return cls(id=str(record["id"]), question=record["question"],
                   answer=int(record["answers"][0]), solution=list(record["solution"]))


def _operand(op: str, x: int, rng: random.Random) -> int | None:
    """An operand for ``op`` on the current value ``x`` that keeps the result whole and in
    1..MAX_VALUE, or None where ``op`` cannot apply to ``x``."""
    if op == "+":
        return rng.randint(1, min(60, MAX_VALUE - x)) if x < MAX_VALUE else None
    if op == "-":
        return rng.randint(1, min(60, x - 1)) if x >= 2 else None
    if op == "*":
        top = min(9, MAX_VALUE // x)
        return rng.randint(2, top) if top >= 2 else None
    divisors = [d for d in range(2, 13) if x % d == 0]
    return rng.choice(divisors) if divisors else None


def draw_problem(rng: random.Random, n_ops: int, problem_id: str) -> Problem:
    """One problem of ``n_ops`` operations drawn from ``rng``."""
    name, sub, obj = rng.choice(PEOPLE)
    items = rng.choice(ITEMS)
    x = rng.randint(2, 60)
    words = {"name": name, "sub": sub, "Sub": sub.capitalize(), "obj": obj, "items": items}
    sentences = [rng.choice(OPENINGS).format(n=x, **words)]
    solution = []
    for step in STEPS[:n_ops]:
        options = [(op, n) for op in TEMPLATES if (n := _operand(op, x, rng)) is not None]
        op, n = rng.choice(options)  # "+" always applies: x < MAX_VALUE after any step
        sentence = rng.choice(TEMPLATES[op]).format(n=n, **words)
        sentences.append(f"{step}, {sentence[0].lower()}{sentence[1:]}")
        solution.append(f"{x} {op} {n}")
        x = {"+": x + n, "-": x - n, "*": x * n, "/": x // n}[op]
    sentences.append(rng.choice(QUESTIONS).format(**words))
    return Problem(id=problem_id, question=" ".join(sentences), answer=x, solution=solution)


def generate_problems(seed: int, n: int, max_ops: int = MAX_OPS, prefix: str = "calc",
                      exclude: Collection[str] = ()) -> list[Problem]:
    """``n`` distinct problems from ``seed``, with 1..``max_ops`` operations (uniformly
    mixed), none whose question is in ``exclude``.

    Args:
        seed: seed of the draw (the same seed gives the same problems).
        n: problems wanted.
        max_ops: most operations of a problem, in 1..MAX_OPS.
        prefix: ids are ``<prefix>-<seed>-<k>``.
        exclude: questions (texts) of other sets to leave out.
    """
    if not 1 <= max_ops <= MAX_OPS:
        raise ValueError(f"max_ops ({max_ops}) must be in 1..{MAX_OPS}")
    rng = random.Random(seed)
    seen = set(exclude)
    problems: list[Problem] = []
    for _ in range(100 * n + 1000):  # room for draws that repeat or are excluded
        if len(problems) == n:
            break
        p = draw_problem(rng, rng.randint(1, max_ops), f"{prefix}-{seed}-{len(problems)}")
        if p.question not in seen:
            seen.add(p.question)
            problems.append(p)
    if len(problems) < n:
        raise ValueError(f"could draw only {len(problems)} distinct problems of up to "
                         f"{max_ops} operations from seed {seed}; ask for fewer")
    return problems
