"""How well the search-QA task's description of a prompt predicts its success, on a run's trees.

    python scripts/prompt_features.py runs/demo/trees    # a run's --data.trees_dir

For each saved tree (one prompt's rollouts in one step) it computes the task's description of
the prompt (``SearchEnvironment.prompt_features``: how findable the prompt's supporting
documents are; what ``--model.featuriser.task_features 3`` gives the predictor) with the
world's training corpus and questions (``--world``, the demo's by default), and takes the
prompt's success in that step: its root's value, the mean reward of its leaves. Reports how
many distinct descriptions the prompts have, and for each number its distinct values and its
rank correlation with success over the trees (Spearman, ties sharing their mean rank: the
statistic the predictor's roots are scored with, ``callbacks/METRICS.md``). A description that
hardly varies cannot tell prompts apart, whatever the predictor does with it. Ends with one
JSON line, with the commit and machine load (``benchmarks/provenance.py``), also written to
``--out`` if given.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
import provenance  # noqa: E402
from trace_lightning.math.calibration import spearman  # noqa: E402
from trace_lightning.tasks.search_qa.datasets import load_qa  # noqa: E402
from trace_lightning.tasks.search_qa.environment import (  # noqa: E402
    PROMPT_FEATURES, SearchEnvironment)
from trace_lightning.tasks.search_qa.retrieval import BM25Retriever  # noqa: E402
from trace_lightning.tree import RolloutTree, read_jsonl  # noqa: E402


def describe(trees: list[RolloutTree], env: SearchEnvironment, examples: dict) -> dict:
    """The spread of the trees' prompt descriptions and each number's rank correlation with
    the trees' success (root values; ``compute_values`` must have run, as it has on saved
    trees)."""
    missing = sorted({t.tree_id for t in trees} - set(examples))
    if missing:
        raise SystemExit(f"prompt_features.py: {len(missing)} trees' prompts are not among the "
                         f"world's training questions (e.g. {missing[0]!r}); give the --world "
                         f"the run trained on")
    feats = [env.prompt_features(examples[t.tree_id]) for t in trees]
    success = [t.root.value for t in trees]
    return {"trees": len(trees), "prompts": len({t.tree_id for t in trees}),
            "success": sum(success) / len(success) if success else None,
            "distinct_descriptions": len({tuple(f) for f in feats}),
            "features": {name: {"distinct_values": len({f[i] for f in feats}),
                                "rank_correlation": _finite(
                                    spearman([f[i] for f in feats], success))}
                         for i, name in enumerate(PROMPT_FEATURES)}}


def _finite(x: float) -> float | None:
    """``x``, or None where it is NaN (a constant side has no rank correlation)."""
    return None if x != x else x


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees_dir", help="a run's --data.trees_dir (JSONL files of trees)")
    p.add_argument("--world", default="runs/demo/world",
                   help="the demo world the run trained on (train_corpus.jsonl, train_qa.jsonl "
                        "and the tokenizer in model/)")
    p.add_argument("--topk", type=int, default=2, help="passages per search (the run's "
                                                       "--data.task.init_args.env.topk)")
    p.add_argument("--out", default=None, help="also write the JSON line here")
    args = p.parse_args(argv)
    stamp = provenance.Stamp()
    files = sorted(Path(args.trees_dir).glob("*.jsonl"))
    if not files:
        raise SystemExit(f"prompt_features.py: no .jsonl files in {args.trees_dir}; give the "
                         f"folder a run wrote with --data.trees_dir")
    world = Path(args.world)
    for name in ("train_corpus.jsonl", "train_qa.jsonl", "model"):
        if not (world / name).exists():
            raise SystemExit(f"prompt_features.py: --world {world} has no {name}; give the "
                             f"folder of a built demo world (data.task.init_args.demo.out_dir)")
    from transformers import AutoTokenizer

    with open(world / "train_corpus.jsonl") as f:
        retriever = BM25Retriever.from_documents(json.loads(line) for line in f if line.strip())
    env = SearchEnvironment(AutoTokenizer.from_pretrained(world / "model"), retriever,
                            topk=args.topk)
    examples = {e.id: e for e in load_qa(world / "train_qa.jsonl")}
    trees = [t for f in files for t in read_jsonl(f)]
    result = {"benchmark": "prompt_features", "trees_dir": args.trees_dir, "files": len(files),
              "topk": args.topk, **describe(trees, env, examples)}
    provenance.publish(result, stamp, args.out, demo_dir=world)
    return result


if __name__ == "__main__":
    main()
