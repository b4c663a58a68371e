"""Warm start: supervised fine-tuning of the demo policy on gold search trajectories.

A gold trajectory is built through the real environment, exactly as the agent loop builds
a rollout: the prompt's ids from ``env.prompt``, each turn's text tokenised, and after every
search the observation ids from ``env.observe`` (the real retriever). It is stored as a
one-leaf :class:`~trace_lightning.tree.RolloutTree`, so ``flatten()`` gives the training
sequence and the policy mask (1 on turn tokens, 0 on prompt and observation tokens).

Demonstrations come from many worlds (each with its own BM25 index), each question used
about once: a tiny model that sees the same world's facts over and over memorises them
(a low loss on that world, no success on another), while fresh names leave copying from
the observation as the only way to lower the loss.

Noisy demonstrations (a share ``noise`` of the trajectories) make one reading error: at a
random hop they copy another entity of the right kind (a namesake's, from the observation
when one is there) and follow the world from it, so they usually end in a wrong answer.

The loss is the token-mean cross-entropy on policy tokens:
``L = -sum_t m_t log p(x_t | x_<t) / sum_t m_t`` with ``m`` the policy mask; optionally
plus ``context_weight`` times the same on prompt and observation tokens (``sft_loss``).
"""

from __future__ import annotations

import copy
import logging
import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from trace_lightning.tasks.search_qa.demo.world import World, fact_phrase, gold_turns, relation
from trace_lightning.tasks.search_qa.environment import SearchEnvironment, parse_turn
from trace_lightning.tasks.search_qa.retrieval import BM25Retriever
from trace_lightning.tasks.base import Example
from trace_lightning.tasks.sft import fit_demonstrations
from trace_lightning.tree import RolloutTree

log = logging.getLogger(__name__)


def _noisy_chain(question: dict, world: World, rng: random.Random) -> tuple[list[str], int]:
    """A chain with one reading error at a random hop k >= 1; returns (chain, k)."""
    chain = question["chain"]
    path = [relation(world, a, b) for a, b in zip(chain, chain[1:])]
    k = rng.randrange(1, len(chain))
    subject = chain[k - 1]
    # Prefer what a namesake's document says (what misreading the observation would copy);
    # else any other entity of the right kind.
    namesakes = [n for n, e in world.entities.items()
                 if n != subject and e.kind == world.entities[subject].kind
                 and set(n.split()) & set(subject.split())]
    options = sorted({world.entities[n].relations[path[k - 1]] for n in namesakes} - {chain[k]})
    if not options:
        kind = world.entities[chain[k]].kind
        options = sorted(n for n, e in world.entities.items() if e.kind == kind and n != chain[k])
    new = chain[:k] + [rng.choice(options)]
    for rel in path[k:]:
        new.append(world.entities[new[-1]].relations[rel])
    return new, k


def demonstration_turns(question: dict, world: World, noisy: bool = False,
                        rng: random.Random | None = None) -> list[str]:
    """The turns of a gold (or, with ``noisy``, a one-error) demonstration."""
    if not noisy:
        return gold_turns(question, world)
    chain, k = _noisy_chain(question, world, rng or random.Random(0))
    true = question["chain"]
    turns = [f"<think> find {chain[0]}</think><search> {chain[0]}</search>"]
    for j in range(1, len(chain)):
        if j == k:  # the misread: the right phrase with the wrong entity copied
            phrase = fact_phrase(world, true[j - 1], true[j])
            phrase = phrase[: len(phrase) - len(true[j])] + chain[j]
        else:
            phrase = fact_phrase(world, chain[j - 1], chain[j])
        tag = "answer" if j == len(chain) - 1 else "search"
        turns.append(f"<think> {phrase}</think><{tag}> {chain[j]}</{tag}>")
    return turns


def gold_trees(env: SearchEnvironment, world: World, questions: Sequence[dict] | None = None,
               noise: float = 0.0, seed: int = 0) -> list[RolloutTree]:
    """One single-path tree per question, built through ``env`` (prompt, real observations).

    Turns are processed hop by hop with one batched retriever call per hop. A trajectory
    whose observation misses the document its next turn reads (possible with a weak
    retriever) is dropped, so every kept demonstration is one a policy could have followed.
    Rewards come from ``env.score`` (1 for gold demonstrations, usually 0 for noisy ones).

    Args:
        env: the search environment (its tokenizer, retriever, prompt and observations).
        world: the world the questions come from.
        questions: QA records with ``chain``; default ``world.questions``.
        noise: share of demonstrations with one reading error, in [0, 1].
        seed: RNG seed of the noise.
    """
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"warm start noise ({noise}) must be in [0, 1]")
    rng = random.Random(seed)
    questions = list(world.questions if questions is None else questions)
    trees, all_turns, nodes = [], [], []
    for q in questions:
        ids, text = env.prompt(q["question"])
        trees.append(RolloutTree.new(q["id"], q["question"], q["answers"], ids, text,
                                     dataset=q["dataset"]))
        all_turns.append(demonstration_turns(q, world, rng.random() < noise, rng))
        nodes.append(0)
    alive = list(range(len(trees)))
    depth = 0
    while alive:
        actions = {i: parse_turn(all_turns[i][depth]) for i in alive}
        for i, a in actions.items():
            assert a.kind != "invalid", f"demonstration turn does not parse: {a.error}"
        searching = [i for i in alive if actions[i].kind == "search"]
        observed = dict(zip(searching, env.observe([actions[i].argument for i in searching])))
        keep = []
        for i in alive:
            turn = all_turns[i][depth]
            gen = env.tokenizer.encode(turn, add_special_tokens=False)
            obs_ids, obs_text = observed.get(i, ([], ""))
            finished = actions[i].kind == "answer"
            node = trees[i].add_child(
                nodes[i], rollout=0 if depth == 0 else None, token_ids=gen + list(obs_ids),
                logprobs=[0.0] * (len(gen) + len(obs_ids)),
                policy_mask=[1] * len(gen) + [0] * len(obs_ids), text=turn,
                observation=obs_text, action=actions[i].kind, argument=actions[i].argument,
                finished=finished, finish_reason="answer" if finished else "")
            nodes[i] = node.id
            if finished:
                q = questions[i]
                node.reward, node.metrics = env.score(
                    actions[i], Example(q["id"], q["question"], q["answers"]))
                trees[i].compute_values()
                continue
            # The next turn's thought copies a fact about this search's entity: its document
            # must be in the observation.
            if f"(Title: {actions[i].argument})" in obs_text:
                keep.append(i)
            else:
                trees[i] = None  # type: ignore[call-overload]
        alive = keep
        depth += 1
    return [t for t in trees if t is not None]


def world_env(env: SearchEnvironment, world: World) -> SearchEnvironment:
    """``env`` (tokenizer, prompt, observation settings) searching ``world`` with BM25."""
    out = copy.copy(env)
    out.retriever = BM25Retriever.from_documents(world.documents)
    return out


def warm_start(model_dir: str | Path, worlds: World | Sequence[World], env: SearchEnvironment,
               steps: int = 300, batch_size: int = 16, lr: float = 3e-3, warmup: int = 20,
               noise: float = 0.0, context_weight: float = 0.0, weight_decay: float = 0.0,
               stop_loss: float | None = None, seed: int = 0, log_every: int = 50,
               num_threads: int | None = None) -> dict:
    """Fine-tune the model in ``model_dir`` on gold trajectories and save it back.

    Args:
        model_dir: a directory ``from_pretrained`` loads (the tiny model); overwritten with
            the trained weights (``save_pretrained``), so transformers and vLLM load it.
        worlds: the worlds whose questions are demonstrated (all of each world's questions).
        env: the environment the demonstrations go through: its tokenizer (the model's),
            prompt and observation settings; each world is searched by a BM25 index over
            its own documents (``world_env``).
        steps: optimizer steps, at most (0 saves nothing and returns at once).
        batch_size: trajectories per step; each pass over the demonstrations uses each
            once, in batches of similar length (``batch_order``).
        lr: AdamW learning rate (linear warmup, then constant).
        warmup: warmup steps.
        noise: share of noisy demonstrations (one reading error each).
        context_weight: weight of the language-model loss on prompt and observation tokens
            (0: policy tokens only); see ``sft_loss``.
        weight_decay: AdamW weight decay.
        stop_loss: stop early once the mean loss of the last 50 steps is at most this
            (None: run all ``steps``). Held-out success follows the loss more closely than
            the step count: the loss falls in a sudden drop whose timing varies by a
            hundred steps or more between seeds.
        seed: seed of the noise, the batch order and torch.
        log_every: log the mean loss every this many steps (0: never).
        num_threads: torch CPU threads while training (restored after); None keeps torch's
            setting. On a busy machine 1 thread is several times faster per step than
            threads that spin waiting for each other.

    Returns:
        ``{"losses": [...], "steps": int, "n_demos": int, "n_dropped": int,
        "demo_reward": float, "seconds": float}`` (``steps``: the steps actually run).
    """
    if stop_loss is not None and stop_loss <= 0:
        raise ValueError(f"warm start stop_loss ({stop_loss}) must be > 0 or None")
    if steps < 0 or batch_size < 1 or lr <= 0:
        raise ValueError(f"warm start needs steps >= 0 ({steps}), batch_size >= 1 "
                         f"({batch_size}) and lr > 0 ({lr})")
    start = time.perf_counter()
    worlds = [worlds] if isinstance(worlds, World) else list(worlds)
    trees = [t for k, w in enumerate(worlds)
             for t in gold_trees(world_env(env, w), w, noise=noise, seed=seed + k)]
    seqs = [s for t in trees for s in t.flatten()]
    n_questions = sum(len(w.questions) for w in worlds)
    stats = {"losses": [], "steps": 0, "n_demos": len(seqs), "n_dropped": n_questions - len(trees),
             "demo_reward": sum(s.reward for s in seqs) / max(len(seqs), 1), "seconds": 0.0}
    if steps == 0:
        return stats
    if not seqs:
        raise ValueError("warm start has no demonstrations: every question's chain missed "
                         "its document in the retriever's top-k; raise env topk")
    threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        fit_demonstrations(model_dir, seqs, stats, steps, batch_size, lr, warmup, weight_decay,
                           context_weight, stop_loss, seed, log_every,
                           env.tokenizer.pad_token_id,
                           lr_flag="warm_start_lr in --data.task.init_args.demo.options")
    finally:
        torch.set_num_threads(threads)
    stats["seconds"] = time.perf_counter() - start
    return stats


