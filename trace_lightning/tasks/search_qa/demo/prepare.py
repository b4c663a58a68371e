"""Prepare the CPU demo: worlds, corpora, questions, tokenizer, tiny model, warm start.

``prepare_demo(out_dir)`` writes, in our corpus and QA schemas (the standard loaders read
them, so the demo runs the same code path as the real task)::

    out_dir/
      train_corpus.jsonl  train_qa.jsonl   the training world (seed)
      eval_corpus.jsonl   eval_qa.jsonl    the held-out world (eval_seed)
      model/                               tokenizer + tiny Qwen3, warm-started
      manifest.json                        the settings; written last

The warm start uses other worlds (``warm_worlds`` of them, seeds from ``warm_seed``), so
neither the RL questions nor the held-out ones were demonstrated: both start from the same
skill, not memorised facts. No held-out question is one that training (RL or warm start)
asks with the same answer (``held_out_world``).

It is idempotent: when ``manifest.json`` holds the same settings (seeds included) and every
file exists, it returns at once; any other setting rebuilds everything. A rebuild trains the
new model in ``model.partial/`` and leaves the old world, manifest included, untouched until
then; only the last step (milliseconds) removes the manifest, writes the data, swaps
``model/`` in by renames and writes the new manifest. A crash during the long part leaves the
old world complete; one during the swap leaves no manifest, so the next call rebuilds.

The build runs in a process of its own with pinned CPU kernels (``tasks.build.call_pinned``):
one config builds the same world, warm-started policy included, on every x86-64 CPU of one
vendor (MKL runs a path of its own on AMD CPUs: an Intel CPU builds another world).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from trace_lightning.console import duration
from trace_lightning.tasks.build import call_pinned, exclusive, kernels
from trace_lightning.tasks.search_qa.demo.warm_start import warm_start
from trace_lightning.tasks.search_qa.demo.world import World, generate_world, vocabulary_text
from trace_lightning.tasks.search_qa.environment import SearchEnvironment
from trace_lightning.folders import replace_dir
from trace_lightning.jsonl import write_records
from trace_lightning.models import build_tiny_model, train_tokenizer
from trace_lightning.tasks.search_qa.tiny_policy import AGENT_TAGS
from trace_lightning.tasks.search_qa.retrieval import BM25Retriever

log = logging.getLogger(__name__)

# The tiny policy's instruction: short (every token is paid for on a CPU), same tags.
DEMO_INSTRUCTION = "Search one name at a time, then answer.\nQuestion: {question}\n"
MANIFEST_VERSION = 8  # bump when the world, the formats or the warm start change
# Tiny Qwen3 defaults (``tiny_qwen3_config`` fields); ``model=`` overrides any of them.
# Measured in calibration runs of the warm start: width 64 learns the skill as fast
# per example as 128 at about half the compute; 2 layers copy from the question but not
# from the observations.
DEFAULT_MODEL = {"hidden_size": 64, "layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 32,
                 "intermediate": 192, "max_position": 1024}


@dataclass
class DemoPaths:
    """Where ``prepare_demo`` put things."""

    root: Path
    train_corpus: Path
    train_qa: Path
    eval_corpus: Path
    eval_qa: Path
    model: Path
    manifest: Path

    @classmethod
    def under(cls, root: str | Path) -> DemoPaths:
        r = Path(root)
        return cls(root=r, train_corpus=r / "train_corpus.jsonl", train_qa=r / "train_qa.jsonl",
                   eval_corpus=r / "eval_corpus.jsonl", eval_qa=r / "eval_qa.jsonl",
                   model=r / "model", manifest=r / "manifest.json")


def qa_records(world: World) -> list[dict]:
    """A world's questions as QA records (the file format of ``datasets.load_qa``), each
    naming the documents its answer passes through (``supporting_titles``)."""
    return [{**q, "supporting_titles": q["chain"][:-1]} for q in world.questions]


def held_out_world(eval_seed: int, n_questions: int, trained: Sequence[World],
                   **sizes) -> World:
    """``eval_seed``'s world with its first ``n_questions`` questions that no world in
    ``trained`` asks with the same answer.

    Another seed is another world, but every name comes from one syllable pool, so a name
    (mostly a company's) can exist in two worlds and the same question, with the same
    answer, turn up in both; a policy could answer it from memory. Measured at the default
    sizes over the 1560 ordered pairs of seeds 0..39 (600 training, 200 held-out questions):
    3 pairs share such a question, 103 share a question's text with another answer (memory
    answers those wrongly, so they stay). Such a question is skipped for the next one. A
    world's questions are drawn one after another, so where nothing is shared (the default
    seed 0, eval_seed 1 and warm worlds) the set is the one drawn without this check.

    Args:
        eval_seed: seed of the held-out world.
        n_questions: held-out questions wanted (fewer if the world runs out).
        trained: the worlds whose questions are trained on (RL and warm start).
        **sizes: ``generate_world`` sizes.
    """
    seen = {(q["question"], tuple(q["answers"])) for w in trained for q in w.questions}
    # Up to len(seen) questions can be skipped: draw that many more.
    world = generate_world(eval_seed, n_questions=n_questions + len(seen), **sizes)
    kept = [q for q in world.questions if (q["question"], tuple(q["answers"])) not in seen]
    return replace(world, questions=kept[:n_questions])


def demo_env(tokenizer, world: World, topk: int = 3, max_obs_tokens: int = 256,
             max_seq_tokens: int = 1024, max_turns: int = 5, use_chat_template: bool = True,
             instruction: str = DEMO_INSTRUCTION) -> SearchEnvironment:
    """The demo's environment over ``world``'s documents (in-process BM25)."""
    return SearchEnvironment(tokenizer, BM25Retriever.from_documents(world.documents),
                             topk=topk, max_turns=max_turns, max_obs_tokens=max_obs_tokens,
                             max_seq_tokens=max_seq_tokens, instruction=instruction,
                             use_chat_template=use_chat_template)


def prepare_demo(out_dir: str | Path, seed: int = 0, eval_seed: int = 1, warm_seed: int = 2,
                 n_people: int = 300, n_cities: int = 40, n_countries: int = 8,
                 n_companies: int = 40, n_questions: int = 600, n_eval_questions: int = 200,
                 namesakes: int = 3, vocab_size: int = 512, model: dict | None = None,
                 model_seed: int = 0, warm_start_steps: int = 1000,
                 warm_start_batch: int = 16, warm_start_lr: float = 3e-3,
                 warm_start_noise: float = 0.0, warm_start_context_weight: float = 0.0,
                 warm_start_stop_loss: float | None = 0.07,
                 warm_worlds: int = 16,
                 warm_questions: int = 300, topk: int = 2,
                 use_chat_template: bool = False, warm_start_threads: int | None = None,
                 force: bool = False) -> DemoPaths:
    """Build (or find) the demo under ``out_dir``.

    Args:
        out_dir: output folder (created).
        seed: seed of the training world (the RL questions).
        eval_seed: seed of the held-out world.
        warm_seed: the warm-start worlds have seeds ``warm_seed * 1000 + k``.
        n_people: people per world.
        n_cities: cities per world.
        n_countries: countries per world.
        n_companies: companies per world.
        n_questions: questions of the training world.
        n_eval_questions: questions of the held-out world.
        namesakes: people sharing each first name and each last name (distractors).
        vocab_size: BPE vocabulary size (agent tags and control tokens included).
        model: overrides of :data:`DEFAULT_MODEL` (``tiny_qwen3_config`` fields).
        model_seed: seed of the random initialisation.
        warm_start_steps: most supervised steps on gold trajectories (0: no warm start).
        warm_start_batch: trajectories per warm-start step.
        warm_start_lr: warm-start peak learning rate.
        warm_start_noise: share of noisy demonstrations.
        warm_start_context_weight: weight of the language-model loss on prompt and
            observation tokens during the warm start (0: policy tokens only).
        warm_start_stop_loss: end the warm start once its loss (mean of 50 steps) is at
            most this; None runs all ``warm_start_steps``.
        warm_worlds: worlds whose gold trajectories warm-start the policy.
        warm_questions: questions per warm-start world.
        topk: passages per search in the demonstrations (use the same in the RL run).
        use_chat_template: wrap prompts in the chat template (use the same in the RL run).
        warm_start_threads: torch CPU threads of the warm start (None: one, as the pinned
            build process starts with). Not part of the manifest, but the policy depends on
            it: sums split over threads add in another order.
        force: rebuild even if the manifest matches.
    """
    if seed == eval_seed:
        raise ValueError(f"prepare_demo: eval_seed ({eval_seed}) equals seed ({seed}) "
                         f"(--data.task.init_args.demo.eval_seed, "
                         f"--data.task.init_args.demo.seed): the held-out world would "
                         f"be the training world and its questions training questions, so "
                         f"held-out accuracy would measure memorisation; set eval_seed to "
                         f"another seed (default 1, with seed 0)")
    warm_seeds = [warm_seed * 1000 + k for k in range(warm_worlds)]
    if warm_start_steps > 0 and {seed, eval_seed} & set(warm_seeds):
        raise ValueError(f"prepare_demo: warm_seed ({warm_seed}) gives warm-start worlds "
                         f"{warm_seeds[0]}..{warm_seeds[-1]}, which hold seed ({seed}) or "
                         f"eval_seed ({eval_seed}); pick another warm_seed")
    paths = DemoPaths.under(out_dir)
    model_cfg = {**DEFAULT_MODEL, **(model or {})}
    settings = {"version": MANIFEST_VERSION, "seed": seed, "eval_seed": eval_seed,
                "warm_seed": warm_seed, "n_people": n_people, "n_cities": n_cities,
                "n_countries": n_countries, "n_companies": n_companies,
                "n_questions": n_questions, "n_eval_questions": n_eval_questions,
                "namesakes": namesakes, "vocab_size": vocab_size, "model": model_cfg,
                "model_seed": model_seed, "warm_start_steps": warm_start_steps,
                "warm_start_batch": warm_start_batch, "warm_start_lr": warm_start_lr,
                "warm_start_noise": warm_start_noise,
                "warm_start_context_weight": warm_start_context_weight,
                "warm_start_stop_loss": warm_start_stop_loss, "warm_worlds": warm_worlds,
                "warm_questions": warm_questions,
                "topk": topk, "use_chat_template": use_chat_template,
                "instruction": DEMO_INSTRUCTION}
    if not force and _matches(paths, settings):  # a built demo may sit on a read-only disk
        log.info("demo world: %s is up to date", paths.root)
        return paths
    paths.root.mkdir(parents=True, exist_ok=True)
    # one builder at a time (two runs started on one out_dir, or one per node on a shared
    # disk): the others wait, then find it up to date
    with exclusive(paths.root / ".prepare.lock", "the demo"):
        if not force and _matches(paths, settings):
            log.info("demo world: %s is up to date (built by another process)", paths.root)
            return paths
        # the build runs in a process with pinned CPU kernels: one world per CPU vendor
        call_pinned(build_demo, out_dir=str(paths.root), settings=settings,
                    warm_start_threads=warm_start_threads)
        return paths


def build_demo(out_dir: str, settings: dict, warm_start_threads: int | None = None) -> None:
    """Build the demo under ``out_dir`` from ``prepare_demo``'s ``settings`` (checked there),
    in the process ``call_pinned`` starts, and swap it in: the new model is trained in
    ``model.partial/`` and the old world stays whole until the last step."""
    paths, s = DemoPaths.under(out_dir), settings
    sizes = {k: s[k] for k in ("n_people", "n_cities", "n_countries", "n_companies",
                               "namesakes")}
    model_cfg, steps = s["model"], s["warm_start_steps"]
    warm_seeds = [s["warm_seed"] * 1000 + k for k in range(s["warm_worlds"])]
    start = time.perf_counter()
    stages = 4 if steps > 0 else 3
    log.info("building the demo world in %s (first run only; 3 to 10 minutes on 2 "
             "cores, most of it the warm start)", paths.root)
    train = generate_world(s["seed"], n_questions=s["n_questions"], **sizes)
    warm = ([generate_world(w, n_questions=s["warm_questions"], **sizes) for w in warm_seeds]
            if steps > 0 else [])
    held_out = held_out_world(s["eval_seed"], s["n_eval_questions"], [train, *warm], **sizes)
    log.info("  1/%d corpus: a training world (%d questions, %d documents), a held-out "
             "one (%d questions) and %d warm-start worlds (%s)", stages,
             len(train.questions), len(train.documents), len(held_out.questions),
             len(warm), duration(time.perf_counter() - start))

    texts = vocabulary_text(**sizes) + [DEMO_INSTRUCTION.format(question=q["question"])
                                        for q in train.questions[:50]]
    tokenizer = train_tokenizer(texts, s["vocab_size"], AGENT_TAGS)
    log.info("  2/%d tokenizer: byte-level BPE of %d tokens (%s)", stages, s["vocab_size"],
             duration(time.perf_counter() - start))
    staging = paths.model.with_name(paths.model.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    build_tiny_model(tokenizer, staging, seed=s["model_seed"], **model_cfg)
    log.info("  3/%d policy: a tiny Qwen3, %d layers of width %d (%s)", stages,
             model_cfg["layers"], model_cfg["hidden_size"],
             duration(time.perf_counter() - start))
    stats: dict = {}
    if steps > 0:
        log.info("  4/%d warm start: supervised steps on gold trajectories of the "
                 "warm-start worlds, at most %d, until the loss is %s", stages, steps,
                 s["warm_start_stop_loss"])
        env = demo_env(tokenizer, warm[0], topk=s["topk"],
                       use_chat_template=s["use_chat_template"])
        stats = warm_start(staging, warm, env, steps=steps, batch_size=s["warm_start_batch"],
                           lr=s["warm_start_lr"], noise=s["warm_start_noise"],
                           context_weight=s["warm_start_context_weight"],
                           stop_loss=s["warm_start_stop_loss"], seed=s["model_seed"],
                           num_threads=warm_start_threads)
        stats["final_loss"] = sum(stats["losses"][-20:]) / len(stats["losses"][-20:])
        del stats["losses"]
    result = {"settings": settings, "warm_start": stats, "kernels": kernels(),
              "seconds": round(time.perf_counter() - start, 1),
              "files": {k: str(v.relative_to(paths.root)) for k, v in asdict(paths).items()
                        if k not in ("root", "manifest")}}
    # The swap: without a manifest, a world caught half swapped is never taken as complete.
    paths.manifest.unlink(missing_ok=True)
    write_records(train.documents, paths.train_corpus)
    write_records(qa_records(train), paths.train_qa)
    write_records(held_out.documents, paths.eval_corpus)
    write_records(qa_records(held_out), paths.eval_qa)
    replace_dir(staging, paths.model)
    tmp = paths.manifest.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(paths.manifest)
    loss = stats.get("final_loss")
    log.info("demo world ready in %s (%s%s)", paths.root, duration(result["seconds"]),
             "" if loss is None else f"; warm-start loss {loss:.3f}")


def _matches(paths: DemoPaths, settings: dict) -> bool:
    if not paths.manifest.is_file():
        return False
    try:
        old = json.loads(paths.manifest.read_text())["settings"]
    except (json.JSONDecodeError, KeyError):
        return False
    files = [paths.train_corpus, paths.train_qa, paths.eval_corpus, paths.eval_qa,
             paths.model / "config.json", paths.model / "tokenizer.json"]
    return old == settings and all(f.exists() for f in files)
