"""What building a task's files shares: one builder at a time.

Two runs started on one output folder (or one per node on a shared disk) would both build
it; ``exclusive`` makes the others wait, after which they find it built (each task's
manifest says so).
"""

from __future__ import annotations

import fcntl
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


@contextmanager
def exclusive(lock: Path, what: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock`` (created), waiting for another holder; where
    the filesystem has no ``flock`` (some network filesystems), go on without it. ``what``
    names the build in the messages ("the demo")."""
    with open(lock, "a") as f:
        locked = True
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is building %s in %s: waiting for it", what, lock.parent)
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as e:
            log.warning("cannot lock %s (%s): building %s without a lock; do not start two "
                        "runs on one folder at once", lock, e, what)
            locked = False
        try:
            yield
        finally:
            if locked:
                fcntl.flock(f, fcntl.LOCK_UN)
