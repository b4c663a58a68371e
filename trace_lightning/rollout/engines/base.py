"""What every rollout engine speaks: token ids in, token ids and log-probs out."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class SamplingConfig:
    """Sampling settings of one engine call.

    Args:
        temperature: softmax temperature; 0 means greedy.
        top_p: nucleus sampling mass (1.0 for training rollouts: the update has no nucleus).
        max_tokens: most new tokens per call (one agent turn).
        stop: strings that end a turn; the stop string is kept in the output.
        seed: base seed; sample k of prompt i (of ``n``) uses ``seed + i * n + k``, so a
            batch is reproducible and no two samples share a seed. None: unseeded.

    An engine returns each sampled token's log-prob under the distribution it was sampled
    from: ``log_softmax(logits / temperature)``, renormalised over the nucleus where
    ``top_p`` < 1 (the raw ``log_softmax(logits)`` when greedy), as verl and TRL compute it,
    so a trainer that recomputes them at the same temperature starts its ratios at 1.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class Completion:
    """One sampled continuation of one prompt."""

    token_ids: list[int]
    logprobs: list[float]  # log-prob of each sampled token under the sampling policy
    finish_reason: str  # "stop" (a stop string or EOS) | "length"
    cached_tokens: int = 0  # prompt tokens served from the prefix cache, where reported


class RolloutEngine(Protocol):
    """A generator the DataModule samples trees from."""

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 n: int = 1) -> list[list[Completion]]:
        """``n`` completions for each prompt (token ids); result[i][k] is prompt i's k-th."""
        ...

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-prob of each token given the ones before it (first token: 0.0)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights with the policy's (names as in the HF state dict)
        and drop anything computed with the old ones (e.g. vLLM's prefix cache)."""
        ...

    def sleep(self) -> None:
        """The trainer's turn: free what the engine holds between its phases (vLLM's sleep
        mode offloads weights and drops the KV cache on CUDA; a no-op where unsupported).
        The DataModule calls it after every rollout or validation phase."""
        ...

    def wake_up(self) -> None:
        """The engine's turn: take back what ``sleep`` freed, before any sync or sampling."""
        ...

    def host_compute(self) -> AbstractContextManager[None]:
        """The trainer's own torch work between sampling calls while the engine is awake (the
        predictor's featurisation of a step's roots and prefixes): on CPU it runs on the
        process's threads, not the engine's one; a no-op where threads are not split."""
        ...

    def close(self) -> None:
        """Release the engine's memory (KV cache, weights); the engine is unusable after."""
        ...
