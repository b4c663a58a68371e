"""The policy loss: pure torch, tensors in, ``(loss, stats)`` out.

Alignment (the one convention every tensor here follows): all ``(B, T)`` tensors are aligned
with ``input_ids``. Position ``t`` holds the quantity of token ``t`` given tokens ``< t``:
``logp[:, t] = log pi(input_ids[:, t] | input_ids[:, :t])``, computed from the model's
``logits[:, t - 1]`` (the logit at position t-1 predicts token t). Position 0 has no
prediction: it gets 0 and must be masked out (it is always a prompt token). This matches the
behaviour log-probs stored in the tree (``LeafSequence.logprobs``) and the engines'
``prompt_logprobs`` (first token 0.0).

Policy loss (PPO clipped surrogate, DAPO's asymmetric "clip-higher")::

    ratio_t = exp(logp_t - old_t)
    pg_t    = max(-A_t ratio_t, -A_t clip(ratio_t, 1 - clip_low, 1 + clip_high))
    pg_t    = min(pg_t, -A_t dual_clip)   where A_t < 0            (dual-clip, optional)
    kl_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1       (k3 estimator, optional)
    loss    = agg(pg) + kl_coef * agg(kl)

over mask tokens only (policy tokens: prompt, observation and padding tokens are out).
``agg`` is the token mean (DAPO / Dr. GRPO: every token of the mini-batch weighs the same).
Dual-clip (Ye et al. 2020, verl's ``clip_ratio_c``): for a negative advantage the surrogate
grows without bound with the ratio (a token the policy now likes far more than the sampler
did); capping it at ``-A dual_clip`` bounds that term and zeroes its gradient.
Numerical guards as in verl: ``logp - old`` and ``ref - logp`` are clamped to [-20, 20]
before ``exp``, and masked positions are zeroed *before* ``exp``, so a masked token with a
huge ratio can produce neither ``inf * 0 = nan`` nor a gradient.

Packed trees: a token shared by several leaves (``tree_packing``) stands for one (leaf,
token) pair per leaf through it; ``weighted_policy_loss`` takes each token's pair count and
its leaves' summed positive and negative advantages and gives the per-leaf loss, KL and
statistics exactly (``policy_loss`` is it with one pair per mask token).

Micro-batching: pass ``normalizer`` = the whole mini-batch's mask tokens; each micro-batch's
loss is then its sum divided by that count, and summing the micro-batch losses (or
accumulating their gradients) gives exactly the mini-batch loss.

Token log-probs in chunks: ``token_logprobs`` by default goes through ``row_logprobs``, a
custom autograd function that walks the ``(N, V)`` logit rows in chunks of about
``chunk_elements`` logits. Each chunk is cast to float32, reduced (``logsumexp``, the target's
logit, the entropy) and dropped; backward recomputes each chunk's softmax from the saved
logits and the per-row ``logsumexp`` and writes ``d logp / d logits = (onehot - softmax) / tau``
straight into a gradient of the logits' own dtype. No float32 ``(B, T, V)`` tensor is ever
built: with Qwen3's 151,936-token vocabulary, 8 x 2048 tokens of float32 logits are 10 GB per
copy, and the plain path (``chunk_elements=None``, kept as the reference) builds several.
``masked_token_logprobs`` goes one step further: from the final hidden states it runs the LM
head only on the positions whose next token is trained (policy tokens), so neither the logits
nor their gradient exist anywhere else. ``selected_token_logprobs`` is its last step, the
log-probs of those rows put back in place; ``TraceModule`` calls it on the rows its LM head
ran on inside the model's forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

_LOG_RATIO_CLAMP = 20.0
CHUNK_ELEMENTS = 1 << 28  # logits per float32 chunk (1 GiB); 1,766 rows of a 151,936 vocab


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, with_entropy: bool = False,
                   temperature: float = 1.0, chunk_elements: int | None = CHUNK_ELEMENTS,
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob (and optionally entropy) of each token of ``input_ids`` under ``logits``.

    Args:
        logits: ``(B, T, V)`` model output on ``input_ids``.
        input_ids: ``(B, T)`` token ids.
        with_entropy: also return the entropy of each predictive distribution.
        temperature: divide the logits by this first (match the sampler's temperature).
        chunk_elements: float32 work per chunk, in logits (see ``row_logprobs``); ``None``
            takes the plain path, which casts all of ``logits`` to float32 at once (the
            reference the chunked path is tested against).

    Returns:
        ``logp (B, T)``: ``logp[:, t] = log softmax(logits[:, t-1])[input_ids[:, t]]``, 0 at t=0.
        ``entropy (B, T)`` or ``None``: entropy of ``softmax(logits[:, t-1])``, 0 at t=0;
        detached (for logging; there is no entropy bonus, so no graph is kept for it).
        Computed in float32 via ``logsumexp`` + ``gather``: no full log-softmax tensor is built.
    """
    if chunk_elements is None:
        return _token_logprobs_plain(logits, input_ids, with_entropy, temperature)
    b, t, v = logits.shape
    # Row (i, s) of the flattened logits predicts input_ids[i, s + 1]; the last position of
    # each row predicts nothing (target 0, result dropped, so its gradient is exactly 0).
    targets = F.pad(input_ids[:, 1:], (0, 1))  # (B, T)
    logp, ent = row_logprobs(logits.reshape(b * t, v), targets.reshape(b * t),
                             with_entropy=with_entropy, temperature=temperature,
                             chunk_elements=chunk_elements)  # (B*T,) each
    logp = F.pad(logp.view(b, t)[:, :-1], (1, 0))  # (B, T)
    if ent is not None:
        ent = F.pad(ent.view(b, t)[:, :-1], (1, 0))  # (B, T)
    return logp, ent


def _token_logprobs_plain(logits: torch.Tensor, input_ids: torch.Tensor, with_entropy: bool,
                          temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``token_logprobs`` on one float32 copy of the whole ``(B, T-1, V)`` (the reference)."""
    shifted = logits[:, :-1].float()  # (B, T-1, V)
    if temperature != 1.0:
        shifted = shifted / temperature  # (B, T-1, V)
    targets = input_ids[:, 1:]  # (B, T-1)
    lse = torch.logsumexp(shifted, dim=-1)  # (B, T-1)
    picked = shifted.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T-1)
    logp = F.pad(picked - lse, (1, 0))  # (B, T)
    entropy = None
    if with_entropy:
        with torch.no_grad():  # a statistic: nothing (B, T-1, V) is kept for backward
            probs = torch.softmax(shifted, dim=-1)  # (B, T-1, V)
            ent = lse - (probs * shifted).sum(-1)  # (B, T-1): H = lse - E_p[logit]
        entropy = F.pad(ent, (1, 0))  # (B, T)
    return logp, entropy


def row_logprobs(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool = False,
                 temperature: float = 1.0, chunk_elements: int = CHUNK_ELEMENTS,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits[n] / temperature)[targets[n]]`` for each row, in float32 chunks.

    Args:
        logits: ``(N, V)`` one row of logits per predicted token (any float dtype).
        targets: ``(N,)`` the token each row predicts.
        with_entropy: also return each row's entropy (detached).
        temperature: divide the logits by this first.
        chunk_elements: about this many logits are cast to float32 at a time
            (``max(1, chunk_elements // V)`` rows).

    Returns:
        ``logp (N,)`` float32 (float64 for float64 logits) with gradient to ``logits`` (in
        ``logits``' dtype), and ``entropy (N,)`` of the same dtype or ``None``.
    """
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements ({chunk_elements}) must be >= 1; pass None to "
                         f"token_logprobs for the unchunked path")
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"row_logprobs expects logits (N, V) and targets (N,); got "
                         f"{tuple(logits.shape)} and {tuple(targets.shape)}")
    rows = max(1, chunk_elements // max(logits.shape[1], 1))
    logp, ent = _ChunkedRowLogprobs.apply(logits, targets, float(temperature), rows,
                                          bool(with_entropy))
    return logp, (ent if with_entropy else None)


def _work_dtype(logits: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 logits (the exactness tests run in float64)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


class _ChunkedRowLogprobs(torch.autograd.Function):
    """Row log-probs whose float32 working set is one chunk of rows (see the module doc)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                rows: int, with_entropy: bool):
        logits = logits.contiguous()
        n = logits.shape[0]
        acc = _work_dtype(logits)
        f32 = dict(dtype=acc, device=logits.device)
        logp = torch.empty(n, **f32)  # (N,)
        lse = torch.empty(n, **f32)  # (N,)
        ent = torch.empty(n if with_entropy else 0, **f32)  # (N,) or (0,)
        for s in range(0, n, rows):
            e = min(s + rows, n)
            x = logits[s:e].to(acc)  # (C, V); a view when logits are float32: never in-place
            if temperature != 1.0:
                x = x / temperature  # (C, V)
            lse_c = torch.logsumexp(x, dim=-1)  # (C,)
            lse[s:e] = lse_c
            logp[s:e] = x.gather(-1, targets[s:e, None]).squeeze(-1) - lse_c  # (C,)
            if with_entropy:
                p = torch.exp(x - lse_c[:, None])  # (C, V)
                ent[s:e] = lse_c - p.mul_(x).sum(-1)  # (C,): H = lse - E_p[logit]
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.rows = temperature, rows
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_ent: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        tau, rows, n = ctx.temperature, ctx.rows, logits.shape[0]
        grad = torch.empty_like(logits)  # (N, V) in the logits' dtype
        for s in range(0, n, rows):
            e = min(s + rows, n)
            x = logits[s:e].to(lse.dtype)  # (C, V)
            if tau != 1.0:
                x = x / tau  # (C, V)
            g = grad_logp[s:e].to(lse.dtype)  # (C,)
            p = torch.exp(x - lse[s:e, None])  # (C, V): softmax, a new tensor
            p.mul_(-g[:, None])  # (C, V): -g * p
            p.scatter_add_(-1, targets[s:e, None], g[:, None])  # (C, V): g * (onehot - p)
            if tau != 1.0:
                p.div_(tau)  # d x / d logits = 1 / tau
            grad[s:e] = p  # cast to the logits' dtype
        return grad, None, None, None, None


def masked_token_logprobs(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
                          input_ids: torch.Tensor, mask: torch.Tensor,
                          with_entropy: bool = False, temperature: float = 1.0,
                          chunk_elements: int = CHUNK_ELEMENTS,
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``token_logprobs(head(hidden), input_ids)`` computed only where ``mask`` is 1.

    The LM head runs on the rows whose *next* token is a mask token, so the logits (and their
    gradient) of prompt, observation and padding positions are never built. Equal to
    ``token_logprobs`` on mask tokens, 0 elsewhere; a loss that only reads mask tokens (as
    ``policy_loss`` does) gets the same value and gradient.

    Args:
        hidden: ``(B, T, H)`` final hidden states on ``input_ids`` (after the final norm).
        head: the LM head, ``(M, H) -> (M, V)`` (e.g. ``model.lm_head``).
        input_ids: ``(B, T)`` token ids.
        mask: ``(B, T)`` 1 on the tokens whose log-prob is wanted (position 0 is ignored).
        with_entropy, temperature, chunk_elements: as in ``token_logprobs``/``row_logprobs``.

    Returns:
        ``logp (B, T)`` float32 (float64 for a float64 head) and ``entropy (B, T)`` or
        ``None``, 0 off the mask.
    """
    b, s = mask[:, 1:].bool().nonzero(as_tuple=True)  # (M,) each: row s predicts token s + 1
    return selected_token_logprobs(head(hidden[b, s]), input_ids, b, s + 1,
                                   with_entropy=with_entropy, temperature=temperature,
                                   chunk_elements=chunk_elements)


def selected_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, b: torch.Tensor,
                            t: torch.Tensor, with_entropy: bool = False,
                            temperature: float = 1.0, chunk_elements: int = CHUNK_ELEMENTS,
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the tokens ``input_ids[b, t]`` from the logits of the rows predicting them,
    in place in ``(B, T)`` (0 elsewhere): the LM head ran on those rows only.

    Args:
        logits: ``(M, V)``; row ``m`` predicts token ``input_ids[b[m], t[m]]``.
        input_ids: ``(B, T)`` token ids.
        b, t: ``(M,)`` each, the batch row and position of each predicted token.
        with_entropy, temperature, chunk_elements: as in ``row_logprobs``.

    Returns:
        ``logp (B, T)`` and ``entropy (B, T)`` or ``None``, in ``row_logprobs``' dtype
        (float32; float64 for float64 logits).
    """
    lp, ent = row_logprobs(logits, input_ids[b, t], with_entropy=with_entropy,
                           temperature=temperature, chunk_elements=chunk_elements)  # (M,)

    def to_tokens(values: torch.Tensor) -> torch.Tensor:  # (M,) -> (B, T), 0 elsewhere
        return torch.zeros(input_ids.shape, dtype=values.dtype,
                           device=values.device).index_put((b, t), values)

    return to_tokens(lp), (to_tokens(ent) if ent is not None else None)


def _agg(values: torch.Tensor, weights: torch.Tensor, normalizer: float | None,
         pairs: torch.Tensor) -> torch.Tensor:
    """The (leaf, token) mean of ``(B, T)`` values: their ``weights``-weighted sum over
    ``normalizer`` (None: over this batch's own ``pairs``)."""
    total = (values * weights).sum()  # ()
    if normalizer is None:  # an empty batch: a zero loss, not 0 / 0
        return total / pairs.clamp(min=1.0)
    # as given, even below 1: over several ranks it is the count over all ranks / ranks
    return total / normalizer


def token_weights(advantages: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The weights of ``weighted_policy_loss`` for per-leaf rows: each mask token is one
    (leaf, token) pair. ``(B, T)`` float each: ``count`` (the mask), ``adv_pos`` /
    ``adv_neg`` (the advantage where positive / negative), ``n_pos`` / ``n_neg`` (0 or 1)."""
    valid = mask.bool()  # (B, T)
    adv = torch.where(valid, advantages.float(), torch.zeros_like(advantages, dtype=torch.float))
    return {"count": valid.float(), "adv_pos": adv.clamp(min=0.0),  # (B, T) each
            "adv_neg": adv.clamp(max=0.0), "n_pos": (adv > 0).float(),
            "n_neg": (adv < 0).float()}


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.28,
                ref_logprobs: torch.Tensor | None = None, kl_coef: float = 0.0,
                normalizer: float | None = None,
                entropy: torch.Tensor | None = None, dual_clip: float | None = None,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate policy loss with an optional k3 KL penalty to a reference.

    Args:
        logprobs: ``(B, T)`` current policy log-probs (with grad), aligned with input_ids.
        old_logprobs: ``(B, T)`` behaviour log-probs (the sampler's).
        advantages: ``(B, T)`` per-token advantages.
        mask: ``(B, T)`` 1 on trained (policy) tokens, 0 on prompt/observation/padding.
        clip_low: ratio is clipped below at ``1 - clip_low`` (for ``A < 0``).
        clip_high: ratio is clipped above at ``1 + clip_high`` (for ``A > 0``; DAPO: 0.28).
        ref_logprobs: ``(B, T)`` reference log-probs, for the KL term (``None``: no KL).
        kl_coef: weight of the k3 KL term (needs ``ref_logprobs`` when > 0).
        normalizer: the mini-batch's token count when this is one micro-batch
            (> 0; over several ranks that count over all ranks / ranks, which may be below 1);
            ``None`` normalises by this batch's own count.
        entropy: ``(B, T)`` per-token entropy, only reported in the stats.
        dual_clip: cap of ``-A ratio`` for ``A < 0`` at ``-A dual_clip`` (> 1; ``None``: off).

    Returns:
        ``loss`` (scalar) and detached scalar ``stats``: ``clip_frac_low``,
        ``clip_frac_high``, ``clip_frac_dual`` (0 when off), ``approx_kl`` (k1: mean of
        old - logp), ``approx_kl_k3``,
        ``ratio_mean``, ``ratio_max``, ``tokens``, and ``kl_ref`` / ``entropy`` when given.
        Stats are plain means over this call's mask tokens (not divided by ``normalizer``).
    """
    return weighted_policy_loss(logprobs, old_logprobs, token_weights(advantages, mask),
                                clip_low=clip_low, clip_high=clip_high,
                                ref_logprobs=ref_logprobs, kl_coef=kl_coef,
                                normalizer=normalizer, entropy=entropy, dual_clip=dual_clip)


def weighted_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                         weights: dict[str, torch.Tensor], clip_low: float = 0.2,
                         clip_high: float = 0.28, ref_logprobs: torch.Tensor | None = None,
                         kl_coef: float = 0.0, normalizer: float | None = None,
                         entropy: torch.Tensor | None = None, dual_clip: float | None = None,
                         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``policy_loss`` where each token stands for several (leaf, token) pairs.

    A token shared by the leaves of a packed tree has one context, so one ratio ``r``; each
    leaf's clipped term is ``A * f+(r)`` for ``A > 0`` and ``A * f-(r)`` for ``A < 0``::

        f+(r) = -min(r, 1 + clip_high)
        f-(r) = -max(r, 1 - clip_low)            (dual-clip: -min(max(r, 1 - clip_low), dual_clip))

    (``max(-A r, -A clip(r))`` for the sign of ``A``), so the token's terms add up to
    ``adv_pos f+(r) + adv_neg f-(r)``. The KL term, the entropy and every statistic are
    means over pairs, each token weighted by its ``count``; the loss is divided by
    ``normalizer`` (pairs of the mini-batch) as in ``policy_loss``. With one pair per mask
    token (``token_weights``) this is ``policy_loss`` exactly.

    Args:
        weights: ``(B, T)`` float each: ``count`` (pairs on the token; 0 off policy tokens),
            ``adv_pos`` / ``adv_neg`` (their summed positive / negative advantages),
            ``n_pos`` / ``n_neg`` (how many of them are positive / negative).
        the rest: as in ``policy_loss``.
    """
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef ({kl_coef}) > 0 needs ref_logprobs; pass the reference "
                         f"model's log-probs or set kl_coef to 0")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip ({dual_clip}) must be > 1 (verl's default is 3.0) or None")
    if normalizer is not None and not normalizer > 0:
        raise ValueError(f"normalizer ({normalizer}) must be > 0 (the mini-batch's count) or "
                         f"None (this batch's own count)")
    dt = logprobs.dtype
    count = weights["count"].to(dt)  # (B, T): pairs per token
    valid = count > 0  # (B, T)
    n_pairs = count.sum()  # ()
    n_tokens = n_pairs.clamp(min=1.0)  # ()

    log_ratio = torch.where(valid, logprobs - old_logprobs, torch.zeros_like(logprobs))  # (B, T)
    log_ratio = log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    f_pos = -ratio.clamp(max=1.0 + clip_high)  # (B, T)
    f_neg = -(ratio.clamp(min=1.0 - clip_low) if dual_clip is None
              else ratio.clamp(min=1.0 - clip_low, max=dual_clip))  # (B, T)
    pg = weights["adv_pos"].to(dt) * f_pos + weights["adv_neg"].to(dt) * f_neg  # (B, T)
    loss = _agg(pg, valid.to(dt), normalizer, n_pairs)  # ()

    with torch.no_grad():
        r = ratio.detach()  # (B, T)
        n_pos, n_neg = weights["n_pos"].to(dt), weights["n_neg"].to(dt)  # (B, T)
        low = n_neg * (r < 1.0 - clip_low)  # (B, T): pairs whose gradient is zeroed here
        high = n_pos * (r > 1.0 + clip_high)  # (B, T)
        dual = n_neg * (r > dual_clip) if dual_clip is not None else torch.zeros_like(r)
        neg = -log_ratio.detach()  # (B, T): old - logp
        stats = {
            "clip_frac_low": low.sum() / n_tokens,
            "clip_frac_high": high.sum() / n_tokens,
            "clip_frac_dual": dual.sum() / n_tokens,
            "approx_kl": (neg * count).sum() / n_tokens,
            # k3 of the same KL(old || new), tokens sampled from old: (r - 1) - log r
            "approx_kl_k3": ((torch.exp(-neg) + neg - 1.0) * count).sum() / n_tokens,
            "ratio_mean": (r * count).sum() / n_tokens,
            "ratio_max": torch.where(valid, r, torch.zeros_like(r)).max(),
            "tokens": n_pairs,
        }

    if ref_logprobs is not None:
        d = torch.where(valid, ref_logprobs - logprobs, torch.zeros_like(logprobs))  # (B, T)
        d = d.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # (B, T)
        kl = torch.exp(d) - d - 1.0  # (B, T): k3 >= 0
        kl_loss = _agg(kl, count, normalizer, n_pairs)  # ()
        # a mean over this call's pairs, as every statistic (kl_loss is over the normalizer)
        stats["kl_ref"] = (kl.detach() * count).sum() / n_tokens
        if kl_coef > 0:
            loss = loss + kl_coef * kl_loss
    if entropy is not None:
        stats["entropy"] = (entropy.detach() * count).sum() / n_tokens
    return loss, stats
