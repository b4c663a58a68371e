"""Do two runs log the same figures? Every scalar key outside ``perf/*`` (seconds and memory,
which no two runs share), compared step by step to the digit.

    python scripts/same_figures.py BEFORE_RUN AFTER_RUN [--label NAME] [--out FILE.json]

A run is a TensorBoard version folder (``runs/demo/tensorboard/version_0``) or a folder with
one below it. A change that should not move any figure (a refactor, a new seam) is run before
and after on the same world and checked here; the answer is one JSON line (``--out`` also
writes it, for the docs to quote): the keys compared, the ones only one run has, and every key
whose values differ, with its first difference.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def version_dir(path: Path) -> Path:
    """``path`` if it holds event files, else its newest ``version_<N>`` below it."""
    if any(path.glob("events.out.tfevents.*")):
        return path
    versions = sorted(path.rglob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    found = [v for v in versions if any(v.glob("events.out.tfevents.*"))]
    if not found:
        raise SystemExit(f"{path}: no TensorBoard event files here or in a version_<N> below; "
                         f"give a run's log folder (runs/demo/tensorboard/version_0)")
    return found[-1]


def scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar key of ``run``'s event files: its (step, value) pairs in order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(version_dir(run)), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def compare(before: dict[str, list], after: dict[str, list], ignore: str = "perf/") -> dict:
    """Keys outside ``ignore`` compared: those in one run only, and those whose (step, value)
    series differ, each with its first differing pair."""
    keys_b = {k for k in before if not k.startswith(ignore)}
    keys_a = {k for k in after if not k.startswith(ignore)}
    differ = {}
    for k in sorted(keys_b & keys_a):
        pairs = list(zip(before[k], after[k]))
        first = next((p for p in pairs if p[0] != p[1]), None)
        if first is not None or len(before[k]) != len(after[k]):
            differ[k] = {"before": first[0] if first else len(before[k]),
                         "after": first[1] if first else len(after[k])}
    return {"keys_compared": len(keys_b & keys_a), "values_compared":
            sum(len(before[k]) for k in keys_b & keys_a),
            "only_before": sorted(keys_b - keys_a), "only_after": sorted(keys_a - keys_b),
            "differ": differ,
            "same": not differ and keys_b == keys_a}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--label", default="", help="what was changed between the runs")
    p.add_argument("--out", type=Path, help="also write the JSON line here")
    args = p.parse_args(argv)
    result = {"check": "same_figures", "label": args.label,
              "before": str(version_dir(args.before)), "after": str(version_dir(args.after)),
              **compare(scalars(args.before), scalars(args.after))}
    line = json.dumps(result)
    if args.out:
        args.out.write_text(line + "\n")
    print(line)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["same"] else 1)
