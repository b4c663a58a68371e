"""Hand-checked exact match / token F1 (SQuAD normalisation, HotpotQA yes/no rule)."""

from __future__ import annotations

import pytest

from trace_lightning.tasks.search_qa.reward import (exact_match, f1_score, normalize_answer, reward_from_scores,
                                    score_answer)


@pytest.mark.parametrize("text, expected", [
    ("The Big  Red Dog.", "big red dog"),  # case, article, punctuation, whitespace
    ("An apple a day", "apple day"),
    ("Theatre anthem", "theatre anthem"),  # articles only as whole words
    ("U.S.A.", "usa"),
    ("  ", ""),
])
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_exact_match_ignores_case_punctuation_and_articles():
    assert exact_match("the Eiffel Tower!", ["Eiffel tower"]) == 1.0
    assert exact_match("Eiffel", ["Eiffel Tower"]) == 0.0
    assert exact_match("NYC", ["New York City", "NYC"]) == 1.0  # any alias
    assert exact_match("Lee Mantle", "Lee Mantle") == 1.0  # a single gold string


def test_f1_partial_overlap():
    # pred "the big red dog" -> [big, red, dog]; gold "red dog" -> [red, dog]
    # common 2: precision 2/3, recall 2/2, F1 = 2 * (2/3) / (2/3 + 1) = 0.8
    assert f1_score("the big red dog", ["red dog"]) == pytest.approx(0.8)
    # pred [barack, obama] vs gold [barack, hussein, obama, ii]: P 2/2, R 2/4 -> F1 2/3
    assert f1_score("Barack Obama", ["Barack Hussein Obama II"]) == pytest.approx(2 / 3)
    # repeated tokens count once per match: pred [new, new, york] vs gold [new, york]
    # common min(2,1) + 1 = 2: P 2/3, R 1 -> 0.8
    assert f1_score("new new york", ["New York"]) == pytest.approx(0.8)
    assert f1_score("Paris", ["London"]) == 0.0


def test_scores_take_the_best_alias():
    # vs "red dog": 0.8 (above); vs "big red dog": exact -> 1.0
    assert f1_score("the big red dog", ["red dog", "big red dog"]) == 1.0
    assert exact_match("the big red dog", ["red dog", "big red dog"]) == 1.0
    # vs "dog": P 1/3, R 1 -> 0.5; vs "red dog": 0.8 -> max 0.8
    assert f1_score("big red dog", ["dog", "red dog"]) == pytest.approx(0.8)


def test_yes_no_rule():
    assert f1_score("no", ["yes"]) == 0.0
    assert f1_score("yes", ["yes"]) == 1.0
    # gold "yes": any other prediction scores 0 even with token overlap
    assert f1_score("yes they are", ["yes"]) == 0.0
    # pred "no" vs a non yes/no gold that contains "no": 0 by the rule (plain F1 would be 2/3)
    assert f1_score("no", ["no doubt"]) == 0.0
    assert f1_score("noanswer", ["no answer"]) == 0.0


def test_missing_or_empty_answers_score_zero():
    assert score_answer(None, ["yes"]) == (0.0, 0.0)
    assert score_answer("", ["yes"]) == (0.0, 0.0)
    assert score_answer("the", ["the"]) == (0.0, 0.0)  # normalises to empty: still wrong
    assert score_answer(" . ", ["."]) == (0.0, 0.0)
    assert score_answer("Red dog", ["the big red dog"]) == (0.0, pytest.approx(0.8))
    assert score_answer("Lee Mantle", ["Lee Mantle"]) == (1.0, 1.0)


def test_reward_from_scores():
    assert reward_from_scores(1.0, 1.0, "em") == 1.0
    assert reward_from_scores(0.0, 0.8, "em") == 0.0
    assert reward_from_scores(0.0, 0.8, "f1") == 0.8
    assert reward_from_scores(0.0, 0.3, "f1_threshold") == 1.0  # >= threshold
    assert reward_from_scores(0.0, 0.29, "f1_threshold") == 0.0
    assert reward_from_scores(0.0, 0.5, "f1_threshold", f1_threshold=0.6) == 0.0
    with pytest.raises(ValueError, match="one of 'em', 'f1', 'f1_threshold'"):
        reward_from_scores(1.0, 1.0, "accuracy")
    with pytest.raises(ValueError, match="f1_threshold"):
        reward_from_scores(1.0, 1.0, "f1_threshold", f1_threshold=2.0)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        reward_from_scores(0.0, 0.0, "f1_threshold", f1_threshold=0.0)
