"""Learning benchmark: held-out accuracy per method at equal sampling cost.

Trains the same warm-started demo policy with ``uniform`` (GRPO), ``random_tree``
(TreePO-style), ``prompt`` (prompt-level allocation) and ``trace``, at the same leaves per
step and the same number of steps, over several seeds, through the real CLI
(``trace-lightning fit --config configs/demo.yaml [--config configs/demo_<method>.yaml]``),
and reads every figure back from the runs' TensorBoard event files. Each run is its own
process (as a user runs it), so one run's engine memory cannot starve the next; a run whose
event files already hold all its epochs is read back instead of rerun (``--fresh`` reruns).

Reported per method: held-out accuracy (val/demo_heldout/em) before RL and after each epoch
(mean and min-max over seeds), effective ratio, informative-leaf share, generated tokens,
wall time of the fit (first to last logged event); and the sampling budget (leaves) each
method needs to reach a target accuracy, by default the final accuracy of ``uniform`` (so
``trace``'s budget / ``uniform``'s is the saving at equal result): per seed at the first
evaluation at or above it, and on the mean curve over seeds, linear between evaluations
(the ratio in the JSON line); and, on the same mean curve, the generated tokens it needs
(tree leaves share their prefixes' tokens, so a leaf of ``trace`` costs fewer than one of
``uniform``: the saving in compute, a second unit beside the leaves) and the training
wall-clock (``perf/step_s``: the sampling phase, that is weight sync, rollouts, predictor
calls and fit, plus the update; validation excluded), per seed and on the mean curve; and
how many distinct prompts each method trained on over the run (``alloc/prompts_distinct``)
and the share of its opened prompts that were new to it (``alloc/prompts_new``). Runs
go seed by seed, every method of a seed before the next seed (uniform, trace, uniform,
trace, ...), so drift in the machine's load hits every method alike. Every method is also
paired with ``uniform`` seed by seed
(the same seed: the same candidates every epoch and the same evaluation questions): mean
difference in final accuracy, in accuracy averaged over all epochs (eight evaluations, so
less noise than the last one alone) and in effective ratio, each with its standard error
and the count of seeds ahead. ``--final-samples K`` evaluates each run's last checkpoint once
more with K samples per held-out question (``trace-lightning validate --ckpt_path``, in
``<run>/final_eval``; each per-epoch evaluation takes 2): the final accuracy with about
sqrt(K / 2) times less sampling noise, paired the same way; that score is then also the
last point of each curve the costs to the target are read on, and uniform's mean of it the
default target. A compute ratio read where two flat curves cross moves with a few seeds, so
each comes with an interval: the seeds resampled with replacement (paired), the target and
both mean curves recomputed per draw, 90% of the draws' ratios inside. ``targets`` in the
JSON line checks trace against the issue's: at most 0.6x uniform's tokens and 0.8x its
training seconds to uniform's final accuracy (the interval's upper end under the bound), and
a final accuracy not behind by more than one standard error of the paired difference.
Writes a plot of accuracy against sampling budget per method (the mean over seeds, shaded
+- its standard error).

    python benchmarks/learning.py                   # 3 seeds x 4 methods (about an hour here)
    python benchmarks/learning.py --quick           # 1 seed, 3 epochs, 128 leaves (< 10 min here)
    python benchmarks/learning.py --final-samples 16  # + each final policy on 200 x 16 rollouts
    python benchmarks/learning.py --methods uniform,trace,oracle  # + the upper bound
                                                    # (configs/demo_oracle.yaml)
    python benchmarks/learning.py --held-in 200     # + accuracy on 200 training-world
                                                    # questions (what RL trains on)
    python benchmarks/learning.py --val-every 8 --no-before  # one evaluation, after the fit
    python benchmarks/learning.py --world my_world.yaml  # on another demo world: a config
                                       # setting data.task.init_args.demo (out_dir, build)
                                       # and policy_path

``--held-in N`` adds a second evaluation, on the first N questions of the training world
(``val/demo_heldin/em``; candidates are drawn from all its questions, so these are ones
the policy trains on): whether a method learns its own prompts faster, apart from how that
carries over to the held-out world; with ``--final-samples`` the last checkpoints are scored
on them too.

Ends with one JSON line, also written to ``--out`` (default ``docs/results/learning.json``;
with ``--quick`` in its out-dir) with the commit, date, machine load and demo world.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import provenance  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
METHODS = ["uniform", "random_tree", "prompt", "trace"]
KEYS = {"acc": "val/demo_heldout/em", "acc_in": "val/demo_heldin/em",
        "effective": "rollout/effective_ratio", "informative": "rollout/informative_leaf_share",
        "leaves": "alloc/leaves", "tokens": "alloc/generated_tokens", "epoch_s": "perf/epoch_s",
        "step_s": "perf/step_s", "opened": "alloc/prompts_opened", "new": "alloc/prompts_new",
        "distinct": "alloc/prompts_distinct"}
# The predictor's out-of-sample quality (callbacks/METRICS.md), averaged over a run's epochs
PREDICTOR_TAGS = [f"predictor/{part}{metric}" for part in ("", "roots/", "prefixes/")
                  for metric in ("brier_skill", "brier_skill_vs_previous", "spearman")]
# Written beside each run this benchmark trains: that run's command, commit, date and the
# machine's load before and after it (a run read back was trained by an earlier command).
RUN_RECORD = "run.json"
# Compute ratios' intervals: seeds resampled this many times, the central share kept
BOOT_DRAWS, BOOT_LEVEL = 2000, 0.9
# The costs to the target: leaves, generated tokens, training seconds (name, run key)
COSTS = (("budget", "leaves"), ("tokens", "tokens"), ("time", "step_s"))
# The issue's targets for trace against uniform: at most these shares of uniform's generated
# tokens and training seconds to uniform's final accuracy (the interval's upper end must be
# under them), and a final accuracy not behind by more than one standard error
TARGETS = {"tokens": 0.6, "time": 0.8}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--val-limit", type=int, default=200, help="held-out questions per eval")
    p.add_argument("--val-every", type=int, default=1,
                   help="evaluate after every n-th epoch (--epochs must be a multiple)")
    p.add_argument("--before", action=argparse.BooleanOptionalAction, default=True,
                   help="evaluate the warm-started policy before RL (--no-before: skip it; "
                        "then no budget or time to target is computed)")
    p.add_argument("--out", default=None,
                   help="the JSON line also goes here (default docs/results/learning.json, "
                        "--quick: in its out-dir)")
    p.add_argument("--out-dir", default=None,
                   help="runs go here (default runs/learning, --quick: runs/learning_quick)")
    p.add_argument("--target", type=float, default=None,
                   help="accuracy to reach (default: uniform's final mean accuracy)")
    p.add_argument("--plot", default=None,
                   help="the plot (default docs/learning.png, --quick: in its out-dir)")
    p.add_argument("--quick", action="store_true",
                   help="1 seed, 3 epochs, 100 questions, half the demo's budget per step")
    p.add_argument("--extra", action="append", default=[],
                   help="one more CLI override for every run, repeatable: "
                        "--extra=--model.advantage=treepo --extra=--data.allocator.roots=64")
    p.add_argument("--extra-for", action="append", default=[], metavar="METHOD=OVERRIDE",
                   help="one more CLI override for one method's runs, repeatable: "
                        "--extra-for trace=--model.lr=5e-4 (each method at its own learning "
                        "rate; give that comparison its own --out-dir)")
    p.add_argument("--final-samples", type=int, default=0,
                   help="evaluate each run's last checkpoint again with this many samples per "
                        "held-out question (0: off)")
    p.add_argument("--fresh", action="store_true", help="rerun runs that already finished")
    p.add_argument("--held-in", type=int, default=0,
                   help="also evaluate on this many training-world questions (0: off)")
    p.add_argument("--world", default=None,
                   help="a config (YAML) of another demo world, added after configs/demo.yaml "
                        "to every run: it sets data.task.init_args.demo (where the world is built "
                        "and how) and model.policy_path (default: the demo's own world, "
                        "runs/demo/world)")
    return p.parse_args(argv)


def world_dir(world_config: str | None) -> str:
    """Where the runs' demo world lives: ``data.task.init_args.demo.out_dir`` of
    ``world_config`` (the ``--world`` file), else configs/demo.yaml's."""
    import yaml

    path = Path(world_config) if world_config else REPO / "configs" / "demo.yaml"
    if not path.is_file():
        raise SystemExit(f"--world {world_config}: no such file; give a YAML config that sets "
                         f"data.task.init_args.demo (out_dir and how to build the world) and "
                         f"model.policy_path (<out_dir>/model)")
    data = (yaml.safe_load(path.read_text()) or {}).get("data") or {}
    out = ((data.get("task") or {}).get("init_args") or {}).get("demo") or {}
    if not isinstance(out, dict) or "out_dir" not in out:
        raise SystemExit(f"--world {world_config}: it sets no data.task.init_args.demo.out_dir; "
                         f"a world config names where its world is built (and "
                         f"model.policy_path, its model/)")
    return str(out["out_dir"])


def scalars(run_dir: Path, version: int = -1) -> tuple[dict[str, list[float]], float]:
    """A run's scalars by tag, and the seconds between its first and last event."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    versions = sorted((run_dir / "tensorboard").glob("version_*"),
                      key=lambda p: int(p.name.split("_")[1]))
    acc = EventAccumulator(str(versions[version]), size_guidance={"scalars": 0})
    acc.Reload()
    events = [e for t in acc.Tags()["scalars"] for e in acc.Scalars(t)]
    span = max(e.wall_time for e in events) - min(e.wall_time for e in events) if events else 0.0
    return {t: [e.value for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}, span


def predictor_means(per_run: list[dict[str, float]]) -> dict[str, float]:
    """Each ``PREDICTOR_TAGS`` entry's mean over the runs that logged it (their epochs' mean)."""
    return {t: float(np.mean([r[t] for r in per_run if t in r]))
            for t in PREDICTOR_TAGS if any(t in r for r in per_run)}


def prompt_counts(runs: list[dict]) -> dict[str, float | None]:
    """Over ``runs`` (one method's seeds): the distinct prompts each opened by its last
    epoch (mean over seeds) and the share of its opened prompts that were new to it (opened
    prompts summed over epochs); None where a run did not log them."""
    if not runs or not all(r.get("distinct") and r.get("opened") for r in runs):
        return {"prompts_distinct": None, "new_prompt_share": None}
    return {"prompts_distinct": float(np.mean([r["distinct"][-1] for r in runs])),
            "new_prompt_share": float(np.mean([sum(r["new"]) / sum(r["opened"])
                                               for r in runs]))}


def _finished(out: Path, epochs: int, held_in: bool, val_every: int = 1,
              before: bool = True) -> bool:
    """Whether ``out`` holds a finished run of ``epochs`` epochs evaluated every
    ``val_every`` (one with fewer evaluations is rerun; one with more is not this run: its
    checkpoint and figures are another length's, nor is one without the training-world
    evaluation ``held_in`` asks for). ``before``: version_0 is the evaluation before RL and
    the fit comes after it."""
    runs = sorted((out / "tensorboard").glob("version_*"))
    if len(runs) < (2 if before else 1):
        return False
    s = scalars(out)[0]
    done, evals = len(s.get(KEYS["acc"], [])), epochs // val_every
    if done > evals:
        raise SystemExit(f"{out} holds a run of {done} evaluations and --epochs {epochs} "
                         f"--val-every {val_every} ask for {evals}: pass --out-dir for a new "
                         f"folder, or --fresh to replace that run")
    if done == evals and held_in and KEYS["acc_in"] not in s:
        raise SystemExit(f"{out} holds a finished run without the training-world evaluation "
                         f"--held-in asks for ({KEYS['acc_in']}): pass --out-dir for a new "
                         f"folder, or --fresh to rerun it with that evaluation")
    return done == evals


def extra_for(pairs: list[str], methods: list[str] | None = None) -> dict[str, list[str]]:
    """``--extra-for METHOD=OVERRIDE`` values as each method's overrides, in order; with
    ``methods`` a pair is checked against them (one error naming the flag and the value)."""
    out: dict[str, list[str]] = {}
    for pair in pairs:
        method, sep, override = pair.partition("=")
        if not sep or not override.startswith("--") or (methods and method not in methods):
            raise SystemExit(f"learning.py: --extra-for {pair}: expected METHOD=--override "
                             f"with METHOD one of --methods ({','.join(methods or [])}), e.g. "
                             f"--extra-for trace=--model.lr=5e-4")
        out.setdefault(method, []).append(override)
    return out


def run(method: str, seed: int, args, root: Path) -> dict:
    out = root / f"{method}_seed{seed}"
    configs = ["--config", str(REPO / "configs" / "demo.yaml")]
    if args.world:
        configs += ["--config", str(Path(args.world).resolve())]
    if method != "trace":
        configs += ["--config", str(REPO / "configs" / f"demo_{method}.yaml")]
    world = world_dir(args.world)
    val = [{"name": "demo_heldout", "path": f"{world}/eval_qa.jsonl",
            "corpus": f"{world}/eval_corpus.jsonl", "limit": args.val_limit}]
    if args.held_in:
        val.append({"name": "demo_heldin", "path": f"{world}/train_qa.jsonl",
                    "corpus": f"{world}/train_corpus.jsonl", "limit": args.held_in})
    common = [f"--trainer.default_root_dir={out}", f"--trainer.logger.init_args.save_dir={out}",
              f"--seed_everything={seed}", f"--data.seed={seed}",
              f"--data.allocator.seed={seed}", f"--data.task.init_args.val={json.dumps(val)}",
              *args.extra, *extra_for(args.extra_for).get(method, [])]
    if args.fresh or not _finished(out, args.epochs, args.held_in > 0, args.val_every,
                                   args.before):
        if out.exists():
            shutil.rmtree(out)
        cli = [sys.executable, "-m", "trace_lightning.cli"]
        stamp = provenance.Stamp()
        if args.before:  # accuracy of the warm-started policy, then training
            subprocess.run([*cli, "validate", *configs, *common], check=True, cwd=REPO)
        subprocess.run([*cli, "fit", *configs, *common, f"--trainer.max_epochs={args.epochs}",
                        f"--trainer.check_val_every_n_epoch={args.val_every}"],
                       check=True, cwd=REPO)
        # the run's own commit, date and load: a summary may read it back much later
        (out / RUN_RECORD).write_text(json.dumps(stamp.fields()) + "\n")
    before = scalars(out, 0)[0] if args.before else {}
    s, wall_s = scalars(out)
    result = {"method": method, "seed": seed,
              "acc_before": before.get(KEYS["acc"], [None])[-1],
              "acc_in_before": before.get(KEYS["acc_in"], [None])[-1],
              "acc": s[KEYS["acc"]],
              **{k: s.get(v, []) for k, v in KEYS.items() if k != "acc"},
              "wall_s": wall_s,
              # runs logged before a tag existed have none: it is left out
              "predictor": {t: float(np.nanmean(s[t])) for t in PREDICTOR_TAGS
                            if s.get(t) and not np.all(np.isnan(s[t]))},
              "trained": (json.loads((out / RUN_RECORD).read_text())
                          if (out / RUN_RECORD).exists() else None)}
    if args.final_samples:
        final = final_eval(out, configs, common, args.final_samples)
        result["acc_final_eval"] = final[KEYS["acc"]]
        result["acc_in_final_eval"] = final.get(KEYS["acc_in"])
    return result


def final_eval(out: Path, configs: list[str], common: list[str], samples: int
               ) -> dict[str, float]:
    """The run's last checkpoint on its evaluation sets with ``samples`` rollouts per
    question, through ``trace-lightning validate --ckpt_path`` (read back when already
    there): the held-out accuracy, and the training world's when the run evaluates it."""
    where = out / "final_eval" / f"samples_{samples}"
    if not ((where / "tensorboard").exists() and KEYS["acc"] in scalars(where)[0]):
        (ckpt,) = sorted((out / "tensorboard").glob("version_*/checkpoints/last.ckpt"))[-1:]
        if where.exists():
            shutil.rmtree(where)
        subprocess.run([sys.executable, "-m", "trace_lightning.cli", "validate", *configs,
                        *common, f"--trainer.default_root_dir={where}",
                        f"--trainer.logger.init_args.save_dir={where}",
                        f"--data.val_samples={samples}", f"--ckpt_path={ckpt}"],
                       check=True, cwd=REPO)
    s = scalars(where)[0]
    return {k: s[k][-1] for k in (KEYS["acc"], KEYS["acc_in"]) if k in s}


# An accuracy within this of the target reaches it: accuracies are float32 means, and the
# same mean of five seeds can come out 5e-9 apart when summed in another order (uniform's own
# final accuracy, the default target, must be reached where its curve first equals it).
REACHED_TOL = 1e-6


def budget_to_reach(acc_before: float, acc: list[float], leaves: list[float],
                    target: float) -> float | None:
    """Leaves spent by the first evaluation at or above ``target`` (within ``REACHED_TOL``),
    the one before RL (0 leaves) included (None: never)."""
    spent = np.cumsum([0, *leaves])
    for a, b in zip([acc_before, *acc], spent):
        if a >= target - REACHED_TOL:
            return float(b)
    return None


def budget_on_curve(acc_before: float, acc: list[float], leaves: list[float],
                    target: float) -> float | None:
    """Leaves at which the curve (0, acc_before), (leaves spent, acc after each epoch)...
    first reaches ``target`` (within ``REACHED_TOL``), linear between evaluations (None:
    never).

    Run on the mean curve over seeds: the mean of 3+ evaluations is less noisy than any one,
    so this is defined where a per-seed first crossing would depend on one lucky point."""
    xs = [0.0, *np.cumsum(leaves).tolist()]
    ys = [acc_before, *acc]
    if ys[0] >= target - REACHED_TOL:
        return 0.0
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if y1 >= target - REACHED_TOL:
            return float(x0 + (x1 - x0) * min(1.0, (target - y0) / (y1 - y0)))
    return None


def cost_curve(r: dict) -> list[float]:
    """A run's accuracy after each evaluation as the costs to the target read it: the last
    one is the final evaluation's (``--final-samples``, the same checkpoint on K samples per
    question instead of 2) where there is one, since a crossing is decided near the end."""
    final = r.get("acc_final_eval")
    return [*r["acc"][:-1], final] if final is not None else list(r["acc"])


def mean_curve_cost(rs: list[dict], key: str, target: float, val_every: int,
                    idx: Sequence[int] | None = None) -> float | None:
    """Cost (``key``: leaves, tokens or step_s) at which the mean over the runs ``rs[idx]``
    (all by default; repeats count again) of their cost curves first reaches ``target``:
    each interval's mean cost over those runs, linear between evaluations (None: never)."""
    idx = range(len(rs)) if idx is None else idx
    curves = np.array([cost_curve(rs[i]) for i in idx])  # (runs, evaluations)
    costs = np.array([per_eval(rs[i][key], val_every) for i in idx])  # (runs, evaluations)
    before = float(np.mean([rs[i]["acc_before"] for i in idx]))
    return budget_on_curve(before, curves.mean(0).tolist(), costs.mean(0).tolist(), target)


def cost_ratio_interval(u: list[dict], m: list[dict], key: str, target: float | None,
                        val_every: int, draws: int = BOOT_DRAWS, level: float = BOOT_LEVEL,
                        seed: int = 0) -> dict:
    """How sure a compute-to-target ratio is: the seeds drawn with replacement ``draws``
    times (paired: one draw picks the same seeds of ``u``, uniform, and ``m``), and for each
    draw the target (uniform's mean final on those seeds, or the given ``target``) and
    ``m``'s cost to it over ``u``'s, both on the drawn seeds' mean curves. Returns the
    ``level`` interval's ends (percentiles of the draws; None, "never": ``m`` does not reach
    the target in that share of draws or more) and the share of draws where ``m`` reaches it.
    Draws where uniform's own mean curve is at the target before RL are left out (None:
    every draw was)."""
    rng = np.random.default_rng(seed)
    ratios = []  # (draws,): m's cost / u's, inf where m never reaches the target
    for _ in range(draws):
        idx = rng.integers(0, len(u), len(u))
        t = target if target is not None else float(np.mean([cost_curve(u[i])[-1]
                                                             for i in idx]))
        uc, mc = mean_curve_cost(u, key, t, val_every, idx), mean_curve_cost(m, key, t,
                                                                            val_every, idx)
        if uc:
            ratios.append(np.inf if mc is None else mc / uc)
    if not ratios:
        return None
    ratios = np.array(ratios)
    tail = (1 - level) / 2
    low, high = (float(x) if np.isfinite(x) else None
                 for x in np.quantile(ratios, [tail, 1 - tail], method="inverted_cdf"))
    return {"low": low, "high": high, "level": level,
            "reached_share": float(np.isfinite(ratios).mean()), "draws": len(ratios)}


def paired(a: list[float], b: list[float]) -> dict:
    """``a - b`` seed by seed: the differences, their mean, the standard error of that mean
    (sample standard deviation / sqrt(seeds); None for one seed) and how many are > 0."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)  # (seeds,)
    se = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else None
    return {"diff_per_seed": d.tolist(), "mean": float(d.mean()), "se": se,
            "ahead": int((d > 0).sum()), "seeds": len(d)}


def fmt_paired(p: dict) -> str:
    """``+0.005 +-0.006 (7/10)``: mean difference, its standard error, seeds ahead / seeds."""
    se = f" +-{p['se']:.3f}" if p["se"] is not None else ""
    return f"{p['mean']:+.3f}{se} ({p['ahead']}/{p['seeds']})"


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.quick:
        args.seeds, args.epochs, args.val_limit = "0", 3, 100
        args.extra = ["--data.allocator.roots=64", "--data.candidates_per_step=96", *args.extra]
    args.out_dir = args.out_dir or ("runs/learning_quick" if args.quick else "runs/learning")
    args.plot = args.plot or ("docs/learning.png" if not args.quick
                              else str(Path(args.out_dir) / "learning.png"))
    methods = args.methods.split(",")
    unknown = [m for m in methods
               if m != "trace" and not (REPO / "configs" / f"demo_{m}.yaml").exists()]
    world_dir(args.world)  # a --world file that names no world fails here, before any run
    extra_for(args.extra_for, methods)  # so does a malformed --extra-for
    if unknown:  # before hours of runs, not after
        raise SystemExit(f"learning.py: --methods {args.methods}: no configs/demo_<method>.yaml "
                         f"for {unknown}; the methods are trace and those configs' "
                         f"(uniform, random_tree, prompt, prefix, oracle)")
    if args.target is None and "uniform" not in methods:  # before hours of runs, not after
        raise SystemExit("learning.py: --target is needed when --methods has no 'uniform' "
                         "(whose final accuracy is the default target)")
    if args.val_every < 1 or args.epochs % args.val_every:
        raise SystemExit(f"learning.py: --val-every {args.val_every} must be >= 1 and divide "
                         f"--epochs {args.epochs}")
    seeds = [int(s) for s in args.seeds.split(",")]
    root = Path(args.out_dir)
    stamp = provenance.Stamp()
    # seed by seed, methods in turn: drift in the machine's load hits every method alike
    runs = [run(m, s, args, root) for s in seeds for m in methods]

    summary = {}
    for m in methods:
        rs = [r for r in runs if r["method"] == m]
        acc = np.array([r["acc"] for r in rs])  # (seeds, epochs)
        summary[m] = {
            "acc_before": (float(np.mean([r["acc_before"] for r in rs])) if args.before
                           else None),
            "acc_mean": acc.mean(0).tolist(), "acc_min": acc.min(0).tolist(),
            "acc_max": acc.max(0).tolist(), "final_acc": float(acc[:, -1].mean()),
            # standard error of the mean over seeds, per epoch (0 for one seed)
            "acc_se": (acc.std(0, ddof=1) / np.sqrt(len(rs)) if len(rs) > 1
                       else np.zeros(acc.shape[1])).tolist(),
            "effective_ratio": float(np.mean([np.mean(r["effective"]) for r in rs])),
            "informative_leaf_share": float(np.mean([np.mean(r["informative"]) for r in rs])),
            "leaves_per_step": float(np.mean([np.mean(r["leaves"]) for r in rs])),
            "generated_tokens_per_step": float(np.mean([np.mean(r["tokens"]) for r in rs])),
            # runs logged before perf/step_s existed have none: no time figures
            "step_s": (float(np.mean([np.mean(r["step_s"]) for r in rs]))
                       if all(len(r.get("step_s", [])) == args.epochs for r in rs) else None),
            "wall_s": float(np.mean([r["wall_s"] for r in rs])),
            "final_acc_per_seed": acc[:, -1].tolist(),
            "acc_per_seed": acc.tolist(),
            "effective_per_seed": [float(np.mean(r["effective"])) for r in rs],
            # the epochs' mean per seed, then over the seeds that logged the tag
            "predictor": predictor_means([r.get("predictor", {}) for r in rs]),
            # how many questions the method trained on: distinct prompts opened over the
            # run, and the share of opened prompts that were new (runs logged before
            # AllocationSpread counted them have none)
            **prompt_counts(rs),
        }
        if args.held_in:
            acc_in = np.array([r["acc_in"] for r in rs])  # (seeds, epochs)
            summary[m].update({
                "held_in_before": (float(np.mean([r["acc_in_before"] for r in rs]))
                                   if args.before else None),
                "held_in_acc_mean": acc_in.mean(0).tolist(),
                "held_in_final_per_seed": acc_in[:, -1].tolist(),
                "held_in_mean_per_seed": acc_in.mean(1).tolist()})
        if args.final_samples:
            summary[m]["final_eval_per_seed"] = [r["acc_final_eval"] for r in rs]
            summary[m]["final_eval_acc"] = float(np.mean(summary[m]["final_eval_per_seed"]))
            if args.held_in:
                per_seed = [r["acc_in_final_eval"] for r in rs]
                summary[m]["held_in_final_eval_per_seed"] = per_seed
                summary[m]["held_in_final_eval_acc"] = float(np.mean(per_seed))
    # the target: uniform's final accuracy, on K samples per question with --final-samples
    target = args.target
    if target is None and "uniform" in summary:
        target = float(np.mean([cost_curve(r)[-1] for r in runs if r["method"] == "uniform"]))
    for m in methods:
        rs = [r for r in runs if r["method"] == m]
        r = summary[m]
        for unit, key in COSTS:
            # cost to the target per seed (first evaluation at or above it) and on the mean
            # curve (each interval's mean cost over seeds; linear between evaluations), each
            # curve ending with its final evaluation (cost_curve)
            reach = target is not None and args.before and (key != "step_s"
                                                            or r["step_s"] is not None)
            r[f"{unit}_to_target"] = [
                budget_to_reach(x["acc_before"], cost_curve(x),
                                per_eval(x[key], args.val_every), target) if reach else None
                for x in rs]
            r[f"{unit}_to_target_mean_curve"] = (
                mean_curve_cost(rs, key, target, args.val_every) if reach else None)
        # the area under each seed's curve: the mean of its evaluations after every epoch
        r["mean_acc_per_seed"] = [float(np.mean(x["acc"])) for x in rs]
    if "uniform" in summary:
        u = summary["uniform"]
        for m in methods:
            if m != "uniform":
                r = summary[m]
                r["vs_uniform"] = {
                    "final_acc": paired(r["final_acc_per_seed"], u["final_acc_per_seed"]),
                    "mean_acc": paired(r["mean_acc_per_seed"], u["mean_acc_per_seed"]),
                    "effective_ratio": paired(r["effective_per_seed"], u["effective_per_seed"])}
                if args.held_in:
                    r["vs_uniform"]["held_in_final"] = paired(r["held_in_final_per_seed"],
                                                              u["held_in_final_per_seed"])
                    r["vs_uniform"]["held_in_mean"] = paired(r["held_in_mean_per_seed"],
                                                             u["held_in_mean_per_seed"])
                if args.final_samples:
                    r["vs_uniform"]["final_eval"] = paired(r["final_eval_per_seed"],
                                                           u["final_eval_per_seed"])
                if args.final_samples and args.held_in:
                    r["vs_uniform"]["held_in_final_eval"] = paired(
                        r["held_in_final_eval_per_seed"], u["held_in_final_eval_per_seed"])
                # how sure the cost ratios to the target are, over the seeds (the target
                # drawn with them unless --target fixed it)
                rs = [x for x in runs if x["method"] == m]
                us = [x for x in runs if x["method"] == "uniform"]
                intervals = {
                    unit: cost_ratio_interval(us, rs, key, args.target, args.val_every)
                    for unit, key in COSTS
                    if args.before and len(seeds) > 1
                    and (key != "step_s" or (r["step_s"] and u["step_s"]))}
                r["vs_uniform"]["cost_ratio_interval"] = {
                    unit: v for unit, v in intervals.items() if v is not None}

    print(f"\nlearning benchmark: {len(seeds)} seed(s) x {args.epochs} epochs, "
          f"target accuracy {'-' if target is None else f'{target:.3f}'}")
    print(f"{'method':12s}{'acc before':>12s}{'final acc':>11s}{'min-max':>14s}"
          f"{'effective':>11s}{'informative':>13s}{'leaves/step':>13s}{'tokens/step':>13s}"
          f"{'step s':>8s}{'wall s':>9s}{'prompts':>9s}  leaves to target")
    for m, r in summary.items():
        print(f"{m:12s}{_num(r['acc_before'], '12.3f')}{r['final_acc']:11.3f}"
              f"{min(r['final_acc_per_seed']):7.3f}-{max(r['final_acc_per_seed']):.3f}"
              f"{r['effective_ratio']:11.3f}{r['informative_leaf_share']:13.3f}"
              f"{r['leaves_per_step']:13.1f}{r['generated_tokens_per_step']:13.0f}"
              f"{_num(r['step_s'], '8.1f')}{r['wall_s']:9.0f}"
              f"{_num(r['prompts_distinct'], '9.0f')}  {r['budget_to_target']}")
    if any("vs_uniform" in r for r in summary.values()):
        print("\npaired with uniform, seed by seed: mean difference +- standard error "
              "(seeds ahead / seeds); leaves, generated tokens and training seconds to the "
              "target on the mean curve")
        print(f"{'method':12s}{'final acc':>24s}{'mean acc, all evals':>26s}"
              f"{'effective ratio':>24s}{'leaves':>9s}{'tokens':>10s}{'seconds':>9s}")

        for m, r in summary.items():
            v = r.get("vs_uniform")
            cells = [fmt_paired(v[k]) for k in ("final_acc", "mean_acc", "effective_ratio")] \
                if v else ["", "", ""]
            print(f"{m:12s}{cells[0]:>24s}{cells[1]:>26s}{cells[2]:>24s}"
                  f"{_num(r['budget_to_target_mean_curve'], '9.0f')}"
                  f"{_num(r['tokens_to_target_mean_curve'], '10.0f')}"
                  f"{_num(r['time_to_target_mean_curve'], '9.1f')}")
        print(f"\nthe ratios to uniform's cost, {BOOT_LEVEL:.0%} interval over the seeds "
              f"({BOOT_DRAWS} draws; never: the target not reached; reached: share of draws)")
        for m, r in summary.items():
            intervals = r.get("vs_uniform", {}).get("cost_ratio_interval", {})
            if intervals:
                print(f"{m:12s}" + "".join(
                    f"{unit} {_ratio(r_['low'])}-{_ratio(r_['high'])} (reached "
                    f"{r_['reached_share']:.0%})   " for unit, r_ in intervals.items()))
    if args.held_in:
        print(f"\ntraining-world accuracy ({args.held_in} questions), before RL and after each "
              f"epoch (mean over seeds); vs uniform: final, and all-epoch mean")
        for m, r in summary.items():
            v = r.get("vs_uniform", {})
            pairs = (f"  {fmt_paired(v['held_in_final'])}  {fmt_paired(v['held_in_mean'])}"
                     if v else "")
            print(f"{m:12s}{_num(r['held_in_before'], '.3f')} | "
                  f"{' '.join(f'{a:.3f}' for a in r['held_in_acc_mean'])}{pairs}")
    if args.final_samples:
        print(f"\nlast checkpoints again, {args.final_samples} samples per held-out question")
        print(f"{'method':12s}{'final acc':>11s}{'vs uniform':>24s}  per seed")
        sets = [("", "final_eval")]
        if args.held_in:
            sets.append((f"the same checkpoints on the {args.held_in} training-world questions",
                         "held_in_final_eval"))
        for title, key in sets:
            if title:
                print(title)
            for m, r in summary.items():
                v = r.get("vs_uniform")
                seeds_txt = " ".join(f"{a:.3f}" for a in r[f"{key}_per_seed"])
                print(f"{m:12s}{r[f'{key}_acc']:11.3f}"
                      f"{fmt_paired(v[key]) if v else '':>24s}  {seeds_txt}")
    result = {"benchmark": "learning", "seeds": seeds, "epochs": args.epochs,
              "val_every": args.val_every, "final_samples": args.final_samples,
              "extra": args.extra, "extra_for": extra_for(args.extra_for),
              "world_config": args.world, "target": target,
              "methods": summary,
              # each run's own provenance (None: trained before runs recorded it)
              "runs": {f"{r['method']}_seed{r['seed']}": r.get("trained") for r in runs}}
    if "trace" in summary and "uniform" in summary:
        t, u = summary["trace"], summary["uniform"]
        vs = t["vs_uniform"]
        result["trace_ahead_every_seed"] = vs["final_acc"]["ahead"] == len(seeds)
        result["trace_more_effective_every_seed"] = vs["effective_ratio"]["ahead"] == len(seeds)
        if args.final_samples:
            result["trace_ahead_every_seed_final_eval"] = \
                vs["final_eval"]["ahead"] == len(seeds)
        for unit, _ in COSTS:
            tc, uc = t[f"{unit}_to_target_mean_curve"], u[f"{unit}_to_target_mean_curve"]
            if tc is not None and uc:
                result[f"trace_{unit}_over_uniform"] = tc / uc
        result["targets"] = targets(result, vs, "final_eval" if args.final_samples
                                    else "final_acc")
    if "targets" in result:
        print("\ntrace's targets: " + "; ".join(
            f"{unit} at most {v['at_most']}x: "
            f"{'met' if v['met'] else 'not met'} ({_num(v['ratio'], '.2f')}"
            + (f", interval {_ratio(v['interval'][0])}-{_ratio(v['interval'][1])})"
               if v["interval"]
               else ")")
            for unit, v in result["targets"].items() if unit in TARGETS)
            + f"; final not behind by more than one standard error: "
              f"{'met' if result['targets']['final']['met'] else 'not met'}")
    if args.plot and args.before:
        plot(summary, args.plot, target, args.val_every)
    out = args.out or (str(Path(args.out_dir) / "learning.json") if args.quick
                       else str(provenance.RESULTS / "learning.json"))
    provenance.publish(result, stamp, out, demo_dir=world_dir(args.world))
    return result


def targets(result: dict, vs: dict, final_key: str) -> dict:
    """Trace against the issue's targets (``TARGETS``): each cost ratio is met when the
    upper end of its interval over seeds is at or under its bound (an unreached target or a
    single seed: not met), the final accuracy when trace's paired difference from uniform
    (``final_key``: on K samples per question with --final-samples) is no more than one
    standard error below zero."""
    out = {}
    for unit, bound in TARGETS.items():
        interval = vs.get("cost_ratio_interval", {}).get(unit)
        out[unit] = {"ratio": result.get(f"trace_{unit}_over_uniform"), "at_most": bound,
                     "interval": [interval["low"], interval["high"]] if interval else None,
                     "met": bool(interval) and interval["high"] is not None
                     and interval["high"] <= bound}
    d = vs[final_key]
    out["final"] = {"diff": d["mean"], "se": d["se"], "scores": final_key,
                    "met": d["se"] is not None and d["mean"] >= -d["se"]}
    out["all_met"] = all(v["met"] for v in out.values())
    return out


def per_eval(per_epoch: list[float], every: int) -> list[float]:
    """Per-epoch costs summed over each stretch between evaluations (every ``every``)."""
    n = len(per_epoch) // every
    return [float(sum(per_epoch[i * every:(i + 1) * every])) for i in range(n)]


def _ratio(x: float | None) -> str:
    """A cost ratio's interval end: ``0.55x``, or ``never`` (None)."""
    return "never" if x is None else f"{x:.2f}x"


def _num(x: float | None, spec: str) -> str:
    """``x`` formatted, or a dash right-aligned to the same width where there is none."""
    width = spec.split(".")[0]
    return f"{'-':>{width}s}" if x is None else format(x, spec)


def plot(summary: dict, path: str, target: float | None, val_every: int = 1) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for m, r in summary.items():
        leaves = r["leaves_per_step"] * val_every * np.arange(0, len(r["acc_mean"]) + 1)
        mean = np.array([r["acc_before"], *r["acc_mean"]])
        se = np.array([0.0, *r["acc_se"]])
        ax.plot(leaves, mean, marker="o", label=m)
        ax.fill_between(leaves, mean - se, mean + se, alpha=0.15)
    if target is not None:
        ax.axhline(target, color="grey", ls=":", lw=1, label="target")
    ax.set_xlabel("sampling budget (leaves)")
    ax.set_ylabel("held-out exact match")
    seeds = len(next(iter(summary.values()))["final_acc_per_seed"])
    ax.set_title(f"demo world, {seeds} seed{'s' if seeds > 1 else ''}: mean +- standard error")
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


if __name__ == "__main__":
    main()
