"""Validation rows: each finished trajectory's scores, sampled afresh on every pass.

Lightning may build the validation loaders before training starts and reuse them, so the
rollouts are not sampled when a loader is made: ``SampleOnIter`` has ``ValRollouts`` call
its ``sample()`` at the start of every pass, with the weights of that moment.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from trace_lightning.tasks.base import ANSWER, INVALID
from trace_lightning.tree import Node, RolloutTree


def resampled_loader(n: int, sample: Callable[[], list[dict]], batch_size: int = 64
                     ) -> DataLoader:
    """A loader over ``n`` rows that ``sample()`` makes anew at the start of every pass."""
    rows = ValRollouts(n, sample)
    return DataLoader(rows, batch_size=batch_size, sampler=SampleOnIter(rows),
                      collate_fn=collate_rows)


class ValRollouts(Dataset):
    """``n`` validation rows, (re)computed by ``sample()`` when ``refresh`` is called."""

    def __init__(self, n: int, sample) -> None:
        self.n, self.sample, self.rows = n, sample, None

    def refresh(self) -> None:
        self.rows = self.sample()
        assert len(self.rows) == self.n, (len(self.rows), self.n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


class SampleOnIter(Sampler):
    """In-order sampler that refreshes its ``ValRollouts`` at the start of every pass."""

    def __init__(self, rows: ValRollouts) -> None:
        self.rows = rows

    def __iter__(self):
        self.rows.refresh()
        return iter(range(len(self.rows)))

    def __len__(self) -> int:
        return len(self.rows)


def val_row(tree: RolloutTree, leaf: Node, calls_metric: str) -> dict:
    """One trajectory's scores: the task's metrics (search QA: EM, F1), the reward, the tool
    calls it ran (named ``calls_metric``: ``searches``) and a malformed last turn.

    A tool call the episode ended on (``max_turns``, or its observation would not fit)
    never ran, and is not counted (as the rollout budget's ``tool_calls`` does not)."""
    turns = tree.path(leaf.id)[1:]
    calls = sum(n.action not in (ANSWER, INVALID) and not n.finished for n in turns)
    return {"dataset": tree.dataset,
            **{k: float(v or 0.0) for k, v in (leaf.metrics or {}).items()},
            "reward": float(leaf.reward or 0.0), calls_metric: float(calls),
            "malformed": float(leaf.action == INVALID)}


def collate_rows(rows: list[dict]) -> dict:
    """Rows to tensors (the dataset names stay a list)."""
    return {k: (torch.tensor([r[k] for r in rows]) if k != "dataset" else [r[k] for r in rows])
            for k in rows[0]}
