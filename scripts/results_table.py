"""The README's headline results table, written from the benchmarks' JSON lines.

Every figure in the table is read from ``docs/results/<benchmark>.json`` (what the benchmark
printed last, with the command, commit, date and machine load it ran under), so the README
quotes nothing by hand. ``python scripts/results_table.py`` rewrites the table between the
README's ``<!-- results:begin -->`` and ``<!-- results:end -->`` markers; ``--check`` only
says whether it is current (a test runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
README = REPO / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"

# The command of the JSON lines written before benchmarks recorded their own (``command``).
COMMANDS = {
    "allocation.json": "python benchmarks/allocation.py",
    "allocation_new_prompts.json": "python benchmarks/allocation.py --new-prompts",
}


def _load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.is_file() else None


def _provenance(r: dict) -> str:
    """``commit, date, load`` of a JSON line (``provenance.publish``), in a table cell."""
    return f"`{r['commit']}`, {r['date']}, load {r['machine']['load_before'][0]:.1f}"


def _row(what: str, figures: str, name: str, r: dict, anchor: str) -> str:
    command = r.get("command") or COMMANDS[name]
    return (f"| [{what}](docs/results.md#{anchor}) | {figures} | `{command}` | "
            f"[{_provenance(r)}](docs/results/{name}) |")


def _paired(v: dict) -> str:
    return f"{v['mean']:+.3f} ± {v['se']:.3f} ({v['ahead']}/{v['seeds']} seeds ahead)"


def _prompts(v: dict) -> str:
    """`` (N distinct prompts)`` where a regime row counted them, else nothing."""
    n = v.get("prompts_distinct")
    return f" ({n:.0f} distinct prompts)" if n is not None else ""


def _times(x: float | None) -> str:
    return "never" if x is None else f"{x:.2f}x"


def _reach_with_intervals(r: dict, intervals: dict) -> str:
    """Trace's cost to GRPO's final accuracy (``learning.py``'s ``targets``): the ratios on
    the mean curves, their intervals over resampled seeds, and whether the targets hold."""
    tokens, time = (intervals[unit] for unit in ("tokens", "time"))
    spans = (f"{tokens['level']:.0%} intervals over the seeds {_times(tokens['low'])}-"
             f"{_times(tokens['high'])} and {_times(time['low'])}-{_times(time['high'])}")
    target = f"GRPO's final accuracy ({r['final_samples']} samples, {r['target']:.3f})"
    ratios = [r.get(f"trace_{unit}_over_uniform") for unit in ("tokens", "time")]
    head = (f"trace's mean curve reaches {target} with {ratios[0]:.2f}x GRPO's generated "
            f"tokens and {ratios[1]:.2f}x its training time" if None not in ratios else
            f"trace's mean curve does not reach {target}")
    met = "met" if r["targets"]["all_met"] else "not met"
    return (f"{head} ({spans}); the targets (at most 0.6x and 0.8x over the whole interval, "
            f"final within one standard error) {met}")


def _own_rates(r: dict) -> str:
    """A learning line whose methods ran at their own overrides (``--extra-for``): each
    method's final against GRPO's, and how often its curve reaches GRPO's final."""
    def rate(m: str) -> str:
        lr = [o.split("=", 1)[1] for o in r["extra_for"].get(m, []) if o.startswith("--model.lr=")]
        return f"lr {lr[-1]}" if lr else "the demo's lr"
    u = r["methods"]["uniform"]
    cells = [f"GRPO at {rate('uniform')} {u['final_eval_acc']:.3f}"]
    for m, v in r["methods"].items():
        if m != "uniform":
            reached = v["vs_uniform"]["cost_ratio_interval"]["tokens"]["reached_share"]
            cells.append(f"{m} at {rate(m)} - GRPO {_paired(v['vs_uniform']['final_eval'])}, "
                         f"its mean curve at GRPO's final in {reached:.0%} of seed resamplings")
    leaves = u["leaves_per_step"]
    budget = "the demo's budget" if leaves == 256 else f"{leaves:.0f} leaves per step"
    return (f"{len(r['seeds'])} seeds x {r['epochs']} epochs at {budget}; final "
            f"held-out accuracy ({r['final_samples']} samples per question) " + "; ".join(cells))


def rows() -> list[str]:
    """The table's rows, one per benchmark whose JSON line is there."""
    out = []
    # The learning benchmark at the demo's budget: the first world build, then the second
    # (with the demo's beliefs and without); then the first at half the demo's leaves per step
    # and at twice its steps; then the third build against a GRPO that fits no predictor
    # (the times before it charge GRPO for one), trace's predictor fed by the update.
    second = "the-demos-budget-on-the-second-build"
    for name, what, anchor in (
            ("learning.json", "Learning: trace against GRPO, demo budget, first build",
             "learning-python-benchmarkslearningpy"),
            ("learning_world2.json", "Learning: trace against GRPO, demo budget, second build",
             second),
            ("learning_world2_belief.json",
             "Learning: the same without beliefs, demo budget, second build", second),
            ("learning_128.json",
             "Learning: trace against GRPO, half the demo's budget per step, first build",
             "half-the-demos-budget-per-step-128-leaves-the-same-8-steps"),
            ("learning_e16.json",
             "Learning: trace against GRPO, twice the demo's steps (16 epochs), first build",
             "twice-the-steps-16-epochs-at-the-demos-budget"),
            ("learning_world3_update_features_15.json",
             "Learning: trace against a GRPO that fits no predictor, trace's predictor reading "
             "the update's forward, demo budget, third build (an Intel CPU)",
             "the-continuations-features-read-from-the-updates-forward")):
        r = _load(name)
        if not (r and {"uniform", "trace"} <= set(r["methods"])):
            continue
        u, t = r["methods"]["uniform"], r["methods"]["trace"]
        final = (f"final held-out accuracy ({r['final_samples']} samples per question) "
                 f"GRPO {u['final_eval_acc']:.3f}, trace {t['final_eval_acc']:.3f}, "
                 f"trace - GRPO {_paired(t['vs_uniform']['final_eval'])}"
                 if r.get("final_samples") else
                 f"final held-out accuracy GRPO {u['final_acc']:.3f}, trace "
                 f"{t['final_acc']:.3f}")
        if "targets" in r:  # the target is GRPO's final on K samples, with intervals
            reach = _reach_with_intervals(r, t["vs_uniform"]["cost_ratio_interval"])
        else:
            ratios = [r.get(f"trace_{unit}_over_uniform") for unit in ("tokens", "time")]
            reach = (f"trace reaches GRPO's final accuracy on the mean per-epoch curve "
                     f"({r['target']:.3f}) with {ratios[0]:.2f}x GRPO's generated tokens and "
                     f"{ratios[1]:.2f}x GRPO's training time" if None not in ratios else
                     f"trace's mean per-epoch curve does not reach GRPO's final accuracy "
                     f"({r['target']:.3f})")
        out.append(_row(
            what,
            f"{len(r['seeds'])} seeds x {r['epochs']} epochs; {final}; effective ratio "
            f"{u['effective_ratio']:.3f} -> {t['effective_ratio']:.3f}; {reach}",
            name, r, anchor))
    # Other methods against GRPO, each at its own overrides where it has them.
    for name, what, anchor in (
            ("learning_lr.json",
             "Learning: trace and the oracle at 2.5x the learning rate, GRPO at the demo's, "
             "first build", "a-larger-learning-rate-25x-the-demos"),
            ("learning_e16_oracle.json",
             "Learning: trace and the oracle against GRPO, 16 epochs, first build, an AVX-512 CPU",
             "the-oracle-for-16-epochs"),
            ("learning_world3_64.json",
             "Learning: the oracle and trace against GRPO at 64 leaves per step, third build",
             "the-oracle-at-64-leaves-per-step-on-the-third-build")):
        r = _load(name)
        if r and "uniform" in r["methods"]:
            out.append(_row(what, _own_rates(r), name, r, anchor))
    r = _load("learning_64.json")
    if r and "uniform" in r["methods"]:
        u = r["methods"]["uniform"]
        reach = []
        for m, v in r["methods"].items():
            if m == "uniform":
                continue
            cost = [v[f"{unit}_to_target_mean_curve"] / u[f"{unit}_to_target_mean_curve"]
                    if v[f"{unit}_to_target_mean_curve"] is not None else None
                    for unit in ("tokens", "time")]
            reach.append(f"{m} reaches it with {cost[0]:.2f}x GRPO's generated tokens and "
                         f"{cost[1]:.2f}x its training time" if None not in cost
                         else f"{m}'s mean curve does not reach it")
        out.append(_row(
            "Learning: compute to GRPO's final accuracy at 64 leaves per step, second build",
            f"{len(r['seeds'])} seeds x {r['epochs']} epochs, held-out accuracy every "
            f"{r['val_every']} epochs; GRPO's final on the mean curve {r['target']:.3f}: "
            + "; ".join(reach),
            "learning_64.json", r, "compute-to-target-at-64-leaves-per-step"))
    # One row per regime study, each the JSON line of its own command, on two builds of the
    # demo world (their warm starts stopped at different steps).
    for name, what in (
            ("regime.json", "Learning: where allocation pays (the oracle as the probe)"),
            ("regime_world2.json", "Learning: where allocation pays, a second world build"),
            ("regime_choices.json", "Learning: trace's choices one at a time, second build"),
            ("regime_tree.json",
             "Learning: the tree at 64 leaves per step, 10 seeds, second build"),
            ("regime_candidates.json",
             "Learning: trace choosing among 192 candidates per step, second build"),
            ("regime_candidates_belief.json",
             "Learning: the same without beliefs (more distinct prompts), second build")):
        r = _load(name)
        if not r:
            continue
        cells = []
        for leaves, methods in r["budgets"].items():
            u = methods["uniform"]
            pairs = ", ".join(f"{m} - GRPO {_paired(v['vs_uniform_final_eval'])}{_prompts(v)}"
                              for m, v in methods.items() if m != "uniform")
            cells.append(f"{leaves} leaves per step, GRPO {u['final_eval_acc']:.3f}"
                         f"{_prompts(u)}; {pairs}")
        out.append(_row(
            what,
            f"{len(r['seeds'])} seeds x {r['total_leaves']:,} leaves per run; final held-out "
            f"accuracy ({r['final_samples']} samples per question) at "
            + "; at ".join(cells),
            name, r, "where-allocation-pays-python-benchmarksregimepy"))
    for name, seed1, what, targets in (
            ("allocation.json", "allocation_seed1.json",
             "Allocation: the demo's prompts, which recur", "targets 2.0x and 0.85"),
            ("allocation_new_prompts.json", "allocation_new_prompts_seed1.json",
             "Allocation: never-seen prompts", "targets 1.4x, +0.03 and 0.75")):
        runs = [r for r in (_load(name), _load(seed1)) if r]
        if runs:
            def figures(r: dict) -> str:
                a = r["allocators"]
                er = {k: v["effective_ratio"] for k, v in a.items()}
                return (f"seed {r['config']['seed']}: GRPO {er['uniform']:.3f}, random_tree "
                        f"{er['random_tree']:.3f}, trace {er['trace']:.3f}, oracle "
                        f"{er['oracle']:.3f} (trace / GRPO {er['trace'] / er['uniform']:.2f}, "
                        f"trace - random_tree {er['trace'] - er['random_tree']:+.3f}, trace / "
                        f"oracle {er['trace'] / er['oracle']:.2f})")
            out.append(_row(what, "effective ratio " + "; ".join(map(figures, runs))
                            + f" ({targets}: not met)", name, runs[0],
                            "allocation-python-benchmarksallocationpy"))
    r = _load("predictability.json")
    if r:
        p = r["policies"]

        def best(kind: str) -> float:
            return max(v["brier_skill"] for pol in p.values() for m, v in pol[kind].items()
                       if m not in ("ceiling", "outcomes", "siblings", "signals+outcomes",
                                    "mlp"))
        out.append(_row(
            "What a predictor can know of never-seen prompts",
            f"Brier skill on held-out prompts (warm start, trained policy): roots at most "
            f"{best('roots'):.2f} from any reader of the prompt (true probabilities "
            f"{p['warm']['roots']['ceiling']['brier_skill']:.2f}); prefixes at most "
            f"{best('prefixes'):.2f} from their tokens, "
            f"{p['warm']['prefixes']['outcomes']['brier_skill']:.2f} and "
            f"{p['trained']['prefixes']['outcomes']['brier_skill']:.2f} from the outcomes "
            f"stage 2 has seen (own rollout and siblings)",
            "predictability.json", r, "what-a-predictor-can-know-of-new-prompts-python-"
            "benchmarkspredictabilitypy"))
    r = _load("update.json")
    if r:
        out.append(_row(
            "The update: a tree forwarded once",
            f"trace's trees against one row per leaf: {r['trace_tokens_ratio']:.2f}x the "
            f"tokens, {r['trace_time_ratio']:.2f}x the time, the same loss (relative "
            f"difference {r['trace_loss_rel_diff']:.0e})",
            "update.json", r, "the-update-a-tree-forwarded-once-python-benchmarksupdatepy"))
    r = _load("retrieval.json")
    if r:
        out.append(_row(
            "Retrieval server (BM25, HTTP)",
            f"{r['clients']} clients: {r['requests_per_s']:.0f} requests/s, p50 "
            f"{r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms, {r['errors']} errors",
            "retrieval.json", r, "retrieval-python-benchmarksretrievalpy"))
    return out


def table() -> str:
    """The block between the markers."""
    head = ["| benchmark | figures | command | commit, date, load (the JSON) |",
            "| --- | --- | --- | --- |"]
    return "\n".join([BEGIN, *head, *rows(), END])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true",
                   help="exit 1 if the README's table is not what the JSON files give")
    args = p.parse_args(argv)
    text = README.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        print(f"README.md must hold {BEGIN} and {END} once each", file=sys.stderr)
        return 1
    start, end = text.index(BEGIN), text.index(END) + len(END)
    new = text[:start] + table() + text[end:]
    if args.check:
        if new != text:
            print("README.md's results table differs from docs/results/*.json; run "
                  "python scripts/results_table.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
