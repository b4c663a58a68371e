"""benchmarks/regime.py: each budget's runs at equal total leaves, and the study's line."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "regime.py"


@pytest.fixture(scope="module")
def regime():
    spec = importlib.util.spec_from_file_location("bench_regime", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_each_budget_trains_the_same_total_leaves(regime):
    """2,048 leaves: 32 epochs of 64 (32 roots, 48 candidates), 8 of 256 (the demo's 128
    roots and 192 candidates), each scored once, after its last epoch."""
    args = regime.parse_args(["--extra=--trainer.logger=false"])
    a64 = regime.budget_args(64, args)
    flag = lambda name: a64[a64.index(name) + 1]  # noqa: E731
    assert (flag("--epochs"), flag("--val-every")) == ("32", "32")
    assert "--no-before" in a64 and flag("--final-samples") == "16"
    assert "--extra=--data.allocator.roots=32" in a64
    assert "--extra=--data.candidates_per_step=48" in a64
    assert a64[-1] == "--extra=--trainer.logger=false"
    a256 = regime.budget_args(256, args)
    assert a256[a256.index("--epochs") + 1] == "8"
    assert "--extra=--data.allocator.roots=128" in a256
    assert "--extra=--data.candidates_per_step=192" in a256


@pytest.mark.parametrize("leaves", [66, 96])
def test_a_budget_that_cannot_split_evenly_is_refused(regime, leaves):
    # 66 is no multiple of 4 (roots and candidates); 96 does not divide 2,048
    with pytest.raises(SystemExit, match=f"--budgets {leaves} must be a multiple of 4 that "
                                         f"divides --total-leaves 2048"):
        regime.budget_args(leaves, regime.parse_args([]))


def test_the_line_pairs_each_budget_and_keeps_every_run_s_provenance(regime, tmp_path,
                                                                     monkeypatch):
    calls = []

    def learning_main(argv):
        calls.append(argv)
        leaves = 2048 // int(argv[argv.index("--epochs") + 1])
        per = {"effective_ratio": 0.4, "generated_tokens_per_step": 30.0 * leaves,
               "step_s": leaves / 16, "final_eval_per_seed": [0.44, 0.45],
               "prompts_distinct": 100.0 + leaves}
        paired = {"mean": 0.01, "se": 0.005, "ahead": 2, "seeds": 2}
        return {"methods": {
                    "uniform": {**per, "final_eval_acc": 0.445},
                    "oracle": {**per, "final_eval_acc": 0.455, "effective_ratio": 0.7,
                               "vs_uniform": {"final_eval": paired, "effective_ratio": paired}}},
                "runs": {"uniform_seed0": {"commit": f"c{leaves}"}, "oracle_seed0": None}}

    monkeypatch.setattr(regime.learning, "main", learning_main)
    out = tmp_path / "regime.json"
    result = regime.main(["--budgets", "64,256", "--seeds", "0,1", "--out", str(out),
                          "--held-in", "50"])
    assert [a[a.index("--epochs") + 1] for a in calls] == ["32", "8"]
    assert [a[a.index("--held-in") + 1] for a in calls] == ["50", "50"]
    assert result["budgets"]["64"]["oracle"]["prompts_distinct"] == 164.0
    assert result["budgets"]["64"]["oracle"]["vs_uniform_final_eval"]["mean"] == 0.01
    assert result["budgets"]["256"]["uniform"]["vs_uniform_final_eval"] is None
    assert result["runs"]["256"] == {"uniform_seed0": {"commit": "c256"}, "oracle_seed0": None}
    line = json.loads(out.read_text())
    assert line["budgets"] == result["budgets"] and {"commit", "date", "machine"} <= set(line)


def test_the_baseline_is_required(regime):
    with pytest.raises(SystemExit, match="--methods must include uniform"):
        regime.main(["--methods", "oracle,trace"])
