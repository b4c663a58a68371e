"""The rollout tree on random trees: values vs. a brute-force walk, flattening, prefixes,
and the JSONL round trip. Pure Python, no engine."""

from __future__ import annotations

import json
import random
import re

import pytest

from trace_lightning.tree import Budget, RolloutTree, bare_rewards, read_jsonl, write_jsonl

from builders.trees import tree_with_continuations

SEEDS = list(range(8))


def random_tree(seed: int, open_ends: bool = False) -> RolloutTree:
    """A random tree: 1-4 bare rollouts, depth up to 4, branching up to 3, rewards in {0, 1}.

    Every token id in the tree is unique (a global counter), so a test can follow each
    token into the flattened sequences. A turn holds 1-5 policy tokens and, when it is not
    a leaf, 0-6 observation tokens (an answer turn has none). With ``open_ends`` some inner
    nodes are left without children, as in a tree under construction.
    """
    rng = random.Random(seed)
    counter = iter(range(10_000, 10**9))
    prompt = [next(counter) for _ in range(rng.randint(1, 8))]
    tree = RolloutTree.new(f"t{seed}", f"question {seed}?", ["yes", "Yes."], prompt,
                           prompt_text=f"prompt {seed}", dataset="hotpotqa")

    def turn(parent: int, rollout: int | None, depth: int) -> None:
        leaf = depth >= 4 or rng.random() < 0.35
        n_pol = rng.randint(1, 5)
        n_obs = 0 if leaf else rng.randint(0, 6)
        ids = [next(counter) for _ in range(n_pol + n_obs)]
        node = tree.add_child(
            parent, rollout=rollout, token_ids=ids,
            logprobs=[-rng.uniform(0.01, 5.0) for _ in range(n_pol)] + [0.0] * n_obs,
            policy_mask=[1] * n_pol + [0] * n_obs,
            text=f"turn {len(tree.nodes)} ünïcode", observation="obs" * n_obs,
            action="answer" if leaf else "search", argument="q",
            finished=leaf, finish_reason="answer" if leaf else "",
            reward=float(rng.randint(0, 1)) if leaf else None)
        if leaf:
            node.metrics = {"em": node.reward, "f1": node.reward}
            return
        if open_ends and rng.random() < 0.2:
            return  # an inner node whose continuations were not sampled yet
        for _ in range(rng.randint(1, 3)):
            turn(node.id, None, depth + 1)

    for r in range(rng.randint(1, 4)):
        turn(0, r, 1)
    return tree


def descendants(tree: RolloutTree, node_id: int) -> list[int]:
    """Brute force: ``node_id`` and everything below it, by walking ``children``."""
    out, stack = [], [node_id]
    while stack:
        i = stack.pop()
        out.append(i)
        stack.extend(tree.nodes[i].children)
    return out


@pytest.mark.parametrize("open_ends", [False, True])
@pytest.mark.parametrize("seed", SEEDS)
def test_values_match_brute_force(seed, open_ends):
    tree = random_tree(seed, open_ends)
    tree.compute_values()
    for node in tree.nodes:
        leaves = [tree.nodes[i] for i in descendants(tree, node.id) if tree.nodes[i].finished]
        assert node.n_leaves == len(leaves)
        if leaves:
            assert node.value == pytest.approx(sum(n.reward for n in leaves) / len(leaves),
                                               abs=1e-12)
        else:
            assert node.value is None  # only an open end mid-construction
    assert tree.root.n_leaves == len(tree.leaves())


def test_values_hand_checked():
    # root -> a (search) -> {a1: reward 1, a2: reward 0}; root -> b: reward 1
    # a: n_leaves 2, value 1/2; root: n_leaves 3, value (1 + 0 + 1) / 3 = 2/3
    tree = RolloutTree.new("h", "q", ["x"], [1, 2])
    kw = dict(token_ids=[3], logprobs=[-0.5], policy_mask=[1])
    a = tree.add_child(0, rollout=0, **kw)
    tree.add_child(a.id, finished=True, reward=1.0, **kw)
    tree.add_child(a.id, finished=True, reward=0.0, **kw)
    tree.add_child(0, rollout=1, finished=True, reward=1.0, **kw)
    tree.compute_values()
    assert (a.n_leaves, a.value) == (2, 0.5)
    assert tree.root.n_leaves == 3
    assert tree.root.value == pytest.approx(2 / 3, abs=1e-12)
    assert tree.mixed


@pytest.mark.parametrize("seed", SEEDS)
def test_flatten_one_sequence_per_leaf(seed):
    tree = random_tree(seed, open_ends=True)
    seqs = tree.flatten()
    leaves = tree.leaves()
    assert [s.leaf_id for s in seqs] == [n.id for n in leaves]
    policy_owner = {}  # token id -> node id, for every policy token of the tree
    for node in tree.nodes:
        for t, m in zip(node.token_ids, node.policy_mask):
            if m:
                policy_owner[t] = node.id
    for seq, leaf in zip(seqs, leaves):
        path = tree.path(leaf.id)
        assert seq.ancestors == [n.id for n in path] and path[0].id == 0
        assert seq.rollout == leaf.rollout and seq.reward == leaf.reward
        assert seq.tree_id == tree.tree_id
        assert seq.input_ids == [t for n in path for t in n.token_ids]
        assert len(seq.input_ids) == len(seq.policy_mask) == len(seq.logprobs)
        # masks: exactly the path's policy tokens, never a prompt or observation token
        masked = [t for t, m in zip(seq.input_ids, seq.policy_mask) if m]
        assert masked == [t for n in path for t, m in zip(n.token_ids, n.policy_mask) if m]
        assert seq.policy_mask[:len(tree.root.token_ids)] == [0] * len(tree.root.token_ids)
        assert all(policy_owner.get(t) is None for t, m in zip(seq.input_ids, seq.policy_mask)
                   if not m)
        # log-probs: the node's behaviour log-prob on policy tokens, 0.0 elsewhere
        assert seq.logprobs == [x for n in path for x in n.logprobs]
        assert all(x == 0.0 for x, m in zip(seq.logprobs, seq.policy_mask) if not m)
        assert all(x < 0.0 for x, m in zip(seq.logprobs, seq.policy_mask) if m)
    # each policy token appears exactly once in each leaf below its node, nowhere else
    for t, owner in policy_owner.items():
        below = set(descendants(tree, owner))
        for seq in seqs:
            want = 1 if seq.leaf_id in below else 0
            assert seq.input_ids.count(t) == want
            if want:
                assert seq.policy_mask[seq.input_ids.index(t)] == 1


@pytest.mark.parametrize("seed", SEEDS)
def test_prefixes_and_prefix_ids(seed):
    tree = random_tree(seed, open_ends=True)
    want = {n.id for n in tree.nodes if n.parent is not None and not n.finished}
    assert {n.id for n in tree.prefixes()} == want
    seqs = {s.leaf_id: s for s in tree.flatten()}
    for node in tree.nodes:
        prefix = tree.prefix_ids(node.id)
        assert prefix == [t for n in tree.path(node.id) for t in n.token_ids]
        for i in descendants(tree, node.id):
            if tree.nodes[i].finished:
                assert seqs[i].input_ids[:len(prefix)] == prefix
    # bare rollouts in rollout order; every node keeps its bare rollout's index
    assert [tree.nodes[i].rollout for i in tree.bare_rollouts()] == sorted(
        tree.nodes[i].rollout for i in tree.root.children)
    for b in tree.bare_rollouts():
        assert {tree.nodes[i].rollout for i in descendants(tree, b)} == {tree.nodes[b].rollout}


@pytest.mark.parametrize("rewards, mixed", [
    ([], False), ([0.0], False), ([0.0, 0.0, 0.0], False), ([1.0, 1.0], False),
    ([0.0, 1.0], True), ([1.0, 0.0, 0.0], True),
])
def test_mixed(rewards, mixed):
    tree = RolloutTree.new("m", "q", ["x"], [1])
    for r, reward in enumerate(rewards):
        tree.add_child(0, rollout=r, token_ids=[2], logprobs=[-1.0], policy_mask=[1],
                       finished=True, reward=reward)
    assert tree.mixed is mixed


def test_add_child_invariants():
    tree = RolloutTree.new("i", "q", ["x"], [1, 2, 3])
    assert tree.root.policy_mask == [0, 0, 0] and tree.root.logprobs == [0.0] * 3
    with pytest.raises(AssertionError, match="explicit rollout"):
        tree.add_child(0, token_ids=[4], logprobs=[-1.0], policy_mask=[1])
    leaf = tree.add_child(0, rollout=0, token_ids=[4], logprobs=[-1.0], policy_mask=[1],
                          finished=True, reward=0.0)
    with pytest.raises(AssertionError, match="is a leaf"):
        tree.add_child(leaf.id, token_ids=[5], logprobs=[-1.0], policy_mask=[1])
    with pytest.raises(AssertionError):  # lengths of ids, log-probs and mask must agree
        tree.add_child(0, rollout=1, token_ids=[5, 6], logprobs=[-1.0], policy_mask=[1, 0])


def test_jsonl_round_trip_is_lossless_and_atomic(tmp_path):
    trees = [random_tree(s, open_ends=bool(s % 2)) for s in SEEDS]
    for t in trees[::2]:
        t.compute_values()
    trees[0].nodes[1].prediction = 0.123456789012345
    trees[0].nodes[1].continuations = 3
    trees[1].budget = Budget(leaves=7, generated_tokens=123, prefill_tokens=4567,
                             cached_tokens=4000, tool_calls=5)
    trees[2].question = 'Was "Weird Al" Yankovic born in 東京?\nno'
    path = tmp_path / "trees" / "epoch_0.jsonl"  # the folder does not exist yet
    write_jsonl(trees, path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["epoch_0.jsonl"]  # no .tmp left
    assert len(path.read_text().splitlines()) == len(trees)  # one tree per line
    back = list(read_jsonl(path))
    assert back == trees  # dataclass equality: every field of every node and the budget
    # overwriting replaces the file as a whole
    write_jsonl(trees[:2], path)
    assert list(read_jsonl(path)) == trees[:2]
    assert sorted(p.name for p in path.parent.iterdir()) == ["epoch_0.jsonl"]


def test_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "trees.jsonl"
    good = [random_tree(0)]
    write_jsonl(good, path)
    bad = random_tree(1)
    bad.nodes[1].prediction = object()  # not JSON-serialisable: the write fails midway
    with pytest.raises(TypeError):
        write_jsonl([random_tree(2), bad], path)
    assert list(read_jsonl(path)) == good  # the old file is intact, never half-written


def test_failed_write_leaves_no_temp_file(tmp_path):
    path = tmp_path / "trees.jsonl"
    bad = random_tree(1)
    bad.nodes[1].prediction = object()
    with pytest.raises(TypeError):
        write_jsonl([bad], path)
    assert list(tmp_path.iterdir()) == []


def _bad_line_cases():
    ok = pytest.param
    return [
        ok("{not json", id="not-json"),
        ok('{"tree_id": "x"}', id="missing-fields"),
        ok("null", id="null"),
        ok("42", id="number"),
        ok('{"tree_id": "x", "question": "q", "answers": [], "nodes": [{"bogus": 1}], '
           '"budget": {}}', id="bad-node"),
        ok('{"tree_id": "x", "question": "q", "answers": [], "nodes": [], '
           '"budget": {"leaves": 1, "bogus": 2}}', id="bad-budget"),
        ok('{"tree_id": "x", "question": "q", "answers": [], "nodes": [], "budget": {}, '
           '"extra": 1}', id="unknown-field"),
        ok('"a JSON string"', id="json-string"),
        ok("[[1, 2, 3]]", id="list-of-triples"),
    ]


@pytest.mark.parametrize("bad", _bad_line_cases())
def test_read_jsonl_names_file_and_line(tmp_path, bad):
    path = tmp_path / "trees.jsonl"
    write_jsonl([random_tree(0), random_tree(1)], path)
    with open(path, "a") as f:
        f.write("\n" + bad + "\n")  # a blank line 3 (skipped), the bad tree on line 4
    reader = read_jsonl(path)
    assert next(reader) == random_tree(0)
    assert next(reader) == random_tree(1)
    with pytest.raises(ValueError, match=re.escape(f"{path}:4 is not a rollout tree")):
        next(reader)


def test_read_jsonl_missing_file(tmp_path):
    missing = tmp_path / "no" / "epoch_0.jsonl"
    with pytest.raises(FileNotFoundError, match="does not exist") as err:
        list(read_jsonl(missing))
    assert str(missing) in str(err.value) and "write_jsonl" in str(err.value)


def test_to_dict_is_plain_json():
    tree = random_tree(3)
    tree.compute_values()
    d = json.loads(json.dumps(tree.to_dict()))
    assert RolloutTree.from_dict(d) == tree
    assert set(d) == {"tree_id", "question", "answers", "dataset", "nodes", "budget",
                      "prompt_features"}
    # a tree written before prompts were described reads back with none
    del d["prompt_features"]
    assert RolloutTree.from_dict(d) == tree


def test_a_node_field_the_tree_does_not_know_is_one_clear_error():
    d = json.loads(json.dumps(random_tree(2).to_dict()))
    d["nodes"][1]["em"] = 1.0  # a field of another version's nodes
    with pytest.raises(ValueError, match=r"has node fields \['em'\] that RolloutTree's nodes "
                                         r"do not have: it was written by another version"):
        RolloutTree.from_dict(d)


def test_bare_rewards_follow_each_bare_rollout_not_its_continuations():
    # bare paths end at a1 (0), b1 (1) and c (0); the continuations a2, b2 (both 1) are not
    assert bare_rewards(tree_with_continuations()) == [0.0, 1.0, 0.0]
    assert bare_rewards(RolloutTree.new("q", "q?", ["x"], [1])) == []
