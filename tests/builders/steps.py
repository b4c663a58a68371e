"""The rollout step the callbacks are checked on, built by hand, the figures derived by hand
from it, and a datamodule and module that serve it to a real Trainer (test_callback_stats.py,
test_callbacks.py and its two-process script).

The step (3 opened prompts of 5 candidates; ``r`` = leaf reward, ``p`` = prediction)::

    A (p .5)  r0: s(p .6) ─┬─ answer r=0   (bare)          leaves [0, 1, 1, 0]
                           ├─ answer r=1   (continuation)   mixed; bare rewards [0, 1]
                           └─ answer r=0   (continuation)
              r1: answer r=1 (bare)
    B (p .2)  r0: s(p .3) ── answer r=0                     leaves [0, 0, 0]
              r1: s(p .1) ── s(p .05) ─┬─ answer r=0 (bare) not mixed; bare [0, 0]
                                       └─ answer r=0 (continuation)
    C (p .4)  r0: s(p .7) ─┬─ answer r=0 (bare)             leaves [0, 0, 1]
                           └─ answer r=1 (continuation)     mixed; bare [0, 0]
              r1: invalid r=0 (bare)
"""

from __future__ import annotations

import math

import lightning as L
import torch
from torch.utils.data import DataLoader

from trace_lightning.rollout.step import RolloutStep
from trace_lightning.tree import Budget, RolloutTree


def add_turn(tree: RolloutTree, parent: int, rollout: int | None = None, *,
             action: str = "search", reward: float | None = None, f1: float | None = None,
             prediction: float | None = None, policy: int = 3, obs: int = 2):
    """A turn with ``policy`` policy tokens and ``obs`` observation tokens (none on leaves)."""
    finished = reward is not None
    obs = 0 if finished else obs
    n = tree.add_child(parent, rollout=rollout, token_ids=[7] * (policy + obs),
                       logprobs=[-0.5] * policy + [0.0] * obs,
                       policy_mask=[1] * policy + [0] * obs,
                       text=f"<think>step under {parent}</think><{action}>x</{action}>",
                       observation="" if finished else "Doc 1(Title: T) some passage text",
                       action=action, argument="paris" if action == "answer" else "query",
                       finished=finished, finish_reason=action if finished else "",
                       reward=reward,
                       metrics=None if reward is None else {"em": reward, "f1": f1})
    n.prediction = prediction
    return n


def build_trees() -> list[RolloutTree]:
    """The three trees drawn above (A, B, C), their values computed."""
    a = RolloutTree.new("q-a", "Where is A?", ["paris"], [1, 2, 3], "prompt A", "hotpotqa")
    a.root.prediction = 0.5
    a1 = add_turn(a, 0, 0, prediction=0.6)
    add_turn(a, a1.id, action="answer", reward=0.0, f1=0.2)
    add_turn(a, 0, 1, action="answer", reward=1.0, f1=1.0)
    a1.continuations = 2
    add_turn(a, a1.id, action="answer", reward=1.0, f1=1.0)
    add_turn(a, a1.id, action="answer", reward=0.0, f1=0.0)

    b = RolloutTree.new("q-b", "Who is B?", ["bob", "robert"], [1, 2], "prompt B", "hotpotqa")
    b.root.prediction = 0.2
    b1 = add_turn(b, 0, 0, prediction=0.3)
    add_turn(b, b1.id, action="answer", reward=0.0, f1=0.0)
    b3 = add_turn(b, 0, 1, prediction=0.1)
    b4 = add_turn(b, b3.id, prediction=0.05)
    add_turn(b, b4.id, action="answer", reward=0.0, f1=0.5)
    b4.continuations = 1
    add_turn(b, b4.id, action="answer", reward=0.0, f1=0.0)

    c = RolloutTree.new("q-c", "When was C?", ["1999"], [1, 2, 3, 4], "prompt C", "hotpotqa")
    c.root.prediction = 0.4
    c1 = add_turn(c, 0, 0, prediction=0.7)
    add_turn(c, c1.id, action="answer", reward=0.0, f1=0.4)
    add_turn(c, 0, 1, action="invalid", reward=0.0, f1=0.0)
    c1.continuations = 1
    add_turn(c, c1.id, action="answer", reward=1.0, f1=1.0)
    for t in (a, b, c):
        t.compute_values()
    return [a, b, c]


def build_step(epoch: int = 0, trees: list[RolloutTree] | None = None,
               root_plan: list[int] | None = None, predictions: bool = True) -> RolloutStep:
    """The step drawn above (or ``trees``), with GRPO-centred advantages ``r - mean_tree``."""
    trees = build_trees() if trees is None else trees
    if not predictions:
        for t in trees:
            for n in t.nodes:
                n.prediction = None
    seqs = []
    for t in trees:
        leaves = t.flatten()
        mu = sum(s.reward for s in leaves) / len(leaves)
        for s in leaves:
            s.advantage = s.reward - mu
        seqs += leaves
    return RolloutStep(epoch=epoch, trees=trees, candidates=5,
                       root_plan=[2, 0, 2, 2, 0] if root_plan is None else root_plan,
                       sequences=seqs,
                       budget=Budget(leaves=sum(len(t.leaves()) for t in trees),
                                     generated_tokens=500, prefill_tokens=800, cached_tokens=200,
                                     tool_calls=6),
                       pool_returned=1,
                       seconds={"rollout": 2.0, "tools": 0.75, "predict": 0.5},
                       cold_start=False, engine_calls=7,
                       trust={"roots": 0.25, "prefixes": 1.0})


# ---- expected values, derived by hand ------------------------------------------------------
STD_2_9 = math.sqrt(2 / 9)  # population std of {0, 0, 1} or {0, 1, 0}: var = 2/9
EXPECTED_ROLLOUT = {
    # 10 leaves, 3 successes
    "rollout/reward_mean": 0.3,
    "rollout/reward_std": math.sqrt(0.3 * 0.7),
    # prompts: A {0,1,1,0} -> 0.5, B {0,0,0} -> 0, C {0,0,1} -> sqrt(2/9)
    "rollout/prompt_reward_std_mean": (0.5 + 0 + STD_2_9) / 3,
    "rollout/prompt_reward_std_min": 0.0,
    "rollout/prompt_reward_std_max": 0.5,
    # branched subtrees: A r0 {0,1,0} -> sqrt(2/9), B r1 {0,0} -> 0, C r0 {0,1} -> 0.5
    "rollout/subtree_reward_std_mean": (STD_2_9 + 0 + 0.5) / 3,
    "rollout/subtree_reward_std_min": 0.0,
    "rollout/subtree_reward_std_max": 0.5,
    # mixed: A, C; bare rollouts: A {0,1} mixed, B {0,0}, C {0,0} zero-variance
    "rollout/effective_ratio": 2 / 3,
    "rollout/zero_std_share": 1 / 3,
    "rollout/zero_std_share_bare": 2 / 3,
    "rollout/em": 0.3,
    # f1: A .2+1+1+0, B 0+.5+0, C .4+0+1 -> 4.1 / 10
    "rollout/f1": 0.41,
    # advantages r - mean: all 4 of A and 3 of C non-zero, B's 3 zero -> 7/10
    "rollout/informative_leaf_share": 0.7,
}
# leaves per opened prompt [4, 3, 3]: sum |x_i - x_j| over ordered pairs = 4 (4-3 four times);
# gini = 4 / (2 * 3 * 10) = 1/15; entropy = H(.4, .3, .3) / ln 3
H = -(0.4 * math.log(0.4) + 2 * 0.3 * math.log(0.3))
EXPECTED_ALLOC = {
    "alloc/candidates": 5, "alloc/prompts_opened": 3, "alloc/prompts_filtered": 2,
    "alloc/root_gini": 0.0,  # m = [2, 2, 2]
    "alloc/leaves_per_prompt_gini": 1 / 15,
    "alloc/leaves_per_prompt_entropy": H / math.log(3),  # 0.99118
    "alloc/leaves_per_prompt_max": 4,
    "alloc/branched_prefixes": 3,
    # continuations [2, 1, 1] at depths [1, 2, 1]: (2*1 + 1*2 + 1*1) / 4
    "alloc/branch_depth_mean": 1.25,
    "alloc/pool_returned": 1, "alloc/cold_start": 0.0, "alloc/effective_ratio": 2 / 3,
    "alloc/leaves": 10, "alloc/generated_tokens": 500, "alloc/tool_calls": 6,
    "alloc/trust_roots": 0.25, "alloc/trust_prefixes": 1.0,  # the step's, as given
}
# 8 predicted nodes (p, y, w): B (.05,0,2) (.1,0,2) (.2,0,3) (.3,0,1); C (.4,1/3,3) (.7,.5,2);
# A (.5,.5,4) (.6,1/3,3). W = 20.
# brier: sum w (p-y)^2 = .005+.02+.12+.09 + .013333+.08 + 0+.213333 = .541667 -> /20
# baseline: ybar = (2+1+1+1)/20 = .25; sum w (y-.25)^2 = 8*.0625 + .25 + 2*.020833 + .125
#           = .916667 -> /20;  skill = 1 - .541667/.916667 = 9/22
# ece: every node alone in its bin: sum w |p-y| = .1+.2+.6+.3+.2+.4+0+.8 = 2.6 -> /20 = .13
# spearman: p ranks 1..8 (order above: B.05 B.1 B.2 B.3 C.4 A.5 A.6 C.7), y ranks
#           [2.5]*4 + [5.5, 7.5, 5.5, 7.5]: 34 / sqrt(42 * 36)
EXPECTED_PREDICTOR = {
    "predictor/brier": 0.541667 / 20, "predictor/brier_baseline": 0.916667 / 20,
    "predictor/brier_skill": 9 / 22, "predictor/ece": 0.13,
    "predictor/spearman": 34 / math.sqrt(42 * 36),
    "predictor/prediction_mean": (0.05 + 0.1 + 0.2 + 0.3 + 0.4 + 0.7 + 0.5 + 0.6) / 8,
    "predictor/nodes": 8, "predictor/roots": 3,
    # leaf-weighted values over 10 leaves: 2 + 1 = 3 (roots), 1 + 1 = 2 (prefixes)
    "predictor/outcome_mean": 5 / 20,
    # roots: p (.5 .2 .4), values (1/2, 0, 1/3), weights (4 3 3); Brier (0 + .12 + 1/75)/10
    # = 2/150 against (.16 + .27 + 1/300)/10 = 13/300 around their mean .3
    "predictor/roots/brier_skill": 9 / 13, "predictor/roots/spearman": 1.0,
    "predictor/roots/prediction_mean": 1.1 / 3, "predictor/roots/outcome_mean": 0.3,
    # prefixes a1 b1 b3 b4 c1: p (.6 .3 .1 .05 .7), values (1/3 0 0 0 1/2), weights
    # (3 1 2 2 2); Brier 49/1200 against 52/1200 around their mean .2; ranks (4 3 2 1 5)
    # and (4 2 2 2 5): 8 / sqrt(10 * 8)
    "predictor/prefixes/brier_skill": 3 / 52, "predictor/prefixes/spearman": 8 / math.sqrt(80),
    "predictor/prefixes/prediction_mean": 1.75 / 5, "predictor/prefixes/outcome_mean": 0.2,
}


# validation rows: hotpotqa em [1, 0, 1], nq em [0, 0]
VAL_ROWS = {
    "hotpotqa": [dict(dataset="hotpotqa", em=1.0, f1=1.0, reward=1.0, searches=2.0,
                      malformed=0.0),
                 dict(dataset="hotpotqa", em=0.0, f1=0.5, reward=0.0, searches=1.0,
                      malformed=0.0),
                 dict(dataset="hotpotqa", em=1.0, f1=1.0, reward=1.0, searches=0.0,
                      malformed=1.0)],
    "nq": [dict(dataset="nq", em=0.0, f1=0.2, reward=0.0, searches=1.0, malformed=0.0),
           dict(dataset="nq", em=0.0, f1=0.0, reward=0.0, searches=1.0, malformed=1.0)],
}


def collate_rows(rows: list[dict]) -> dict:
    """As ``trace_lightning.rollout.validation.collate_rows``: tensors per field, names as a
    list."""
    return {k: (torch.tensor([r[k] for r in rows]) if k != "dataset" else [r[k] for r in rows])
            for k in rows[0]}


class StepData(L.LightningDataModule):
    """Serves ``steps[epoch]`` as ``last_step`` when the train dataloader is (re)built."""

    def __init__(self, steps: list, val_rows: dict[str, list[dict]] | None = None):
        super().__init__()
        self.steps = steps
        self.val_rows = VAL_ROWS if val_rows is None else val_rows
        self.last_step = None
        self.last_val_trees: dict = {}
        self.sync_diff: float | None = None
        self.timings: dict[str, float] = {}
        self.task_metrics = ("em", "f1")  # search QA's, its headline first

    def train_dataloader(self) -> DataLoader:
        epoch = self.trainer.current_epoch
        self.last_step = self.steps[min(epoch, len(self.steps) - 1)]
        self.sync_diff, self.timings["sync"], self.timings["sample"] = 0.003, 0.25, 1.5
        return DataLoader(torch.arange(4.0).reshape(4, 1), batch_size=2)

    def val_dataloader(self) -> list[DataLoader]:
        return [DataLoader(rows, batch_size=2, collate_fn=collate_rows)
                for rows in self.val_rows.values()]


class TinyModule(L.LightningModule):
    """A linear layer; validation_step returns the batch, as TraceModule does."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        loss = self.w(batch).pow(2).mean()
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        return batch

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
