"""The ``trace-lightning`` command: LightningCLI over TraceModule and TraceDataModule.

    trace-lightning fit --config configs/demo.yaml
    trace-lightning validate --config configs/demo.yaml --ckpt_path last

``--ckpt_path last`` means the newest intact checkpoint that a run with the same logger (or
``ModelCheckpoint.dirpath``) saved before, in any of its versions: each run logs to a new
``version_<N>``, where Lightning's own lookup would find nothing and quietly use the initial
weights. Intact: it loads; a ``last.ckpt`` linking to a deleted file, or a file cut short by a
stop during its save, is skipped with a warning (``last_checkpoint``). ``validate --ckpt_path
last`` that finds none is an error (``validate`` without ``--ckpt_path`` scores
``--model.policy_path``); ``fit`` then starts from ``--model.policy_path``, unless there are
checkpoints and none loads (an error naming them).
With several processes, each resolves it in its own file system and the datamodule's setup
checks that all found the same checkpoint (``TraceDataModule.expect_checkpoint``).

The configuration as given is the run's, with ``last`` or a path alike (Lightning's CLI
would replace every ``--model.*`` value by the checkpoint's when the path is a file, and
silently); settings that differ from the checkpoint's are listed in a warning, and a
``fit`` from a checkpoint that already trained ``--trainer.max_epochs`` epochs says so
before the engine starts.

Errors are one line (``TRACE_LIGHTNING_DEBUG=1``: with the traceback, or the usage); a run
that fails removes the log folder it created if it wrote nothing into it.

``main(args)`` takes the argument list so tests can run the CLI in-process; ``cli(args)``
does the same and returns the ``LightningCLI`` object.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import sys
import textwrap
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # vLLM in-process (CPU, tests)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from lightning.pytorch import Trainer  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402

from callbacks._common import RolloutCallback  # noqa: E402
from callbacks.export_policy import ExportPolicy  # noqa: E402
from trace_lightning.console import setup_console  # noqa: E402
from trace_lightning.data import TraceDataModule  # noqa: E402
from trace_lightning.training.checkpoints import checkpoint_meta  # noqa: E402
from trace_lightning.training.module import TraceModule  # noqa: E402

log = logging.getLogger(__name__)

DEBUG_ENV = "TRACE_LIGHTNING_DEBUG"  # set: errors with their traceback (see main)


class TraceCLI(LightningCLI):
    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """``fit`` and ``validate``: the module has no test or predict step (a test set is a
        validation set of the task, e.g. search QA's ``--data.task.init_args.val``), so
        Lightning's ``test`` and ``predict`` are not offered only to fail after the engine
        starts."""
        return {k: v for k, v in LightningCLI.subcommands().items() if k in ("fit", "validate")}

    def add_arguments_to_parser(self, parser) -> None:
        # one source for values that data and model share
        parser.link_arguments("model.policy_path", "data.policy_path")
        parser.link_arguments("model.advantage", "data.advantage")
        parser.link_arguments("model.tree_packing", "data.tree_packing")

    def _parse_ckpt_path(self) -> None:
        """Lightning's replaces the parsed ``--model.*`` values by a checkpoint file's
        hyper-parameters (not ``last``'s, resolved later); here the configuration as given
        wins either way, and ``_resolve_checkpoint`` lists where it differs."""

    def instantiate_classes(self) -> None:
        """Lightning's, with a section's own error unwrapped: a bad value in a section typed
        ``X | None`` (``--data.allocator.roots=0``) fails in ``X``'s constructor, and
        jsonargparse reports it as "Does not validate against any of the Union subtypes",
        with the constructor's message in the middle of the config's dump."""
        try:
            super().instantiate_classes()
        except ValueError as e:
            inner = union_error(str(e))
            if inner is None:
                raise
            raise ValueError(inner) from None

    def _run_subcommand(self, subcommand: str) -> None:
        """Lightning's; a run that fails removes the log folders it created and wrote
        nothing into (``remove_unused_log_dir``): a setup error left an empty
        ``version_<N>`` behind, one per attempt."""
        created = [(Path(d), _first_missing(Path(d))) for d in self._log_dirs()
                   if not Path(d).exists()]
        try:
            super()._run_subcommand(subcommand)
        except BaseException:
            if self.trainer.is_global_zero:  # the process that writes the logs
                for log_dir, top in created:
                    remove_unused_log_dir(log_dir, top)
            raise

    def _log_dirs(self) -> list[str]:
        """The loggers' version folders (``<save_dir>/<name>/version_<N>``); asking fixes N."""
        return [lg.log_dir for lg in self.trainer.loggers if lg.log_dir]

    def before_fit(self) -> None:
        # the callbacks' own setup checks would run only after the datamodule's prepare_data
        # and setup (a demo world, a retrieval index, an engine): say what is missing first
        for callback in self.trainer.callbacks:
            if isinstance(callback, RolloutCallback):
                callback.check(self.trainer, self.datamodule)
        self._check_output_dirs()
        self._resolve_checkpoint(required=False)
        self._announce_logs()

    def before_validate(self) -> None:
        self._check_output_dirs()
        self._resolve_checkpoint(required=True)
        self._announce_logs()

    def after_fit(self) -> None:
        """Say where the trained policy and the checkpoints are (rank 0)."""
        if not self.trainer.is_global_zero:
            return
        for callback in self.trainer.callbacks:
            if isinstance(callback, ExportPolicy) and callback.exported:
                log.info("trained policy (a Hugging Face folder; transformers and `vllm "
                         "serve` load it): %s", callback.exported[-1])
        ckpt = self.trainer.checkpoint_callback
        if isinstance(ckpt, ModelCheckpoint) and (ckpt.last_model_path or ckpt.best_model_path):
            log.info("checkpoint: %s (resume or score it again with --ckpt_path last)",
                     ckpt.last_model_path or ckpt.best_model_path)

    def _announce_logs(self) -> None:
        """Where this run's TensorBoard logs go and the command that shows them (rank 0)."""
        if not self.trainer.is_global_zero:
            return
        for lg in self.trainer.loggers:
            if isinstance(lg, TensorBoardLogger):
                log.info("logs: %s\n  watch them: %s --logdir %s", lg.log_dir,
                         tensorboard_command(), lg.save_dir)

    def _check_output_dirs(self) -> None:
        """Every folder the run writes into can be written (none is created), before any
        work: the loggers' and checkpoints' would fail at the first log, after the first
        epoch's rollouts, and ``--data.trees_dir`` after them too, each with a bare
        ``OSError``."""
        trainer = self.trainer
        dirs = [("--trainer.default_root_dir", trainer.default_root_dir)]
        dirs += [(f"--trainer.logger.init_args.save_dir ({type(lg).__name__})", lg.save_dir)
                 for lg in trainer.loggers if lg.save_dir]
        dirs += [("ModelCheckpoint's dirpath", cb.dirpath) for cb in trainer.checkpoint_callbacks
                 if isinstance(cb, ModelCheckpoint) and cb.dirpath]
        if self.subcommand == "fit" and self.datamodule.trees_dir:
            dirs.append(("--data.trees_dir", self.datamodule.trees_dir))
        for flag, path in dirs:
            check_output_dir(path, flag)

    def _resolve_checkpoint(self, required: bool) -> None:
        """Replace ``--ckpt_path last`` by the path of the newest intact checkpoint, and tell
        the datamodule which checkpoint this process loads: its setup checks that every
        process found the same one (``TraceDataModule.expect_checkpoint``)."""
        config = self.config_init[self.subcommand]
        path, error = config.get("ckpt_path"), None
        if path == "last":
            found, searched, skipped = last_checkpoint(self.trainer)
            if found is None and skipped:  # not a fresh start: say which did not load
                error = FileNotFoundError(
                    f"--ckpt_path last: no checkpoint in {', '.join(searched)} loads: "
                    f"{'; '.join(skipped)}; pass the path of a checkpoint that does, or leave "
                    f"--ckpt_path out to start from --model.policy_path's weights")
            elif found is None and required:
                error = FileNotFoundError(
                    f"--ckpt_path last: no last checkpoint (*.ckpt) in "
                    f"{', '.join(searched)}; train first (ModelCheckpoint, as in "
                    f"configs/demo.yaml, writes one there), pass a checkpoint's path, or leave "
                    f"--ckpt_path out to use --model.policy_path's weights")
            elif found is None:
                log.warning("--ckpt_path last: no last checkpoint in %s yet; training starts "
                            "from --model.policy_path", ", ".join(searched))
            else:
                if skipped:
                    log.warning("--ckpt_path last: %s, the newest checkpoint that loads; "
                                "skipped the newer %s", found, "; ".join(skipped))
                log.info("--ckpt_path last: %s", found)
            if error is not None and self.trainer.world_size == 1:
                raise error  # at once; with several processes, in setup on every one
            path = config["ckpt_path"] = None if found is None else str(found)
        self.datamodule.expect_checkpoint(path, error)
        if path is not None and error is None:
            self._compare_with_checkpoint(path)

    def _compare_with_checkpoint(self, path: str) -> None:
        """Warn where the model's settings differ from the checkpoint's, and when a ``fit``
        has no epoch left to train. A path that does not read as a checkpoint is left to the
        datamodule's setup, which fails on it (on every process). Said by global rank 0."""
        if not self.trainer.is_global_zero:
            return
        try:
            meta = checkpoint_meta(path)
        except (OSError, ValueError):
            return
        differ = setting_differences(dict(self.model.hparams), meta.get("hyper_parameters"))
        if differ:
            log.warning("--ckpt_path %s: these settings differ from the checkpoint's, and the "
                        "values given here are used (the weights, optimizer state and step "
                        "count come from the checkpoint; a setting that shapes the model "
                        "must match it, or the weights will not load):\n  %s",
                        path, "\n  ".join(differ))
        done = trained_epochs(meta)
        max_epochs = self.trainer.max_epochs
        if self.subcommand == "fit" and max_epochs not in (None, -1) and done >= max_epochs:
            log.warning("--ckpt_path %s: the checkpoint already trained %d epoch(s) and "
                        "--trainer.max_epochs is %d, so this fit trains nothing; raise "
                        "--trainer.max_epochs to train further", path, done, max_epochs)


def tensorboard_command() -> str:
    """How to start TensorBoard from here: the ``tensorboard`` script of this environment
    (``.venv/bin/tensorboard`` when the venv is not activated), else the bare name."""
    script = Path(sys.executable).parent / "tensorboard"
    if not script.is_file():
        return "tensorboard"
    try:
        return str(script.relative_to(Path.cwd()))
    except ValueError:
        return str(script)


def check_output_dir(path: str | os.PathLike, flag: str) -> None:
    """``path`` is, or can become, a folder this process can write into; otherwise an
    OSError naming ``flag``, the path and why. Tried by writing a folder into its nearest
    existing ancestor and removing it (permissions say little to root or on special file
    systems); nothing is left behind."""
    import errno
    import tempfile

    probe = Path(path).absolute()
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        if not probe.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(probe))
        os.rmdir(tempfile.mkdtemp(dir=probe, prefix=".write_check_"))
    except OSError as e:
        raise type(e)(e.errno, f"{flag} ({path}) is not a folder this run can write into "
                               f"({e.strerror}: {e.filename}); give a writable folder",
                      ) from None


def union_error(message: str) -> str | None:
    """The one real error of jsonargparse's "Does not validate against any of the Union
    subtypes" (the others: "Expected a <class 'NoneType'>"), or None for another message.

    A section's parse error nests the key and its error under the section's class
    ("Problem with given class_path ...:", "Parser key "kind":", the error): that is
    returned as ``key "kind": <the error>``."""
    if not message.startswith("Does not validate against any of the Union subtypes"):
        return None
    listed = message.partition("\nErrors:\n")[2].split("\nGiven value")[0]
    errors: list[list[str]] = []  # each error's lines, the first without its "  - "
    for line in listed.splitlines():
        if line.startswith("  - "):
            errors.append([line[len("  - "):]])
        elif errors:
            errors[-1].append(line.strip())
    errors = [e for e in errors if e[0] != "Expected a <class 'NoneType'>"]
    if len(errors) != 1:
        return None
    first, *nested = errors[0]
    if first.startswith("Problem with given class_path") and len(nested) == 2 \
            and nested[0].startswith("Parser key "):
        return f"{nested[0].removeprefix('Parser ').rstrip(':')}: {nested[1]}"
    return " ".join(errors[0])


class TraceParser(LightningArgumentParser):
    """Lightning's parser, whose errors are one line, ``error: <message>`` (jsonargparse
    prints the whole usage, about 90 lines, before it; ``TRACE_LIGHTNING_DEBUG=1`` still
    does), with

    - a bad value in a section typed ``X | None`` (``--data.engine.kind=vlm``) reported as
      its own error instead of jsonargparse's dump of every Union subtype (``union_error``);
    - a YAML syntax error in a ``--config`` file named by the file, line and column
      (PyYAML reads the file's text, which it calls "<unicode string>");
    - a ``--config`` file that names its base (``config: demo.yaml``, relative to its own
      folder) read as ``--config <base> --config <the rest of the file>``: the rest
      overrides the base key by key (``parse_overlay``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._reading: list[str] = []  # the --config files being parsed, innermost last

    def parse_path(self, path, *args, **kwargs):
        self._reading.append(str(path))
        try:
            base, rest = config_base(path)
            if base is None:
                return super().parse_path(path, *args, **kwargs)
            if os.path.realpath(base) in map(os.path.realpath, self._reading):
                self.error(f"{path}: its base, config: {base}, is a file being read already "
                           f"(a loop); name a base that does not name this file")
            return self.parse_overlay(base, rest)
        finally:
            self._reading.pop()

    def parse_overlay(self, base: str, rest: dict):
        """The config of ``--config <base> --config <rest>`` (what ``ActionConfigFile``
        asks ``parse_path`` for: the values given, no defaults, not yet validated).

        jsonargparse's own reading of a ``config:`` key (4.53) puts each top-level section of
        the file in place of the base's whole section (``trainer: {max_epochs: 3}`` drops
        every other trainer setting of the base). Read as a second ``--config``, a section
        merges key by key, a list (``trainer.callbacks``) replaces the base's, and a
        changed ``class_path`` keeps only the base's ``init_args`` the new class also
        takes."""
        from jsonargparse import ActionConfigFile, Namespace
        import yaml

        cfg = Namespace()
        ActionConfigFile.apply_config(self, cfg, "config", base)
        ActionConfigFile.apply_config(self, cfg, "config", yaml.safe_dump(rest, sort_keys=False))
        del cfg["config"]  # the files read; ActionConfigFile records the one given
        return cfg

    def error(self, message: str, ex: Exception | None = None):
        section, sep, rest = message.partition(":\n")  # 'Parser key "data.engine"'
        inner = union_error(textwrap.dedent(rest)) if sep and section.startswith("Parser key") \
            else None
        if inner is not None:
            nested = re.match(r'key "([^"]+)": (.*)', inner, re.S)
            message = (f'{section[:-1]}.{nested[1]}": {nested[2]}' if nested
                       else f"{section}: {inner}")
        if self._reading and ex is not None:
            message = yaml_error(self._reading[-1], ex.__cause__) or message
        if not self.exit_on_error or debugging():
            return super().error(message, ex)  # the usage too (or an ArgumentError raised)
        sys.stderr.write(f"error: {message}\n")
        self.exit(2)


def config_base(path) -> tuple[str | None, dict]:
    """The base a YAML config file names (its top-level ``config:``, a path relative to the
    file's folder), and the file's other keys; ``(None, {})`` for a file without one, or
    one that is not a YAML mapping (jsonargparse reads it, and reports its errors)."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return None, {}
    if not isinstance(data, dict) or not isinstance(data.get("config"), str):
        return None, {}
    rest = {k: v for k, v in data.items() if k != "config"}
    return os.path.join(os.path.dirname(os.fspath(path)), data["config"]), rest


def yaml_error(path: str, error: BaseException | None) -> str | None:
    """``<path>, line L, column C: <problem> (<context> at line L, column C)`` for a YAML
    syntax error in the file ``path``; None for another error."""
    import yaml

    if not isinstance(error, yaml.MarkedYAMLError) or error.problem_mark is None:
        return None

    def at(mark) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    context = (f" ({error.context} at {at(error.context_mark)})"
               if error.context and error.context_mark else "")
    return (f"{path}, {at(error.problem_mark)}: {error.problem}{context}; the file is not "
            f"valid YAML")


def debugging() -> bool:
    """``TRACE_LIGHTNING_DEBUG`` is set (not empty or 0): errors come with their traceback
    (and parse errors with the usage)."""
    return os.environ.get(DEBUG_ENV, "0") not in ("", "0")


def remove_unused_log_dir(log_dir: Path, top: Path) -> None:
    """Remove ``log_dir``, a logger's folder this run created, if the run wrote no result
    into it: it holds only TensorBoard event files with no record after their header, and
    the CLI's ``config.yaml`` of this run. Then its parents up to ``top`` (the first folder
    this run created) that are left empty. Any other file keeps the folder, and a folder
    this run did not create is never passed here."""
    if not log_dir.is_dir():
        return
    entries = list(log_dir.iterdir())
    if not all(e.is_file() and not e.is_symlink()
               and (e.name == "config.yaml" or _empty_event_file(e)) for e in entries):
        return
    for e in entries:
        e.unlink()
    folder = log_dir
    while True:
        try:
            folder.rmdir()  # only an empty folder
        except OSError:
            return
        if folder == top:
            return
        folder = folder.parent


def _empty_event_file(path: Path) -> bool:
    """``path`` is a TensorBoard event file with no record after the file-version record
    every writer starts with (TFRecord framing: 8-byte length, 4-byte CRC, data, 4-byte
    CRC), or with none yet."""
    import struct

    if not path.name.startswith("events.out.tfevents."):
        return False
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
    return size == 0 or (len(head) == 8 and size == struct.unpack("<Q", head)[0] + 16)


def _first_missing(path: Path) -> Path:
    """The outermost folder of ``path`` (itself included) that does not exist yet."""
    path = path.absolute()
    while not path.parent.exists():
        path = path.parent
    return path


def setting_differences(given: dict, saved: dict | None) -> list[str]:
    """``--model.<key>: <given> (the checkpoint's: <saved>)`` for each hyper-parameter both
    hold with different values (compared as JSON: a tuple equals its list)."""
    def plain(v):
        return json.loads(json.dumps(v, default=str))

    return [f"--model.{k}: {plain(given[k])!r} (the checkpoint's: {plain(v)!r})"
            for k, v in (saved or {}).items()
            if not k.startswith("_") and k in given and plain(given[k]) != plain(v)]


def trained_epochs(meta: dict) -> int:
    """Epochs whose training the checkpoint's run finished (its fit loop's processed
    epochs; 0 if it holds no loop state)."""
    progress = meta.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {})
    return int(progress.get("current", {}).get("processed", 0))


def last_checkpoint(trainer: Trainer) -> tuple[Path | None, list[str], list[str]]:
    """The checkpoint ``--ckpt_path last`` means: the newest intact one of those this
    trainer's checkpoint callbacks wrote in earlier runs (a ``.ckpt`` file, or a folder for
    sharded FSDP checkpoints); the places searched (patterns); and the newer ones skipped,
    each with why.

    Newest is the latest saved (modification time; a ``last.ckpt`` before the checkpoint it
    links to), as in Lightning's own lookup: of two runs from scratch with one logger, the
    later one's. Intact: it loads (``checkpoints.load_problem``). A stop at any moment of a
    save leaves one: stopped after Lightning deleted the previous checkpoint and before it
    linked ``last.ckpt`` to the new one, the link points at the deleted file and the new
    one is the newest; stopped while a file was written (Lightning copies it from a
    temporary file when the temporary folder is on another file system), that file is cut
    short and the one before it is the newest intact.

    A ``ModelCheckpoint`` with a ``dirpath`` saves there; one without saves under the first
    logger's ``<save_dir>/<name>/<version>/checkpoints`` (every version is searched), or
    ``<default_root_dir>/checkpoints`` without a logger."""
    from trace_lightning.training.checkpoints import load_problem

    patterns: list[str] = []
    for cb in trainer.checkpoint_callbacks:
        if not isinstance(cb, ModelCheckpoint):
            continue
        if cb.dirpath is not None:
            patterns.append(str(Path(cb.dirpath) / "*.ckpt"))
        elif trainer.loggers:
            logger = trainer.loggers[0]
            base = Path(logger.save_dir or trainer.default_root_dir)
            if logger.name:
                base = base / str(logger.name)
            patterns.append(str(base / "*" / "checkpoints" / "*.ckpt"))
        else:
            patterns.append(str(Path(trainer.default_root_dir) / "checkpoints" / "*.ckpt"))
    patterns = list(dict.fromkeys(patterns))
    found = {Path(p) for pattern in patterns for p in glob.glob(pattern)}

    def saved(path: Path) -> tuple[float, bool]:
        stat = path.stat() if path.exists() else path.lstat()  # a link to a deleted file
        return stat.st_mtime, path.name.startswith("last")

    skipped = []
    for path in sorted(found, key=saved, reverse=True):
        problem = load_problem(path)
        if problem is None:
            return path, patterns, skipped
        skipped.append(f"{path} ({problem})")
    return None, patterns, skipped


def cli(args: list[str] | None = None, run: bool = True) -> TraceCLI:
    """Run the CLI on ``args`` (default: sys.argv) and return it: tests read its trainer,
    model and datamodule. ``run=False``: only build them (``args`` without a subcommand)."""
    return TraceCLI(
        TraceModule, TraceDataModule,
        args=args, run=run,
        # the DataModule shards prompts over ranks itself: no DistributedSampler on top
        trainer_defaults={"reload_dataloaders_every_n_epochs": 1, "num_sanity_val_steps": 0,
                          "check_val_every_n_epoch": 1, "use_distributed_sampler": False},
        save_config_kwargs={"overwrite": True},
        # TraceModule builds its optimizers (policy, and the predictor's own) itself: no
        # --optimizer / --lr_scheduler, which would replace them with one over no parameters
        auto_configure_optimizers=False,
        subclass_mode_model=False, subclass_mode_data=False, parser_class=TraceParser,
    )


def main(args: list[str] | None = None) -> None:
    """The ``trace-lightning`` console script (returns None: exit status 0 on success).

    An error that reaches the interpreter is printed as one line, ``error: <type>:
    <message>`` (exit status 1), not Python's traceback of Lightning's frames above it
    (15 to 51 lines); ``TRACE_LIGHTNING_DEBUG=1`` prints the traceback. A caller that
    catches it (a test, a notebook) gets the exception as raised."""
    global _excepthook
    if _excepthook is None:
        _excepthook = sys.excepthook
        sys.excepthook = _one_line_errors
    setup_console()
    cli(args)


_excepthook = None  # the hook main replaced by _one_line_errors


def _one_line_errors(kind, value, traceback) -> None:
    """``sys.excepthook`` for an Exception raised through ``main``: its one line (the hook
    before it for anything else, and under ``TRACE_LIGHTNING_DEBUG``)."""
    frame, through_main = traceback, False
    while frame is not None and not through_main:
        through_main, frame = frame.tb_frame.f_code is main.__code__, frame.tb_next
    if through_main and issubclass(kind, Exception) and not debugging():
        sys.stderr.write(f"error: {kind.__name__}: {value} (TRACE_LIGHTNING_DEBUG=1 prints "
                         f"the traceback)\n")
    else:
        _excepthook(kind, value, traceback)


if __name__ == "__main__":
    main()
