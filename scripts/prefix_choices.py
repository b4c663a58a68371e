"""What stage 2 branched from: the prefixes it continued against those it passed over.

    python scripts/prefix_choices.py runs/demo/trees    # a run's --data.trees_dir

Reads every tree a run saved (``--data.trees_dir``: one JSONL file per epoch and rank) and
splits the prefixes stage 2 could have continued (the unfinished turns of each bare rollout,
the path through first children) into those it gave continuations and the rest. For each
side: how many, how sure the policy was of its own turns there (``confidence_of``: the mean
log-prob of the prefix's policy tokens, its last turn's mean, the share of tokens below
log 1/2), the mean success of the leaves below (``value``) and the predictor's mean
prediction. A plain mean over prefixes, each counted once. Then, per depth (the turn a prefix
ends at), what a continuation from there costs and buys: the bare rollouts' generated tokens
after such a prefix, the generated tokens of each continuation's path, and how often a
continuation's reward differs from its bare rollout's (the contrast it adds). Ends with one
JSON line, with the commit and machine load (``benchmarks/provenance.py``), also written to
``--out`` if given.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
import provenance  # noqa: E402
from trace_lightning.tree import bare_end  # noqa: E402
from trace_lightning.allocation.features import confidence_features  # noqa: E402
from trace_lightning.tree import Node, RolloutTree, read_jsonl  # noqa: E402


def bare_prefixes(tree: RolloutTree) -> list[Node]:
    """The unfinished turns of each bare rollout (from each root child, through first
    children): what stage 2 chose its prefixes from."""
    return [n for start in tree.bare_rollouts()
            for n in tree.path(bare_end(tree, start).id)[1:] if not n.finished]


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def choices(trees: Iterable[RolloutTree]) -> dict[str, dict]:
    """``{"continued": stats, "passed_over": stats}`` over the bare prefixes of ``trees``."""
    sides: dict[str, dict[str, list[float]]] = {
        side: {"mean_logprob": [], "last_turn_logprob": [], "low_share": [], "value": [],
               "prediction": []} for side in ("continued", "passed_over")}
    for tree in trees:
        conf = confidence_features([tree])
        for node in bare_prefixes(tree):
            s = sides["continued" if node.continuations > 0 else "passed_over"]
            mean_lp, last_lp, _, low = conf[(tree.tree_id, node.id)].tolist()
            s["mean_logprob"].append(mean_lp)
            s["last_turn_logprob"].append(last_lp)
            s["low_share"].append(low)
            if node.value is not None:
                s["value"].append(node.value)
            if node.prediction is not None:
                s["prediction"].append(node.prediction)
    return {side: {"prefixes": len(s["mean_logprob"]), **{k: _mean(v) for k, v in s.items()}}
            for side, s in sides.items()}


def by_depth(trees: Iterable[RolloutTree]) -> dict:
    """``{"bare_rollouts", "bare_tokens", "bare_pairs_differ", "depths": {depth: stats}}``
    over the bare prefixes of ``trees``: the bare rollouts' mean generated tokens and the share
    of pairs of one prompt's bare rollouts whose rewards differ (what another fresh rollout
    adds); per depth the prefixes, those continued, the bare rollout's mean generated tokens
    after the prefix, the continuations' leaves, their mean generated tokens (their own nodes
    only: the prefix is shared) and the share whose reward differs from the bare rollout's.
    Means are None where there is nothing to average."""
    depths: dict[int, dict[str, list[float]]] = {}
    bare_tokens, pairs = [], []
    for tree in trees:
        rewards = [bare_end(tree, start).reward for start in tree.bare_rollouts()]
        pairs += [float(a != b) for i, a in enumerate(rewards) for b in rewards[i + 1:]]
        for start in tree.bare_rollouts():
            end = bare_end(tree, start)
            path = tree.path(end.id)[1:]
            tokens = [n.n_policy_tokens for n in path]
            bare_tokens.append(sum(tokens))
            for k, node in enumerate(path):
                if node.finished:
                    continue
                d = depths.setdefault(node.depth, {"prefixes": [], "continued": [], "after": [],
                                                   "tokens": [], "differs": []})
                d["prefixes"].append(1)
                d["continued"].append(int(node.continuations > 0))
                d["after"].append(sum(tokens[k + 1:]))
                for child in node.children[1:]:  # the first child is the bare rollout's
                    stack, spent = [child], 0
                    while stack:
                        n = tree.nodes[stack.pop()]
                        spent += n.n_policy_tokens
                        if n.finished:
                            d["differs"].append(float(n.reward != end.reward))
                        stack.extend(n.children)
                    d["tokens"].append(spent)
    out = {}
    for depth in sorted(depths):
        d = depths[depth]
        leaves = len(d["differs"])
        out[str(depth)] = {"prefixes": len(d["prefixes"]), "continued": sum(d["continued"]),
                           "bare_tokens_after": _mean(d["after"]), "continuation_leaves": leaves,
                           "continuation_tokens": (sum(d["tokens"]) / leaves if leaves
                                                   else None),
                           "differs_from_bare": _mean(d["differs"])}
    return {"bare_rollouts": len(bare_tokens), "bare_tokens": _mean(bare_tokens),
            "bare_pairs_differ": _mean(pairs), "depths": out}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees_dir", help="a run's --data.trees_dir (JSONL files of trees)")
    p.add_argument("--out", default=None, help="also write the JSON line here")
    args = p.parse_args(argv)
    stamp = provenance.Stamp()
    files = sorted(Path(args.trees_dir).glob("*.jsonl"))
    if not files:
        raise SystemExit(f"prefix_choices.py: no .jsonl files in {args.trees_dir}; give the "
                         f"folder a run wrote with --data.trees_dir")
    trees = [t for f in files for t in read_jsonl(f)]
    result = {"benchmark": "prefix_choices", "trees_dir": args.trees_dir, "files": len(files),
              **choices(trees), "by_depth": by_depth(trees)}
    provenance.publish(result, stamp, args.out)
    return result


if __name__ == "__main__":
    main()
