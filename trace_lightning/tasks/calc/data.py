"""``CalcData``: the calculator task's problems and its own warm-started tiny policy.

``prepare`` writes, once per node::

    out_dir/
      train.jsonl     the training problems (seed)
      heldout.jsonl   the held-out problems (eval_seed), none of them trained on
      model/          tokenizer + tiny Qwen3, warm-started on gold trajectories
      manifest.json   the settings it was built with; written last

The warm start demonstrates problems of a third seed (``warm_seed``), so neither the RL
problems nor the held-out ones were demonstrated. A build is skipped when the manifest holds
the same settings and every file exists; any other setting rebuilds everything, the new
model trained in ``model.partial/`` and swapped in by renames (``folders.replace_dir``) only
once it is complete, under the search demo's build lock (one builder per ``out_dir``), in a
process with pinned CPU kernels (``tasks.build.call_pinned``: the same policy on every
x86-64 CPU of one vendor).
"""

from __future__ import annotations

import inspect
import json
import logging
import shutil
import time
from pathlib import Path

from trace_lightning.jsonl import jsonl_lines, write_records
from trace_lightning.models import build_tiny_model
from trace_lightning.tasks.base import Example, TaskData
from trace_lightning.tasks.calc.problems import MAX_OPS, Problem, generate_problems
from trace_lightning.tasks.calc.task import CALC_INSTRUCTION, CalcTask, check_settings
from trace_lightning.tasks.calc.warm_start import calc_tokenizer, warm_start
from trace_lightning.tasks.build import call_pinned, exclusive, kernels
from trace_lightning.folders import replace_dir

log = logging.getLogger(__name__)

MANIFEST_VERSION = 2  # bump when the problems, the formats or the warm start change
TRAIN_SET, HELDOUT_SET = "calc", "calc_heldout"
# Tiny Qwen3 defaults (``tiny_qwen3_config`` fields); ``model`` overrides any of them.
DEFAULT_MODEL = {"hidden_size": 64, "layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 32,
                 "intermediate": 192, "max_position": 512}
_FLAG = "--data.task.init_args"


class CalcData(TaskData):
    """Generated arithmetic word problems and a tiny policy warm-started to use a
    calculator. Every setting is checked on construction: the first one this task cannot
    use is one ValueError naming its flag, the value, why and the fix.

    Args:
        out_dir: where the problems, the policy (``<out_dir>/model``, which
            ``--model.policy_path`` must name) and the manifest are written.
        seed: seed of the training problems.
        eval_seed: seed of the held-out problems (none of them a training or warm-start
            problem).
        warm_seed: seed of the problems the warm start demonstrates.
        n_train: training problems.
        n_eval: held-out problems.
        n_warm: problems the warm start demonstrates (each once per pass).
        max_ops: most operations of a problem (1 to 4); problems mix 1..max_ops evenly.
        max_turns: turns before an episode is cut (a problem of k operations takes k + 1).
        max_seq_tokens: a trajectory's tokens before it is cut.
        instruction: the prompt, with ``{question}`` (the policy is warm-started on it).
        use_chat_template: wrap prompts in the tokenizer's chat template.
        vocab_size: the tiny policy's BPE vocabulary (calculator tags included).
        model: overrides of ``DEFAULT_MODEL`` (``tiny_qwen3_config`` fields).
        model_seed: seed of the policy's random initialisation and of the warm start.
        warm_start_steps: most supervised steps on gold trajectories (0: no warm start).
        warm_start_batch: demonstrations per warm-start step.
        warm_start_lr: warm-start learning rate (AdamW, constant after 20 warmup steps).
        warm_start_noise: share of demonstrations with one wrong operand.
        warm_start_stop_loss: end the warm start once its loss (mean of 50 steps) is at most
            this; None runs all ``warm_start_steps``.
        warm_start_threads: torch CPU threads of the warm start (None: one, as the pinned
            build process starts with). Not part of the manifest, but the policy depends on
            it: sums split over threads add in another order.
    """

    metric = "correct"

    def __init__(self, out_dir: str = "runs/calc", seed: int = 0, eval_seed: int = 1,
                 warm_seed: int = 2, n_train: int = 2000, n_eval: int = 200,
                 n_warm: int = 4000, max_ops: int = 4, max_turns: int = 6,
                 max_seq_tokens: int = 512, instruction: str = CALC_INSTRUCTION,
                 use_chat_template: bool = False, vocab_size: int = 768,
                 model: dict | None = None, model_seed: int = 0, warm_start_steps: int = 1500,
                 warm_start_batch: int = 8, warm_start_lr: float = 6e-3,
                 warm_start_noise: float = 0.0, warm_start_stop_loss: float | None = 0.12,
                 warm_start_threads: int | None = 1):
        self.out_dir = Path(out_dir)
        self.seed, self.eval_seed, self.warm_seed = seed, eval_seed, warm_seed
        self.n_train, self.n_eval, self.n_warm, self.max_ops = n_train, n_eval, n_warm, max_ops
        self.max_turns, self.max_seq_tokens = max_turns, max_seq_tokens
        self.instruction, self.use_chat_template = instruction, use_chat_template
        self.vocab_size, self.model, self.model_seed = vocab_size, model or {}, model_seed
        self.warm_start_steps, self.warm_start_batch = warm_start_steps, warm_start_batch
        self.warm_start_lr, self.warm_start_noise = warm_start_lr, warm_start_noise
        self.warm_start_stop_loss, self.warm_start_threads = (warm_start_stop_loss,
                                                              warm_start_threads)
        self.train_examples: list[Example] = []
        self.val_examples: dict[str, list[Example]] = {}
        self._check_flags()

    # ---- paths and settings -------------------------------------------------------------
    @property
    def model_dir(self) -> Path:
        return self.out_dir / "model"

    @property
    def train_path(self) -> Path:
        return self.out_dir / "train.jsonl"

    @property
    def heldout_path(self) -> Path:
        return self.out_dir / "heldout.jsonl"

    @property
    def manifest_path(self) -> Path:
        return self.out_dir / "manifest.json"

    def settings(self) -> dict:
        """What the files and the policy are built from (the manifest's ``settings``)."""
        return {"version": MANIFEST_VERSION, "seed": self.seed, "eval_seed": self.eval_seed,
                "warm_seed": self.warm_seed, "n_train": self.n_train, "n_eval": self.n_eval,
                "n_warm": self.n_warm, "max_ops": self.max_ops,
                "instruction": self.instruction, "use_chat_template": self.use_chat_template,
                "vocab_size": self.vocab_size, "model": {**DEFAULT_MODEL, **self.model},
                "model_seed": self.model_seed, "warm_start_steps": self.warm_start_steps,
                "warm_start_batch": self.warm_start_batch, "warm_start_lr": self.warm_start_lr,
                "warm_start_noise": self.warm_start_noise,
                "warm_start_stop_loss": self.warm_start_stop_loss}

    # ---- checks -------------------------------------------------------------------------
    def _check_flags(self) -> None:
        """The settings alone, refused before any work."""
        if self.eval_seed == self.seed:
            raise ValueError(f"{_FLAG}.eval_seed ({self.eval_seed}) equals {_FLAG}.seed: the "
                             f"held-out problems would be drawn like the training ones; set "
                             f"eval_seed to another seed (default 1, with seed 0)")
        if self.warm_start_steps > 0 and self.warm_seed in (self.seed, self.eval_seed):
            raise ValueError(f"{_FLAG}.warm_seed ({self.warm_seed}) equals seed ({self.seed}) "
                             f"or eval_seed ({self.eval_seed}): the warm start would "
                             f"demonstrate the problems RL trains on; pick another warm_seed")
        if not 1 <= self.max_ops <= MAX_OPS:
            raise ValueError(f"{_FLAG}.max_ops ({self.max_ops}) must be in 1..{MAX_OPS}: the "
                             f"problems chain 1 to {MAX_OPS} operations; set it in that range")
        for name in ("n_train", "n_eval") + (("n_warm",) if self.warm_start_steps else ()):
            if getattr(self, name) < 1:
                raise ValueError(f"{_FLAG}.{name} ({getattr(self, name)}) must be >= 1: an "
                                 f"empty set has nothing to train on or measure; raise it")
        check_settings(self.max_turns, self.max_seq_tokens, self.instruction)
        if self.max_turns < self.max_ops + 1:
            raise ValueError(f"{_FLAG}.max_turns ({self.max_turns}) must be >= max_ops + 1 "
                             f"({self.max_ops + 1}): the policy makes one calculator call per "
                             f"operation, then answers; raise max_turns or lower max_ops")
        if self.vocab_size < 300:
            raise ValueError(f"{_FLAG}.vocab_size ({self.vocab_size}) must be >= 300: 256 "
                             f"byte tokens, the control tokens and the calculator tags come "
                             f"first; raise it")
        for name, value, least in (("warm_start_steps", self.warm_start_steps, 0),
                                   ("warm_start_batch", self.warm_start_batch, 1)):
            if value < least:
                raise ValueError(f"{_FLAG}.{name} ({value}) must be >= {least}")
        if self.warm_start_lr <= 0:
            raise ValueError(f"{_FLAG}.warm_start_lr ({self.warm_start_lr}) must be > 0")
        if not 0.0 <= self.warm_start_noise <= 1.0:
            raise ValueError(f"{_FLAG}.warm_start_noise ({self.warm_start_noise}) must be in "
                             f"[0, 1]: it is the share of noisy demonstrations")
        if self.warm_start_stop_loss is not None and self.warm_start_stop_loss <= 0:
            raise ValueError(f"{_FLAG}.warm_start_stop_loss ({self.warm_start_stop_loss}) must "
                             f"be > 0, or null to run all warm_start_steps")

    def _check_policy(self, policy_path: str) -> None:
        """The task trains its own policy: ``--model.policy_path`` must be it."""
        if Path(policy_path).resolve() != self.model_dir.resolve():
            raise ValueError(f"--model.policy_path ({policy_path!r}) must be the calc task's "
                             f"own policy {str(self.model_dir)!r} (built under "
                             f"{_FLAG}.out_dir); set it so")

    # ---- preparing and loading ----------------------------------------------------------
    def prepare(self, policy_path: str, fitting: bool) -> None:
        """Write the problems and build the warm-started policy, unless the manifest says
        they are built with these settings (fitting or not: one build serves both)."""
        self._check_policy(policy_path)
        settings = self.settings()
        if self._built(settings):  # a built task may sit on a read-only disk
            log.info("calc task in %s is up to date", self.out_dir)
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with exclusive(self.out_dir / ".prepare.lock", "the calc task"):
            if self._built(settings):
                log.info("calc task in %s is up to date (built by another process)",
                         self.out_dir)
                return
            # the build runs in a process with pinned CPU kernels: one policy per CPU vendor
            call_pinned(build_calc, init=self.init_args(), settings=settings)

    def setup(self, fitting: bool, train_limit: int | None, processes: int,
              prompts_needed: int) -> None:
        """Read the held-out problems (at least one per process), and when ``fitting`` the
        first ``train_limit`` training ones (at least ``prompts_needed``)."""
        held_out = self._read(self.heldout_path, HELDOUT_SET, None)
        if len(held_out) < processes:
            raise ValueError(f"{self.heldout_path} holds {len(held_out)} held-out problems, "
                             f"fewer than the {processes} processes: one without any would "
                             f"skip validation while the others wait for it (a hang); raise "
                             f"{_FLAG}.n_eval to at least {processes}")
        self.val_examples = {HELDOUT_SET: held_out}
        if fitting:
            self.train_examples = self._read(self.train_path, TRAIN_SET, train_limit)
            if len(self.train_examples) < prompts_needed:
                raise ValueError(f"{self.train_path} holds {len(self.train_examples)} training "
                                 f"problems (train limit {train_limit}), fewer than the "
                                 f"{prompts_needed} prompts the allocator needs per step; raise "
                                 f"{_FLAG}.n_train (and the limit) or lower "
                                 f"--data.allocator.roots")

    def _read(self, path: Path, name: str, limit: int | None) -> list[Example]:
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: the calc task's problems are "
                                    f"written by prepare (the DataModule's prepare_data); run "
                                    f"it, or check {_FLAG}.out_dir")
        records = (json.loads(line) for _, line in jsonl_lines(path))
        return [Problem.from_record(r).example(name) for r in records][:limit]

    def environment(self, tokenizer, val_set: str | None = None) -> CalcTask:
        """The task every set rolls out with (one calculator for all)."""
        if val_set not in (None, HELDOUT_SET):
            raise ValueError(f"the calc task has one validation set, {HELDOUT_SET!r}; got "
                             f"{val_set!r}")
        return CalcTask(tokenizer, max_turns=self.max_turns, max_seq_tokens=self.max_seq_tokens,
                        instruction=self.instruction, use_chat_template=self.use_chat_template)

    # ---- the build ----------------------------------------------------------------------
    def problem_sets(self) -> tuple[list[Problem], list[Problem], list[Problem]]:
        """(training, warm-start, held-out) problems; the held-out set excludes the others'
        questions, the warm-start set the training set's."""
        train = generate_problems(self.seed, self.n_train, self.max_ops, prefix=TRAIN_SET)
        warm = (generate_problems(self.warm_seed, self.n_warm, self.max_ops, prefix="warm",
                                  exclude={p.question for p in train})
                if self.warm_start_steps > 0 else [])
        heldout = generate_problems(self.eval_seed, self.n_eval, self.max_ops,
                                    prefix=HELDOUT_SET,
                                    exclude={p.question for p in train + warm})
        return train, warm, heldout

    def init_args(self) -> dict:
        """The constructor's arguments (JSON), from which the build process makes its own."""
        names = inspect.signature(type(self).__init__).parameters
        return {n: str(self.out_dir) if n == "out_dir" else getattr(self, n)
                for n in names if n != "self"}

    def _build(self, settings: dict) -> None:
        start = time.perf_counter()
        log.info("building the calc task in %s (first run only; about 3 minutes on 2 cores, "
                 "most of it the warm start)", self.out_dir)
        train, warm, heldout = self.problem_sets()
        # the tokenizer learns the wording and the numbers of trajectories like the policy's
        tokenizer = calc_tokenizer(warm or train, self.vocab_size, self.instruction)
        staging = self.model_dir.with_name(self.model_dir.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        build_tiny_model(tokenizer, staging, seed=self.model_seed, **settings["model"])
        stats: dict = {}
        if self.warm_start_steps > 0:
            stats = warm_start(staging, self.environment(tokenizer), warm,
                               steps=self.warm_start_steps, batch_size=self.warm_start_batch,
                               lr=self.warm_start_lr, noise=self.warm_start_noise,
                               stop_loss=self.warm_start_stop_loss, seed=self.model_seed,
                               num_threads=self.warm_start_threads)
            last = stats.pop("losses")[-20:]
            stats["final_loss"] = sum(last) / len(last)
        result = {"settings": settings, "warm_start": stats, "kernels": kernels(),
                  "seconds": round(time.perf_counter() - start, 1)}
        # without a manifest, files caught half swapped are never taken as complete
        self.manifest_path.unlink(missing_ok=True)
        write_records((p.record(TRAIN_SET) for p in train), self.train_path)
        write_records((p.record(HELDOUT_SET) for p in heldout), self.heldout_path)
        replace_dir(staging, self.model_dir)
        tmp = self.manifest_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2))
        tmp.replace(self.manifest_path)
        log.info("prepared the calc task in %s (%.0f s)", self.out_dir, result["seconds"])

    def _built(self, settings: dict) -> bool:
        try:
            old = json.loads(self.manifest_path.read_text())["settings"]
        except (OSError, json.JSONDecodeError, KeyError):
            return False
        files = [self.train_path, self.heldout_path, self.model_dir / "config.json",
                 self.model_dir / "tokenizer.json"]
        return old == settings and all(f.exists() for f in files)


def build_calc(init: dict, settings: dict) -> None:
    """``CalcData(**init)``'s build from ``settings``, in the process ``call_pinned`` starts."""
    CalcData(**init)._build(settings)
