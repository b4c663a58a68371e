"""Token-budget packing, mini-batch splits and collation."""

from __future__ import annotations

import random

import pytest
import torch

from trace_lightning.packing.leaves import collate, pack_microbatches, padding_share, split_minibatches
from trace_lightning.tree import LeafSequence
from launch import leave_group
from builders import search_datamodule


def seq(n: int, k: int = 0, prompt: int = 2) -> LeafSequence:
    policy = [0] * min(prompt, n) + [1] * max(n - prompt, 0)
    return LeafSequence(tree_id=f"t{k}", leaf_id=k, rollout=0, input_ids=[k + 3] * n,
                        policy_mask=policy, logprobs=[-0.5 * m for m in policy],
                        reward=float(k % 2), ancestors=[0, 1])


def skewed(seed: int = 0, n: int = 64) -> list[LeafSequence]:
    rng = random.Random(seed)
    # Mostly short sequences with a long tail, as multi-turn rollouts are.
    lengths = [rng.choice([rng.randint(8, 40)] * 4 + [rng.randint(200, 400)]) for _ in range(n)]
    return [seq(length, k) for k, length in enumerate(lengths)]


def test_pack_covers_every_index_once_within_budget():
    seqs = skewed()
    batches = pack_microbatches(seqs, max_tokens=1024)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(len(seqs)))
    for b in batches:
        assert len(b) * max(len(seqs[i].input_ids) for i in b) <= 1024


def test_pack_oversized_sequence_alone():
    seqs = [seq(10, 0), seq(50, 1), seq(12, 2)]
    batches = pack_microbatches(seqs, max_tokens=30)
    # Longest first: [1] alone (50 > 30); then [2, 0]: 2 * 12 = 24 <= 30.
    assert batches == [[1], [2, 0]]
    with pytest.raises(ValueError, match="max_tokens"):
        pack_microbatches(seqs, max_tokens=0)


def test_packing_pads_less_than_fixed_size_batches():
    seqs = skewed()
    packed = pack_microbatches(seqs, max_tokens=2048)
    # Naive: same number of micro-batches, fixed size, in arrival order.
    size = -(-len(seqs) // len(packed))
    naive = [list(range(i, min(i + size, len(seqs)))) for i in range(0, len(seqs), size)]
    assert padding_share(packed, seqs) < padding_share(naive, seqs)
    assert padding_share(packed, seqs) < 0.3 and padding_share(naive, seqs) > 0.5
    # Hand check: lengths 2 and 4 in one batch: 6 real of 8 slots -> 0.25.
    assert padding_share([[0, 1]], [seq(2), seq(4)]) == pytest.approx(0.25)


def test_split_minibatches_balanced_and_seeded():
    seqs = skewed(1, 50)
    groups = split_minibatches(seqs, 4, seed=3)
    assert sorted(i for g in groups for i in g) == list(range(50))
    tokens = [sum(len(seqs[i].input_ids) for i in g) for g in groups]
    assert max(tokens) - min(tokens) <= max(len(s.input_ids) for s in seqs)
    assert groups == split_minibatches(seqs, 4, seed=3)
    assert groups != split_minibatches(seqs, 4, seed=4)
    with pytest.raises(ValueError, match="n_minibatches"):
        split_minibatches(seqs, 0)
    # More mini-batches than sequences: every sequence alone, the rest empty.
    small = split_minibatches(seqs[:2], 4, seed=0)
    assert len(small) == 4 and sorted(len(g) for g in small) == [0, 0, 1, 1]


def test_collate_shapes_and_masks():
    a, b = seq(5, 0), seq(3, 1)  # policy masks [0,0,1,1,1] and [0,0,1]
    out = collate([a, b], pad_id=0, advantages=[[9, 9, 1, 2, 3], [9, 9, 4]])
    for k in ("input_ids", "attention_mask", "policy_mask", "old_logprobs", "advantages"):
        assert out[k].shape == (2, 5)
    assert out["input_ids"].dtype == torch.long
    assert out["input_ids"][1].tolist() == [4, 4, 4, 0, 0]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert out["policy_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]]
    assert out["old_logprobs"].tolist() == [[0, 0, -0.5, -0.5, -0.5], [0, 0, -0.5, 0, 0]]
    # Advantages zeroed off policy tokens (the 9s sit on prompt tokens).
    assert out["advantages"].tolist() == [[0, 0, 1, 2, 3], [0, 0, 4, 0, 0]]
    assert out["rewards"].tolist() == [0.0, 1.0]
    # Without per-token lists, seq.advantage is spread over policy tokens.
    a.advantage, b.advantage = 0.5, -2.0
    out = collate([a, b], pad_id=0)
    assert out["advantages"].tolist() == [[0, 0, 0.5, 0.5, 0.5], [0, 0, -2.0, 0, 0]]


def test_collate_rejects_policy_first_token():
    bad = seq(3, 0, prompt=0)
    with pytest.raises(ValueError, match="prompt token"):
        collate([bad], pad_id=0)


def test_ppo_epochs_pass_over_every_leaf_each_time_in_fresh_splits():
    """The step's per-leaf mini-batches (``training.batches``, ``tree_packing`` off)."""
    from trace_lightning.rollout.step import RolloutStep
    from trace_lightning.training.batches import step_minibatches
    from trace_lightning.tree import Budget

    seqs = skewed(n=12)
    for k, s in enumerate(seqs):  # distinct per sequence and per token, signs mixed
        s.token_advantages = [(k - 5.5) + 0.01 * t for t in range(len(s.input_ids))]
    step = RolloutStep(epoch=3, trees=[], candidates=12, root_plan=[1] * 12, sequences=seqs,
                       budget=Budget(leaves=12))
    batches = step_minibatches(step, pad=0, minibatches=2, ppo_epochs=3, max_tokens=8192,
                               tree_packing=False, temperature=1.0)
    assert len(batches) == 6  # 2 mini-batches x 3 passes, one optimizer step each

    def ids(batch):  # the first token of each row names its sequence (k + 3)
        return sorted(int(row[0]) - 3 for mb in batch["micro"] for row in mb["input_ids"])

    # every row trains on its own sequence's advantages, on its policy tokens only
    for batch in batches:
        for mb in batch["micro"]:
            for r, row in enumerate(mb["input_ids"]):
                s = seqs[int(row[0]) - 3]
                n = len(s.input_ids)
                want = torch.tensor(s.token_advantages) * torch.tensor(s.policy_mask)
                torch.testing.assert_close(mb["advantages"][r, :n].float(), want.float())
                assert not mb["advantages"][r, n:].any()  # padding
    passes = [ids(batches[2 * e]) + ids(batches[2 * e + 1]) for e in range(3)]
    assert all(sorted(p) == list(range(12)) for p in passes)  # each pass: every leaf once
    splits = [ids(batches[2 * e]) for e in range(3)]
    assert len({tuple(s) for s in splits}) > 1  # passes are split afresh, not replayed
    total = sum(sum(s.policy_mask) for s in seqs)
    assert sum(b["n_tokens"] for b in batches) == 3 * total
    assert all(b["normalizer"] == b["n_tokens"] for b in batches)  # one process
    with pytest.raises(ValueError, match="ppo_epochs"):
        search_datamodule(train="unused.jsonl", corpus="unused.jsonl", ppo_epochs=0)


def _equalise_worker(rank: int, world: int, out_dir: str) -> None:
    import torch.distributed as dist

    from trace_lightning.packing.leaves import equalise_over_ranks

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
                            world_size=world)
    try:
        # (micro-batches, policy tokens) of two mini-batches on each rank
        share = {0: [(3, 30.0), (1, 10.0)], 1: [(1, 6.0), (0, 0.0)]}[rank]
        minis = [{"micro": [{"k": i} for i in range(k)], "n_tokens": n} for k, n in share]
        out = equalise_over_ranks(minis, pad_id=0)
        torch.save([(len(m["micro"]), m["normalizer"], m["n_tokens"]) for m in out],
                   f"{out_dir}/rank{rank}.pt")
    finally:
        leave_group()


def test_minibatches_over_two_ranks_share_one_token_mean(tmp_path):
    """Two gloo processes. Micro-batch counts become the max over ranks (at least 1), and the
    loss divisor is the mini-batch's tokens summed over ranks / 2: DDP averages the two
    gradients, so a token weighs 1/2 * 1/18 = 1/36 = 1/(30 + 6) on either rank, the
    token-mean over the whole mini-batch (with each rank's own count, a token on rank 1
    would weigh 1/2 * 1/6, five times one on rank 0)."""
    torch.multiprocessing.spawn(_equalise_worker, args=(2, str(tmp_path)), nprocs=2)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert got[0] == [(3, 18.0, 30.0), (1, 5.0, 10.0)]
    assert got[1] == [(3, 18.0, 6.0), (1, 5.0, 0.0)]
