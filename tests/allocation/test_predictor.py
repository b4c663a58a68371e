"""The shared success predictor: featurisers, model, targets, replay, and that it learns."""

from __future__ import annotations

import copy
import io
import random
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from trace_lightning.math.calibration import brier_skill
from trace_lightning.allocation.features import (
    CONFIDENCE_DIM, Featuriser, bag_node_features, confidence_features, confidence_of,
    node_features, prompt_features,
)
from trace_lightning.allocation.predictor import (
    PredictorBatch,
    ReplayBuffer,
    SuccessPredictor,
    fit_predictor,
    node_targets,
    predict_nodes,
    prompt_group,
    training_batch,
    weighted_squared_error,
)
from trace_lightning.tree import RolloutTree, write_jsonl
from launch import leave_group

A, B, SEP, EOP = 1, 2, 3, 4  # key tokens, end of observation, end of prompt; filler 8..63


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread is faster, and far faster on a busy shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def policy() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=256)
    return Qwen3ForCausalLM(cfg).eval()


def _filler(rng: random.Random, k: int) -> list[int]:
    return [rng.randrange(8, 64) for _ in range(k)]


def _turn(rng: random.Random, key: int | None = None, reps: int = 3, **fields) -> dict:
    """A turn: policy tokens (with ``reps`` copies of ``key``), then an observation ending in SEP."""
    act = _filler(rng, rng.randrange(3, 7))
    if key is not None:
        i = rng.randrange(len(act) + 1)
        act[i:i] = [key] * reps
    obs = _filler(rng, rng.randrange(2, 5)) + [SEP]
    return dict(token_ids=act + obs, logprobs=[0.0] * (len(act) + len(obs)),
                policy_mask=[1] * len(act) + [0] * len(obs), **fields)


def key_world(n: int, seed: int, informative: bool = True) -> list[RolloutTree]:
    """Trees whose success is visible in the prefix.

    A key token (A or B, three copies) sits in the prompt (2/3 of trees) or else in each bare
    rollout's first turn; reward ~ Bernoulli(0.9) after A and Bernoulli(0.1) after B. Each
    first turn gets 3 answer leaves. With ``informative=False`` rewards ignore the key.
    """
    rng = random.Random(seed)
    trees = []
    for i in range(n):
        prompt_key = rng.choice([A, B, None])
        prompt = _filler(rng, rng.randrange(4, 8))
        if prompt_key is not None:
            j = rng.randrange(len(prompt) + 1)
            prompt[j:j] = [prompt_key] * 3
        tree = RolloutTree.new(f"{seed}-{i}", "q", ["a"], prompt + [EOP])
        for r in range(2):
            key = prompt_key or rng.choice([A, B])
            first = tree.add_child(0, rollout=r, **_turn(rng, None if prompt_key else key))
            for _ in range(3):
                p = (0.9 if key == A else 0.1) if informative else 0.5
                tree.add_child(first.id, finished=True, reward=float(rng.random() < p),
                               **_turn(rng))
        tree.compute_values()
        trees.append(tree)
    return trees


def branched_trees() -> list[RolloutTree]:
    """A tree with continuations and an unfinished prefix, and a bare root."""
    rng = random.Random(7)
    t = RolloutTree.new("t", "q", ["a"], _filler(rng, 5) + [EOP])
    a = t.add_child(0, rollout=0, **_turn(rng, A))
    b = t.add_child(a.id, **_turn(rng))
    t.add_child(b.id, finished=True, reward=1.0, **_turn(rng))
    t.add_child(a.id, finished=True, reward=0.0, **_turn(rng))  # continuation from turn 1
    c = t.add_child(b.id, **_turn(rng))  # continuation from turn 2, not finished yet
    t.add_child(0, rollout=1, finished=True, reward=0.0, **_turn(rng, B))
    assert c.children == []
    bare = RolloutTree.new("bare", "q", ["a"], _filler(rng, 9) + [EOP])
    for tree in (t, bare):
        tree.compute_values()
    return [t, bare]


# ---- featurisers ---------------------------------------------------------------------------
def test_one_pass_gives_every_prefix(policy):
    """Each node's feature equals a separate forward over exactly its prefix."""
    trees = branched_trees()
    policy.train()  # node_features must switch to eval and restore the mode
    feats = node_features(policy, trees, batch_tokens=40)  # small: several padded batches
    assert policy.training
    policy.eval()
    assert set(feats) == {(t.tree_id, n.id) for t in trees for n in t.nodes}
    with torch.no_grad():
        for tree in trees:
            for n in tree.nodes:
                ids = torch.tensor([tree.prefix_ids(n.id)])  # (1, T)
                ref = policy(ids, output_hidden_states=True).hidden_states[-1][0, -1]  # (D,)
                f = feats[(tree.tree_id, n.id)]
                assert f.dtype == torch.float32 and not f.requires_grad and f.shape == (32,)
                torch.testing.assert_close(f, ref, atol=1e-5, rtol=0)
    # candidate prompts read the same state as the roots they become
    roots = prompt_features(policy, [t.root.token_ids for t in trees], batch_tokens=40)  # (2, D)
    for i, t in enumerate(trees):
        torch.testing.assert_close(roots[i], feats[(t.tree_id, 0)], atol=1e-5, rtol=0)


def test_known_features_are_not_recomputed(policy):
    trees = branched_trees()
    marker = torch.full((32,), 7.0)
    known = {("t", 0): marker, ("t", 1): marker, ("bare", 0): marker}
    feats = node_features(policy, trees, batch_tokens=4096, known=known)
    assert feats[("t", 0)] is marker and feats[("bare", 0)] is marker
    full = node_features(policy, trees, batch_tokens=4096)
    torch.testing.assert_close(feats[("t", 2)], full[("t", 2)], atol=1e-6, rtol=0)


def test_bag_of_tokens_features():
    trees = branched_trees()
    fz = Featuriser("bag_of_tokens", buckets=16)
    feats = fz.nodes(None, trees)
    for tree in trees:
        for n in tree.nodes:
            f = feats[(tree.tree_id, n.id)]
            assert f.shape == (16,)
            assert f.sum().item() == pytest.approx(1.0)
            # the bag of the prefix, built incrementally, equals the bag of its token ids
            direct = fz.prompts(None, [tree.prefix_ids(n.id)])[0]  # (16,)
            torch.testing.assert_close(f, direct)
    assert fz.feature_dim(None) == 16
    assert bag_node_features(trees, 16).keys() == feats.keys()


def test_task_features_follow_every_node_of_their_prompt(policy):
    trees = branched_trees()
    trees[0].prompt_features, trees[1].prompt_features = [0.5, 1.0, 0.0], [0.0, 0.25, 1.0]
    fz = Featuriser("hidden", batch_tokens=40, task_features=3)
    assert fz.feature_dim(policy.config) == 32 + 3
    feats, hidden = fz.nodes(policy, trees), node_features(policy, trees, batch_tokens=40)
    for tree in trees:
        for n in tree.nodes:
            k = (tree.tree_id, n.id)
            torch.testing.assert_close(feats[k], torch.cat(
                [hidden[k], torch.tensor(tree.prompt_features)]))
    # after the confidence numbers when both are on; known features come back unchanged
    both = Featuriser("bag_of_tokens", buckets=16, confidence=True, task_features=3)
    assert both.feature_dim(None) == 16 + CONFIDENCE_DIM + 3
    f = both.nodes(None, trees)[("t", 2)]
    torch.testing.assert_close(f[16:16 + CONFIDENCE_DIM], confidence_features(trees)[("t", 2)])
    torch.testing.assert_close(f[-3:], torch.tensor([0.5, 1.0, 0.0]))
    marker = torch.full((16 + CONFIDENCE_DIM + 3,), 7.0)
    assert both.nodes(None, trees, known={("t", 1): marker})[("t", 1)] is marker
    # a tree with another count (a task that describes no prompts: none) names the flag
    trees[1].prompt_features = []
    with pytest.raises(ValueError, match=r"tree bare carries 0 prompt features but "
                                         r"--model.featuriser.task_features is 3"):
        fz.nodes(policy, trees)
    with pytest.raises(ValueError, match="no trees to read"):
        fz.prompts(policy, [trees[0].root.token_ids])


def test_featuriser_rejects_unknown_kind():
    with pytest.raises(ValueError, match="expected one of"):
        Featuriser("logits")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="confidence.*true or false"):
        Featuriser(confidence="yes")  # type: ignore[arg-type]
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="task_features .* must be a count >= 0"):
            Featuriser(task_features=bad)  # type: ignore[arg-type]


def test_confidence_of_by_hand():
    # turn 1: log-probs -0.1, -0.3 (mean -0.2); turn 2: -1.0, -0.2, -0.9 (mean -0.7)
    # all five: mean -2.5 / 5 = -0.5; below log(1/2) = -0.693: -1.0 and -0.9, so 2 / 5
    got = confidence_of([[-0.1, -0.3], [], [-1.0, -0.2, -0.9]])  # the empty turn is skipped
    torch.testing.assert_close(got, torch.tensor([-0.5, -0.7, -0.7, 0.4]))
    torch.testing.assert_close(confidence_of([[-0.2, -0.4]]),
                               torch.tensor([-0.3, -0.3, -0.3, 0.0]))
    torch.testing.assert_close(confidence_of([]), torch.zeros(CONFIDENCE_DIM))


def _with_logprobs(trees: list[RolloutTree], seed: int) -> list[RolloutTree]:
    """``trees`` with random log-probs on policy tokens (and nonzero junk on observations,
    which the statistics must ignore)."""
    rng = random.Random(seed)
    for t in trees:
        for n in t.nodes:
            n.logprobs = [-rng.random() * 2 if m else -5.0 for m in n.policy_mask]
    return trees


def test_confidence_features_read_each_prefix_path(policy):
    trees = _with_logprobs(branched_trees(), seed=3)
    conf = confidence_features(trees)
    assert set(conf) == {(t.tree_id, n.id) for t in trees for n in t.nodes}
    for tree in trees:
        for n in tree.nodes:  # brute force: the path's turns, read from scratch
            turns = [[lp for lp, m in zip(p.logprobs, p.policy_mask) if m]
                     for p in tree.path(n.id)[1:]]
            torch.testing.assert_close(conf[(tree.tree_id, n.id)], confidence_of(turns))
        assert conf[(tree.tree_id, 0)].eq(0).all()  # a root has no turns
    # the featuriser appends them to the hidden state; candidate prompts get a root's zeros
    fz = Featuriser("hidden", batch_tokens=40, confidence=True)
    assert fz.feature_dim(policy.config) == 32 + CONFIDENCE_DIM
    feats, hidden = fz.nodes(policy, trees), node_features(policy, trees, batch_tokens=40)
    for k, f in feats.items():
        assert f.shape == (32 + CONFIDENCE_DIM,)
        torch.testing.assert_close(f, torch.cat([hidden[k], conf[k]]))
    roots = fz.prompts(policy, [t.root.token_ids for t in trees])  # (2, 36)
    for i, t in enumerate(trees):
        torch.testing.assert_close(roots[i], feats[(t.tree_id, 0)], atol=1e-5, rtol=0)
    # known features (this step's, already with their confidence) come back unchanged
    marker = torch.full((32 + CONFIDENCE_DIM,), 7.0)
    assert fz.nodes(policy, trees, known={("t", 1): marker})[("t", 1)] is marker
    bag = Featuriser("bag_of_tokens", buckets=16, confidence=True)
    assert bag.feature_dim(None) == 16 + CONFIDENCE_DIM
    torch.testing.assert_close(bag.nodes(None, trees)[("t", 2)][16:], conf[("t", 2)])


# ---- model, targets, fitting ---------------------------------------------------------------
def test_predictor_shapes_and_initial_half():
    pred = SuccessPredictor(feature_dim=8, hidden=16, max_depth=4)
    x, depth = torch.randn(5, 8), torch.tensor([0, 1, 2, 4, 9])  # depth 9 clamps to 4
    p = pred(x, depth)  # (5,)
    assert p.shape == (5,)
    torch.testing.assert_close(p, torch.full((5,), 0.5))
    assert pred.predict(x, depth).requires_grad is False


def test_fit_decreases_weighted_loss_on_separable_set():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 6, generator=gen) * 5 + 3  # (N, D) off-centre, large scale
    y = (x[:, 0] > 3).float()  # (N,)
    w = torch.randint(1, 5, (256,), generator=gen).float()  # (N,)
    buf = ReplayBuffer(max_steps=1)
    buf.add(PredictorBatch(x, torch.zeros(256, dtype=torch.long), y, w, torch.arange(256)))
    torch.manual_seed(0)
    pred = SuccessPredictor(6, hidden=32)
    opt = torch.optim.AdamW(pred.parameters(), lr=3e-3)
    stats = fit_predictor(pred, opt, buf, epochs=30, batch_size=32, generator=gen, holdout=0.0)
    # the constant 0.5 start costs exactly 0.25
    assert stats["predictor/loss_before"] == pytest.approx(0.25, abs=1e-6)
    assert stats["predictor/loss"] < 0.05
    assert stats["predictor/updates"] == 30 * 8
    assert stats["predictor/epochs_kept"] == 30 and "predictor/holdout_loss" not in stats
    p = pred.predict(x, torch.zeros(256))
    assert weighted_squared_error(p, y, w).item() == pytest.approx(stats["predictor/loss"])


def test_a_diverging_fit_names_the_flag_and_leaves_the_predictor_as_it_was():
    """Without a held-out share nothing catches a fit that blows up (here an infinite lr):
    the error names --model.predictor_lr, and the predictor and its optimizer are as
    before the fit (a bare assert said "predictor loss is not finite")."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=gen)  # (N, D)
    y = (x[:, 0] > 0).float()  # (N,)
    buf = ReplayBuffer(max_steps=1)
    buf.add(PredictorBatch(x, torch.zeros(64, dtype=torch.long), y, torch.ones(64),
                           torch.arange(64)))
    pred = SuccessPredictor(6, hidden=16)
    opt = torch.optim.SGD(pred.parameters(), lr=float("inf"))
    weights = copy.deepcopy(pred.state_dict())
    with pytest.raises(FloatingPointError, match=r"the predictor's fit diverged: its loss "
                                                 r"over the replay is nan after 2 updates at "
                                                 r"learning rate inf \(--model.predictor_lr"
                                                 r"\).* Lower --model.predictor_lr"):
        fit_predictor(pred, opt, buf, epochs=1, batch_size=32, generator=gen, holdout=0.0)
    for k, v in pred.state_dict().items():
        torch.testing.assert_close(v, weights[k], atol=0, rtol=0)


def test_a_fit_that_beats_nothing_leaves_the_predictor_as_it_was():
    """Each fit first standardises the features on the replay; when no pass beats the
    predictor as it was (here: no pass at all), it keeps its old standardisation too, so its
    predictions do not move, and loss_before is the loss of the predictor that steered."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(200, 6, generator=gen)  # (N, D)
    y = (x[:, 0] > 0).float()  # (N,)
    pred = SuccessPredictor(6, hidden=16)
    opt = torch.optim.AdamW(pred.parameters(), lr=3e-3)
    group = torch.arange(200)

    def replay(feats: torch.Tensor) -> ReplayBuffer:
        buf = ReplayBuffer(max_steps=1)
        buf.add(PredictorBatch(feats, torch.zeros(200, dtype=torch.long), y, torch.ones(200),
                               group))
        return buf

    fit_predictor(pred, opt, replay(x), epochs=10, batch_size=32, generator=gen, holdout=0.0)
    shifted = x + 5.0  # the next replay's features sit elsewhere: new standardisation
    p_before = pred.predict(shifted, torch.zeros(200))
    stats = fit_predictor(pred, opt, replay(shifted), epochs=0, batch_size=32, generator=gen,
                          holdout=0.2)
    torch.testing.assert_close(pred.predict(shifted, torch.zeros(200)), p_before)
    assert stats["predictor/loss_before"] == pytest.approx(
        weighted_squared_error(p_before, y, torch.ones(200)).item())
    # without a held-out share too: a fit of no passes moves nothing
    fit_predictor(pred, opt, replay(shifted), epochs=0, batch_size=32, generator=gen,
                  holdout=0.0)
    torch.testing.assert_close(pred.predict(shifted, torch.zeros(200)), p_before)
    # passes that all make it worse (a huge lr) are undone, the optimizer's moments too:
    # the next fit's first steps would otherwise follow the discarded passes' momentum
    moments = copy.deepcopy(opt.state_dict()["state"])
    for g in opt.param_groups:
        g["lr"] = 10.0
    stats = fit_predictor(pred, opt, replay(x), epochs=3, batch_size=32, generator=gen,
                          holdout=0.2)
    assert stats["predictor/epochs_kept"] == 0
    after = opt.state_dict()["state"]
    for k in moments:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(after[k][name], moments[k][name], atol=0, rtol=0)


def test_standardisation_of_unseen_and_far_values():
    """A dimension constant over the replay (a bag-of-tokens bucket no prompt hit) keeps
    scale 1: a new prompt's 0.1 there moves the input by 0.1, not by 0.1 / 1e-6 (which
    saturated the output at 0 or 1, and a prompt at v = 0 or 1 is filtered out). Values
    beyond CLIP standard deviations count as CLIP."""
    gen = torch.Generator().manual_seed(4)
    x = torch.rand(200, 4, generator=gen)  # (N, D)
    x[:, 3] = 0.0  # never seen
    y = (x[:, 0] > 0.5).float()  # (N,)
    buf = ReplayBuffer(max_steps=1)
    buf.add(PredictorBatch(x, torch.zeros(200, dtype=torch.long), y, torch.ones(200),
                           torch.arange(200)))
    torch.manual_seed(0)
    pred = SuccessPredictor(4, hidden=16)
    fit_predictor(pred, torch.optim.AdamW(pred.parameters(), lr=3e-3), buf, epochs=5,
                  batch_size=32, generator=gen, holdout=0.0)
    assert pred.feature_std[3] == 1.0 and pred.feature_mean[3] == 0.0
    seen, new = x[:8].clone(), x[:8].clone()
    new[:, 3] = 0.1
    depth = torch.zeros(8, dtype=torch.long)
    p_seen, p_new = pred.predict(seen, depth), pred.predict(new, depth)
    assert (p_new - p_seen).abs().max() < 0.1 and ((p_new > 0.01) & (p_new < 0.99)).all()
    far, edge = x[:1].clone(), x[:1].clone()
    far[0, 1] = pred.feature_mean[1] + 100 * pred.feature_std[1]
    edge[0, 1] = pred.feature_mean[1] + SuccessPredictor.CLIP * pred.feature_std[1]
    torch.testing.assert_close(pred.logits(far, depth[:1]), pred.logits(edge, depth[:1]))


def test_early_stopping_keeps_the_predictor_from_memorising_noise():
    # outcomes independent of the features: the best a predictor can do on new nodes is the
    # mean (Brier 0.25 at p = 0.5); a long fit on all nodes memorises them instead
    gen = torch.Generator().manual_seed(1)
    x, x_new = torch.randn(200, 16, generator=gen), torch.randn(2000, 16, generator=gen)
    y = (torch.rand(200, generator=gen) < 0.5).float()
    y_new = (torch.rand(2000, generator=gen) < 0.5).float()
    buf = ReplayBuffer(max_steps=1)
    buf.add(PredictorBatch(x, torch.zeros(200, dtype=torch.long), y, torch.ones(200),
                            torch.arange(200)))

    def fit(holdout: float) -> tuple[dict, float]:
        torch.manual_seed(0)
        pred = SuccessPredictor(16, hidden=128)
        opt = torch.optim.AdamW(pred.parameters(), lr=1e-2)
        stats = fit_predictor(pred, opt, buf, epochs=40, batch_size=32,
                              generator=torch.Generator().manual_seed(0), holdout=holdout)
        p = pred.predict(x_new, torch.zeros(2000, dtype=torch.long))
        return stats, weighted_squared_error(p, y_new, torch.ones(2000)).item()

    memorised, new_loss_memorised = fit(0.0)
    stopped, new_loss_stopped = fit(0.2)
    assert memorised["predictor/loss"] < 0.15  # it fits the noise it saw...
    assert new_loss_memorised > 0.28  # ...and is worse than the mean on new nodes
    assert stopped["predictor/epochs_kept"] < 40
    assert new_loss_stopped < 0.3 < new_loss_memorised - 0.1
    assert stopped["predictor/holdout_loss"] <= 0.25 + 0.05


def test_replay_from_a_checkpoint_before_prompt_groups_loads():
    """Replay entries saved before ``group`` existed load with one group per node (the
    early-stopping holdout then splits by node), not a TypeError."""
    old = {"steps": [{"features": torch.randn(3, 4), "depth": torch.arange(3),
                      "value": torch.tensor([0.0, 0.5, 1.0]), "weight": torch.ones(3)}]}
    buf = ReplayBuffer(max_steps=2)
    buf.load_state_dict(old)
    assert buf.sample_all().group.tolist() == [0, 1, 2] and len(buf) == 3


def test_node_targets_and_predictions():
    trees = branched_trees()
    t = trees[0]
    keys, depth, value, weight = node_targets(trees)
    # root, turn 1, turn 2 of tree "t"; the unfinished turn and the bare root have no leaves
    assert keys == [("t", 0), ("t", 1), ("t", 2)]
    assert depth.tolist() == [0, 1, 2]
    assert value.tolist() == pytest.approx([1 / 3, 1 / 2, 1.0])
    assert weight.tolist() == [3.0, 2.0, 1.0]
    keys_all, *_ = node_targets(trees, include_leaves=True)
    assert len(keys_all) == 3 + len(t.leaves())
    feats = Featuriser("bag_of_tokens", buckets=8).nodes(None, trees)
    batch = training_batch(trees, feats)
    assert batch.features.shape == (3, 8)
    probs = predict_nodes(SuccessPredictor(8), trees, feats)
    # root and non-leaf turns (including the unfinished one and the bare root), no leaves
    assert set(probs) == {("t", 0), ("t", 1), ("t", 2), ("t", 5), ("bare", 0)}
    assert t.nodes[1].prediction == pytest.approx(0.5) and t.nodes[3].prediction is None


def test_replay_buffer_keeps_last_steps_and_round_trips():
    def step(v: float, n: int) -> PredictorBatch:
        return PredictorBatch(torch.randn(n, 4), torch.arange(n), torch.full((n,), v),
                              torch.ones(n), torch.arange(n))

    buf = ReplayBuffer(max_steps=2)
    for i, n in enumerate([3, 2, 4]):
        buf.add(step(float(i), n))
    data = buf.sample_all()
    assert data.value.tolist() == [1.0] * 2 + [2.0] * 4 and len(buf) == 6
    # through a checkpoint file, as Lightning would store it
    blob = io.BytesIO()
    torch.save(buf.state_dict(), blob)
    blob.seek(0)
    restored = ReplayBuffer(max_steps=2)
    restored.load_state_dict(torch.load(blob))
    for a, b in zip(restored.sample_all(), data):
        assert torch.equal(a, b) and a.dtype == b.dtype
    restored.add(step(3.0, 1))  # still keeps only the last 2 steps
    assert restored.sample_all().value.tolist() == [2.0] * 4 + [3.0]
    # the configured size applies to a resumed run, not the saved one's
    blob.seek(0)
    longer, shorter = ReplayBuffer(max_steps=5), ReplayBuffer(max_steps=1)
    longer.load_state_dict(torch.load(blob))
    blob.seek(0)
    shorter.load_state_dict(torch.load(blob))
    longer.add(step(3.0, 1))
    assert longer.sample_all().value.tolist() == [1.0] * 2 + [2.0] * 4 + [3.0]
    assert shorter.sample_all().value.tolist() == [2.0] * 4  # the newest step
    with pytest.raises(ValueError, match="max_steps"):
        ReplayBuffer(0)


# ---- acceptance: the predictor learns from prefixes -----------------------------------------
def _held_out_skill(policy, informative: bool) -> float:
    fz = Featuriser("hidden", batch_tokens=2048)
    train, test = key_world(150, seed=1, informative=informative), key_world(100, seed=2)
    buf = ReplayBuffer(max_steps=1)
    buf.add(training_batch(train, fz.nodes(policy, train)))
    torch.manual_seed(0)
    pred = SuccessPredictor(fz.feature_dim(policy.config), hidden=64)
    opt = torch.optim.AdamW(pred.parameters(), lr=3e-3, weight_decay=0.01)
    fit_predictor(pred, opt, buf, epochs=20, batch_size=64,
                  generator=torch.Generator().manual_seed(0))
    held_out = training_batch(test, fz.nodes(policy, test))
    p = pred.predict(held_out.features, held_out.depth)  # (N,)
    return brier_skill(p, held_out.value, held_out.weight)


def test_predictor_learns_from_prefixes(policy):
    """Hidden features of a random tiny Qwen3 carry the key; the predictor beats the constant.

    Measured held-out Brier skill: 0.55-0.58 over four policy init seeds (noise floor of the
    3-leaf targets caps it near 0.8). A control world where rewards ignore the key stays <= 0.
    """
    for p in policy.parameters():
        p.grad = None
    assert _held_out_skill(policy, informative=True) > 0.3
    assert _held_out_skill(policy, informative=False) < 0.1
    # features are detached: fitting never touched the policy's gradients
    assert all(p.grad is None for p in policy.parameters())


def hesitation_world(n: int, seed: int) -> list[RolloutTree]:
    """Trees whose success shows only in how sure the policy was, not in any token.

    Every token is random filler; each bare rollout's first turn is sampled confidently
    (log-prob -0.05 per token) or hesitantly (-1.5), and its 3 answer leaves succeed with
    probability 0.9 after a confident turn and 0.1 after a hesitant one.
    """
    rng = random.Random(seed)
    trees = []
    for i in range(n):
        tree = RolloutTree.new(f"{seed}-{i}", "q", ["a"], _filler(rng, 6) + [EOP])
        for r in range(2):
            sure = rng.random() < 0.5
            turn = _turn(rng)
            turn["logprobs"] = [(-0.05 if sure else -1.5) if m else 0.0
                                for m in turn["policy_mask"]]
            first = tree.add_child(0, rollout=r, **turn)
            for _ in range(3):
                tree.add_child(first.id, finished=True, reward=float(rng.random() < (
                    0.9 if sure else 0.1)), **_turn(rng))
        tree.compute_values()
        trees.append(tree)
    return trees


def test_confidence_features_carry_what_tokens_do_not():
    """In ``hesitation_world`` the tokens say nothing about success and the log-probs all of
    it: with ``confidence`` the predictor has skill on new trees, without it none."""
    def skill(confidence: bool) -> float:
        fz = Featuriser("bag_of_tokens", buckets=32, confidence=confidence)
        train, test = hesitation_world(150, seed=1), hesitation_world(100, seed=2)
        buf = ReplayBuffer(max_steps=1)
        buf.add(training_batch(train, fz.nodes(None, train)))
        torch.manual_seed(0)
        pred = SuccessPredictor(fz.feature_dim(None), hidden=32)
        opt = torch.optim.AdamW(pred.parameters(), lr=3e-3, weight_decay=0.01)
        fit_predictor(pred, opt, buf, epochs=20, batch_size=64,
                      generator=torch.Generator().manual_seed(0))
        held_out = training_batch(test, fz.nodes(None, test))
        first_turns = held_out.depth == 1  # (N,) where the log-probs differ
        p = pred.predict(held_out.features, held_out.depth)  # (N,)
        return brier_skill(p[first_turns], held_out.value[first_turns],
                           held_out.weight[first_turns])

    assert skill(confidence=True) > 0.5
    assert skill(confidence=False) < 0.1


def test_holdout_splits_by_prompt_so_memorised_questions_do_not_count():
    # 40 prompts x 5 nodes: a node's features are its prompt's random identity plus a little
    # noise, its value the prompt's coin flip. Held out by node, every held-out node's prompt
    # is also in training, so memorising prompts keeps lowering the held-out loss; held out
    # by prompt, memorising does not help and the fit stops near the constant mean (0.25 on
    # new prompts)
    gen = torch.Generator().manual_seed(2)
    ident = torch.randn(40, 16, generator=gen) * 2  # (G, D)
    group = torch.arange(40).repeat_interleave(5)  # (N,) 5 nodes per prompt
    x = ident[group] + 0.1 * torch.randn(200, 16, generator=gen)  # (N, D)
    y = (torch.rand(40, generator=gen) < 0.5).float()[group]  # (N,)
    x_new = torch.randn(2000, 16, generator=gen) * 2
    y_new = (torch.rand(2000, generator=gen) < 0.5).float()

    def fit(groups: torch.Tensor) -> tuple[dict, float]:
        buf = ReplayBuffer(max_steps=1)
        buf.add(PredictorBatch(x, torch.zeros(200, dtype=torch.long), y, torch.ones(200),
                               groups))
        torch.manual_seed(0)
        pred = SuccessPredictor(16, hidden=128)
        opt = torch.optim.AdamW(pred.parameters(), lr=1e-2)
        stats = fit_predictor(pred, opt, buf, epochs=40, batch_size=32,
                              generator=torch.Generator().manual_seed(0), holdout=0.2)
        p = pred.predict(x_new, torch.zeros(2000, dtype=torch.long))
        return stats, weighted_squared_error(p, y_new, torch.ones(2000)).item()

    by_node, new_loss_by_node = fit(torch.arange(200))
    by_prompt, new_loss_by_prompt = fit(group)
    assert by_node["predictor/holdout_loss"] < 0.15  # looks good on memorised prompts...
    assert new_loss_by_node > 0.28  # ...and is worse than the mean on new ones
    assert by_prompt["predictor/epochs_kept"] < by_node["predictor/epochs_kept"]
    assert new_loss_by_prompt < 0.28 < new_loss_by_node - 0.05


def test_training_batch_groups_nodes_by_prompt():
    trees = branched_trees()
    feats = Featuriser("bag_of_tokens", buckets=8).nodes(None, trees)
    batch = training_batch(trees, feats)
    assert batch.group.tolist() == [prompt_group("t")] * 3
    assert prompt_group("t") == prompt_group("t") != prompt_group("u")


def _uneven_ranks_worker(rank: int, world: int, out_dir: str) -> None:
    """Rank 0 holds two trees, rank 1 none (it opened no prompt): featurise under FSDP with
    per-layer wrapping, then gather the predictor entries, as ``receive_step`` does."""
    import datetime
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    from trace_lightning.collectives import all_gather_batch

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    plain = Qwen3ForCausalLM(cfg)
    policy = FSDP(Qwen3ForCausalLM(cfg), device_id=torch.device("cpu"),
                  auto_wrap_policy=ModuleWrapPolicy({Qwen3DecoderLayer}))
    policy.load_state_dict(plain.state_dict())
    head_rows = []
    policy.get_output_embeddings().register_forward_hook(
        lambda module, args, out: head_rows.append(out.shape[1]))
    trees = []
    for i in range(2 if rank == 0 else 0):
        t = RolloutTree.new(f"t{i}", "q", ["a"], list(range(1, 9)))
        for j in range(2):
            t.add_child(0, rollout=j, token_ids=[10 + j, 20], logprobs=[-1.0, -1.0],
                        policy_mask=[1, 1], finished=True, reward=float(j))
        t.compute_values()
        trees.append(t)
    try:
        feats = node_features(policy, trees, batch_tokens=8)  # one forward per path on rank 0
        batch = all_gather_batch(training_batch(trees, feats), SimpleNamespace(world_size=2))
        torch.save({"features": batch.features, "value": batch.value, "head_rows": head_rows,
                    "plain": training_batch(trees, node_features(plain, trees, 8)).features},
                   f"{out_dir}/rank{rank}.pt")
    finally:
        leave_group()


def test_ranks_with_uneven_trees_featurise_and_gather_under_fsdp(tmp_path):
    """Each FSDP forward is a collective: a rank with fewer paths to featurise (here none)
    must still join the other ranks' forwards, or the run hangs; its empty predictor batch
    (no feature width) must not break the gather."""
    torch.multiprocessing.spawn(_uneven_ranks_worker, args=(2, str(tmp_path)), nprocs=2,
                                join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["features"].shape == (2, 32)  # the two roots (leaves are not targets)
    torch.testing.assert_close(r0["features"], r1["features"], atol=0, rtol=0)
    assert r0["value"].tolist() == r1["value"].tolist() == [0.5, 0.5]
    # the decoder's hidden states, as without FSDP; the LM head ran on one row per forward
    torch.testing.assert_close(r0["features"], r0["plain"], atol=1e-5, rtol=0)
    assert r0["head_rows"] and set(r0["head_rows"]) == {1}


def test_weighted_squared_error_by_hand():
    # (1 * 0.2^2 + 3 * 0.1^2 + 2 * 0^2) / 6 = (0.04 + 0.03) / 6 = 0.07 / 6
    got = weighted_squared_error(torch.tensor([0.2, 0.9, 0.5]), torch.tensor([0.0, 1.0, 0.5]),
                                 torch.tensor([1.0, 3.0, 2.0]))
    assert got.item() == pytest.approx(0.07 / 6, rel=1e-6)
    # no weight at all: 0, not NaN
    assert weighted_squared_error(torch.ones(2), torch.zeros(2), torch.zeros(2)).item() == 0.0


# ---- what stage 2 branched from (scripts/prefix_choices.py) ---------------------------------
def test_prefix_choices_split_the_bare_prefixes_by_hand(tmp_path):
    import importlib.util
    import json

    from trace_lightning.tree import write_jsonl

    path = Path(__file__).resolve().parents[2] / "scripts" / "prefix_choices.py"
    spec = importlib.util.spec_from_file_location("prefix_choices", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def turn(logprobs, **fields):  # policy tokens with these log-probs, one observation token
        return dict(token_ids=[9] * (len(logprobs) + 1), logprobs=[*logprobs, -7.0],
                    policy_mask=[1] * len(logprobs) + [0], **fields)

    t = RolloutTree.new("t", "q", ["a"], [5, 6, EOP])
    a = t.add_child(0, rollout=0, prediction=0.5, continuations=1, **turn([-0.1, -0.3]))
    t.add_child(a.id, finished=True, reward=1.0, **turn([-2.0]))  # bare leaf
    t.add_child(a.id, finished=True, reward=0.0, **turn([-2.0]))  # the continuation
    b = t.add_child(0, rollout=1, prediction=0.2, **turn([-1.0, -0.5]))
    c = t.add_child(b.id, prediction=0.1, **turn([-0.5]))
    t.add_child(c.id, finished=True, reward=0.0, **turn([-0.1]))
    t.compute_values()
    assert [n.id for n in script.bare_prefixes(t)] == [a.id, b.id, c.id]
    got = script.choices([t])
    # continued: node a alone, log-probs -0.1, -0.3: mean -0.2, none below log 1/2; its two
    # leaves 1 and 0
    assert got["continued"] == pytest.approx({
        "prefixes": 1, "mean_logprob": -0.2, "last_turn_logprob": -0.2, "low_share": 0.0,
        "value": 0.5, "prediction": 0.5})
    # passed over: b (-1.0, -0.5: mean -0.75, one of two below) and c (its path: -1.0, -0.5,
    # -0.5: mean -2/3, last turn -0.5, one of three below); both lead to the 0 leaf
    assert got["passed_over"] == pytest.approx({
        "prefixes": 2, "mean_logprob": (-0.75 - 2 / 3) / 2, "last_turn_logprob": (-0.75 - 0.5) / 2,
        "low_share": (1 / 2 + 1 / 3) / 2, "value": 0.0, "prediction": 0.15})
    # by depth: bare rollouts of 2 + 1 and 2 + 1 + 1 generated tokens; at depth 1 the
    # prefixes a and b (1 and 2 tokens after them), a continued once by a 1-token leaf whose 0
    # differs from its bare rollout's 1; at depth 2 the prefix c (1 token after), not continued
    # (their rewards 1 and 0: the one pair differs)
    assert script.by_depth([t]) == {"bare_rollouts": 2, "bare_tokens": 3.5,
                                    "bare_pairs_differ": 1.0, "depths": {
        "1": {"prefixes": 2, "continued": 1, "bare_tokens_after": 1.5, "continuation_leaves": 1,
              "continuation_tokens": 1.0, "differs_from_bare": 1.0},
        "2": {"prefixes": 1, "continued": 0, "bare_tokens_after": 1.0, "continuation_leaves": 0,
              "continuation_tokens": None, "differs_from_bare": None}}}
    write_jsonl([t], tmp_path / "epoch_0_rank_0.jsonl")
    script.main([str(tmp_path), "--out", str(tmp_path / "out" / "choices.json")])
    line = json.loads((tmp_path / "out" / "choices.json").read_text())
    assert line["continued"]["prefixes"] == 1 and line["files"] == 1 and "commit" in line
    assert line["by_depth"]["depths"]["1"]["continued"] == 1
    with pytest.raises(SystemExit, match="no .jsonl files in .*--data.trees_dir"):
        script.main([str(tmp_path / "missing")])


# ---- the task's description of prompts (scripts/prompt_features.py) ----------------------
def test_prompt_features_script_ranks_each_number_against_success_by_hand(tmp_path):
    import importlib.util
    from types import SimpleNamespace

    path = Path(__file__).resolve().parents[2] / "scripts" / "prompt_features.py"
    spec = importlib.util.spec_from_file_location("prompt_features", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    described = {"a": [1.0, 1.0, 0.5], "b": [1.0, 0.0, 1.0]}
    env = SimpleNamespace(prompt_features=lambda e: described[e.id])
    examples = {k: SimpleNamespace(id=k) for k in described}
    trees = []
    for tree_id, rewards in [("a", [0.0, 0.0, 0.0, 1.0]), ("a", [1.0, 1.0, 1.0, 0.0]),
                             ("b", [1.0, 1.0])]:
        t = RolloutTree.new(tree_id, "q", ["x"], [5, EOP])
        for i, r in enumerate(rewards):
            t.add_child(0, rollout=i, token_ids=[9], logprobs=[-0.1], policy_mask=[1],
                        finished=True, reward=r)
        t.compute_values()
        trees.append(t)
    got = script.describe(trees, env, examples)
    # successes 0.25, 0.75, 1.0 (ranks 1, 2, 3); title_search_first 1, 1, 0 (ranks 2.5, 2.5,
    # 1): centred (0.5, 0.5, -1) against (-1, 0, 1), r = -1.5 / sqrt(1.5 * 2) = -0.866;
    # question_search_shows 0.5, 0.5, 1: +0.866; title_search_shows is constant: none
    assert got["trees"] == 3 and got["prompts"] == 2 and got["distinct_descriptions"] == 2
    assert got["success"] == pytest.approx(2.0 / 3)
    f = got["features"]
    assert f["title_search_shows"] == {"distinct_values": 1, "rank_correlation": None}
    assert f["title_search_first"]["rank_correlation"] == pytest.approx(-(3 ** 0.5) / 2)
    assert f["question_search_shows"]["rank_correlation"] == pytest.approx(3 ** 0.5 / 2)
    with pytest.raises(SystemExit, match="not among the world's training questions"):
        script.describe(trees, env, {"a": examples["a"]})
    with pytest.raises(SystemExit, match=r"no \.jsonl files in"):
        script.main([str(tmp_path)])
    write_jsonl(trees, tmp_path / "epoch_0_rank_0.jsonl")
    with pytest.raises(SystemExit, match=r"--world .* has no train_corpus.jsonl"):
        script.main([str(tmp_path), "--world", str(tmp_path / "nowhere")])
