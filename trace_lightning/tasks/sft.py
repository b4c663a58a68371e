"""Supervised fine-tuning on demonstrations: how a task warm-starts its tiny policy.

A demonstration is a :class:`~trace_lightning.tree.LeafSequence` (token ids and the policy
mask: 1 on turn tokens, 0 on prompt and observation tokens), built by the task through its
real environment. The loss is the token-mean cross-entropy on policy tokens,
``L = -sum_t m_t log p(x_t | x_<t) / sum_t m_t`` with ``m`` the policy mask, optionally plus
``context_weight`` times the same on prompt and observation tokens (``sft_loss``).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from trace_lightning.console import duration
from trace_lightning.tree import LeafSequence

log = logging.getLogger(__name__)


def sft_loss(model: torch.nn.Module, input_ids: torch.Tensor, policy_mask: torch.Tensor,
             attention_mask: torch.Tensor | None = None,
             context_weight: float = 0.0) -> torch.Tensor:
    """Token-mean cross-entropy on policy tokens, plus optionally on the context.

    ``L = mean_{t: m_t = 1} nll_t + w * mean_{t: m_t = 0, a_t = 1} nll_t`` with ``m`` the
    policy mask, ``a`` the attention mask (real tokens) and ``w = context_weight``. With
    ``w = 0`` (the default) only the policy's tokens are trained on. ``w > 0`` adds a
    language-model loss on the prompt and the observations, a stand-in for the pretraining
    a real LLM brings (reading documents, repeating names).

    No attention mask is passed to the model: right padding never reaches a real token
    under the causal mask and is never a target, so mask-free (faster) attention gives the
    same loss.

    Args:
        input_ids: (B, T) right-padded token ids.
        policy_mask: (B, T) 1 on tokens the policy generated, 0 on prompt, observation and
            padding.
        attention_mask: (B, T) 1 on real tokens; needed only when ``context_weight > 0``.
        context_weight: weight of the context loss.
    """
    logits = model(input_ids=input_ids).logits  # (B, T, V)
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, T-1, V)
    target = input_ids[:, 1:]  # (B, T-1)
    nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (B, T-1)
    mask = policy_mask[:, 1:].to(nll.dtype)  # (B, T-1)
    loss = (nll * mask).sum() / mask.sum().clamp(min=1.0)
    if context_weight > 0:
        if attention_mask is None:
            raise ValueError("sft_loss: context_weight > 0 needs the attention_mask")
        ctx = attention_mask[:, 1:].to(nll.dtype) * (1 - mask)  # (B, T-1)
        loss = loss + context_weight * (nll * ctx).sum() / ctx.sum().clamp(min=1.0)
    return loss


def collate(seqs: Sequence[LeafSequence], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad leaf sequences into (B, T) tensors."""
    width = max(len(s.input_ids) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # (B, T)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)  # (B, T)
    pmask = torch.zeros((len(seqs), width), dtype=torch.long)  # (B, T)
    for b, s in enumerate(seqs):
        n = len(s.input_ids)
        ids[b, :n] = torch.tensor(s.input_ids)
        attn[b, :n] = 1
        pmask[b, :n] = torch.tensor(s.policy_mask)
    return {"input_ids": ids, "attention_mask": attn, "policy_mask": pmask}


def batch_order(lengths: Sequence[int], batch_size: int, seed: int,
                 group: int = 8) -> Iterator[list[int]]:
    """Endless batches of indices: each pass over the data is shuffled, cut into groups of
    ``group`` batches, each group sorted by length and split into batches, and the batches
    shuffled. Similar lengths share a batch, so little compute goes to padding, while every
    example is still used once per pass.
    """
    rng = random.Random(seed)
    while True:
        perm = list(range(len(lengths)))
        rng.shuffle(perm)
        span = batch_size * group
        batches = []
        for start in range(0, len(perm), span):
            chunk = sorted(perm[start:start + span], key=lambda i: lengths[i])
            batches += [chunk[k:k + batch_size] for k in range(0, len(chunk), batch_size)]
        rng.shuffle(batches)
        yield from batches


def fit_demonstrations(model_dir: str | Path, seqs: Sequence[LeafSequence], stats: dict,
                       steps: int, batch_size: int, lr: float, warmup: int,
                       weight_decay: float, context_weight: float, stop_loss: float | None,
                       seed: int, log_every: int, pad: int, lr_flag: str) -> None:
    """Fine-tune the model in ``model_dir`` on ``seqs`` and save it back (``save_pretrained``).

    AdamW with a linear warmup of ``warmup`` steps, then a constant rate; gradients clipped
    at norm 1. Each step's loss is appended to ``stats["losses"]`` and ``stats["steps"]``
    counts the steps run. Every ``log_every`` steps it logs the mean loss, the time so far and
    the most time left (all ``steps``; it stops early once the mean loss of the last 50 steps
    is at most ``stop_loss``). A non-finite loss raises before anything is saved, naming
    ``lr_flag``, the flag that sets ``lr``.
    """
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay,
                            betas=(0.9, 0.95))

    # Linear warmup, then a constant rate. Copying from the observation is learnt in a
    # sudden drop of the loss after a plateau, and any decay of the rate (cosine, or a
    # decay over the last steps) delays that drop.

    def lr_at(step: int) -> float:
        return min(1.0, (step + 1) / warmup)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    batches = batch_order([len(s.input_ids) for s in seqs], batch_size, seed)
    start = time.perf_counter()
    for step in range(steps):
        batch = collate([seqs[i] for i in next(batches)], pad)
        loss = sft_loss(model, batch["input_ids"], batch["policy_mask"],
                        batch["attention_mask"], context_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if not math.isfinite(loss.item()):
            raise FloatingPointError(
                f"warm start: loss {loss.item()} at step {step + 1} (lr {lr}); nothing was "
                f"saved. Lower the learning rate: {lr_flag}")
        stats["losses"].append(loss.item())
        stats["steps"] = step + 1
        if log_every and (step + 1) % log_every == 0:
            recent = stats["losses"][-log_every:]
            spent = time.perf_counter() - start
            more = f", stops at loss {stop_loss}" if stop_loss is not None else ""
            log.info("warm start: step %d/%d, loss %.4f, %s (at most %s more%s)", step + 1,
                     steps, sum(recent) / len(recent), duration(spent),
                     duration(spent / (step + 1) * (steps - step - 1)), more)
        last = stats["losses"][-50:]
        if stop_loss is not None and len(last) == 50 and sum(last) / 50 <= stop_loss:
            log.info("warm start: reached loss %.4f <= %s at step %d (%s)", sum(last) / 50,
                     stop_loss, step + 1, duration(time.perf_counter() - start))
            break
    model.eval()
    model.save_pretrained(model_dir)
