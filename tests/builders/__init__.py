"""Builders shared by the tests: what more than one test file builds, built one way.

- here: the repository's root, the small demo world (one per session, see conftest.py) and
  the command line of a fit on it, a benchmark as a module, the search-QA datamodule, and a
  tiny random-weight Qwen3 with a tokenizer of its own (``tiny_policy``);
- ``builders.trees``: rollout trees and leaf sequences built by hand;
- ``builders.models``: the tiny random-weight Qwen3 without a tokenizer, and float64 copies;
- ``builders.packing``: the packed and per-leaf updates of a list of trees, side by side;
- ``builders.training``: a real Trainer over hand-built mini-batches, sampled mini-batches;
- ``builders.steps``: the hand-built rollout step the callbacks are checked on;
- ``builders.sql``: a small shop database.

Helpers for tests that start processes are in ``launch.py``; the plain loop references the
library is checked against are in ``references.py``.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# a small world and a short warm start: the pipeline is what is tested with it
SMALL_DEMO = {"n_people": 60, "n_cities": 12, "n_countries": 4, "n_companies": 12,
              "n_questions": 80, "n_eval_questions": 16, "warm_questions": 200,
              "warm_start_batch": 8, "warm_start_threads": 1,
              "model": {"hidden_size": 64, "layers": 2, "intermediate": 128}}
SMALL_DEMO_WARM_START_STEPS = 40


def small_demo(out: Path) -> Path:
    """Prepare the small demo world under ``out`` (its tokenizer, policy and warm start)."""
    from trace_lightning.tasks.search_qa.demo.prepare import prepare_demo

    prepare_demo(out, warm_start_steps=SMALL_DEMO_WARM_START_STEPS, **SMALL_DEMO)
    return out


def demo_args(demo_dir: Path, root: Path, epochs: int, *extra: str) -> list[str]:
    """``trace-lightning fit``'s arguments for ``configs/demo.yaml`` on the small demo world
    at ``demo_dir``, logging under ``root``, for ``epochs`` epochs; ``extra`` appended."""
    import json

    return [
        "--config", str(REPO / "configs" / "demo.yaml"),
        f"--trainer.max_epochs={epochs}", f"--trainer.default_root_dir={root}",
        f"--trainer.logger.init_args.save_dir={root}",
        f"--model.policy_path={demo_dir / 'model'}",
        f"--data.task.init_args.demo.out_dir={demo_dir}",
        f"--data.task.init_args.demo.warm_start_steps={SMALL_DEMO_WARM_START_STEPS}",
        f"--data.task.init_args.demo.options={json.dumps(SMALL_DEMO)}",
        "--data.allocator.roots=8", "--data.allocator.group_size=4",
        "--data.allocator.cold_start_nodes=0", "--data.allocator.explore_fraction=0.25",
        "--data.candidates_per_step=16", "--data.minibatches_per_step=2",
        "--model.predictor_epochs=2",
        f"--data.trees_dir={root / 'trees'}", *extra,
    ]


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (its folder on ``sys.path``, for ``provenance``
    and the benchmarks it imports)."""
    import importlib.util
    import sys

    folder = REPO / "benchmarks"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", folder / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def search_datamodule(**kwargs):
    """A ``TraceDataModule`` of the search-QA task: ``SearchQAData``'s arguments (``train``,
    ``corpus``, ``demo``, ``env``, ...) build the task, the rest go to the datamodule."""
    import inspect

    from trace_lightning.data import TraceDataModule
    from trace_lightning.tasks.search_qa.data import SearchQAData

    own = set(inspect.signature(SearchQAData).parameters)
    task = SearchQAData(**{k: v for k, v in kwargs.items() if k in own})
    return TraceDataModule(task=task, **{k: v for k, v in kwargs.items() if k not in own})


def tiny_policy(out: Path, vocab_size: int = 512, seed: int = 0, **config) -> Path:
    """A randomly initialised tiny Qwen3 with a tokenizer of its own, for the tests of parts
    that are about no task in particular (engines, export, the hub): the arithmetic task's
    tokenizer, trained on 300 of its generated problems, nothing to download or read."""
    from trace_lightning.models import build_tiny_model
    from trace_lightning.tasks.calc import CALC_INSTRUCTION, generate_problems
    from trace_lightning.tasks.calc.warm_start import calc_tokenizer

    tokenizer = calc_tokenizer(generate_problems(seed=7, n=300), vocab_size, CALC_INSTRUCTION)
    return build_tiny_model(tokenizer, out, seed=seed, **config)
