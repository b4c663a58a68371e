"""Answer reward: exact match and token F1 against every gold alias, SQuAD-style.

Normalisation (SQuAD v1.1 ``evaluate.py``): lower case, drop punctuation, drop the articles
a/an/the, collapse whitespace. Token F1 as in that script, with HotpotQA's rule on top: if the
normalised prediction or gold is one of yes/no/noanswer and the two differ, F1 is 0 (so "no"
earns nothing against "yes, he did"). Each score is the maximum over aliases.

Deviation from the scripts: a prediction that normalises to the empty string scores 0 on
both metrics even against a gold that also normalises to empty (an empty answer is wrong).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from typing import Literal

_PUNCTUATION = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_YES_NO = {"yes", "no", "noanswer"}


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _golds(golds: str | Sequence[str]) -> list[str]:
    return [golds] if isinstance(golds, str) else list(golds)


def _f1(pred: str, gold: str) -> float:
    """Token F1 of two normalised strings, with HotpotQA's yes/no/noanswer rule."""
    if (pred in _YES_NO or gold in _YES_NO) and pred != gold:
        return 0.0
    pred_tokens, gold_tokens = pred.split(), gold.split()
    same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def exact_match(pred: str, golds: str | Sequence[str]) -> float:
    """1.0 if the normalised prediction equals some normalised gold alias, else 0.0."""
    pred_n = normalize_answer(pred)
    if not pred_n:
        return 0.0
    return float(any(pred_n == normalize_answer(g) for g in _golds(golds)))


def f1_score(pred: str, golds: str | Sequence[str]) -> float:
    """Best token F1 over the gold aliases."""
    pred_n = normalize_answer(pred)
    if not pred_n:
        return 0.0
    return max((_f1(pred_n, normalize_answer(g)) for g in _golds(golds)), default=0.0)


def score_answer(pred: str | None, golds: str | Sequence[str]) -> tuple[float, float]:
    """(em, f1) of a final answer; (0, 0) for a missing (None) or empty answer."""
    if pred is None:
        return 0.0, 0.0
    return exact_match(pred, golds), f1_score(pred, golds)


def reward_from_scores(em: float, f1: float,
                       kind: Literal["em", "f1", "f1_threshold"] = "em",
                       f1_threshold: float = 0.3) -> float:
    """The scalar reward: EM, F1, or 1 when F1 >= ``f1_threshold`` (else 0)."""
    if kind == "em":
        return float(em)
    if kind == "f1":
        return float(f1)
    if kind == "f1_threshold":
        if not 0.0 < f1_threshold <= 1.0:
            raise ValueError(f"f1_threshold ({f1_threshold}) must be in (0, 1] (at 0 a missing "
                             f"answer earns 1); the paper's reading of a correct answer is 0.3")
        return 1.0 if f1 >= f1_threshold else 0.0
    raise ValueError(f"reward kind {kind!r} is not one of 'em', 'f1', 'f1_threshold'")
