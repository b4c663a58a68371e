"""Tree packing: a tree forwarded once gives the per-leaf update exactly.

Hand-built trees (branching at several depths, a continuation that ends at once, observation
tokens between policy tokens, a single-leaf tree) under every advantage kind: the packed
update's loss, gradients and statistics equal the per-leaf update's (float64 to 1e-10
relative, float32 to 1e-5), and the predictor's features equal each prefix forwarded alone.
A mask that lets a token see a sibling's tokens is caught. A tiny random-weight Qwen3.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trace_lightning.math.advantage import ADVANTAGE_KINDS
from trace_lightning.allocation.features import node_features
from trace_lightning.training.module import TraceModule
from trace_lightning.tree import RolloutTree
from trace_lightning.packing.attention import TREE_SDPA, node_plan, tree_attention_mask
from builders.models import policy
from builders.packing import (assert_packed_equals_per_leaf, leaf_micro, packed_micro,
                              sequences, update, with_old_logprobs_near)
from builders.trees import hand_trees
from trace_lightning.packing.trees import (collate_units, layout, pack_rows, split_ends,
                                          unique_tokens, update_units)


@pytest.mark.parametrize("kind", ADVANTAGE_KINDS)
@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("attention", [TREE_SDPA, "sdpa"])
def test_packed_update_equals_the_per_leaf_update(model_state, kind, dtype, rtol, attention):
    model = policy(model_state, dtype, attention)
    trees = hand_trees()
    with_old_logprobs_near(model, trees)
    seqs = sequences(trees, kind)
    packed = packed_micro(trees, seqs, max_tokens=4096)
    assert len(packed) == 1 and len(packed[0]["input_ids"]) < len(seqs)  # trees share rows
    stats = assert_packed_equals_per_leaf(model, trees, kind, rtol)
    # the checks bite: the clip fractions and KL are not all zero
    assert stats["clip_frac_low"] + stats["clip_frac_high"] > 0
    assert stats["kl_ref"] > 0


def test_the_training_step_logs_the_same_statistics_packed(model_state, tmp_path):
    """A real Trainer's step over one packed mini-batch logs the per-leaf step's ``train/*``
    (loss, pairs, clip fractions, KL, entropy, gradient norm)."""
    import lightning as L
    from torch.utils.data import DataLoader

    model = policy(model_state, torch.float32)
    model.save_pretrained(tmp_path / "policy")
    trees = hand_trees()
    with_old_logprobs_near(model, trees)
    seqs = sequences(trees, "tree_grpo")
    pairs = float(sum(sum(s.policy_mask) for s in seqs))
    logged = []
    for micro in (leaf_micro(seqs, 40), packed_micro(trees, seqs, 40)):
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        module = TraceModule(policy_path=str(tmp_path / "policy"), lr=1e-3, kl_coef=0.1)
        trainer.fit(module, DataLoader([{"micro": micro, "n_tokens": pairs}],
                                       batch_size=None, collate_fn=lambda b: b))
        logged.append({k: float(v) for k, v in trainer.logged_metrics.items()})
    assert logged[0].keys() == logged[1].keys() and "train/grad_norm" in logged[0]
    assert logged[0]["train/policy_tokens"] == logged[1]["train/policy_tokens"] == pairs
    for k, v in logged[0].items():
        assert logged[1][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


def test_a_tree_split_at_subtree_boundaries_gives_the_same_update(model_state):
    """A micro-batch budget smaller than tree ``a`` splits it into parts (its prefix
    recomputed in each), and the update is still the per-leaf one; no leaf is dropped."""
    model = policy(model_state)
    trees = hand_trees()
    with_old_logprobs_near(model, trees)
    seqs = sequences(trees, "segment")
    pairs = float(sum(sum(s.policy_mask) for s in seqs))
    a = trees[0]
    assert unique_tokens(a) > 24
    parts = split_ends(a, [n.id for n in a.leaves()], 24)
    assert len(parts) > 2 and sorted(sum(parts, [])) == sorted(n.id for n in a.leaves())
    want = update(model, leaf_micro(seqs, 4096), pairs)
    got = update(model, packed_micro(trees, seqs, max_tokens=24), pairs)
    assert got[0] == pytest.approx(want[0], rel=1e-10)
    for name, g in want[2].items():
        torch.testing.assert_close(got[2][name], g, rtol=1e-10, atol=1e-12)


def test_a_mask_that_shows_a_sibling_is_caught(model_state):
    """Letting a token see the siblings laid out before it (plain causal attention over the
    packed row; or a node plan whose paths hold an earlier sibling's tokens) gives other
    log-probs: the comparisons above can fail."""
    from trace_lightning.packing.trees import node_paths

    trees = hand_trees()
    seqs = sequences(trees, "grpo")
    units = [u for tr in trees
             for u in update_units(tr, [s for s in seqs if s.tree_id == tr.tree_id], 4096)]
    (rows,) = pack_rows([len(u) for u in units], 4096)
    rows = [[units[j] for j in row] for row in rows]
    mb = collate_units(rows, pad_id=0)
    dense = policy(model_state, attention="sdpa")
    good, _ = TraceModule._logprobs(dense, mb)
    t = mb["input_ids"].shape[1]
    leaky = dict(mb, subtree_end=torch.full_like(mb["subtree_end"], t))
    bad, _ = TraceModule._logprobs(dense, leaky)
    assert (good - bad).abs().max() > 1e-3
    per_node = policy(model_state)
    torch.testing.assert_close(TraceModule._logprobs(per_node, mb)[0], good, rtol=1e-10,
                               atol=1e-10)
    # every node's path also holds every token before it in its row (a sibling's among them)
    starts = iter(mb["offsets"][:, 1].tolist())  # each unit's first index, rows in order
    nodes = node_plan([[(a, z, sorted(set(range(a)) | set(path)))
                        for u in row for a, z, path in node_paths(u, next(starts))]
                       for row in rows], t)
    bad, _ = TraceModule._logprobs(per_node, dict(mb, tree_nodes=nodes))
    assert (good - bad).abs().max() > 1e-3


def small_tree() -> RolloutTree:
    """root [1 2] - n1 [3 4] - {n2 [5] (reward 1), n3 [6 7] (reward 0)}."""
    t = RolloutTree.new("h", "q", ["x"], [1, 2])
    n1 = t.add_child(0, rollout=0, token_ids=[3, 4], logprobs=[-1.0, -2.0], policy_mask=[1, 1])
    t.add_child(n1.id, token_ids=[5], logprobs=[-1.5], policy_mask=[1], finished=True,
                reward=1.0)
    t.add_child(n1.id, token_ids=[6, 7], logprobs=[-0.5, 0.0], policy_mask=[1, 0],
                finished=True, reward=0.0)
    t.compute_values()
    return t


@pytest.mark.parametrize("max_tokens", [4096, 12])
def test_node_ends_are_each_prefix_last_token(max_tokens):
    """Every node of every tree is listed (once per unit holding it: a tree split at 12
    tokens repeats its upper nodes), and the tokens its listed end sees under the packed
    attention (j <= i < subtree_end[j]) are its prefix's, in order: its final hidden state
    is the node's feature, as a forward of the prefix alone would give it."""
    trees = hand_trees()
    seqs = sequences(trees, "grpo")
    units = [u for tr in trees
             for u in update_units(tr, [s for s in seqs if s.tree_id == tr.tree_id], max_tokens)]
    by_id = {t.tree_id: t for t in trees}
    listed = []
    for rows in pack_rows([len(u) for u in units], max_tokens):
        mb = collate_units([[units[j] for j in row] for row in rows], pad_id=0)
        assert len(mb["node_keys"]) == len(mb["node_ends"]) == sum(
            len(units[j].last) for row in rows for j in row)
        for (tree_id, node_id), (r, i) in zip(mb["node_keys"], mb["node_ends"].tolist()):
            seen = [int(mb["input_ids"][r, j]) for j in range(i + 1)
                    if i < mb["subtree_end"][r, j]]
            assert seen == by_id[tree_id].prefix_ids(node_id)
            listed.append((tree_id, node_id))
    assert set(listed) == {(t.tree_id, n.id) for t in trees for n in t.nodes}
    assert (len(listed) > len(set(listed))) == (max_tokens == 12)


def test_layout_by_hand():
    """Tree: root [1 2] - n1 [3 4] - {n2 [5], n3 [6 7]}, n1 and n3 policy tokens.
    Depth-first: 1 2 3 4 5 6 7; positions 0 1 2 3 4 4 5 (n3 starts where n2 did, along its
    own path); n2's token 5 (index 4) is seen by itself only, so n3's tokens (5, 6) do not
    see it; the first token of n2 and of n3 are both predicted by n1's last token (index 3).
    """
    t = small_tree()
    u = layout(t, [2, 3])
    assert u.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert u.position_ids.tolist() == [0, 1, 2, 3, 4, 4, 5]
    assert u.subtree_end.tolist() == [7, 7, 7, 7, 5, 7, 7]
    assert u.prev.tolist() == [0, 0, 1, 2, 3, 3, 5]
    assert u.last == {0: 1, 1: 3, 2: 4, 3: 6}
    mask = tree_attention_mask(torch.from_numpy(u.subtree_end)[None])[0, 0].int()
    assert mask.tolist() == [[1, 0, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0, 0],
                             [1, 1, 1, 0, 0, 0, 0],
                             [1, 1, 1, 1, 0, 0, 0],
                             [1, 1, 1, 1, 1, 0, 0],
                             [1, 1, 1, 1, 0, 1, 0],
                             [1, 1, 1, 1, 0, 1, 1]]


def test_weights_by_hand():
    """Leaves of the tree above with GRPO advantages +0.7071 (reward 1) and -0.7071 (reward
    0): n1's two shared tokens carry count 2, adv_pos 0.7071, adv_neg -0.7071, one of each;
    n2's token only the success, n3's policy token only the failure."""
    t = small_tree()
    (u,) = update_units(t, sequences([t], "grpo"), 100)
    a = 1 / np.sqrt(2)
    np.testing.assert_allclose(u.weights["count"], [0, 0, 2, 2, 1, 1, 0])
    np.testing.assert_allclose(u.weights["adv_pos"], [0, 0, a, a, a, 0, 0], rtol=1e-5)
    np.testing.assert_allclose(u.weights["adv_neg"], [0, 0, -a, -a, 0, -a, 0], rtol=1e-5)
    np.testing.assert_allclose(u.weights["n_pos"], [0, 0, 1, 1, 1, 0, 0])
    np.testing.assert_allclose(u.weights["n_neg"], [0, 0, 1, 1, 0, 1, 0])
    np.testing.assert_allclose(u.old_logprobs, [0, 0, -1.0, -2.0, -1.5, -0.5, 0])


def test_pack_rows_shares_rows_within_budget():
    lengths = [10, 3, 4, 9, 2, 6, 1, 12]
    batches = pack_rows(lengths, 24)
    seen = sorted(i for mb in batches for row in mb for i in row)
    assert seen == list(range(len(lengths)))
    for mb in batches:
        width = max(lengths[i] for row in mb for i in row)
        assert len(mb) * width <= 24
        assert all(sum(lengths[i] for i in row) <= width for row in mb)
    assert pack_rows([30, 2], 24) == [[[0]], [[1]]]  # over budget: alone


def test_split_ends_keeps_whole_subtrees_and_every_end():
    """Brute force over budgets: every part fits unless it is one path, parts cover every
    leaf once, in depth-first order."""
    a = hand_trees()[0]
    leaves = [n.id for n in a.leaves()]
    dfs = layout(a, leaves).last  # depth-first order of nodes
    order = [i for i in dfs if i in leaves]
    for budget in range(1, unique_tokens(a) + 2):
        parts = split_ends(a, leaves, budget)
        assert [e for p in parts for e in p] == order
        for p in parts:
            assert len(layout(a, p)) <= budget or len(p) == 1
    assert split_ends(a, leaves, unique_tokens(a)) == [order]


def test_packed_features_equal_each_prefix_alone(model_state):
    """Every node's feature is the last hidden state of its prefix forwarded alone, whatever
    the batch budget (trees split), and known nodes are kept as given."""
    model = policy(model_state)
    trees = hand_trees()
    bare = RolloutTree.new("bare", "q", ["x"], [4, 5, 6])  # a root nothing was sampled from
    trees.append(bare)
    want = {}
    with torch.no_grad():
        for t in trees:
            for n in t.nodes:
                ids = torch.tensor([t.prefix_ids(n.id)])
                want[(t.tree_id, n.id)] = model.model(input_ids=ids).last_hidden_state[0, -1]
    for budget in (4096, 20):
        got = node_features(model, trees, batch_tokens=budget)
        assert got.keys() == want.keys()
        for k, v in want.items():
            torch.testing.assert_close(got[k].double(), v.float().double(), rtol=1e-6,
                                       atol=1e-6, msg=str(k))
    known = {("a", 2): torch.full((64,), 7.0)}
    got = node_features(model, trees, batch_tokens=4096, known=known)
    assert torch.equal(got[("a", 2)], known[("a", 2)])


def test_ppo_epochs_pass_over_every_tree_each_time_in_fresh_splits():
    """The step's packed mini-batches (``training.batches``): each pass holds every (leaf,
    token) pair once, whole trees per mini-batch, split afresh each pass; the divisor is the
    pass's pairs."""
    from trace_lightning.rollout.step import RolloutStep
    from trace_lightning.training.batches import step_minibatches
    from trace_lightning.tree import Budget

    trees = [t for seed in range(4) for t in hand_trees(seed)]
    for i, t in enumerate(trees):
        t.tree_id = f"{t.tree_id}{i}"
        t.root.token_ids[0] = 30 + i  # the first token names the tree
    seqs = sequences(trees, "tree_grpo")
    step = RolloutStep(epoch=3, trees=trees, candidates=12, root_plan=[1] * 12,
                       sequences=seqs, budget=Budget(leaves=len(seqs)))
    batches = step_minibatches(step, pad=0, minibatches=2, ppo_epochs=3, max_tokens=8192,
                               tree_packing=True, temperature=1.0)
    assert len(batches) == 6
    pairs = sum(sum(s.policy_mask) for s in seqs)
    unique = sum(unique_tokens(t) for t in trees)
    for e in range(3):
        one_pass = batches[2 * e: 2 * e + 2]
        assert sum(b["n_tokens"] for b in one_pass) == pairs
        assert sum(float(mb["count"].sum()) for b in one_pass for mb in b["micro"]) == pairs
        real = sum(int((mb["input_ids"] != 0).sum()) for b in one_pass for mb in b["micro"])
        assert real == unique  # every token of every tree once (token ids are >= 1, pad 0)
    def firsts(batch):  # the trees of a mini-batch, by the first token of each unit
        return sorted(int(mb["input_ids"][r, o]) - 30 for mb in batch["micro"]
                      for r, o in mb["offsets"].tolist())

    for e in range(3):
        assert sorted(firsts(batches[2 * e]) + firsts(batches[2 * e + 1])) == list(range(12))
    assert len({tuple(firsts(batches[2 * e])) for e in range(3)}) > 1  # split afresh
    # every node is read in every pass (the predictor's features)
    every = {(t.tree_id, n.id) for t in trees for n in t.nodes}
    for e in range(3):
        assert {tuple(k) for b in batches[2 * e: 2 * e + 2] for mb in b["micro"]
                for k in mb["node_keys"]} == every


@pytest.mark.slow
def test_flex_attention_block_mask_gives_the_sdpa_mask_log_probs(model_state):
    """On CUDA, "auto" attention is FlexAttention with a block mask of the same tree; its
    forward runs on CPU too (its backward does not), so the mask is checked here: the same
    log-probs as the SDPA mask's (compiling it takes about 30 s)."""
    from trace_lightning.training.module import flex_attention_available

    if not flex_attention_available():
        pytest.skip("this torch/transformers has no FlexAttention")
    trees = hand_trees()
    mb = packed_micro(trees, sequences(trees, "grpo"), 4096)[0]
    model = policy(model_state, torch.float32)
    with torch.no_grad():
        want, _ = TraceModule._logprobs(model, mb)
        model.set_attn_implementation("flex_attention")
        got, _ = TraceModule._logprobs(model, mb)
    assert model.config._attn_implementation == "flex_attention"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_attention_auto_is_per_node_sdpa_on_cpu_and_a_bad_kind_is_named(tmp_path):
    module = TraceModule(policy_path=str(tmp_path))
    assert module.attention_implementation() == TREE_SDPA  # no CUDA device here
    assert TraceModule(policy_path=str(tmp_path),
                       attention="sdpa").attention_implementation() == TREE_SDPA
    with pytest.raises(ValueError, match=r"--model.attention \('flash'\)"):
        TraceModule(policy_path=str(tmp_path), attention="flash")


def test_search_r1_shaped_trees_of_the_update_benchmark():
    """benchmarks/update.py's synthetic trees: a 300-token prompt, bare rollouts of 3 turns of
    100 generated + 450 observation tokens, 4 per prompt plus one continuation each from
    one of its prefixes; every leaf path 1,950 tokens."""
    import importlib.util

    from builders import REPO

    spec = importlib.util.spec_from_file_location("bench_update",
                                                  REPO / "benchmarks" / "update.py")
    update = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(update)
    trees = update.search_r1_trees(vocab=97, seed=0, prompts=3)
    for t in trees:
        assert len(t.root.token_ids) == 300
        assert len(t.bare_rollouts()) == 4 and len(t.leaves()) == 8
        for s in t.flatten():
            assert len(s.input_ids) == 1950 and sum(s.policy_mask) == 300
        for n in t.nodes[1:]:
            assert n.policy_mask == [1] * 100 + [0] * 450
        # 4 x 1,650 bare tokens + the prompt, and each continuation 550 or 1,100 more
        assert 300 + 4 * 1650 + 4 * 550 <= unique_tokens(t) <= 300 + 4 * 1650 + 4 * 1100
