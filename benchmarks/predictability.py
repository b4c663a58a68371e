"""Predictability study: what can a predictor know of success on prompts it has never seen?

A labelled set at a fixed policy, then predictors fitted offline on half the prompts and
scored on the other half (split by prompt: no prompt in both halves). For each policy
(``--policies``: the demo's warm start and its trained checkpoint):

- **roots**: ``--prompts`` never-seen questions of the new-prompts world (a world of the
  demo's generator four times its size, as ``benchmarks/allocation.py --new-prompts``), each
  with ``--rollouts`` bare rollouts; the label is its success rate;
- **prefixes**: ``--prefixes-per-prompt`` turn-level prefixes drawn among the first
  ``--group`` bare rollouts of each prompt (what a step of trace would have observed), each
  with ``--continuations`` continuations; the label is their success rate.

What each predictor reads (all of it available when the allocator asks):

- ``today``: the shared predictor as trace runs it (``SuccessPredictor`` on the policy's
  final hidden state at the prefix's last token and its depth, ``fit_predictor``), fitted on
  roots and prefixes together;
- ``probe/L<l>/<last|mean>``: a linear (logistic) probe on the hidden state of layer ``l``
  at the prefix's last token, or averaged over the question's tokens;
- ``signals``: the policy's own signals along the prefix (behaviour log-probs of its turns,
  the entropy of its next-token distributions, turn index, tool calls so far, the last
  observation's length, the prefix's length; for a root, the question's length and how
  likely the policy finds the question's tokens);
- ``outcomes`` (prefixes): the observed rewards of the prompt's bare rollouts when stage 2
  plans: the prefix's own rollout's reward and the mean of its sibling rollouts';
- ``siblings`` (prefixes): the siblings' mean alone (what a predictor trained on tree
  values can read without learning its own rollout's outcome);
- ``depth`` (prefixes): the mean label per turn index;
- ``mlp``: a small MLP over the final hidden state, the signals and the outcomes;
- ``knn``: the mean label of the 25 nearest training nodes in hidden-state space (cosine,
  final layer; roots: averaged over the question, prefixes: at the last token);
- ``ceiling``: true success probabilities, whose Brier score against a rate of n samples is
  the binomial noise ``p (1 - p) / n`` (estimated without bias from the labels).

Scores on the held-out half: Brier skill against the empirical rate (``1 - Brier / Brier of
the held-out mean``) and Spearman's rank correlation, roots and prefixes apart.

And what a root reader buys where stage 1 spends it (``stage1``): from ``STAGE1_CANDIDATES``
held-out prompts drawn at random, each reader opens the ``STAGE1_OPENED`` it values most for
a group of ``STAGE1_GROUP`` rollouts, and the score is the chance that such a group is mixed
(success and failure), averaged over the opened prompts and ``STAGE1_DRAWS`` draws, each
prompt's chance computed exactly from its labelled rollouts (hypergeometric). A point reader
values a prompt as the root solver does an exact prediction, ``1 - p^G - (1 - p)^G``;
``neighbours`` is ``RootNeighbours`` over the training half as the root solver reads it
(a belief, ``--model.neighbours``), ``neighbours_point`` its mean alone; ``random`` opens
prompts at random (``uniform``'s and ``random_tree``'s stage 1), ``ceiling`` by the true
chance.

    python benchmarks/predictability.py                       # both policies; ~17 min here
    python benchmarks/predictability.py --quick               # a small run (a test runs it)

Ends with one JSON line, also written to ``--out`` (default docs/results/predictability.json,
none with --quick). Labelled sets are cached under ``--cache-dir`` per policy and settings.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import trace_lightning  # noqa: E402,F401 - first, so numpy runs its AVX2 paths (numpy_simd)
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import provenance  # noqa: E402

HERE = Path(__file__).resolve()
TRAINED = "runs/demo/tensorboard/version_0/policy/last"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--demo-dir", default="runs/demo/world",
                   help="a prepared demo: the main job (configs/demo.yaml) writes runs/demo/world")
    p.add_argument("--policies", default=f"warm=,trained={TRAINED}",
                   help="name=policy folder pairs; an empty folder means the demo's warm start")
    p.add_argument("--prompts", type=int, default=1000)
    p.add_argument("--rollouts", type=int, default=16, help="bare rollouts per prompt")
    p.add_argument("--group", type=int, default=4,
                   help="the bare rollouts a step observes: prefixes are drawn among them")
    p.add_argument("--prefixes-per-prompt", type=int, default=2)
    p.add_argument("--continuations", type=int, default=8, help="per prefix")
    p.add_argument("--batch-prompts", type=int, default=50, help="prompts per engine wave")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--world-dir", default=None,
                   help="where the new-prompts world is built (default: allocation.py's)")
    p.add_argument("--cache-dir", default="runs/bench/predictability")
    p.add_argument("--collect", default=None, help=argparse.SUPPRESS)  # name=folder, internal
    p.add_argument("--quick", action="store_true",
                   help="40 prompts, 4 rollouts, 1 prefix of 4 continuations each")
    p.add_argument("--out", default=None,
                   help="also write the JSON line here (default docs/results/predictability.json; "
                        "none with --quick)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the child collects with them
    if args.quick:
        args.prompts, args.rollouts, args.group = 40, 4, 2
        args.prefixes_per_prompt, args.continuations, args.batch_prompts = 1, 4, 40
    if args.group > args.rollouts or args.group < 2:
        raise SystemExit(f"--group ({args.group}) must be in [2, --rollouts ({args.rollouts})]: "
                         f"a prefix's siblings are the other rollouts of its group")
    return args


# ---- the labelled set -----------------------------------------------------------------------
def _subtree_leaves(tree, node_id: int) -> list:
    out, stack = [], [node_id]
    while stack:
        n = tree.nodes[stack.pop()]
        if n.finished:
            out.append(n)
        stack.extend(n.children)
    return out


def signals_of(path, entropy: np.ndarray, root_len: int, question_from: int) -> np.ndarray:
    """The policy's own signals at a prefix (the nodes ``path``, root first): (9,).

    ``entropy[i]`` is the entropy of the policy's next-token distribution that predicted
    token ``i`` of the prefix. A root (``path`` of one node) reads its question's tokens."""
    turns = path[1:]
    if not turns:
        q = entropy[question_from:root_len]
        return np.array([0.0, 0.0, 0.0, float(q.mean()) if len(q) else 0.0, 0.0, 0.0, 0.0,
                         float(root_len - question_from), float(root_len)])
    lps, ents, offset = [], [], root_len
    for n in turns:
        for j, (lp, m) in enumerate(zip(n.logprobs, n.policy_mask)):
            if m:
                lps.append(lp)
                ents.append(entropy[offset + j])
        offset += len(n.token_ids)
    last = turns[-1]
    last_lp = [lp for lp, m in zip(last.logprobs, last.policy_mask) if m] or [0.0]
    obs = len(last.policy_mask) - sum(last.policy_mask)
    calls = sum(n.action not in ("", "answer", "invalid") for n in turns)
    return np.array([float(np.mean(lps)) if lps else 0.0, float(np.mean(last_lp)),
                     float(np.mean(np.array(lps) < np.log(0.5))) if lps else 0.0,
                     float(np.mean(ents)) if ents else 0.0, float(len(turns)), float(calls),
                     float(obs), float(offset - root_len), float(offset)])


SIGNALS = ["mean_logprob", "last_turn_logprob", "low_token_share", "mean_entropy", "turn",
           "tool_calls", "observation_tokens", "generated_and_observed_tokens", "prefix_tokens"]


@torch.no_grad()
def read_policy(policy, ids: list[int], positions: list[int], q_from: int, q_to: int):
    """One forward over ``ids``: per layer, the hidden state at each of ``positions`` and the
    mean over the question's tokens ``[q_from, q_to)``; and each token's predictive entropy."""
    out = policy(torch.tensor([ids]), output_hidden_states=True)
    logits = out.logits[0].float()  # (T, V)
    logp = torch.log_softmax(logits, -1)  # (T, V)
    ent = -(logp.exp() * logp).sum(-1)  # (T,) entropy of the distribution after token t
    entropy = torch.cat([torch.zeros(1), ent[:-1]]).numpy()  # (T,) of the one predicting t
    pos = torch.tensor(positions)
    last = np.stack([h[0, pos].float().numpy() for h in out.hidden_states[1:]])  # (L, K, D)
    mean = np.stack([h[0, q_from:q_to].float().mean(0).numpy()
                     for h in out.hidden_states[1:]])  # (L, D)
    return last, mean, entropy


def collect(args, name: str, policy_dir: str) -> dict:
    """Roll out the labelled set with one policy; returns numpy arrays per node kind."""
    import allocation
    from trace_lightning.tree import bare_reward
    from trace_lightning.rollout.agent import Start
    from trace_lightning.tasks.search_qa.demo.prepare import DemoPaths

    world_dir = Path(args.world_dir) if args.world_dir else allocation.NEW_PROMPTS_DIR
    corpus, qa = allocation.new_prompts_world(args.prompts, world_dir)
    policy_dir = policy_dir or str(DemoPaths.under(args.demo_dir).model)
    policy, loop, questions = allocation.demo_world(args.demo_dir, args.seed, 1.0, corpus, qa,
                                                    policy_dir=policy_dir)
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(args.prompts)  # the world's first questions, in a seeded order
    prompts = [questions[i] for i in order]
    # the question's tokens: what follows the instruction every prompt shares
    probe_ids = [loop.env.prompt(e)[0] for e in prompts[:50]]
    shared = 0
    while all(len(p) > shared and p[shared] == probe_ids[0][shared] for p in probe_ids):
        shared += 1
    roots, prefixes = [], []
    for b in range(0, len(prompts), args.batch_prompts):
        trees = [loop.new_tree(e) for e in prompts[b:b + args.batch_prompts]]
        loop.expand([Start(t, 0, args.rollouts) for t in trees], seed=args.seed + 2 * b)
        picks = []
        for t in trees:
            cands = [n for n in t.prefixes() if n.rollout < args.group]
            k = min(args.prefixes_per_prompt, len(cands))
            picks += [(t, cands[int(i)]) for i in sorted(rng.choice(len(cands), k, False))]
        loop.expand([Start(t, n.id, args.continuations) for t, n in picks],
                    seed=args.seed + 2 * b + 1)
        picked = {}
        for t, n in picks:
            picked.setdefault(id(t), []).append(n)
        for t in trees:
            bare = [bare_reward(t, j) for j in range(args.rollouts)]
            root_len = len(t.root.token_ids)
            # one forward for the root and one per prefix
            last, mean, ent = read_policy(policy, t.root.token_ids, [root_len - 1], shared,
                                          root_len)
            roots.append({"label": float(np.mean(bare)), "n": args.rollouts, "depth": 0,
                          "last": last[:, 0], "mean": mean,
                          "signals": signals_of([t.root], ent, root_len, shared),
                          "outcomes": np.zeros(2), "prompt": t.tree_id})
            for n in picked.get(id(t), []):
                ids = t.prefix_ids(n.id)
                last, _, ent = read_policy(policy, ids, [len(ids) - 1], shared, root_len)
                conts = [leaf.reward for c in t.nodes[n.id].children[1:]
                         for leaf in _subtree_leaves(t, c)]
                own = bare[n.rollout]
                sib = [bare[j] for j in range(args.group) if j != n.rollout]
                prefixes.append({"label": float(np.mean(conts)), "n": len(conts),
                                 "depth": n.depth, "last": last[:, 0], "mean": mean,
                                 "signals": signals_of(t.path(n.id), ent, root_len, shared),
                                 "outcomes": np.array([own, float(np.mean(sib))]),
                                 "prompt": t.tree_id})
        print(f"[{name}] {min(b + args.batch_prompts, len(prompts))}/{len(prompts)} prompts, "
              f"{len(prefixes)} prefixes", flush=True)

    def stack(rows):
        return {k: np.array([r[k] for r in rows]) for k in rows[0]}
    return {"roots": stack(roots), "prefixes": stack(prefixes)}


def cache_path(args, name: str, policy_dir: str) -> Path:
    key = json.dumps([policy_dir, args.demo_dir, args.prompts, args.rollouts, args.group,
                      args.prefixes_per_prompt, args.continuations, args.seed, args.world_dir,
                      args.batch_prompts])
    return Path(args.cache_dir) / f"{name}-{hashlib.sha1(key.encode()).hexdigest()[:10]}.npz"


def labelled_set(args, name: str, policy_dir: str) -> dict:
    """The cached labelled set of one policy, rolled out in a child process the first time
    (each vLLM engine lives in a process of its own)."""
    path = cache_path(args, name, policy_dir)
    if not path.exists():
        subprocess.run([sys.executable, str(HERE), *args.argv,
                        f"--collect={name}={policy_dir}"], check=True)
    data = np.load(path, allow_pickle=False)
    out: dict = {"roots": {}, "prefixes": {}}
    for k in data.files:
        kind, field = k.split("/", 1)
        out[kind][field] = data[k]
    return out


def save(data: dict, args, name: str, policy_dir: str) -> None:
    path = cache_path(args, name, policy_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    flat = {f"{kind}/{k}": v for kind, d in data.items() for k, v in d.items()}
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **flat)
    tmp.replace(path)


# ---- predictors, fitted on one half and scored on the other --------------------------------
def _standardise(train: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mu, sd = train.mean(0), train.std(0)
    sd = np.where(sd > 1e-8, sd, 1.0)
    return (train - mu) / sd, (test - mu) / sd


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def probe(xtr, ytr, wtr, gtr, xte, seed: int) -> np.ndarray:
    """A logistic probe (soft labels, weighted, L2) on standardised inputs, its penalty
    chosen on a held-out fifth of the training prompts."""
    from trace_lightning.allocation.posterior import fit_logistic

    def fit(x, y, w, l2):
        return fit_logistic(np.c_[x, np.ones(len(x))], y, w, l2, prior=np.zeros(x.shape[1] + 1))
    xtr, xte = _standardise(xtr, xte)
    groups = np.unique(gtr)
    held = np.isin(gtr, np.random.default_rng(seed).choice(groups, len(groups) // 5, False))
    best, best_l2 = np.inf, 1.0
    for l2 in (1e-3, 1e-2, 1e-1, 1.0, 10.0):
        th = fit(xtr[~held], ytr[~held], wtr[~held], l2)
        p = _sigmoid(np.c_[xtr[held], np.ones(held.sum())] @ th)
        err = float(np.sum(wtr[held] * (p - ytr[held]) ** 2))
        if err < best:
            best, best_l2 = err, l2
    th = fit(xtr, ytr, wtr, best_l2)
    return _sigmoid(np.c_[xte, np.ones(len(xte))] @ th)


def knn(xtr, ytr, xte, k: int = 25) -> np.ndarray:
    """Mean label of the ``k`` nearest training rows by cosine similarity."""
    xtr, xte = _standardise(xtr, xte)
    a = xtr / np.linalg.norm(xtr, axis=1, keepdims=True).clip(1e-9)
    b = xte / np.linalg.norm(xte, axis=1, keepdims=True).clip(1e-9)
    near = np.argsort(-(b @ a.T), axis=1)[:, :k]  # (Nte, k)
    return ytr[near].mean(1)


def shared_predictor(train: list[tuple], test: list[np.ndarray], seed: int) -> list[np.ndarray]:
    """The shared predictor as trace fits it (``SuccessPredictor``, ``fit_predictor``, the
    settings of benchmarks/allocation.py), on roots and prefixes together. ``train``: per
    kind ``(features, depth, label, weight, prompt group)``; ``test``: per kind
    ``(features, depth)``; returns the predictions per test kind."""
    from trace_lightning.allocation.predictor import (PredictorBatch, ReplayBuffer,
                                                      SuccessPredictor, fit_predictor)
    torch.manual_seed(seed)
    model = SuccessPredictor(train[0][0].shape[1], hidden=128)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    buffer = ReplayBuffer(1)
    cols = [np.concatenate(c) for c in zip(*train)]
    buffer.add(PredictorBatch(torch.tensor(cols[0], dtype=torch.float32),
                              torch.tensor(cols[1], dtype=torch.long),
                              torch.tensor(cols[2], dtype=torch.float32),
                              torch.tensor(cols[3], dtype=torch.float32),
                              torch.tensor(cols[4], dtype=torch.long)))
    fit_predictor(model, opt, buffer, epochs=20, batch_size=128,
                  generator=torch.Generator().manual_seed(seed), holdout=0.2)
    return [model.predict(torch.tensor(x, dtype=torch.float32),
                          torch.tensor(d, dtype=torch.long)).numpy() for x, d in test]


def ceiling(y: np.ndarray, n: np.ndarray) -> float:
    """Brier skill of the true success probabilities against rates of ``n`` samples: their
    Brier score is the binomial noise ``p (1 - p) / n``, estimated without bias by
    ``y (1 - y) / (n - 1)``; NaN when the rates do not vary."""
    noise = float(np.mean(y * (1 - y) / np.maximum(n - 1, 1)))
    spread = float(np.var(y))
    return 1.0 - noise / spread if spread > 0 else float("nan")  # NaN: every rate equal


STAGE1_CANDIDATES, STAGE1_OPENED, STAGE1_GROUP, STAGE1_DRAWS = 192, 32, 4, 50


def mixed_chance(successes: np.ndarray, n: np.ndarray, group: int) -> np.ndarray:
    """Chance that ``group`` of a prompt's ``n`` labelled rollouts, ``successes`` of them
    right, drawn without replacement, hold a success and a failure: (N,)."""
    from math import comb
    return np.array([1 - (comb(int(k), group) + comb(int(m - k), group)) / comb(int(m), group)
                     for k, m in zip(successes, n)])


def stage1(values: dict[str, np.ndarray], chance: np.ndarray, seed: int) -> dict:
    """Mean mixed chance of the prompts each reader's ``values`` open (see the module)."""
    rng = np.random.default_rng(seed)
    size = min(STAGE1_CANDIDATES, len(chance))
    opened = max(1, size * STAGE1_OPENED // STAGE1_CANDIDATES)
    got: dict[str, list[float]] = {"random": [], **{m: [] for m in values}}
    for _ in range(STAGE1_DRAWS):
        cand = rng.choice(len(chance), size, replace=False)
        got["random"].append(float(chance[cand[:opened]].mean()))
        for m, v in values.items():
            pick = cand[np.argsort(-v[cand], kind="stable")[:opened]]
            got[m].append(float(chance[pick].mean()))
    return {m: round(float(np.mean(g)), 4) for m, g in got.items()}


def score(p: np.ndarray, y: np.ndarray) -> dict:
    from trace_lightning.math.calibration import brier_skill, spearman
    return {"brier_skill": round(float(brier_skill(p, y)), 4),
            "spearman": round(float(spearman(p, y)), 4)}


def study(data: dict, seed: int) -> dict:
    """Every predictor, fitted on half the prompts and scored on the other half."""
    prompts = np.unique(data["roots"]["prompt"])
    test_prompts = np.random.default_rng(seed).choice(prompts, len(prompts) // 2, False)
    split = {}
    for kind in ("roots", "prefixes"):
        d = data[kind]
        te = np.isin(d["prompt"], test_prompts)
        groups = np.unique(d["prompt"], return_inverse=True)[1]
        split[kind] = (d, ~te, te, groups)
    out: dict = {}
    preds: dict[str, dict[str, np.ndarray]] = {"roots": {}, "prefixes": {}}
    final = -1  # the last layer: the final hidden state, as trace's featuriser reads it
    # today's predictor and the MLP over everything, each fitted on both kinds at once
    for method, feats in (("today", lambda d: d["last"][:, final]),
                          ("mlp", lambda d: np.c_[d["last"][:, final], d["signals"],
                                                  d["outcomes"]])):
        train = [(feats(d)[tr], d["depth"][tr], d["label"][tr], d["n"][tr].astype(float),
                  g[tr]) for d, tr, te, g in split.values()]
        test = [(feats(d)[te], d["depth"][te]) for d, tr, te, g in split.values()]
        for kind, p in zip(split, shared_predictor(train, test, seed)):
            preds[kind][method] = p
    for kind, (d, tr, te, g) in split.items():
        y, w = d["label"], d["n"].astype(float)

        def fit(x):
            return probe(x[tr], y[tr], w[tr], g[tr], x[te], seed)
        layers = d["last"].shape[1]
        for layer in range(layers):
            preds[kind][f"probe/L{layer + 1}/last"] = fit(d["last"][:, layer])
            preds[kind][f"probe/L{layer + 1}/mean"] = fit(d["mean"][:, layer])
        preds[kind]["signals"] = fit(d["signals"])
        if kind == "prefixes":
            preds[kind]["outcomes"] = fit(d["outcomes"])
            preds[kind]["siblings"] = fit(d["outcomes"][:, 1:])
            preds[kind]["signals+outcomes"] = fit(np.c_[d["signals"], d["outcomes"]])
            depth_mean = {k: y[tr][d["depth"][tr] == k].mean() for k in np.unique(d["depth"][tr])}
            preds[kind]["depth"] = np.array([depth_mean.get(k, y[tr].mean())
                                             for k in d["depth"][te]])
        x = d["mean"][:, final] if kind == "roots" else d["last"][:, final]
        preds[kind]["knn"] = knn(x[tr], y[tr], x[te])
        out[kind] = {m: score(p, y[te]) for m, p in preds[kind].items()}
        if kind == "roots":
            out["stage1"] = root_stage1(d, tr, te, preds[kind], seed)
        out[kind]["ceiling"] = {"brier_skill": round(ceiling(y[te], d["n"][te]), 4)}
        out[f"{kind}_count"] = {"train": int(tr.sum()), "test": int(te.sum())}
        out[f"{kind}_success"] = round(float(y.mean()), 4)
    return out


def root_stage1(d: dict, tr: np.ndarray, te: np.ndarray, point: dict[str, np.ndarray],
                seed: int) -> dict:
    """``stage1`` of the roots: every point reader, the neighbours, random and the ceiling."""
    from trace_lightning.allocation.neighbours import RootNeighbours, neighbour_posterior
    from trace_lightning.math.solvers import expected_root_values

    g = min(STAGE1_GROUP, int(d["n"].min()))
    successes = np.rint(d["label"] * d["n"])
    chance = mixed_chance(successes[te], d["n"][te], g)
    values = {m: 1 - p ** g - (1 - p) ** g for m, p in point.items()}
    x = torch.tensor(d["last"][:, -1], dtype=torch.float32)  # the featuriser's root features
    train, test = torch.from_numpy(np.flatnonzero(tr)), torch.from_numpy(np.flatnonzero(te))
    nb = RootNeighbours()
    v, c = neighbour_posterior(x[test], x[train],
                               torch.tensor(successes[tr], dtype=torch.float32),
                               torch.tensor(d["n"][tr], dtype=torch.float32),
                               torch.zeros(len(test), len(train), dtype=torch.bool),
                               torch.full((len(test),), float(d["label"][tr].mean())),
                               nb.k, nb.strength)
    values["neighbours"] = expected_root_values(v.tolist(), c.tolist(), g)[:, g]
    values["neighbours_point"] = expected_root_values(v.tolist(), [None] * len(v), g)[:, g]
    values["ceiling"] = chance
    return {"group": g, "candidates": STAGE1_CANDIDATES, "opened": STAGE1_OPENED,
            "draws": STAGE1_DRAWS, "mixed_chance": stage1(values, chance, seed)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.collect:
        name, _, policy_dir = args.collect.partition("=")
        save(collect(args, name, policy_dir), args, name, policy_dir)
        return {}
    stamp = provenance.Stamp()
    policies = dict(p.partition("=")[::2] for p in args.policies.split(","))
    for name, folder in policies.items():
        if folder and not (Path(folder) / "config.json").exists():
            raise SystemExit(f"--policies {name}={folder}: no Hugging Face policy there (no "
                             f"config.json); the main job writes its trained policy to "
                             f"{TRAINED}, or pass another folder")
    config = {k: v for k, v in vars(args).items() if k not in ("argv", "collect")}
    result = {"benchmark": "predictability", "config": config, "signals": SIGNALS,
              "policies": {}}
    for name, folder in policies.items():
        result["policies"][name] = study(labelled_set(args, name, folder), args.seed)
    for name, r in result["policies"].items():
        for kind in ("roots", "prefixes"):
            print(f"\n{name} {kind} ({r[kind + '_count']['test']} held out, success "
                  f"{r[kind + '_success']:.3f}):  brier skill   spearman")
            for m, s in r[kind].items():
                print(f"  {m:22s}{s['brier_skill']:12.3f}{s.get('spearman', float('nan')):11.3f}")
        st = r["stage1"]
        print(f"\n{name} stage 1: chance that a group of {st['group']} is mixed, "
              f"{st['opened']} of {st['candidates']} opened")
        for m, share in st["mixed_chance"].items():
            print(f"  {m:22s}{share:12.3f}")
    out = args.out or (None if args.quick else provenance.RESULTS / "predictability.json")
    provenance.publish(result, stamp, out, demo_dir=args.demo_dir)
    return result


if __name__ == "__main__":
    main()
