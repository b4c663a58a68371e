"""scripts/same_figures.py on real TensorBoard event files written here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import same_figures  # noqa: E402


def run(folder: Path, figures: dict[str, list[float]]) -> Path:
    """A run's version folder with ``figures`` logged at steps 0, 1, ..."""
    out = folder / "tensorboard" / "version_0"
    writer = SummaryWriter(str(out))
    for key, values in figures.items():
        for step, v in enumerate(values):
            writer.add_scalar(key, v, step)
    writer.close()
    return out


FIGURES = {"val/em": [0.39, 0.4575], "rollout/reward_mean": [0.297, 0.504],
           "perf/rollout_s": [12.0, 14.0]}


def test_the_same_figures_but_the_seconds_are_the_same(tmp_path, capsys):
    a = run(tmp_path / "a", FIGURES)
    b = run(tmp_path / "b", {**FIGURES, "perf/rollout_s": [9.0, 9.5], "perf/tools_s": [1.0, 1.0]})
    result = same_figures.main([str(tmp_path / "a"), str(b), "--out", str(tmp_path / "o.json")])
    assert result["same"] and result["keys_compared"] == 2 and result["values_compared"] == 4
    assert result["before"] == str(a) and result["differ"] == {}
    assert json.loads(capsys.readouterr().out) == result
    assert json.loads((tmp_path / "o.json").read_text()) == result


def test_a_value_off_in_its_last_digit_or_a_missing_key_is_named(tmp_path):
    before = same_figures.scalars(run(tmp_path / "a", FIGURES))
    off = same_figures.scalars(run(tmp_path / "b", {**FIGURES, "val/em": [0.39, 0.4576]}))
    result = same_figures.compare(before, off)
    assert not result["same"] and list(result["differ"]) == ["val/em"]
    assert result["differ"]["val/em"]["before"] == (1, pytest.approx(0.4575))
    assert result["differ"]["val/em"]["after"] == (1, pytest.approx(0.4576))
    fewer = same_figures.scalars(run(tmp_path / "c", {"val/em": [0.39]}))
    result = same_figures.compare(before, fewer)
    assert result["only_before"] == ["rollout/reward_mean"] and not result["same"]
    assert result["differ"] == {"val/em": {"before": 2, "after": 1}}


def test_a_folder_without_event_files_is_one_clear_error(tmp_path):
    with pytest.raises(SystemExit, match=r"no TensorBoard event files here or in a version_<N>"):
        same_figures.version_dir(tmp_path)
