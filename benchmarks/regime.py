"""Regime study: at which leaves per step, if any, does allocation pay in held-out accuracy?

The oracle (``configs/demo_oracle.yaml``: trace's allocation on success rates probed with
extra rollouts, outside the budget) is the probe: where even a perfect predictor learns no
faster than ``uniform``, no predictor can. For each per-step budget L (leaves), every method
trains the demo policy for the same total leaves (``--total-leaves``, so 2,048 is 8 epochs of
the demo's 256, 16 of 128, 32 of 64) through ``benchmarks/learning.py``: the demo's
optimizer steps per RL step (4 mini-batches, one pass) and learning rate (2e-4), L / 2 roots
with one continuation each and 3L / 4 candidates (the demo's 192 at 256). Each run is scored
once, after its last epoch, on 16 samples per held-out question (``--final-samples``), and
methods are paired with uniform seed by seed (mean difference, its standard error, seeds
ahead). Each row also says how many distinct prompts the method trained on; ``--held-in N``
scores the final checkpoints on N training-world questions as well (what RL trained on),
to tell learning the training prompts from carrying it over to new ones.

    python benchmarks/regime.py                                  # 3 budgets x 5 seeds
    python benchmarks/regime.py --budgets 64 --methods uniform,oracle,trace
    python benchmarks/regime.py --budgets 64 --methods uniform,oracle_roots,oracle_prefixes
                                        # the oracle on one stage, the predictor on the other

Runs live in ``runs/regime/L<budget>/`` and finished ones are read back, so a study can be
extended seed by seed. Ends with one JSON line, also written to ``--out`` (default
``docs/results/regime.json``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import learning  # noqa: E402
import provenance  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", default="64,128,256", help="leaves per step, comma-separated")
    p.add_argument("--total-leaves", type=int, default=2048)
    p.add_argument("--methods", default="uniform,oracle")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--final-samples", type=int, default=16)
    p.add_argument("--out-dir", default="runs/regime")
    p.add_argument("--out", default=str(provenance.RESULTS / "regime.json"))
    p.add_argument("--held-in", type=int, default=0,
                   help="also score each final checkpoint on this many training-world "
                        "questions (learning.py --held-in; 0: off)")
    p.add_argument("--extra", action="append", default=[],
                   help="one more CLI override for every run, repeatable")
    p.add_argument("--world", default=None,
                   help="a config of another demo world (learning.py --world)")
    return p.parse_args(argv)


def budget_args(leaves: int, args) -> list[str]:
    """``learning.py``'s arguments for ``leaves`` per step at the study's total."""
    if leaves % 4 or args.total_leaves % leaves:
        raise SystemExit(f"regime.py: --budgets {leaves} must be a multiple of 4 that divides "
                         f"--total-leaves {args.total_leaves}")
    epochs = args.total_leaves // leaves
    return ["--methods", args.methods, "--seeds", args.seeds, "--epochs", str(epochs),
            "--val-every", str(epochs), "--no-before",
            "--final-samples", str(args.final_samples), "--held-in", str(args.held_in),
            "--out-dir", str(Path(args.out_dir) / f"L{leaves}"),
            "--out", str(Path(args.out_dir) / f"L{leaves}" / "learning.json"),
            f"--extra=--data.allocator.roots={leaves // 2}",
            f"--extra=--data.candidates_per_step={3 * leaves // 4}",
            *([f"--world={args.world}"] if args.world else []),
            *[f"--extra={e}" for e in args.extra]]


def main(argv=None) -> dict:
    args = parse_args(argv)
    if "uniform" not in args.methods.split(","):
        raise SystemExit("regime.py: --methods must include uniform (the baseline)")
    stamp = provenance.Stamp()
    rows, trained = {}, {}
    for leaves in [int(b) for b in args.budgets.split(",")]:
        r = learning.main(budget_args(leaves, args))
        trained[leaves] = r["runs"]
        rows[leaves] = {
            m: {"final_eval_acc": v.get("final_eval_acc"),
                "final_eval_per_seed": v.get("final_eval_per_seed"),
                "effective_ratio": v["effective_ratio"],
                "generated_tokens_per_step": v["generated_tokens_per_step"],
                "step_s": v["step_s"],
                "prompts_distinct": v.get("prompts_distinct"),
                "new_prompt_share": v.get("new_prompt_share"),
                "held_in_final_eval_acc": v.get("held_in_final_eval_acc"),
                "held_in_final_eval_per_seed": v.get("held_in_final_eval_per_seed"),
                "vs_uniform_held_in_final_eval":
                    v.get("vs_uniform", {}).get("held_in_final_eval"),
                "predictor": v.get("predictor", {}),
                "vs_uniform_final_eval": v.get("vs_uniform", {}).get("final_eval"),
                "vs_uniform_effective": v.get("vs_uniform", {}).get("effective_ratio")}
            for m, v in r["methods"].items()}
    print(f"\nregime study: {args.total_leaves} leaves per run, final accuracy on "
          f"{args.final_samples} samples per held-out question, paired with uniform")
    w = max(10, *(len(m) + 1 for methods in rows.values() for m in methods))  # name column
    print(f"{'leaves/step':>12s} {'method':{w}s}{'final acc':>11s}{'vs uniform':>24s}"
          f"{'effective':>11s}{'vs uniform':>24s}{'prompts':>9s}")
    for leaves, methods in rows.items():
        for m, v in methods.items():
            acc, eff = v["vs_uniform_final_eval"], v["vs_uniform_effective"]
            print(f"{leaves:12d} {m:{w}s}{v['final_eval_acc']:11.3f}"
                  f"{learning.fmt_paired(acc) if acc else '':>24s}"
                  f"{v['effective_ratio']:11.3f}"
                  f"{learning.fmt_paired(eff) if eff else '':>24s}"
                  f"{learning._num(v['prompts_distinct'], '9.0f')}")
    result = {"benchmark": "regime", "total_leaves": args.total_leaves,
              "seeds": [int(s) for s in args.seeds.split(",")],
              "final_samples": args.final_samples, "held_in": args.held_in,
              "extra": args.extra, "world_config": args.world,
              "budgets": {str(k): v for k, v in rows.items()},
              "runs": {str(k): v for k, v in trained.items()}}
    provenance.publish(result, stamp, args.out, demo_dir=learning.world_dir(args.world))
    return result


if __name__ == "__main__":
    main()
