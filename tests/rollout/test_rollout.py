"""The agent loop with real parts: vLLM (CPU) and transformers engines on a tiny Qwen3 built
here, BM25 over the real HotpotQA passages, real dev questions.

Two sets of weights share one vLLM engine (swapped with the checked weight sync):

- ``random``: the tiny model as built, whose turns are garbage (almost never a valid action);
- ``scripted``: the same architecture with its layers silenced and a bigram LM head written
  by hand, so that it follows the agent format: ``<think> film</think>`` then
  ``<search> American</search>`` (p = 3/4) or ``<answer> yes</answer>`` /
  ``<answer> no</answer>`` (p = 1/8 each). It searches, answers right or wrong, and reaches
  the turn and token limits, which a random model of this size never does.
"""

from __future__ import annotations

import copy
import gc
from dataclasses import replace
import json
import math
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trace_lightning.tasks.search_qa.datasets import load_qa
from trace_lightning.tasks.base import Example
from trace_lightning.rollout.engines import HFEngine, SamplingConfig, build_engine, make_probe, sync_weights
from trace_lightning.tasks.search_qa.environment import SearchEnvironment, parse_turn
from trace_lightning.tasks.search_qa.tiny_policy import build_tiny_from_corpus
from trace_lightning.tasks.search_qa.retrieval import BM25Retriever, RetrieverError
from trace_lightning.rollout.agent import AgentLoop, Start
from trace_lightning.tree import bare_reward
from trace_lightning.tree import Budget, RolloutTree
from launch import leave_group

BLOCK = 32  # the engine's KV block; the prefix cache reuses whole blocks only
SAMPLING = SamplingConfig(temperature=1.0, max_tokens=24)
GREEDY = SamplingConfig(temperature=0.0, max_tokens=24)
FINISH_REASONS = {"answer", "invalid", "max_turns", "max_tokens"}


class CountingRetriever:
    """The real retriever, with every query it receives recorded."""

    def __init__(self, inner: BM25Retriever):
        self.inner, self.queries, self.calls = inner, [], 0

    def search(self, queries: list[str], topk: int):
        self.calls += 1
        self.queries.extend(queries)
        return self.inner.search(queries, topk)


class SlowRetriever(CountingRetriever):
    """A counting retriever that takes ``delay_s`` more per call (a remote server)."""

    def __init__(self, inner: BM25Retriever, delay_s: float):
        super().__init__(inner)
        self.delay_s = delay_s

    def search(self, queries: list[str], topk: int):
        time.sleep(self.delay_s)
        return super().search(queries, topk)


class RecordingEngine:
    """The real engine, with every ``generate`` call's prompts and completions recorded."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, sampling, n=1):
        out = self.engine.generate(prompts, sampling, n)
        self.calls.append(([list(p) for p in prompts], out))
        return out


def script_weights(model: torch.nn.Module, tokenizer) -> torch.nn.Module:
    """Turn a tiny untied Qwen3 into a bigram model that writes the agent format.

    With every ``o_proj`` and ``down_proj`` zeroed the layers add nothing, so the last
    hidden state is RMSNorm(embedding of the current token). Each scripted token gets the
    embedding e_k (a basis vector), which the final RMSNorm maps to sqrt(d) * e_k, and the
    LM head's column k holds the next-token logits / sqrt(d). Unscripted logits are 0, so a
    scripted logit of 24 leaves less than 1e-7 of mass off the script.
    """
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    tag = tokenizer.convert_tokens_to_ids
    hi = 24.0
    script: dict[int, dict[int, float]] = {}

    def chain(start: int, words: list[int], end: int, logit: float = hi) -> None:
        seq = [start, *words, end]
        for a, b in zip(seq, seq[1:]):
            script.setdefault(a, {})[b] = logit if a == start else hi

    (newline,) = enc("\n")  # ends the generation prompt and every observation
    script[newline] = {tag("<think>"): hi}
    chain(tag("<think>"), enc(" film"), tag("</think>"))
    script[tag("</think>")] = {tag("<search>"): hi + math.log(3), tag("<answer>"): hi}
    chain(tag("<search>"), enc(" American"), tag("</search>"))
    chain(tag("<answer>"), enc(" yes"), tag("</answer>"))
    chain(tag("<answer>"), enc(" no"), tag("</answer>"))
    for end in ("</search>", "</answer>"):
        script[tag(end)] = {tokenizer.eos_token_id: hi}
    d = model.config.hidden_size
    assert not model.config.tie_word_embeddings and len(script) <= d
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for k, (current, nexts) in enumerate(script.items()):
            emb[current] = 0.0
            emb[current, k] = 1.0
            for nxt, logit in nexts.items():
                head[nxt, k] = logit / math.sqrt(d)
    return model


# ---- fixtures: one model directory, one vLLM engine, one BM25 index per module -------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, shared_data):
    # untied, so that the scripted LM head can differ from the embedding
    return build_tiny_from_corpus(shared_data / "hotpotqa" / "corpus.jsonl",
                                  tmp_path_factory.mktemp("tiny-agent"), vocab_size=1024,
                                  seed=0, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def policies(model_dir, tokenizer):
    random = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return {"random": random, "scripted": script_weights(copy.deepcopy(random), tokenizer)}


@pytest.fixture(scope="module")
def vllm(model_dir):
    engine = build_engine("vllm", model_dir, enforce_eager=True, kv_cache_memory_gb=0.25,
                          max_model_len=1024, block_size=BLOCK)
    engine.weights = "random"  # which policy's weights it holds (the test's own bookkeeping)
    yield engine
    engine.close()  # and the process group vLLM started: later modules start their own


def _holding(engine, policies, name: str):
    if engine.weights != name:
        assert sync_weights(policies[name], engine, make_probe(1024, 64), atol=1e-3).diff < 1e-3
        engine.weights = name
    return RecordingEngine(engine)


@pytest.fixture
def vllm_random(vllm, policies):
    return _holding(vllm, policies, "random")


@pytest.fixture
def vllm_scripted(vllm, policies):
    return _holding(vllm, policies, "scripted")


@pytest.fixture(scope="module")
def bm25(shared_data, tmp_path_factory):
    # the same cache folder as test_environment.py: built once per test session
    return BM25Retriever(str(shared_data / "hotpotqa" / "corpus.jsonl"),
                         cache_dir=str(tmp_path_factory.getbasetemp() / "bm25"))


@pytest.fixture
def retriever(bm25):
    return CountingRetriever(bm25)


def make_env(tokenizer, retriever, **kw) -> SearchEnvironment:
    kw = {"topk": 3, "max_turns": 4, "max_obs_tokens": 64, "max_seq_tokens": 768, **kw}
    return SearchEnvironment(tokenizer, retriever, **kw)


@pytest.fixture(scope="module")
def examples(shared_data):
    # six real dev questions (two yes/no ones), and the trap of the prompt's own example
    dev = load_qa(shared_data / "hotpotqa" / "dev_distractor.jsonl", limit=6)
    assert [e.answers[0] for e in dev].count("yes") + [e.answers[0] for e in dev].count("no") == 2
    return dev + [Example("beijing", "What is the capital of China?", ["Beijing"], "trap")]


# ---- checks shared by the tests ------------------------------------------------------------

def check_tree(tree: RolloutTree, tokenizer, env: SearchEnvironment) -> None:
    """Invariants of a fully grown tree, the budget's accounting among them."""
    root_len = len(tree.root.token_ids)
    for node in tree.nodes[1:]:
        n_pol = node.n_policy_tokens
        assert len(node.token_ids) == len(node.logprobs) == len(node.policy_mask)
        assert node.policy_mask == [1] * n_pol + [0] * (len(node.token_ids) - n_pol)
        assert all(lp <= 0.0 for lp in node.logprobs[:n_pol])
        assert all(lp == 0.0 for lp in node.logprobs[n_pol:])
        assert node.text == tokenizer.decode(node.token_ids[:n_pol])
        assert node.action == parse_turn(node.text).kind
        bare = tree.path(node.id)[1]
        assert node.rollout == bare.rollout >= 0
        if node.observation:
            assert node.action == "search"
            assert tokenizer.decode(node.token_ids[n_pol:]) == node.observation
            assert node.observation.startswith("\n\n<information>")
        else:
            assert n_pol == len(node.token_ids)
        if node.finished:
            assert not node.children and node.finish_reason in FINISH_REASONS
            assert 0.0 <= node.reward <= 1.0 and set(node.metrics) == {"em", "f1"}
            if node.finish_reason != "answer":
                assert node.reward == 0.0
            assert node.depth <= env.max_turns
        else:
            assert node.children, "a grown tree has no open ends"
            assert node.finish_reason == "" and node.reward is None
            assert node.action == "search" and node.observation
    assert tree.root.policy_mask == [0] * root_len
    leaves = tree.leaves()
    assert tree.budget.leaves == len(leaves)
    assert tree.budget.generated_tokens == sum(n.n_policy_tokens for n in tree.nodes)
    assert tree.budget.tool_calls == sum(bool(n.observation) for n in tree.nodes)
    assert tree.budget.prefill_tokens == sum(len(tree.prefix_ids(n.parent))
                                             for n in tree.nodes[1:]) > 0
    for seq in tree.flatten():
        assert seq.input_ids[:root_len] == tree.root.token_ids


def grow(engine, env, examples, count: int, seed: int, sampling=SAMPLING):
    loop = AgentLoop(engine, env, sampling)
    trees = [loop.new_tree(e) for e in examples]
    spent = loop.expand([Start(t, 0, count) for t in trees], seed=seed)
    return loop, trees, spent


def signature(tree: RolloutTree) -> list[tuple]:
    """The shape of a tree: per node, where it hangs and how it ended."""
    return [(n.parent, n.depth, n.rollout, n.action, n.finish_reason, len(n.children))
            for n in tree.nodes]


# ---- bare rollouts ---------------------------------------------------------------------------

def test_bare_rollouts_of_a_random_model(vllm_random, retriever, tokenizer, examples):
    env = make_env(tokenizer, retriever)
    _, trees, spent = grow(vllm_random, env, examples, 3, seed=0)
    (prompts, completions), *_ = vllm_random.calls
    assert prompts == [t.root.token_ids for t in trees for _ in range(3)]  # one batched call
    total = Budget()
    for tree, example in zip(trees, examples):
        assert tree.tree_id == example.id and tree.answers == example.answers
        assert tree.root.text == env.prompt(example.question)[1]
        assert [tree.nodes[i].rollout for i in tree.bare_rollouts()] == [0, 1, 2]
        check_tree(tree, tokenizer, env)
        total.add(tree.budget)
    assert spent == total
    assert spent.tool_calls == len(retriever.queries)
    assert spent.leaves == 3 * len(examples)
    # garbage ends as "invalid" with the reason kept, and scores 0
    leaves = [n for t in trees for n in t.leaves()]
    assert sum(n.finish_reason == "invalid" for n in leaves) >= len(leaves) - 1
    assert all(n.argument for n in leaves if n.finish_reason == "invalid")  # the parse error
    # the instruction's own "<answer> Beijing </answer>" is never scored
    assert [n.reward for n in trees[-1].leaves()] == [0.0, 0.0, 0.0]


def test_bare_rollouts_of_a_searching_model(vllm_scripted, retriever, tokenizer, examples):
    env = make_env(tokenizer, retriever)
    _, trees, spent = grow(vllm_scripted, env, examples, 3, seed=0)
    for tree in trees:
        assert [tree.nodes[i].rollout for i in tree.bare_rollouts()] == [0, 1, 2]
        check_tree(tree, tokenizer, env)
    nodes = [n for t in trees for n in t.nodes[1:]]
    assert {n.finish_reason for n in nodes if n.finished} <= {"answer", "max_turns"}
    assert all(n.argument == "American" for n in nodes if n.action == "search")
    assert spent.tool_calls == len(retriever.queries) == sum(bool(n.observation) for n in nodes)
    assert retriever.queries and set(retriever.queries) == {"American"}
    # right and wrong answers: "yes" scores 1 on a yes question, 0 elsewhere
    for tree in trees:
        for leaf in tree.leaves():
            if leaf.finish_reason == "answer":
                assert leaf.reward == float(leaf.argument == tree.answers[0])
    assert any(t.mixed for t in trees)
    assert all(not t.mixed for t in trees if t.answers[0] not in ("yes", "no"))


# ---- continuations ---------------------------------------------------------------------------

def _continue(loop, engine, retriever, starts, seed):
    """Run continuations; returns (budget, queries sent, new node ids per start)."""
    before = {id(s.tree): len(s.tree.nodes) for s in starts}
    n_queries, n_calls = len(retriever.queries), len(engine.calls)
    spent = loop.expand(starts, seed=seed)
    new = []
    for s in starts:
        new.append([n.id for n in s.tree.nodes[before[id(s.tree)]:]
                    if s.node in [a.id for a in s.tree.path(n.id)]])
    return spent, retriever.queries[n_queries:], engine.calls[n_calls:], new


def check_continuations(starts, spent, queries, calls, new, tokenizer, env, seen=None):
    """``seen``: how many leading tokens of each prefix the engine has already prefilled
    (default: all of them, as for a prefix the agent loop sampled)."""
    # the first call resumes each prefix's exact token ids, once per continuation
    first_prompts, first_out = calls[0]
    assert first_prompts == [s.tree.prefix_ids(s.node) for s in starts for _ in range(s.count)]
    # and the engine served the part it had seen from its prefix cache (whole blocks)
    cached = [c[0].cached_tokens for c in first_out]
    seen = seen or [len(p) for p in first_prompts]
    assert all(c >= BLOCK * ((n - 1) // BLOCK) > 0 for c, n in zip(cached, seen))
    assert spent.cached_tokens >= sum(cached)
    for s, ids in zip(starts, new):
        tree, prefix = s.tree, s.tree.prefix_ids(s.node)
        start = tree.nodes[s.node]
        new_leaves = [tree.nodes[i] for i in ids if tree.nodes[i].finished]
        assert len(new_leaves) == s.count  # each continuation ends in exactly one leaf
        assert sum(1 for i in ids if tree.nodes[i].parent == s.node) == s.count
        for leaf in new_leaves:
            assert tree.prefix_ids(leaf.id)[:len(prefix)] == prefix
            assert leaf.rollout == start.rollout
        for seq in tree.flatten():
            if seq.leaf_id in ids:
                assert seq.input_ids[:len(prefix)] == prefix and seq.rollout == start.rollout
                assert s.node in seq.ancestors
        check_tree(tree, tokenizer, env)
    # the retriever saw only the new turns' searches, never the prefixes' again
    new_obs = sum(bool(s.tree.nodes[i].observation) for s, ids in zip(starts, new) for i in ids)
    assert len(queries) == spent.tool_calls == new_obs
    assert spent.leaves == sum(s.count for s in starts)


def test_continuations_of_sampled_prefixes(vllm_scripted, retriever, tokenizer, examples):
    env = make_env(tokenizer, retriever)
    loop, trees, _ = grow(vllm_scripted, env, examples, 3, seed=1)
    for t in trees:
        t.compute_values()
    starts = [Start(t, t.prefixes()[-1].id, 2) for t in trees if t.prefixes()]
    assert len(starts) >= 4, "the scripted model searches with p = 3/4"
    leaves_before = {id(s.tree): s.tree.nodes[s.node].n_leaves for s in starts}
    spent, queries, calls, new = _continue(loop, vllm_scripted, retriever, starts, seed=2)
    check_continuations(starts, spent, queries, calls, new, tokenizer, env)
    for s in starts:
        s.tree.compute_values()
        assert s.tree.nodes[s.node].n_leaves == leaves_before[id(s.tree)] + 2


def test_continuation_of_a_hand_built_prefix(vllm_random, retriever, tokenizer, examples):
    """A random model never searches, so the prefix is written by hand: a search turn with
    its behaviour log-probs from the engine and a real observation from ``env.observe``."""
    env = make_env(tokenizer, retriever)
    loop, (tree,), _ = grow(vllm_random, env, examples[:1], 3, seed=3)
    text = "<think> Who is he?</think><search> Scott Derrickson nationality</search>"
    policy = tokenizer.encode(text, add_special_tokens=False)
    assert parse_turn(text).argument == "Scott Derrickson nationality"
    ((obs, obs_text),) = env.observe(["Scott Derrickson nationality"])
    root = tree.root.token_ids
    logprobs = vllm_random.engine.prompt_logprobs([root + policy])[0][len(root):]
    node = tree.add_child(0, rollout=len(tree.root.children), token_ids=policy + obs,
                          logprobs=logprobs + [0.0] * len(obs),
                          policy_mask=[1] * len(policy) + [0] * len(obs), text=text,
                          observation=obs_text, action="search",
                          argument="Scott Derrickson nationality")
    tree.budget.tool_calls += 1  # what the agent loop would have counted for this turn
    tree.budget.generated_tokens += len(policy)
    tree.budget.prefill_tokens += len(root)
    assert tree.prefixes() == [node] and node.rollout == 3
    spent, queries, calls, new = _continue(loop, vllm_random, retriever,
                                           [Start(tree, node.id, 2)], seed=4)
    # the root prompt was prefilled by the bare rollouts; the hand-built turn was not
    check_continuations([Start(tree, node.id, 2)], spent, queries, calls, new, tokenizer, env,
                        seen=[len(root)] * 2)
    assert "Scott Derrickson nationality" not in queries


# ---- tools with state: continuations inherit their prefix's -----------------------------------

class SearchLog:
    """A ``ToolState``: the queries its trajectory has searched so far, in order."""

    def __init__(self, queries: list[str], counts: dict[str, int]):
        self.queries, self.counts, self.closed = list(queries), counts, False

    def fork(self) -> SearchLog:
        self.counts["forks"] += 1
        return SearchLog(self.queries, self.counts)

    def close(self) -> None:
        assert not self.closed, "a state is closed once"
        self.closed = True
        self.counts["closed"] += 1


class NumberedSearch(SearchEnvironment):
    """Search QA whose observation numbers the trajectory's searches (``search 3: ...``): a
    tool with state, the count, which a continuation must inherit from its prefix; with
    ``drift`` the observation also counts every call ever made (not deterministic)."""

    def __init__(self, tokenizer, retriever, continuation: str, drift: bool = False):
        super().__init__(tokenizer, retriever, topk=3, max_turns=4, max_obs_tokens=64,
                         max_seq_tokens=768)
        self.continuation, self.drift = continuation, drift
        self.counts = {"started": 0, "forks": 0, "closed": 0, "executed": 0}
        self.states: list[SearchLog] = []
        self.scored: list[tuple[str, int]] = []  # (example, searches its state holds)

    def start(self, example: Example) -> SearchLog:
        assert example.extras == {"tag": example.id}, "the example's own extras"
        self.counts["started"] += 1
        self.states.append(SearchLog([], self.counts))
        return self.states[-1]

    def execute(self, calls, states):
        out = []
        for call, state in zip(calls, states):
            self.counts["executed"] += 1
            state.queries.append(call.argument)
            ever = f" ({self.counts['executed']} ever)" if self.drift else ""
            text = f"\n\n<information>search {len(state.queries)}{ever}</information>\n\n"
            out.append((self._encode(text), text))
        return out

    def score(self, final, example, state=None):
        assert not state.closed, "scored on the trajectory's state, before it is closed"
        self.scored.append((example.id, len(state.queries)))
        return super().score(final, example, state)


def grow_with_continuations(engine, env, examples):
    """Bare rollouts of every example, then two continuations of each tree's prefixes."""
    loop, trees, _ = grow(engine, env, examples, 3, seed=1)
    starts = [Start(t, p.id, 2) for t in trees for p in t.prefixes()]
    loop.expand(starts, seed=2)
    loop.release()
    return trees, starts


@pytest.mark.parametrize("continuation", ["fork", "replay"])
def test_continuations_start_from_the_tool_state_their_prefix_left(
        vllm_scripted, retriever, tokenizer, examples, continuation):
    tagged = [replace(e, extras={"tag": e.id}) for e in examples]
    env = NumberedSearch(tokenizer, retriever, continuation)
    trees, starts = grow_with_continuations(vllm_scripted, env, tagged)
    assert len(starts) >= 4 and any(s.tree.nodes[s.node].depth >= 2 for s in starts)
    for tree in trees:
        for node in tree.nodes[1:]:
            if node.observation:  # its trajectory's k-th search says "search k"
                k = sum(n.action == "search" for n in tree.path(node.id)[1:])
                assert node.observation == f"\n\n<information>search {k}</information>\n\n"
    # one state per trajectory; each closed once, the saved forks at release()
    searches_before = {(id(s.tree), s.node): sum(bool(n.observation)
                                                 for n in s.tree.path(s.node)) for s in starts}
    bare, continued = 3 * len(examples), 2 * len(starts)
    tool_turns = sum(bool(n.observation) for t in trees for n in t.nodes)
    if continuation == "fork":  # a fork of every prefix saved, one per continuation
        prefixes = sum(not n.finished for t in trees for n in t.nodes[1:])
        assert env.counts["started"] == bare and env.counts["forks"] == prefixes + continued
    else:  # a fresh state per continuation, the prefix's searches run again on it
        replayed = sum(2 * k for k in searches_before.values())
        assert env.counts["started"] == bare + continued and env.counts["forks"] == 0
        assert env.counts["executed"] == tool_turns + replayed
    assert env.counts["closed"] == env.counts["started"] + env.counts["forks"]
    # every leaf scored against its own trajectory's state: the searches its path ran (a
    # search on the last turn runs none; one whose observation would not fit ran, unshown)
    leaves = [(t.tree_id, sum(bool(n.observation) for n in t.path(leaf.id))
               + (leaf.finish_reason == "max_tokens" and leaf.action == "search"))
              for t in trees for leaf in t.leaves()]
    assert sorted(env.scored) == sorted(leaves)


def test_fork_and_replay_grow_the_same_trees(vllm_scripted, retriever, tokenizer, examples):
    tagged = [replace(e, extras={"tag": e.id}) for e in examples[:4]]
    grown = {}
    for continuation in ("fork", "replay"):
        trees, _ = grow_with_continuations(
            vllm_scripted, NumberedSearch(tokenizer, retriever, continuation), tagged)
        grown[continuation] = [[(n.parent, n.token_ids, n.observation, n.reward)
                                for n in t.nodes] for t in trees]
    assert grown["fork"] == grown["replay"]


def test_replaying_a_tool_that_is_not_deterministic_is_refused(vllm_scripted, retriever,
                                                                tokenizer, examples):
    env = NumberedSearch(tokenizer, retriever, "replay", drift=True)
    loop, trees, _ = grow(vllm_scripted, env, [replace(e, extras={"tag": e.id})
                                               for e in examples], 3, seed=1)
    tree = next(t for t in trees if t.prefixes())
    with pytest.raises(RuntimeError, match=r"gave another observation than the prefix holds .*"
                                           r"not deterministic, so its continuations must fork"):
        loop.expand([Start(tree, tree.prefixes()[0].id, 1)], seed=2)


def test_continuing_a_leaf_is_refused(vllm_random, retriever, tokenizer, examples):
    env = make_env(tokenizer, retriever)
    loop, (tree,), _ = grow(vllm_random, env, examples[:1], 1, seed=5)
    with pytest.raises(AssertionError, match="cannot continue leaf"):
        loop.expand([Start(tree, tree.leaves()[0].id, 1)], seed=0)


# ---- limits ----------------------------------------------------------------------------------

def test_max_turns_ends_with_reward_zero(vllm_scripted, retriever, tokenizer, examples):
    env = make_env(tokenizer, retriever, max_turns=2)
    _, trees, spent = grow(vllm_scripted, env, examples, 3, seed=6)
    leaves = [n for t in trees for n in t.leaves()]
    cut = [n for n in leaves if n.finish_reason == "max_turns"]
    assert cut, "with p(search) = 3/4 some of 21 rollouts search twice"
    for n in cut:
        assert n.depth == 2 and n.action == "search" and n.argument == "American"
        assert n.observation == "" and (n.reward, n.metrics) == (0.0, {"em": 0.0, "f1": 0.0})
    for t in trees:
        check_tree(t, tokenizer, env)
        assert max(n.depth for n in t.nodes) <= 2
        assert not any(n.observation for n in t.nodes if n.depth == 2)  # no call at the cut
    assert spent.tool_calls == len(retriever.queries)


def test_max_seq_tokens_ends_with_reward_zero(vllm_scripted, retriever, tokenizer, examples):
    limit = 400
    env = make_env(tokenizer, retriever, max_turns=10, max_obs_tokens=48, max_seq_tokens=limit)
    _, trees, _ = grow(vllm_scripted, env, examples, 3, seed=7)
    cut = [(t, n) for t in trees for n in t.leaves() if n.finish_reason == "max_tokens"]
    assert cut, "a search turn adds about 60 tokens to prompts of about 260"
    for tree, n in cut:
        assert n.action == "search" and (n.reward, n.metrics) == (0.0, {"em": 0.0, "f1": 0.0})
        # its observation would not have fitted: the leaf ends on the search, within the limit
        assert n.observation == "" and n.n_policy_tokens == len(n.token_ids)
        assert len(tree.prefix_ids(n.id)) < limit
        assert len(tree.prefix_ids(n.id)) + len(env.observe([n.argument])[0][0]) >= limit
    for tree in trees:
        check_tree(tree, tokenizer, env)
        assert all(len(tree.prefix_ids(p.id)) < limit for p in tree.prefixes())
        assert {n.finish_reason for n in tree.leaves()} <= {"answer", "max_tokens"}


def test_prompt_without_room_for_a_turn_is_a_clear_error(retriever, tokenizer, examples):
    env = make_env(tokenizer, retriever)
    length = len(env.prompt(examples[0].question)[0])
    AgentLoop(None, make_env(tokenizer, retriever, max_seq_tokens=length + 1),
              SAMPLING).new_tree(examples[0])  # one token of room: fine
    with pytest.raises(ValueError, match=rf"is {length} tokens, at or over "
                                         rf"the task's max_seq_tokens \({length}, a setting of "
                                         rf"--data\.task\.init_args\)"):
        AgentLoop(None, make_env(tokenizer, retriever, max_seq_tokens=length),
                  SAMPLING).new_tree(examples[0])


@pytest.mark.parametrize("margin", [3, 1])
def test_turn_cut_at_max_seq_tokens_is_max_tokens(vllm_scripted, retriever, tokenizer, examples,
                                                  margin):
    """A greedy scripted turn is 6 tokens (``<think> film</think><search> American</search>``);
    the limit leaves ``margin`` of them (a prompt at or over it is an error, tested above)."""
    probe_env = make_env(tokenizer, retriever)
    prompt_len = len(probe_env.prompt(examples[0].question)[0])
    limit = prompt_len + margin
    env = make_env(tokenizer, retriever, max_seq_tokens=limit)
    _, (tree,), _ = grow(vllm_scripted, env, examples[:1], 1, seed=0, sampling=GREEDY)
    (leaf,) = tree.leaves()
    assert leaf.depth == 1 and leaf.reward == 0.0
    assert len(tree.flatten()[0].input_ids) <= limit
    assert leaf.finish_reason == "max_tokens"


def test_collect_step_rolls_out_the_agreed_root_plan(vllm_random, retriever, tokenizer,
                                                     examples):
    """The ranks' root plans are made one (rank 0's) before any rollout: the step opens the
    agreed prompts, whatever this process planned; stage 1 is recorded per tree."""
    from dataclasses import replace

    from trace_lightning.allocation.allocators import Allocator
    from trace_lightning.rollout.step import StepSpec, collect_step

    alloc = Allocator("uniform", roots=8, continuations=0, max_rollouts_per_prompt=4,
                      group_size=4)  # plans the first 2 candidates, 4 rollouts each
    agreed = [0, 0, 0, 0, 4, 4, 0]

    def agree(plan):
        assert plan.rollouts == [4, 4, 0, 0, 0, 0, 0]
        return replace(plan, rollouts=agreed)

    loop = AgentLoop(vllm_random, make_env(tokenizer, retriever), SAMPLING)
    step = collect_step(loop, alloc, examples,
                        StepSpec(epoch=0, seed=0, advantage="grpo", agree=agree))
    assert [t.tree_id for t in step.trees] == [examples[4].id, examples[5].id]
    assert step.root_plan == agreed and step.stage1 == [4, 4]
    assert step.budget.leaves == 8 == len(step.sequences)



def grow_with(loop, starts, seed, then, any_rank=None):
    """Grow ``starts`` as ``collect_step`` does stage 2: after each turn that reports trees,
    ``then(done)``'s starts join the next turn (``then`` None: no stage 2)."""
    if then is None:
        return loop.expand(starts, seed=seed, any_rank=any_rank)
    growth = loop.grow(starts, seed=seed, any_rank=any_rank)
    for done in growth:
        with growth.guard():
            growth.add(then(done))
    return growth.budget

def test_a_tree_branches_while_other_trees_still_run(vllm_scripted, retriever, tokenizer,
                                                    examples):
    """``grow``: a tree is reported once, as soon as all its trajectories have ended, and
    the continuations the caller adds run in the next turn's one engine call beside the
    trajectories of trees still in stage 1 (no tree waits for another)."""
    env = make_env(tokenizer, retriever, max_turns=4)
    loop = AgentLoop(vllm_scripted, env, SAMPLING)
    trees = [loop.new_tree(e) for e in examples]
    reported: list[RolloutTree] = []
    overlapped = []  # (engine calls so far, starts returned, trees still running)
    started: list[Start] = []

    def then(done: list[RolloutTree]) -> list[Start]:
        for t in done:  # every bare rollout has ended: two scored leaves, chains complete
            assert len(t.leaves()) == 2 and all(n.reward is not None for n in t.leaves())
        reported.extend(done)
        starts = [Start(t, t.prefixes()[0].id, 2) for t in done if t.prefixes()]
        started.extend(starts)
        running = [t for t in trees if not any(t is r for r in reported)]
        if starts and running:
            overlapped.append((len(vllm_scripted.calls), starts, running))
        return starts

    spent = grow_with(loop, [Start(t, 0, 2) for t in trees], 11, then)
    assert sorted(t.tree_id for t in reported) == sorted(t.tree_id for t in trees)
    assert overlapped, "p(answer) 1/4 per turn: some tree ends its stage 1 before another"
    calls, starts, running = overlapped[0]
    prompts = vllm_scripted.calls[calls][0]  # the next turn's batch
    for s in starts:
        assert prompts.count(s.tree.prefix_ids(s.node)) == 2
    for t in running:
        assert any(p[:len(t.root.token_ids)] == t.root.token_ids for p in prompts)
    assert spent.leaves == 2 * len(trees) + 2 * len(started) == sum(len(t.leaves())
                                                                    for t in trees)
    for t in trees:
        check_tree(t, tokenizer, env)


def test_any_rank_keeps_every_rank_reporting_on_the_same_turns(vllm_scripted, retriever,
                                                              tokenizer, examples):
    """With ``any_rank`` a rank whose trees are done still yields (no trees) on the turns
    another rank reports on, and loops until no rank has work; it runs no empty
    engine call meanwhile. The other rank is simulated here (its flags); the two-process
    FSDP fit in test_fit.py runs the real collective."""
    env = make_env(tokenizer, retriever, max_turns=1)  # every episode ends on turn 1
    loop = AgentLoop(vllm_scripted, env, SAMPLING)
    trees = [loop.new_tree(e) for e in examples[:2]]
    flags: list[list[bool]] = []
    reports: list[int] = []

    def any_rank(mine: list[bool]) -> list[bool]:
        peer = len(flags) < 3  # the peer reports and runs for three turns, and never fails
        flags.append(mine)
        report, more, failed = mine
        return [report or peer, more or peer, failed]

    def then(done):
        reports.append(len(done))
        return []

    spent = grow_with(loop, [Start(t, 0, 2) for t in trees], 0, then, any_rank)
    assert spent.leaves == 4 and len(vllm_scripted.calls) == 1
    assert reports == [2, 0, 0]
    # (report, more, failed) per turn
    assert flags == [[True, True, False], [False, False, False], [False, False, False],
                     [False, False, False]]


class FailingRetriever:
    """A retriever that answers ``good`` requests, then fails as a server gone down does."""

    def __init__(self, inner, good: int):
        self.inner, self.good = inner, good

    def search(self, queries, topk):
        if self.good == 0:
            raise RetrieverError("retrieval server http://127.0.0.1:1 is down (test)")
        self.good -= 1
        return self.inner.search(queries, topk)


@pytest.mark.parametrize("branching", [True, False])
def test_a_turn_failing_on_one_rank_stops_every_rank(vllm_scripted, retriever, tokenizer,
                                                     examples, branching):
    """A rank whose retriever fails raises its own error, but only after telling the others
    (the failed flag of its turn's ``any_rank``); a rank whose peer failed raises
    ``RankFailed`` on that turn instead of looping on (it would wait in its next collective
    for a peer that is gone). The same with and without stage 2 (the caller's work between
    turns)."""
    from trace_lightning.collectives import RankFailed

    then = (lambda done: []) if branching else None
    env = make_env(tokenizer, FailingRetriever(retriever, good=1), max_turns=4)
    loop = AgentLoop(vllm_scripted, env, SAMPLING)
    trees = [loop.new_tree(e) for e in examples[:2]]
    sent: list[list[bool]] = []

    def any_rank(mine):  # the peer has nothing left to do
        sent.append(mine)
        return mine

    with pytest.raises(RetrieverError, match="is down"):
        grow_with(loop, [Start(t, 0, 2) for t in trees], 0, then, any_rank)
    assert [f[2] for f in sent] == [False, True]  # the second turn's search failed

    env = make_env(tokenizer, retriever, max_turns=4)
    loop = AgentLoop(vllm_scripted, env, SAMPLING)
    trees = [loop.new_tree(e) for e in examples[:2]]
    turns = []

    def peer_fails_on_turn_2(mine):  # the peer runs on, and fails on turn 2
        turns.append(mine)
        return [mine[0], True, len(turns) == 2]

    with pytest.raises(RankFailed, match="another process failed a rollout turn"):
        grow_with(loop, [Start(t, 0, 2) for t in trees], 0, then, peer_fails_on_turn_2)
    assert len(turns) == 2


def test_a_failing_then_is_raised_on_every_rank_at_the_next_turns_flags(
        vllm_scripted, retriever, tokenizer, examples):
    """Stage 2 (the caller's work between turns inside ``Growth.guard``: planning, the
    oracle's probe rollouts) failing on one rank: it runs no more turns, tells the others
    at the next turn's flags, then raises its error."""
    env = make_env(tokenizer, retriever, max_turns=1)  # every episode ends on turn 1
    loop = AgentLoop(vllm_scripted, env, SAMPLING)
    trees = [loop.new_tree(e) for e in examples[:2]]
    sent = []

    def then(done):
        raise ValueError("planning failed (test)")

    def any_rank(mine):  # a peer with work left, which never fails itself
        sent.append(mine)
        return [mine[0], True, mine[2]]

    with pytest.raises(ValueError, match="planning failed"):
        grow_with(loop, [Start(t, 0, 2) for t in trees], 0, then, any_rank)
    assert sent == [[True, True, False], [False, False, True]]
    assert len(vllm_scripted.calls) == 1


def _stage_two_rank_worker(rank: int, world: int, out_dir: str, model_dir: str, corpus: str,
                           cache_dir: str, max_turns: tuple[int, int] = (1, 4),
                           fail_rank: int | None = None) -> None:
    """One rank of a two-process ``collect_step`` with ``trace``: the scripted policy samples
    (transformers engine), and the predictions run the featuriser through an FSDP-wrapped
    copy, each of whose forwards is a collective, on the turns the rank's trees end.
    ``fail_rank``: that rank's retriever fails after its first request; each rank writes
    the error it stopped with."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    from trace_lightning.allocation.allocators import Allocator
    from trace_lightning.rollout.step import StepSpec, collect_step
    from trace_lightning.collectives import any_rank, from_rank0
    from trace_lightning.allocation.features import node_features

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = script_weights(AutoModelForCausalLM.from_pretrained(model_dir).eval(), tokenizer)
    wrapped = FSDP(copy.deepcopy(policy), device_id=torch.device("cpu"),
                   auto_wrap_policy=ModuleWrapPolicy({Qwen3DecoderLayer}))
    calls: list[int] = []

    def predict(trees: list[RolloutTree]) -> None:
        calls.append(len(trees))
        node_features(wrapped, trees, batch_tokens=1)  # one forward (collective) per path
        for t in trees:
            for n in [t.root, *t.prefixes()]:
                n.prediction = 0.5

    # by default rank 0's episodes end on turn 1 (its pool is spent at once), rank 1's run
    # to 4 turns
    retriever = BM25Retriever(corpus, cache_dir=cache_dir)
    if rank == fail_rank:
        retriever = FailingRetriever(retriever, good=1)
    env = make_env(tokenizer, retriever, max_turns=max_turns[rank])
    loop = AgentLoop(HFEngine(policy, tokenizer=tokenizer), env, SAMPLING)
    examples = load_qa(Path(corpus).parent / "dev_distractor.jsonl", limit=12)
    alloc = Allocator("trace", roots=16, continuations=1, max_rollouts_per_prompt=2,
                      group_size=2)
    try:
        step = collect_step(loop, alloc, examples, StepSpec(
            epoch=0, seed=rank, advantage="grpo", predict=predict, predictor_nodes_seen=1,
            shard=(rank, world), agree=from_rank0, any_rank=any_rank))
        json_out = {"calls": calls, "leaves": step.budget.leaves,
                    "continuations": sum(n.continuations for t in step.trees for n in t.nodes)}
    except Exception as e:  # written, not raised: spawn would kill the other rank
        json_out = {"error": type(e).__name__, "message": str(e)}
    try:
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(json_out))
    finally:
        # The FSDP copy holds the process group and outlives its names (reference cycles,
        # and an error's traceback): left to interpreter exit, the group's gloo threads
        # would stop during finalisation, where a C++ thread asking for the GIL is ended
        # mid-destructor ("terminate called without an active exception", SIGABRT). Free
        # it first, so that the group goes here.
        del wrapped, predict, loop
        gc.collect()
        leave_group()


def test_ranks_branch_on_turns_of_their_own_and_still_meet(model_dir, shared_data, bm25,
                                                           tmp_path):
    """Two processes (gloo): each rank's trees end their stage 1 on turns of its own, and its
    predictions are FSDP collectives; ``any_rank`` has both predict on every turn either
    needs (with no trees when none of its own ended), so the step ends instead of hanging,
    and the two ranks' leaves add up to the one budget."""
    torch.multiprocessing.spawn(
        _stage_two_rank_worker, nprocs=2, join=True,
        args=(2, str(tmp_path), str(model_dir), str(shared_data / "hotpotqa" / "corpus.jsonl"),
              str(bm25.index_dir.parent)))
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["leaves"] + r1["leaves"] == 16 * 2
    assert len(r0["calls"]) == len(r1["calls"]) >= 3  # the roots, then the same turns
    # rank 0 reported all its trees on turn 1 and spent its pool (one-turn episodes have no
    # prefix); it then predicts nothing on each turn rank 1 reports on
    assert r0["calls"][1] > 0 and set(r0["calls"][2:]) == {0} and r0["continuations"] == 0
    assert r1["continuations"] > 0


def test_a_retriever_failing_on_one_rank_stops_both(model_dir, shared_data, bm25, tmp_path):
    """Two processes (gloo), ``trace``: rank 1's retriever goes down after its first
    request. Rank 1 stops with the retriever's error, and rank 0, which has its own
    trajectories still running, stops on the same turn with ``RankFailed`` (before, it went
    on into its next collective, where under NCCL it waited for the process group's
    timeout)."""
    torch.multiprocessing.spawn(
        _stage_two_rank_worker, nprocs=2, join=True,
        args=(2, str(tmp_path), str(model_dir), str(shared_data / "hotpotqa" / "corpus.jsonl"),
              str(bm25.index_dir.parent), (4, 4), 1))
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r1["error"] == "RetrieverError" and "is down" in r1["message"]
    assert r0["error"] == "RankFailed", r0
    assert "another process failed a rollout turn" in r0["message"]


# ---- the transformers engine -----------------------------------------------------------------

def test_hf_engine_grows_trees_of_the_same_shape(vllm_random, policies, retriever, tokenizer,
                                                 examples):
    env = make_env(tokenizer, retriever)
    hf = HFEngine(policies["random"], tokenizer=tokenizer, batch_size=32)
    _, v_trees, v_spent = grow(vllm_random, env, examples, 3, seed=8)
    _, h_trees, h_spent = grow(hf, env, examples, 3, seed=8)
    assert v_spent.leaves == h_spent.leaves == 3 * len(examples)
    for v, h in zip(v_trees, h_trees):
        check_tree(h, tokenizer, env)
        assert h.root.token_ids == v.root.token_ids
        assert signature(h) == signature(v)  # all garbage: three invalid depth-1 leaves
        assert [n.text for n in h.nodes[1:]] != [n.text for n in v.nodes[1:]]


def test_hf_and_vllm_agree_on_a_greedy_scripted_policy(vllm_scripted, policies, retriever,
                                                       tokenizer, examples):
    """Greedy, the scripted policy always searches: both engines grow the same trees, token for
    token, up to ``max_turns``; only the behaviour log-probs differ in rounding."""
    env = make_env(tokenizer, retriever, max_turns=3)
    hf = HFEngine(policies["scripted"], tokenizer=tokenizer, batch_size=32)
    _, v_trees, v_spent = grow(vllm_scripted, env, examples[:3], 2, seed=9, sampling=GREEDY)
    _, h_trees, h_spent = grow(hf, env, examples[:3], 2, seed=9, sampling=GREEDY)
    assert h_spent.generated_tokens == v_spent.generated_tokens
    assert h_spent.tool_calls == v_spent.tool_calls == 3 * 2 * 2
    for v, h in zip(v_trees, h_trees):
        check_tree(h, tokenizer, env)
        assert signature(h) == signature(v)
        assert [n.token_ids for n in h.nodes] == [n.token_ids for n in v.nodes]
        assert {n.finish_reason for n in h.leaves()} == {"max_turns"}
        for hn, vn in zip(h.nodes, v.nodes):
            torch.testing.assert_close(torch.tensor(hn.logprobs), torch.tensor(vn.logprobs),
                                       atol=1e-3, rtol=0)


def test_prefix_kind_predicts_only_the_opened_trees_and_branches_where_planned(
        vllm_scripted, retriever, tokenizer, examples):
    """``prefix`` (random_tree's roots, trace's prefixes): stage 1 opens the first M/G
    candidates without predicting any (its plan reads none), and each tree is predicted
    once its bare rollouts end, then branched where ``solve_prefixes`` puts the budget:
    with every prefix predicted 1.0, only failed rollouts' prefixes gain (q = 1 - r), and
    each tree spends its own m_i N = 2 there. (Seed 0: the first tree's rollout 1 succeeds
    through one prefix beside three failed ones, where random prefixes would land with
    probability 1 - (3/4)^2.)"""
    from trace_lightning.allocation.allocators import Allocator
    from trace_lightning.rollout.step import StepSpec, collect_step

    alloc = Allocator("prefix", roots=4, continuations=1, max_rollouts_per_prompt=4,
                      group_size=2)
    predicted: list[list[str]] = []

    def predict(trees: list[RolloutTree]) -> None:
        predicted.append([t.tree_id for t in trees])
        for t in trees:
            for n in [t.root, *t.prefixes()]:
                n.prediction = 1.0

    loop = AgentLoop(vllm_scripted, make_env(tokenizer, retriever, max_turns=3), SAMPLING)
    step = collect_step(loop, alloc, examples, StepSpec(
        epoch=0, seed=0, advantage="grpo", predict=predict, predictor_nodes_seen=10**6))
    opened = [examples[0].id, examples[1].id]
    assert step.root_plan == [2, 2] + [0] * (len(examples) - 2) and not step.cold_start
    assert [t.tree_id for t in step.trees] == opened
    assert sorted(i for call in predicted for i in call) == opened  # each opened tree once
    assert step.budget.leaves == 8 == len(step.sequences) and step.stage1 == [2, 2]
    success_prefixes = 0
    for t in step.trees:
        failed = {j for j in range(2) if bare_reward(t, j) == 0.0}
        success_prefixes += sum(n.rollout not in failed for n in t.prefixes() if n.rollout in (0, 1))
        for n in t.nodes:
            if n.continuations:  # a prefix of a stage-1 bare rollout that failed
                assert n.rollout in failed and n.prediction == 1.0
        assert sum(n.continuations for n in t.nodes) == 2
    assert success_prefixes > 0, "a successful rollout's prefix, where random prefixes could land"
    assert step.unspent == 0


def test_resting_roots_reach_the_root_plan(vllm_scripted, retriever, tokenizer, examples):
    """The roots ``predict`` marks resting (as ``PromptHistory.adjust`` does) are left closed
    by stage 1: ``prompt`` with L = 4 on predictions favouring the
    first candidates opens the next two instead."""
    from trace_lightning.allocation.allocators import Allocator
    from trace_lightning.rollout.step import StepSpec, collect_step

    alloc = Allocator("prompt", roots=4, continuations=0, max_rollouts_per_prompt=2,
                      group_size=2)

    def predict(trees: list[RolloutTree]) -> None:
        for i, t in enumerate(trees):
            t.root.prediction = 0.5 if i < 4 else 0.9
            t.root.resting = i < 2

    loop = AgentLoop(vllm_scripted, make_env(tokenizer, retriever, max_turns=1), SAMPLING)
    step = collect_step(loop, alloc, examples, StepSpec(
        epoch=0, seed=0, advantage="grpo", predict=predict, predictor_nodes_seen=10**6))
    assert step.root_plan == [0, 0, 2, 2] + [0] * (len(examples) - 4)
    assert [t.tree_id for t in step.trees] == [examples[2].id, examples[3].id]


def test_oracle_predict_estimates_success_by_extra_rollouts(vllm_scripted, retriever,
                                                             tokenizer, examples):
    """``oracle_predict`` on the scripted policy, whose success odds are known by hand.

    Each turn answers with p = 1/4 and is right with p = 1/2 on a yes/no question (never on
    another), and the episode ends after ``max_turns`` = 3 turns; so from a node at depth d
    success is sum_{j < 3 - d} (1/8) (3/4)^j = (1 - (3/4)^(3 - d)) / 2:
    0.2891 at the root, 0.2188 after one search, 0.125 after two. A probe that restarted the
    turn count (depth 0) would score every prefix 0.289. Probes cost no budget and leave the
    trees as they were; a node already predicted is not probed again.
    """
    from trace_lightning.rollout.step import oracle_predict

    env = make_env(tokenizer, retriever, max_turns=3)
    yes_no = [e for e in examples if e.answers[0] in ("yes", "no")]
    other = [e for e in examples if e.answers[0] not in ("yes", "no")][:1]
    loop, trees, _ = grow(vllm_scripted, env, yes_no + other, 8, seed=3)
    shapes = [signature(t) for t in trees]
    engine = RecordingEngine(vllm_scripted)
    counted = []  # the step's progress (leaves finished): probes are not among them
    probing = AgentLoop(engine, env, SAMPLING, on_leaves=counted.append)
    predict = oracle_predict(probing, samples=100, seed=0)
    predict(trees)
    assert [signature(t) for t in trees] == shapes  # probes are separate trees
    assert counted == [] and probing.on_leaves == counted.append
    assert probing.tool_s == 0.0  # the probes' searches are "predict" time
    by_depth: dict[int, list[float]] = {}
    for t in trees[:len(yes_no)]:
        for n in [t.root, *t.prefixes()]:
            by_depth.setdefault(n.depth, []).append(n.prediction)
    assert sorted(by_depth) == [0, 1, 2], "8 rollouts of p(search) 3/4 reach depth 2"
    for depth, want in {0: 0.2891, 1: 0.2188, 2: 0.125}.items():
        # 100 samples a node, at least 2 nodes: >= 200 samples a depth, sd <= 0.036
        assert len(by_depth[depth]) >= 2, (depth, by_depth[depth])
        got = sum(by_depth[depth]) / len(by_depth[depth])
        assert got == pytest.approx(want, abs=0.08), (depth, by_depth[depth])
    assert all(n.prediction == 0.0 for n in [trees[-1].root, *trees[-1].prefixes()])
    calls = len(engine.calls)
    predict(trees)
    assert len(engine.calls) == calls  # every node already has its prediction
    # stage 2 calls the oracle once per turn: two calls on the same question draw fresh
    # samples, not the same ones again
    fresh = [loop.new_tree(yes_no[0]) for _ in range(2)]
    predict([fresh[0]])
    first = [o[0].token_ids for o in engine.calls[-1][1]]
    predict([fresh[1]])
    assert [o[0].token_ids for o in engine.calls[-1][1]] != first


@pytest.mark.parametrize("nodes", ["roots", "prefixes"])
def test_oracle_on_one_stage_leaves_the_other_to_the_learned_predictions(
        vllm_scripted, retriever, tokenizer, examples, nodes):
    """``oracle_predict(nodes=...)`` probes one stage's nodes only; the other stage keeps the
    learned predictions (here a stand-in that sets 0.77 everywhere, run first on every call).
    A second call, as stage 2 makes on trees stage 1 predicted, probes nothing again and
    puts the probed estimates back over the learned ones."""
    from trace_lightning.rollout.step import oracle_predict

    env = make_env(tokenizer, retriever, max_turns=3)
    yes_no = [e for e in examples if e.answers[0] in ("yes", "no")][:2]
    _, trees, _ = grow(vllm_scripted, env, yes_no, 8, seed=3)
    assert all(t.prefixes() for t in trees)
    learned_calls = []

    def learned(ts: list[RolloutTree]) -> None:
        learned_calls.append(len(ts))
        for t in ts:
            for n in [t.root, *t.prefixes()]:
                n.prediction = 0.77

    engine = RecordingEngine(vllm_scripted)
    predict = oracle_predict(AgentLoop(engine, env, SAMPLING), samples=4, seed=0,
                             nodes=nodes, learned=learned)
    predict(trees)
    probed = [n.prediction for t in trees
              for n in ([t.root] if nodes == "roots" else t.prefixes())]
    kept = [n.prediction for t in trees
            for n in (t.prefixes() if nodes == "roots" else [t.root])]
    assert all(p in (0.0, 0.25, 0.5, 0.75, 1.0) for p in probed)  # 4 probes each
    assert kept == [0.77] * len(kept)
    calls = len(engine.calls)
    predict(trees)
    assert len(engine.calls) == calls and learned_calls == [2, 2]
    assert [n.prediction for t in trees
            for n in ([t.root] if nodes == "roots" else t.prefixes())] == probed
    with pytest.raises(ValueError, match="need the learned predictions"):
        oracle_predict(AgentLoop(engine, env, SAMPLING), samples=4, seed=0, nodes=nodes)


@pytest.mark.parametrize("max_turns, overlap", [(1, True), (3, True), (3, False)])
def test_collect_step_spends_stage_two_per_tree(vllm_scripted, retriever, tokenizer, examples,
                                                max_turns, overlap):
    """random_tree at 2 prompts x 2 bare rollouts + 1 continuation each (8 leaves). With one
    turn per episode there is no prefix: all 4 continuations become extra bare rollouts,
    round robin (rollouts 2 and 3 of each tree, after stage 1's 0 and 1). With three turns
    each continuation hangs under a planned prefix of a bare rollout, in that rollout's
    subtree, and a tree's leaves are its bare rollouts plus its continuations."""
    from trace_lightning.allocation.allocators import Allocator
    from trace_lightning.rollout.step import StepSpec, collect_step

    alloc = Allocator("random_tree", roots=4, continuations=1, max_rollouts_per_prompt=4,
                      group_size=2)
    slow = SlowRetriever(retriever.inner, delay_s=0.05)
    loop = AgentLoop(vllm_scripted, make_env(tokenizer, slow, max_turns=max_turns), SAMPLING)
    calls = len(vllm_scripted.calls)
    tic = time.perf_counter()
    step = collect_step(loop, alloc, examples,
                        StepSpec(epoch=0, seed=5, advantage="grpo", overlap=overlap))
    wall = time.perf_counter() - tic
    assert step.engine_calls == len(vllm_scripted.calls) - calls > 0
    # the searches' time is its own phase, taken out of "rollout" (not counted twice)
    assert (slow.calls > 0) == (max_turns > 1)
    assert step.seconds["tools"] >= 0.05 * slow.calls
    assert sum(step.seconds.values()) <= wall
    assert step.budget.leaves == 8 == len(step.sequences) and step.stage1 == [2, 2]
    bare = [len(t.bare_rollouts()) for t in step.trees]
    if max_turns == 1:
        assert step.unspent == 4 and bare == [4, 4]
        for t in step.trees:
            assert [t.nodes[i].rollout for i in t.bare_rollouts()] == [0, 1, 2, 3]
            assert all(n.parent == 0 for n in t.leaves())
        return
    planned = [sum(n.continuations for n in t.nodes) for t in step.trees]
    assert sum(planned) > 0, "p(search) 3/4: some bare rollout has a prefix"
    assert sum(planned) + step.unspent == 4
    for t, extra in zip(step.trees, planned):
        assert len(t.leaves()) == len(t.bare_rollouts()) + extra
        for n in t.nodes:
            if n.continuations:  # a non-leaf prefix of a stage-1 bare rollout
                assert not n.finished and n.depth >= 1 and n.rollout in (0, 1)
                grown = [c for c in n.children if t.nodes[c].rollout == n.rollout]
                assert len(grown) == 1 + n.continuations  # its own turn and the new ones
