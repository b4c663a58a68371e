"""Warm start on gold trajectories: built through the real environment, trained on policy
tokens only, saved where transformers and vLLM load it; and ``prepare_demo``."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

from trace_lightning.tasks.search_qa.datasets import load_qa
from trace_lightning.tasks.search_qa.demo.prepare import DEMO_INSTRUCTION, DemoPaths, demo_env, prepare_demo
from trace_lightning.tasks.sft import batch_order, collate, sft_loss
from trace_lightning.tasks.search_qa.demo.warm_start import (
    gold_trees,
    warm_start,
)
from trace_lightning.tasks.search_qa.demo.world import generate_world, gold_turns, vocabulary_text
from trace_lightning.models import build_tiny_model, tiny_qwen3_config, train_tokenizer
from trace_lightning.tasks.search_qa.tiny_policy import AGENT_TAGS
from trace_lightning.tasks.search_qa.retrieval import load_corpus

SIZES = {"n_people": 40, "n_cities": 10, "n_countries": 4, "n_companies": 10}
MODEL = {"hidden_size": 64, "layers": 2, "heads": 2, "kv_heads": 1, "head_dim": 32,
         "intermediate": 128, "max_position": 512}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(vocabulary_text(n_worlds=2, **SIZES), 400, AGENT_TAGS)


@pytest.fixture(scope="module")
def world():
    return generate_world(3, n_questions=40, **SIZES)


@pytest.fixture(scope="module")
def env(tokenizer, world):
    return demo_env(tokenizer, world, topk=2, use_chat_template=False)


def test_agent_tags_are_single_tokens(tokenizer):
    for tag in AGENT_TAGS:
        assert len(tokenizer.encode(tag, add_special_tokens=False)) == 1
    # A name is tokenised the same in the question, a document and the agent's turn.
    name = " Velmor Kastri"
    ids = tokenizer.encode(name, add_special_tokens=False)
    turn = tokenizer.encode(f"<search>{name}</search>", add_special_tokens=False)
    assert turn[1:-1] == ids


def test_gold_trajectories_mask_exactly_the_turns(env, world, tokenizer):
    trees = gold_trees(env, world)
    assert len(trees) == len(world.questions)  # top-2 always holds the searched document
    by_id = {q["id"]: q for q in world.questions}
    for tree in trees:
        (seq,) = tree.flatten()
        q = by_id[tree.tree_id]
        assert seq.reward == 1.0
        prompt_ids, _ = env.prompt(q["question"])
        assert seq.input_ids[: len(prompt_ids)] == prompt_ids
        # Walk the sequence: prompt, then per turn its tokens (mask 1) and the observation
        # the environment returns for its query (mask 0).
        pos = len(prompt_ids)
        assert not any(seq.policy_mask[:pos])
        turns = gold_turns(q, world)
        for k, turn in enumerate(turns):
            ids = tokenizer.encode(turn, add_special_tokens=False)
            assert seq.input_ids[pos: pos + len(ids)] == ids
            assert all(seq.policy_mask[pos: pos + len(ids)])
            pos += len(ids)
            if k < len(turns) - 1:
                ((obs, _),) = env.observe([q["chain"][k]])
                assert seq.input_ids[pos: pos + len(obs)] == obs
                assert not any(seq.policy_mask[pos: pos + len(obs)])
                pos += len(obs)
        assert pos == len(seq.input_ids)
        assert tokenizer.decode([t for t, m in zip(seq.input_ids, seq.policy_mask) if m]) \
            == "".join(turns)


def test_noisy_demonstrations_make_one_reading_error(env, world):
    noisy = gold_trees(env, world, noise=1.0, seed=0)
    gold = {t.tree_id: t for t in gold_trees(env, world)}
    assert len(noisy) == len(world.questions)
    wrong = 0
    for tree in noisy:
        args = [n.argument for n in tree.nodes[1:]]
        true = [n.argument for n in gold[tree.tree_id].nodes[1:]]
        assert args[0] == true[0] and args != true and len(args) == len(true)
        wrong += tree.leaves()[0].reward == 0.0
    assert wrong >= 0.5 * len(noisy)  # a wrong city can still lie in the right country


def test_warm_start_lowers_the_loss_and_saves(tmp_path, tokenizer, world, env):
    model_dir = build_tiny_model(tokenizer, tmp_path / "model", seed=0, **MODEL)
    seqs = [s for t in gold_trees(env, world) for s in t.flatten()][:16]
    batch = collate(seqs, tokenizer.pad_token_id)

    def loss_of(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            return sft_loss(model, batch["input_ids"], batch["policy_mask"]).item()

    before = loss_of(model_dir)
    threads = torch.get_num_threads()
    stats = warm_start(model_dir, world, env, steps=12, batch_size=8, lr=3e-3, warmup=2,
                       log_every=0, num_threads=1)
    after = loss_of(model_dir)  # the saved model loads in transformers
    assert stats["n_demos"] == len(world.questions) and len(stats["losses"]) == 12
    assert torch.get_num_threads() == threads  # restored
    assert after < before - 0.5, (before, after)


def test_batch_order_uses_each_example_once_per_pass_with_little_padding():
    rng = random.Random(0)
    lengths = [rng.choice([200, 270]) + rng.randrange(30) for _ in range(100)]
    batches = batch_order(lengths, batch_size=8, seed=0)
    # A pass: groups of 64 and 36 examples -> 8 + 5 batches (the last of 4).
    first = list(itertools.islice(batches, 13))
    assert sorted(i for b in first for i in b) == list(range(100))
    second = list(itertools.islice(batches, 13))
    assert sorted(i for b in second for i in b) == list(range(100)) and second != first

    def padding(bs):
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b)
                   for b in bs) / sum(lengths)
    shuffled = list(range(100))
    rng.shuffle(shuffled)
    assert padding(first) < 0.5 * padding([shuffled[k:k + 8] for k in range(0, 100, 8)])


def test_sft_loss_counts_policy_tokens_only(tokenizer):
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_qwen3_config(len(tokenizer), **MODEL))
    ids = torch.randint(0, len(tokenizer), (2, 10))  # (B, T)
    mask = torch.zeros_like(ids)
    mask[0, 4:7] = 1
    changed = ids.clone()
    changed[1, :] = 3  # a row without policy tokens must not matter
    changed[0, 8:] = 5  # nor tokens after the last policy token
    a = sft_loss(model, ids, mask)
    b = sft_loss(model, changed, mask)
    torch.testing.assert_close(a, b)
    # By hand: mean NLL of tokens 4..6 of row 0 given their prefixes.
    logp = torch.log_softmax(model(input_ids=ids[:1]).logits[0], -1)  # (T, V)
    expected = -torch.stack([logp[t - 1, ids[0, t]] for t in (4, 5, 6)]).mean()
    torch.testing.assert_close(a, expected, rtol=1e-5, atol=1e-5)
    # Context term: row 0 is real up to token 7 (8, 9 are padding). Context targets are
    # tokens 1..7 of row 0 outside the policy mask: 1, 2, 3, 7 (token 0 is never a target).
    attn = torch.zeros_like(ids)
    attn[0, :8] = 1
    with_ctx = sft_loss(model, ids[:1], mask[:1], attn[:1], context_weight=0.5)
    ctx = -torch.stack([logp[t - 1, ids[0, t]] for t in (1, 2, 3, 7)]).mean()
    torch.testing.assert_close(with_ctx, expected + 0.5 * ctx, rtol=1e-5, atol=1e-5)


def test_warm_start_stops_at_the_target_loss(tmp_path, tokenizer, world, env):
    model_dir = build_tiny_model(tokenizer, tmp_path / "model", seed=0, **MODEL)
    stats = warm_start(model_dir, world, env, steps=80, batch_size=2, warmup=2, log_every=0,
                       stop_loss=1e9)
    assert stats["steps"] == 50 == len(stats["losses"])  # the first full 50-step window
    with pytest.raises(ValueError, match="stop_loss"):
        warm_start(model_dir, world, env, steps=1, stop_loss=0.0)


def test_diverging_warm_start_raises_and_saves_nothing(tmp_path, tokenizer, world, env):
    """At lr 1e30 the first update blows the weights up and the next loss is not finite:
    the run stops naming the learning rate, and the model on disk is the one it started
    from (a NaN model would otherwise be saved and reused by every later run)."""
    model_dir = build_tiny_model(tokenizer, tmp_path / "model", seed=0, **MODEL)
    before = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    with pytest.raises(FloatingPointError, match=r"nothing was saved.*warm_start_lr"):
        warm_start(model_dir, world, env, steps=5, batch_size=2, lr=1e30, warmup=1,
                   log_every=0)
    after = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_warm_start_over_several_worlds(tmp_path, tokenizer, env):
    worlds = [generate_world(s, n_questions=6, **SIZES) for s in (11, 12)]
    model_dir = build_tiny_model(tokenizer, tmp_path / "model", seed=0, **MODEL)
    stats = warm_start(model_dir, worlds, env, steps=1, batch_size=4, log_every=0)
    # Each world is searched in its own index: every demonstration found its documents.
    assert stats["n_demos"] == 12 and stats["n_dropped"] == 0 and stats["demo_reward"] == 1.0


def _demo_kwargs(**over) -> dict:
    return dict(n_questions=20, n_eval_questions=10, warm_worlds=2, warm_questions=10,
                vocab_size=400, model=MODEL, warm_start_steps=2, warm_start_batch=4,
                **SIZES) | over


def test_prepare_demo_waits_for_another_builder_then_finds_it_built(tmp_path):
    """A second builder of the same out_dir (two runs, or a node each on a shared disk)
    waits on the lock and builds nothing: here the lock is held while one thread prepares."""
    import fcntl

    out = tmp_path / "demo"
    out.mkdir()
    done = []
    with open(out / ".prepare.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        worker = threading.Thread(target=lambda: done.append(prepare_demo(out, **_demo_kwargs(
            warm_start_steps=0))))
        worker.start()
        worker.join(timeout=3)
        assert worker.is_alive()  # waiting
        assert sorted(p.name for p in out.iterdir()) == [".prepare.lock"]  # nothing written
        fcntl.flock(held, fcntl.LOCK_UN)
    worker.join(timeout=120)
    assert done and json.loads(done[0].manifest.read_text())["settings"]["warm_start_steps"] == 0


def test_prepare_demo_finds_a_built_demo_without_the_lock_and_builds_where_flock_fails(
        tmp_path, monkeypatch, caplog):
    """A built demo may sit on a read-only disk: finding it takes no lock. A filesystem
    without flock (ENOLCK on some network filesystems) builds without one, with a warning."""
    import errno
    import fcntl

    import trace_lightning.tasks.search_qa.demo.prepare as prepare_module

    def no_flock(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    paths = prepare_demo(tmp_path / "demo", **_demo_kwargs(warm_start_steps=0))
    assert paths.manifest.is_file() and "cannot lock" in caplog.text

    def no_lock(lock, what):
        raise AssertionError(f"took {lock}")

    monkeypatch.setattr(prepare_module, "exclusive", no_lock)
    assert prepare_demo(tmp_path / "demo", **_demo_kwargs(warm_start_steps=0)) == paths


def test_prepare_demo_rejects_the_training_seed_as_eval_seed(tmp_path):
    # Same seed, same world: the held-out questions would be the first training questions.
    with pytest.raises(ValueError, match=r"eval_seed \(3\) equals seed \(3\) "
                                         r"\(--data.task.init_args.demo.eval_seed, "
                                         r"--data.task.init_args.demo.seed\).*"
                                         r"memorisation; set eval_seed to another seed"):
        prepare_demo(tmp_path / "demo", **_demo_kwargs(seed=3, eval_seed=3))
    assert not (tmp_path / "demo").exists()


def test_prepare_demo_held_out_skips_questions_training_asks(tmp_path):
    # Seeds 4 and 22 at the default sizes: both worlds have a company "Polno Corp" based in
    # a city of "Wyndraja", so the held-out draw's first 200 questions hold one training
    # question with its answer. It is skipped and the draw's 201st question taken instead.
    sizes = {"n_people": 300, "n_cities": 40, "n_countries": 8, "n_companies": 40}
    paths = prepare_demo(tmp_path / "demo", seed=4, eval_seed=22, n_questions=600,
                         n_eval_questions=200, warm_start_steps=0, vocab_size=400,
                         model=MODEL, **sizes)

    def pairs(path):
        return [(r["question"], tuple(r["answers"]))
                for r in map(json.loads, path.read_text().splitlines())]
    train, held_out = pairs(paths.train_qa), pairs(paths.eval_qa)
    shared = ("In which country is Polno Corp based?", ("Wyndraja",))
    assert shared in train and not set(train) & set(held_out)
    plain = [(q["question"], tuple(q["answers"]))
             for q in generate_world(22, n_questions=201, **sizes).questions]
    assert shared in plain[:200]
    assert held_out == [p for p in plain[:200] if p != shared] + [plain[200]]


def _build_process() -> int:
    """The pid of this process's build child (``call_pinned``'s), or 0."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"trace_lightning.tasks.build" in cmdline:
            return int(stat.parent.name)
    return 0


def test_prepare_demo_writes_loadable_files_and_rebuilds_only_when_complete(tmp_path):
    """A built demo: every file loads; the same settings redo nothing; a rebuild killed
    midway leaves the old world whole; a finished one swaps the new world in."""
    kwargs = _demo_kwargs()
    paths = prepare_demo(tmp_path / "demo", **kwargs)
    assert paths == DemoPaths.under(tmp_path / "demo")
    manifest = json.loads(paths.manifest.read_text())
    assert manifest["settings"]["instruction"] == DEMO_INSTRUCTION
    # The standard loaders read every file.
    train, held_out = load_qa(paths.train_qa), load_qa(paths.eval_qa)
    assert len(train) == 20 and len(held_out) == 10
    corpus = {p.title for p in load_corpus(paths.train_corpus)}
    assert all(set(q.extras["supporting_titles"]) <= corpus for q in train)
    assert {p.title for p in load_corpus(paths.eval_corpus)} != corpus
    AutoModelForCausalLM.from_pretrained(paths.model)
    files = [paths.train_qa, paths.eval_qa, paths.train_corpus, paths.eval_corpus,
             paths.manifest, *sorted(paths.model.iterdir())]
    before = {f: f.read_bytes() for f in files}

    # A rebuild killed during its (long) warm start: the build process gets SIGKILL once
    # its new model is on disk in model.partial/.
    errors: list[BaseException] = []

    def rebuild() -> None:
        try:
            prepare_demo(tmp_path / "demo", **{**kwargs, "seed": 5, "eval_seed": 6,
                                               "warm_start_steps": 10**6,
                                               "warm_start_stop_loss": None})
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    worker = threading.Thread(target=rebuild)
    worker.start()
    deadline = time.monotonic() + 120
    while not (paths.root / "model.partial" / "model.safetensors").exists():
        assert worker.is_alive() and time.monotonic() < deadline
        time.sleep(0.1)
    os.kill(_build_process(), signal.SIGKILL)
    worker.join(timeout=60)
    assert not worker.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "exit status -9" in str(errors[0]) and "nothing it built was installed" in str(errors[0])
    # The seed-0 world is whole: its data, its model, its manifest; no seed-5 data beside
    # the seed-0 model, and the old settings still find it up to date.
    assert {f: f.read_bytes() for f in files} == before
    assert sorted(paths.model.iterdir()) == sorted(f for f in files if f.parent == paths.model)
    stamp = (paths.model / "model.safetensors").stat().st_mtime_ns
    prepare_demo(tmp_path / "demo", **kwargs)
    assert (paths.model / "model.safetensors").stat().st_mtime_ns == stamp
    # A finished rebuild (another setting) swaps the new model in and leaves no staging
    # folders.
    prepare_demo(tmp_path / "demo", **{**kwargs, "seed": 5, "eval_seed": 6})
    assert (paths.model / "model.safetensors").stat().st_mtime_ns != stamp
    assert json.loads(paths.manifest.read_text())["settings"]["seed"] == 5
    assert paths.train_qa.read_bytes() != before[paths.train_qa]
    assert sorted(p.name for p in paths.root.iterdir()) == [
        ".prepare.lock", "eval_corpus.jsonl", "eval_qa.jsonl", "manifest.json", "model",
        "train_corpus.jsonl", "train_qa.jsonl"]
    AutoModelForCausalLM.from_pretrained(paths.model)
