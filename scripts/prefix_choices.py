"""What stage 2 branched from: the prefixes it continued against those it passed over.

    python scripts/prefix_choices.py runs/demo/trees    # a run's --data.trees_dir

Reads every tree a run saved (``--data.trees_dir``: one JSONL file per epoch and rank) and
splits the prefixes stage 2 could have continued (the unfinished turns of each bare rollout,
the path through first children) into those it gave continuations and the rest. For each
side: how many, how sure the policy was of its own turns there (``confidence_of``: the mean
log-prob of the prefix's policy tokens, its last turn's mean, the share of tokens below
log 1/2), the mean success of the leaves below (``value``) and the predictor's mean
prediction. A plain mean over prefixes, each counted once. Ends with one JSON line, with the
commit and machine load (``benchmarks/provenance.py``), also written to ``--out`` if given.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
import provenance  # noqa: E402
from trace_lightning.allocation.allocators import bare_end  # noqa: E402
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
    result = {"benchmark": "prefix_choices", "trees_dir": args.trees_dir, "files": len(files),
              **choices(t for f in files for t in read_jsonl(f))}
    provenance.publish(result, stamp, args.out)
    return result


if __name__ == "__main__":
    main()
