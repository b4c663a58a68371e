"""transformers rollout engine: a batched, KV-cached sampling loop on any causal LM.

The fallback where vLLM does not run, and a reference for it. It speaks the same protocol:
token ids in, new token ids + their log-probs under the distribution sampled from (after
temperature and top-p, like vLLM's ``processed_logprobs``; ``base.SamplingConfig``) out.

Its own loop instead of ``model.generate`` gives each sample its own ``torch.Generator``
(sample k of prompt i seeded with ``seed + i * n + k``, as in vLLM) and vLLM's stop
semantics: a stop string is matched on the decoded new text (special tokens skipped), the
token that completes it ends the completion and is kept; EOS ends it too and is kept in
``token_ids``.
Prompts are left-padded; there is no prefix cache, so ``cached_tokens`` is always 0.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedTokenizerBase

from trace_lightning.rollout.engines.base import Completion, SamplingConfig
from trace_lightning.rollout.engines.sync import policy_logprobs


class HFEngine:
    """Rollout engine on a transformers model.

    Args:
        model: a ``save_pretrained`` directory, or a loaded causal LM (shared, not copied: an
            engine built on the policy module itself needs no weight sync).
        tokenizer: needed for stop strings; default: loaded from ``model`` when it is a path.
        dtype: weight dtype when loading from a path.
        device: where the model runs when loading from a path.
        batch_size: sequences (prompts x n) per forward batch.
        seed: seed of requests that do not set one.
    """

    def __init__(self, model: str | Path | nn.Module,
                 tokenizer: str | PreTrainedTokenizerBase | None = None,
                 dtype: str = "float32", device: str = "cpu", batch_size: int = 32,
                 seed: int = 0) -> None:
        if isinstance(model, nn.Module):
            self.model = model
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                model, dtype=getattr(torch, dtype)).to(device)
            if tokenizer is None:
                tokenizer = str(model)
        if isinstance(tokenizer, (str, Path)):
            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.awake = True
        self.default_generator = torch.Generator().manual_seed(seed)
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)  # vLLM stops on it too
        pad = self.model.generation_config.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids, default=0)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 n: int = 1) -> list[list[Completion]]:
        """``n`` completions per prompt; sample k of prompt i is seeded with
        ``sampling.seed + i * n + k`` (its own ``torch.Generator``)."""
        if sampling.stop and self.tokenizer is None:
            raise ValueError(f"stop strings {sampling.stop} need a tokenizer; pass "
                             f"HFEngine(..., tokenizer=path_or_tokenizer)")
        flat = [(i, list(p)) for i, p in enumerate(prompts) for _ in range(n)]
        completions: list[Completion] = []
        device = self.device  # sampling runs where the logits are (no (B, V) copies)
        if self.default_generator.device != device:
            seed = int(self.default_generator.initial_seed())
            self.default_generator = torch.Generator(device=device).manual_seed(seed)
        for start in range(0, len(flat), self.batch_size):
            chunk = flat[start:start + self.batch_size]
            generators = []
            for j, (i, _) in enumerate(chunk):
                if sampling.seed is None:
                    generators.append(self.default_generator)
                else:
                    k = (start + j) % n
                    g = torch.Generator(device=device).manual_seed(sampling.seed + i * n + k)
                    generators.append(g)
            completions += self._generate_batch([p for _, p in chunk], generators, sampling)
        return [completions[i * n:(i + 1) * n] for i in range(len(prompts))]

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], generators: list[torch.Generator],
                        sampling: SamplingConfig) -> list[Completion]:
        model, device = self.model, self.device
        was_training = model.training
        model.eval()
        try:
            batch, width = len(prompts), max(len(p) for p in prompts)
            ids = torch.full((batch, width), self.pad_id, dtype=torch.long)  # (B, T)
            # every step's attention mask at once, prompts left-padded: step k reads a view of
            # its first T + k + 1 columns (growing the mask with cat copied it every step)
            mask = torch.ones(batch, width + sampling.max_tokens, dtype=torch.long)  # (B, T + K)
            for i, p in enumerate(prompts):
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, :width - len(p)] = 0
            ids, mask = ids.to(device), mask.to(device)
            positions = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)  # (B, T)
            cache = DynamicCache(config=model.config)
            # logits_to_keep=1: the prompt's other positions' logits would be (B, T, V)
            logits = model(input_ids=ids, attention_mask=mask[:, :width], position_ids=positions,
                           past_key_values=cache, use_cache=True,
                           logits_to_keep=1).logits[:, -1]  # (B, V)
            tokens: list[list[int]] = [[] for _ in range(batch)]
            logprobs: list[list[float]] = [[] for _ in range(batch)]
            finish: list[str | None] = [None] * batch
            stop_window = max((len(s) for s in sampling.stop), default=0) + 2
            for step in range(sampling.max_tokens):
                # on the model's device; only (B,) tokens and log-probs come back to the host
                # (not the (B, V) logits: a copy of them each step dominates on a GPU)
                logits = logits.float()  # (B, V)
                nxt, chosen = self._sample(logits, generators, sampling)  # (B,) each
                nxt_host, chosen_host = nxt.tolist(), chosen.tolist()
                for i in range(batch):
                    if finish[i] is not None:
                        continue
                    tok = nxt_host[i]
                    tokens[i].append(tok)
                    logprobs[i].append(chosen_host[i])
                    if tok in self.eos_ids:
                        finish[i] = "stop"
                    elif sampling.stop:
                        tail = self.tokenizer.decode(tokens[i][-stop_window:],
                                                     skip_special_tokens=True)
                        if any(s in tail for s in sampling.stop):
                            finish[i] = "stop"
                if all(f is not None for f in finish) or step == sampling.max_tokens - 1:
                    break  # (the last step's token needs no forward)
                positions = positions[:, -1:] + 1  # (B, 1)
                logits = model(input_ids=nxt[:, None], attention_mask=mask[:, :width + step + 1],
                               position_ids=positions, past_key_values=cache,
                               use_cache=True).logits[:, -1]  # (B, V)
        finally:  # an engine built on the policy module leaves it as it found it
            model.train(was_training)
        return [Completion(tokens[i], logprobs[i], finish[i] or "length") for i in range(batch)]

    @staticmethod
    def _sample(logits: torch.Tensor, generators: list[torch.Generator],
                sampling: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token per row of ``logits`` (B, V) and its log-prob under the distribution
        it was drawn from: greedy at temperature 0 (raw log-prob), else temperature + top-p
        sampling with each row's generator."""
        if sampling.temperature == 0:
            nxt = logits.argmax(-1)  # (B,)
            return nxt, torch.log_softmax(logits, -1).gather(1, nxt[:, None])[:, 0]
        logp = torch.log_softmax(logits / sampling.temperature, dim=-1)  # (B, V)
        if sampling.top_p < 1.0:
            sorted_lp, order = logp.sort(dim=-1, descending=True)  # (B, V)
            sorted_p = sorted_lp.exp()  # (B, V)
            # keep a token while the mass before it is below p (vLLM's rule: at top_p 0.5,
            # probabilities [0.5, 0.3, ...] keep the first alone)
            drop = sorted_p.cumsum(-1) - sorted_p >= sampling.top_p  # (B, V)
            sorted_lp = sorted_lp.masked_fill(drop, -math.inf)
            logp = torch.full_like(logp, -math.inf).scatter(-1, order, sorted_lp)  # (B, V)
            logp = torch.log_softmax(logp, dim=-1)  # (B, V): renormalised over the nucleus
        # one uniform per row from the row's own generator, then every row at once
        u = torch.stack([torch.rand((), generator=g, device=logp.device)
                         for g in generators])  # (B,)
        nxt = inverse_cdf(logp.exp(), u)  # (B,)
        return nxt, logp.gather(1, nxt[:, None])[:, 0]

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-prob of each token given the ones before it (first token: 0.0)."""
        return policy_logprobs(self.model, sequences, batch_size=self.batch_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named weights into the model (a tied ``lm_head.weight`` may be absent)."""
        state = dict(weights)
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = self.model.config.tie_word_embeddings
        missing = [k for k in missing if not (tied and k == "lm_head.weight")]
        if missing or unexpected:
            raise KeyError(f"weights do not fit the engine's model: missing {missing}, "
                           f"unexpected {unexpected}")

    def close(self) -> None:
        """Drop the model (the caller's module, if one was passed, stays alive)."""
        self.model = None

    def host_compute(self) -> contextlib.AbstractContextManager[None]:
        """A no-op: this engine samples on the process's own torch threads."""
        return contextlib.nullcontext()

    def sleep(self) -> None:
        """Only marks the phase: the transformers engine keeps its weights where they are."""
        self.awake = False

    def wake_up(self) -> None:
        self.awake = True


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling of one token per row: row ``b`` picks the ``j`` with
    ``cdf[j-1] <= u[b] * cdf[-1] < cdf[j]``, i.e. token ``j`` with probability
    ``probs[b, j] / sum(probs[b])``; a token of probability 0 is never picked.

    Args:
        probs: ``(B, V)`` non-negative weights per row (need not sum to 1).
        u: ``(B,)`` uniforms in [0, 1).

    Returns:
        ``(B,)`` token indices: one inverse-CDF draw for the whole batch, where
        ``torch.multinomial`` would take one call per row (each row has its own generator).
    """
    # float64: a float32 running sum over a 150k vocabulary drifts by ~1e-4, enough to move
    # the intervals of the tail's tokens (some could never be drawn)
    cdf = probs.double().cumsum(-1)  # (B, V), non-decreasing
    idx = torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(-1),
                             right=True)[:, 0]  # (B,)
    last = (probs > 0).cumsum(-1).argmax(-1)  # (B,): the last token with weight > 0
    return torch.minimum(idx, last)  # rounding may put u * total at or past cdf[-1]
