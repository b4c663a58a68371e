"""What ``trace-lightning`` prints: our stage messages shown, known-benign noise hidden.

The command line (``cli.main``) calls ``setup_console`` once; a library user who imports the
modules keeps their own logging. It

- shows INFO messages of ``trace_lightning.*`` and ``callbacks.*`` (the demo world's build
  stages, the warm start's loss, where the logs and the trained policy are, one line per
  epoch), as plain lines on the current ``sys.stderr``: Lightning's rich progress bar
  replaces ``sys.stderr`` while it draws, and a line written there lands above the bar;
- hides Python warnings that are known to be benign in a run (each named below with why).

vLLM's own console (its INFO lines and the warnings it gives on a CPU) is quieted where vLLM
is imported, in ``rollout/engines/vllm_engine.py``.
"""

from __future__ import annotations

import logging
import sys
import warnings

# Our loggers whose INFO lines the command line shows.
LOGGERS = ("trace_lightning", "callbacks")

# Python warnings that every run gives and that say nothing about it: (message regex,
# category, why it is benign).
BENIGN_WARNINGS = (
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", Warning,
     "Lightning 2.6 calls a torch 2.13 API that torch deprecated; nothing of ours"),
    (r"`torch.distributed.reduce_op` is deprecated", FutureWarning,
     "vLLM's Triton dispatcher probes torch's attributes when it is imported"),
)


class _StderrNow(logging.StreamHandler):
    """A StreamHandler that writes to whatever ``sys.stderr`` is at the time of the line (a
    handler keeps the stream it was built with, which the progress bar's redirect misses)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # noqa: D401 - logging's attribute
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def setup_console(level: int = logging.INFO) -> None:
    """Show our loggers' lines at ``level`` and above, once per process (idempotent), and
    hide the known-benign warnings."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(h, _StderrNow) for h in logger.handlers):
            handler = _StderrNow()
            handler.setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(handler)
        logger.setLevel(level)
    for message, category, _why in BENIGN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


def duration(seconds: float) -> str:
    """``seconds`` for a person: ``42 s``, ``3 min 05 s``, ``1 h 02 min``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"
