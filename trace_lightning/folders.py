"""Folders replaced whole: a reader finds the old folder or the new one, never half of one.

Exports, the demo world and the tasks' built policies are written in a fresh folder beside
their destination and swapped in here by renames, so a kill at any moment leaves a complete
folder behind and deletes nothing of the user's.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


def replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished folder ``tmp`` to ``out`` (on one filesystem) by renames only.

    A folder already at ``out`` is moved aside into a fresh folder beside it,
    ``<out>.old-XXXXXXXX/`` (``tempfile.mkdtemp``: no name of the user's is taken or
    cleared), moved back if ``tmp`` cannot be moved in, and deleted, with that fresh folder,
    once it is. So a complete folder is at ``out`` at every moment, or (killed between the
    two renames) at ``<out>.old-XXXXXXXX/<out name>``, which nothing deletes then: move it
    back yourself. Everything at ``out`` is deleted: the caller checks that it may be."""
    out = Path(out)
    if not (out.exists() or out.is_symlink()):
        tmp.rename(out)
        return
    aside = Path(tempfile.mkdtemp(prefix=f"{out.name}.old-", dir=out.parent))
    previous = aside / out.name
    out.rename(previous)
    try:
        tmp.rename(out)
    except BaseException:
        if not (out.exists() or out.is_symlink()):
            previous.rename(out)
            aside.rmdir()
        raise
    shutil.rmtree(aside, ignore_errors=True)
    if aside.exists():
        log.warning("could not delete all of %s, the folder %s replaced: delete it yourself",
                    aside, out)
