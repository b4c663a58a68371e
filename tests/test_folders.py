"""trace_lightning/folders.py: a folder replaced whole, by renames only."""

from __future__ import annotations

from pathlib import Path

import pytest

from trace_lightning.folders import replace_dir


def test_replace_dir_moves_the_previous_folder_back_when_the_swap_fails(tmp_path, monkeypatch):
    """The swap exports, the demo's world and the tasks' policies use: renames only, into
    fresh names; a failed swap moves the previous folder back."""
    out, new = tmp_path / "model", tmp_path / "staging"
    for folder, text in ((out, "previous"), (new, "new"), (tmp_path / "model.old", "mine")):
        folder.mkdir()
        (folder / "f.txt").write_text(text)
    rename = Path.rename

    def failing_rename(self, target):
        if self == new:
            raise OSError("simulated failure moving the new folder into place")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing_rename)
    with pytest.raises(OSError, match="simulated"):
        replace_dir(new, out)
    monkeypatch.undo()
    assert (out / "f.txt").read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "model.old", "staging"]
    replace_dir(new, out)
    assert (out / "f.txt").read_text() == "new"
    assert (tmp_path / "model.old" / "f.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "model.old"]
