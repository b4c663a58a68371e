"""trace_lightning/rollout/validation.py: one held-out trajectory's scores."""

from __future__ import annotations

from trace_lightning.tree import RolloutTree
from trace_lightning.rollout.validation import val_row


def _episode(last_finish: str) -> tuple[RolloutTree, int]:
    """search (ran: observation) -> search that ended the episode with ``last_finish``."""
    t = RolloutTree.new("t", "q", ["a"], [1, 2], dataset="hotpotqa")
    first = t.add_child(0, rollout=0, token_ids=[3, 4], logprobs=[-1.0, -1.0],
                        policy_mask=[1, 0], action="search", argument="x",
                        observation="<information>doc</information>")
    last = t.add_child(first.id, token_ids=[5], logprobs=[-1.0], policy_mask=[1],
                       action="search", argument="y", finished=True,
                       finish_reason=last_finish, reward=0.0,
                       metrics={"em": 0.0, "f1": 0.0})
    return t, last.id


def test_searches_count_the_searches_that_ran_not_the_one_the_episode_ended_on():
    # the second search hit max_turns (or the observation would not fit): it never ran, and
    # the rollout budget's tool_calls does not count it either
    for finish in ("max_turns", "max_tokens"):
        t, leaf = _episode(finish)
        row = val_row(t, t.nodes[leaf], "searches")
        assert row["searches"] == 1.0, finish
        assert (row["dataset"], row["em"], row["malformed"]) == ("hotpotqa", 0.0, 0.0)
