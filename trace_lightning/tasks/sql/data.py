"""``SqlData``: the SQL task's databases, questions and its own warm-started tiny policy.

``prepare`` writes, once per node::

    out_dir/
      db/<set>-<family>-<k>.sqlite   each set's databases, about questions_per_db questions each
      train.jsonl     the training questions, on the training databases (seed)
      heldout.jsonl   the held-out questions, on databases of their own (eval_seed)
      model/          tokenizer + tiny Qwen3, warm-started on gold trajectories
      manifest.json   the settings it was built with and each database's sha256; written last

The warm start demonstrates questions on a third set of databases (``warm_seed``), so
neither the RL questions' rows nor the held-out ones were demonstrated. A build is skipped
when the manifest holds the same settings and every file exists; any other setting rebuilds
everything, the new model trained in ``model.partial/`` and swapped in by renames
(``folders.replace_dir``) only once it is complete, under a build lock (one builder per
``out_dir``), in a process with pinned CPU kernels (``tasks.build.call_pinned``). Nothing but
the build writes a database; the task opens them read-only.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Literal

from trace_lightning.jsonl import jsonl_lines, write_records
from trace_lightning.models import build_tiny_model
from trace_lightning.tasks.base import Example, TaskData
from trace_lightning.tasks.build import call_pinned, exclusive, kernels
from trace_lightning.tasks.sql.questions import KINDS, Database, Question, generate_questions
from trace_lightning.tasks.sql.sandbox import Limits
from trace_lightning.tasks.sql.task import (
    SQL_INSTRUCTION,
    SqlTask,
    check_settings,
    example_extras,
)
from trace_lightning.tasks.sql.warm_start import sql_tokenizer, trajectory_text, warm_start
from trace_lightning.tasks.sql.world import FAMILIES, build_database
from trace_lightning.folders import replace_dir

log = logging.getLogger(__name__)

MANIFEST_VERSION = 1  # bump when the databases, the questions, the formats or the warm start change
TRAIN_SET, HELDOUT_SET, WARM_SET = "sql", "sql_heldout", "warm"
# Tiny Qwen3 defaults (``tiny_qwen3_config`` fields); ``model`` overrides any of them.
DEFAULT_MODEL = {"hidden_size": 64, "layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 32,
                 "intermediate": 192, "max_position": 512}
_FLAG = "--data.task.init_args"


class SqlData(TaskData):
    """Generated SQLite databases, questions with gold queries, and a tiny policy
    warm-started to answer them with SQL. Every setting is checked on construction: the
    first one this task cannot use is one ValueError naming its flag, the value, why and the
    fix.

    Args:
        out_dir: where the databases, the questions, the policy (``<out_dir>/model``, which
            ``--model.policy_path`` must name) and the manifest are written.
        seed: seed of the training databases and questions.
        eval_seed: seed of the held-out databases and questions.
        warm_seed: seed of the databases and questions the warm start demonstrates.
        n_train: training questions.
        n_eval: held-out questions.
        n_warm: questions the warm start demonstrates (each once per pass).
        questions_per_db: questions per database, about: a set of n questions has
            ceil(n / (3 * questions_per_db)) databases of each of the 3 schema families.
        kinds: the question kinds drawn (``questions.KINDS``; null: all).
        max_turns: turns before an episode is cut (the longest gold trajectory takes 3).
        max_seq_tokens: a trajectory's tokens before it is cut.
        instruction: the prompt, with ``{question}`` and ``{schema}`` (the policy is
            warm-started on it).
        use_chat_template: wrap prompts in the tokenizer's chat template.
        continuation: how a continuation gets its prefix's SQL session: ``fork`` (a copy of
            its temp tables and views) or ``replay`` (its queries run again on a new one).
        max_query_steps: SQLite virtual-machine steps of one statement before it is stopped.
        show_rows: rows a query's observation shows (the count is always stated).
        vocab_size: the tiny policy's BPE vocabulary (SQL tags included).
        model: overrides of ``DEFAULT_MODEL`` (``tiny_qwen3_config`` fields).
        model_seed: seed of the policy's random initialisation and of the warm start.
        warm_start_steps: most supervised steps on gold trajectories (0: no warm start).
        warm_start_batch: demonstrations per warm-start step.
        warm_start_lr: warm-start learning rate (AdamW, constant after 20 warmup steps).
        warm_start_noise: share of demonstrations with one change in the answer.
        warm_start_stop_loss: end the warm start once its loss (mean of 50 steps) is at most
            this; None runs all ``warm_start_steps``.
        warm_start_threads: torch CPU threads of the warm start (None: one, as the pinned
            build process starts with). Not part of the manifest, but the policy depends on
            it: sums split over threads add in another order.
    """

    metric = "exec_match"

    def __init__(self, out_dir: str = "runs/sql", seed: int = 0, eval_seed: int = 1,
                 warm_seed: int = 2, n_train: int = 2000, n_eval: int = 200,
                 n_warm: int = 4000, questions_per_db: int = 40, kinds: list[str] | None = None,
                 max_turns: int = 4, max_seq_tokens: int = 512,
                 instruction: str = SQL_INSTRUCTION, use_chat_template: bool = False,
                 continuation: Literal["fork", "replay"] = "fork",
                 max_query_steps: int = 500_000, show_rows: int = 5, vocab_size: int = 800,
                 model: dict | None = None, model_seed: int = 0, warm_start_steps: int = 2500,
                 warm_start_batch: int = 8, warm_start_lr: float = 3e-3,
                 warm_start_noise: float = 0.25, warm_start_stop_loss: float | None = None,
                 warm_start_threads: int | None = 1):
        self.out_dir = Path(out_dir)
        self.seed, self.eval_seed, self.warm_seed = seed, eval_seed, warm_seed
        self.n_train, self.n_eval, self.n_warm = n_train, n_eval, n_warm
        self.questions_per_db, self.kinds = questions_per_db, list(kinds) if kinds else list(KINDS)
        self.max_turns, self.max_seq_tokens = max_turns, max_seq_tokens
        self.instruction, self.use_chat_template = instruction, use_chat_template
        self.continuation = continuation
        self.max_query_steps, self.show_rows = max_query_steps, show_rows
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

    @property
    def limits(self) -> Limits:
        return Limits(max_steps=self.max_query_steps, show_rows=self.show_rows)

    def settings(self) -> dict:
        """What the files and the policy are built from (the manifest's ``settings``)."""
        return {"version": MANIFEST_VERSION, "seed": self.seed, "eval_seed": self.eval_seed,
                "warm_seed": self.warm_seed, "n_train": self.n_train, "n_eval": self.n_eval,
                "n_warm": self.n_warm, "questions_per_db": self.questions_per_db,
                "kinds": self.kinds, "instruction": self.instruction,
                "use_chat_template": self.use_chat_template, "show_rows": self.show_rows,
                "max_query_steps": self.max_query_steps, "vocab_size": self.vocab_size,
                "model": {**DEFAULT_MODEL, **self.model}, "model_seed": self.model_seed,
                "warm_start_steps": self.warm_start_steps,
                "warm_start_batch": self.warm_start_batch, "warm_start_lr": self.warm_start_lr,
                "warm_start_noise": self.warm_start_noise,
                "warm_start_stop_loss": self.warm_start_stop_loss}

    # ---- checks -------------------------------------------------------------------------
    def _check_flags(self) -> None:
        """The settings alone, refused before any work."""
        seeds = {"seed": self.seed, "eval_seed": self.eval_seed}
        if self.warm_start_steps > 0:
            seeds["warm_seed"] = self.warm_seed
        if len(set(seeds.values())) < len(seeds):
            raise ValueError(f"{_FLAG}.seed ({self.seed}), eval_seed ({self.eval_seed}) and "
                             f"warm_seed ({self.warm_seed}) must differ: each set's databases "
                             f"are drawn from its seed, and a held-out or warm-start set on the "
                             f"training databases would not be held out; pick distinct seeds")
        for name in ("n_train", "n_eval", "questions_per_db") + (
                ("n_warm",) if self.warm_start_steps else ()):
            if getattr(self, name) < 1:
                raise ValueError(f"{_FLAG}.{name} ({getattr(self, name)}) must be >= 1: an "
                                 f"empty set has nothing to train on or measure; raise it")
        unknown = sorted(set(self.kinds) - set(KINDS))
        if unknown:
            raise ValueError(f"{_FLAG}.kinds ({self.kinds}) holds unknown kinds {unknown}; "
                             f"choose from {list(KINDS)} (or null for all)")
        check_settings(self.max_turns, self.max_seq_tokens, self.instruction,
                       self.continuation)
        if self.max_turns < 3:
            raise ValueError(f"{_FLAG}.max_turns ({self.max_turns}) must be >= 3: the longest "
                             f"gold trajectory runs two queries, then answers; raise it")
        if self.max_query_steps < 10_000:
            raise ValueError(f"{_FLAG}.max_query_steps ({self.max_query_steps}) must be >= "
                             f"10000: the gold queries need thousands of steps; raise it")
        if self.show_rows < 1:
            raise ValueError(f"{_FLAG}.show_rows ({self.show_rows}) must be >= 1: a lookup's "
                             f"answer is read from the first row; raise it")
        if self.vocab_size < 300:
            raise ValueError(f"{_FLAG}.vocab_size ({self.vocab_size}) must be >= 300: 256 "
                             f"byte tokens, the control tokens and the SQL tags come first; "
                             f"raise it")
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
            raise ValueError(f"--model.policy_path ({policy_path!r}) must be the SQL task's "
                             f"own policy {str(self.model_dir)!r} (built under "
                             f"{_FLAG}.out_dir); set it so")

    # ---- preparing and loading ----------------------------------------------------------
    def prepare(self, policy_path: str, fitting: bool) -> None:
        """Write the databases and questions and build the warm-started policy, unless the
        manifest says they are built with these settings (fitting or not)."""
        self._check_policy(policy_path)
        settings = self.settings()
        if self._built(settings):  # a built task may sit on a read-only disk
            log.info("SQL task in %s is up to date", self.out_dir)
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with exclusive(self.out_dir / ".prepare.lock", "the SQL task"):
            if self._built(settings):
                log.info("SQL task in %s is up to date (built by another process)",
                         self.out_dir)
                return
            call_pinned(build_sql, init=self.init_args(), settings=settings)

    def setup(self, fitting: bool, train_limit: int | None, processes: int,
              prompts_needed: int) -> None:
        """Read the held-out questions (at least one per process), and when ``fitting`` the
        first ``train_limit`` training ones (at least ``prompts_needed``)."""
        held_out = self._read(self.heldout_path, HELDOUT_SET, None)
        if len(held_out) < processes:
            raise ValueError(f"{self.heldout_path} holds {len(held_out)} held-out questions, "
                             f"fewer than the {processes} processes: one without any would "
                             f"skip validation while the others wait for it (a hang); raise "
                             f"{_FLAG}.n_eval to at least {processes}")
        self.val_examples = {HELDOUT_SET: held_out}
        if fitting:
            self.train_examples = self._read(self.train_path, TRAIN_SET, train_limit)
            if len(self.train_examples) < prompts_needed:
                raise ValueError(f"{self.train_path} holds {len(self.train_examples)} training "
                                 f"questions (train limit {train_limit}), fewer than the "
                                 f"{prompts_needed} prompts the allocator needs per step; raise "
                                 f"{_FLAG}.n_train (and the limit) or lower "
                                 f"--data.allocator.roots")

    def example(self, question: Question, dataset: str) -> Example:
        """``question`` as the task's ``Example`` of ``dataset`` (its database's path
        resolved under ``out_dir``)."""
        family = FAMILIES[question.family]
        return Example(id=question.id, question=question.question, answers=[question.gold],
                       dataset=dataset,
                       extras={**example_extras((self.out_dir / question.db).resolve(),
                                                family.schema, question.ordered),
                               "kind": question.kind})

    def _read(self, path: Path, name: str, limit: int | None) -> list[Example]:
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: the SQL task's questions are "
                                    f"written by prepare (the DataModule's prepare_data); run "
                                    f"it, or check {_FLAG}.out_dir")
        records = (json.loads(line) for _, line in jsonl_lines(path))
        examples = [self.example(Question.from_record(r), name) for r in records][:limit]
        missing = sorted(db for db in {e.extras["db"] for e in examples}
                         if not Path(db).is_file())
        if missing:
            raise FileNotFoundError(f"{path} names {len(missing)} database(s) that do not "
                                    f"exist, e.g. {missing[0]}: the databases are written by "
                                    f"prepare with the questions; delete {self.manifest_path} "
                                    f"and run again to rebuild, or check {_FLAG}.out_dir")
        return examples

    def environment(self, tokenizer, val_set: str | None = None) -> SqlTask:
        """The task every set rolls out with (each example names its own database)."""
        if val_set not in (None, HELDOUT_SET):
            raise ValueError(f"the SQL task has one validation set, {HELDOUT_SET!r}; got "
                             f"{val_set!r}")
        return SqlTask(tokenizer, max_turns=self.max_turns, max_seq_tokens=self.max_seq_tokens,
                       instruction=self.instruction, use_chat_template=self.use_chat_template,
                       continuation=self.continuation, limits=self.limits)

    # ---- the build ----------------------------------------------------------------------
    def databases(self, name: str, n_questions: int) -> list[Database]:
        """The databases of set ``name`` of ``n_questions`` (their paths; ``build_sets``
        writes them)."""
        per_family = math.ceil(n_questions / (len(FAMILIES) * self.questions_per_db))
        out = []
        for family_name, family in FAMILIES.items():
            for k in range(per_family):
                rel = f"db/{name}-{family_name}-{k}.sqlite"
                out.append(Database(family, self.out_dir / rel, rel))
        return out

    def _db_seed(self, seed: int, db_index: int) -> int:
        return seed * 100_003 + db_index  # sets' seeds differ, so their databases do

    def build_sets(self) -> dict[str, list[Question]]:
        """Write every set's databases and draw its questions: set name -> questions."""
        sets = {TRAIN_SET: (self.seed, self.n_train), HELDOUT_SET: (self.eval_seed, self.n_eval)}
        if self.warm_start_steps > 0:
            sets[WARM_SET] = (self.warm_seed, self.n_warm)
        shutil.rmtree(self.out_dir / "db", ignore_errors=True)  # no database of another build
        out = {}
        for name, (seed, n) in sets.items():
            dbs = self.databases(name, n)
            for k, db in enumerate(dbs):
                build_database(db.path, db.family, self._db_seed(seed, k))
            out[name] = generate_questions(seed, n, dbs, tuple(self.kinds), prefix=name)
        return out

    def init_args(self) -> dict:
        """The constructor's arguments (JSON), from which the build process makes its own."""
        names = inspect.signature(type(self).__init__).parameters
        return {n: str(self.out_dir) if n == "out_dir" else getattr(self, n)
                for n in names if n != "self"}

    def _build(self, settings: dict) -> None:
        start = time.perf_counter()
        log.info("building the SQL task in %s (first run only; a few minutes on 2 cores, "
                 "most of it the warm start)", self.out_dir)
        # without a manifest, files caught half rewritten are never taken as complete
        self.manifest_path.unlink(missing_ok=True)
        sets = self.build_sets()
        demo = sets.get(WARM_SET) or sets[TRAIN_SET]
        demo_examples = [self.example(q, WARM_SET) for q in demo]
        # the tokenizer learns the wording, the names and the results of gold trajectories
        tokenizer = sql_tokenizer([trajectory_text(q, e, self.instruction, self.limits)
                                   for q, e in zip(demo, demo_examples)], self.vocab_size)
        staging = self.model_dir.with_name(self.model_dir.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        build_tiny_model(tokenizer, staging, seed=self.model_seed, **settings["model"])
        stats: dict = {}
        if self.warm_start_steps > 0:
            stats = warm_start(staging, self.environment(tokenizer), demo, demo_examples,
                               steps=self.warm_start_steps, batch_size=self.warm_start_batch,
                               lr=self.warm_start_lr, noise=self.warm_start_noise,
                               stop_loss=self.warm_start_stop_loss, seed=self.model_seed,
                               num_threads=self.warm_start_threads)
            last = stats.pop("losses")[-20:]
            stats["final_loss"] = sum(last) / len(last)
        result = {"settings": settings, "warm_start": stats, "kernels": kernels(),
                  "databases": database_hashes(self.out_dir),
                  "seconds": round(time.perf_counter() - start, 1)}
        write_records((q.record(TRAIN_SET) for q in sets[TRAIN_SET]), self.train_path)
        write_records((q.record(HELDOUT_SET) for q in sets[HELDOUT_SET]), self.heldout_path)
        replace_dir(staging, self.model_dir)
        tmp = self.manifest_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2))
        tmp.replace(self.manifest_path)
        log.info("prepared the SQL task in %s (%.0f s)", self.out_dir, result["seconds"])

    def _built(self, settings: dict) -> bool:
        try:
            manifest = json.loads(self.manifest_path.read_text())
            old, dbs = manifest["settings"], manifest["databases"]
        except (OSError, json.JSONDecodeError, KeyError):
            return False
        files = [self.train_path, self.heldout_path, self.model_dir / "config.json",
                 self.model_dir / "tokenizer.json"] + [self.out_dir / rel for rel in dbs]
        return old == settings and all(f.exists() for f in files)


def database_hashes(out_dir: str | Path) -> dict[str, str]:
    """Each database file under ``out_dir/db`` (path relative to ``out_dir``) -> its
    sha256: the manifest records them, and a check after training finds them unchanged."""
    out_dir = Path(out_dir)
    return {str(p.relative_to(out_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((out_dir / "db").glob("*.sqlite"))}


def build_sql(init: dict, settings: dict) -> None:
    """``SqlData(**init)``'s build from ``settings``, in the process ``call_pinned`` starts."""
    SqlData(**init)._build(settings)
