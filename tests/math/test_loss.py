"""Hand-checked policy and predictor losses, micro-batch equivalence, token log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from trace_lightning.math.loss import masked_token_logprobs, policy_loss, row_logprobs, token_logprobs
from trace_lightning.allocation.predictor import weighted_squared_error

RTOL, ATOL = 1e-5, 1e-6


def one_by_four():
    """1x4 example; token 2 is an observation (mask 0) with ratio exp(50)."""
    logp = torch.tensor([[-1.0, -0.9, -10.0, -2.5]], requires_grad=True)  # (1, 4)
    old = torch.tensor([[-1.0, -1.0, -60.0, -2.0]])  # (1, 4)
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0]])  # (1, 4)
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])  # (1, 4)
    return logp, old, adv, mask


def test_policy_loss_by_hand():
    logp, old, adv, mask = one_by_four()
    loss, stats = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # t0: ratio exp(0) = 1, A = 1 -> pg = -1.
    # t1: ratio exp(0.1) = 1.105171 in [0.8, 1.28] -> pg = -1.105171.
    # t2: masked (ratio exp(50) must not matter).
    # t3: ratio exp(-0.5) = 0.606531, A = -1: max(0.606531, 0.8) = 0.8 (clipped low).
    # token mean: (-1 - 1.105171 + 0.8) / 3 = -0.435057.
    assert loss.item() == pytest.approx((-1 - math.exp(0.1) + 0.8) / 3, rel=RTOL, abs=ATOL)
    assert torch.isfinite(loss)
    loss.backward()
    # d pg / d logp = -A ratio where unclipped, 0 where clipped; divided by 3 tokens.
    expected = torch.tensor([[-1 / 3, -math.exp(0.1) / 3, 0.0, 0.0]])
    torch.testing.assert_close(logp.grad, expected, rtol=RTOL, atol=ATOL)
    assert stats["clip_frac_low"].item() == pytest.approx(1 / 3, rel=RTOL)
    assert stats["clip_frac_high"].item() == 0.0
    # approx_kl (k1) = mean(old - logp) = (0 + (-0.1) + 0.5) / 3 = 0.133333.
    assert stats["approx_kl"].item() == pytest.approx(0.4 / 3, rel=RTOL, abs=ATOL)
    # k3 of the same KL(old || new) (samples from old), r = new / old: mean((r - 1) - log r)
    # = (0 + (e^0.1 - 1 - 0.1) + (e^-0.5 - 1 + 0.5)) / 3 = (0.005171 + 0.106531) / 3 = 0.037234
    # (the ratio upside down, old / new, gives 0.051186)
    assert stats["approx_kl_k3"].item() == pytest.approx(0.0372339, rel=1e-4)
    # ratio over mask tokens: mean (1 + 1.105171 + 0.606531)/3 = 0.903901, max 1.105171.
    assert stats["ratio_mean"].item() == pytest.approx((1 + math.exp(0.1) + math.exp(-0.5)) / 3,
                                                       rel=RTOL)
    assert stats["ratio_max"].item() == pytest.approx(math.exp(0.1), rel=RTOL)
    assert stats["tokens"].item() == 3


def test_clip_high_zeroes_gradient_only_for_positive_advantage():
    # Both tokens: logp - old = 0.5 -> ratio 1.648721 > 1.28.
    # t0 A = +1: max(-1.648721, -1.28) = -1.28 (clipped high, grad 0).
    # t1 A = -1: max(1.648721, 1.28) = 1.648721 (unclipped, grad = ratio / 2 tokens = 0.824361).
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)  # (1, 2)
    old = torch.tensor([[-0.5, -0.5]])  # (1, 2)
    adv = torch.tensor([[1.0, -1.0]])  # (1, 2)
    mask = torch.ones(1, 2)  # (1, 2)
    loss, stats = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx((-1.28 + math.exp(0.5)) / 2, rel=RTOL, abs=ATOL)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, math.exp(0.5) / 2]]),
                               rtol=RTOL, atol=ATOL)
    assert stats["clip_frac_high"].item() == pytest.approx(0.5)
    assert stats["clip_frac_low"].item() == 0.0
    # Symmetric clip 0.2 -> bound 1.2: t0 still clipped, loss (-1.2 + 1.648721) / 2.
    loss, _ = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx((-1.2 + math.exp(0.5)) / 2, rel=RTOL, abs=ATOL)


def test_dual_clip_caps_the_negative_advantage_term():
    # logp - old = log 5 -> ratio 5 on both tokens; dual_clip 3.
    # t0 A = -1: max(-A ratio, -A clip(ratio)) = max(5, 1.28) = 5; min(5, -A x 3 = 3) = 3,
    #     capped: gradient 0.
    # t1 A = +2: max(-10, -2 x 1.28 = -2.56) = -2.56 (clipped high; dual-clip is for A < 0).
    # token mean: (3 - 2.56) / 2 = 0.22; without dual-clip (5 - 2.56) / 2 = 1.22 with
    # gradient ratio x 1 / 2 tokens = 2.5 on t0.
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)  # (1, 2)
    old = torch.full((1, 2), -math.log(5.0))  # (1, 2)
    adv = torch.tensor([[-1.0, 2.0]])  # (1, 2)
    mask = torch.ones(1, 2)  # (1, 2)
    loss, stats = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert loss.item() == pytest.approx((3.0 - 2.56) / 2, rel=RTOL, abs=ATOL)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.zeros(1, 2), rtol=RTOL, atol=ATOL)
    assert stats["clip_frac_dual"].item() == pytest.approx(0.5)
    logp.grad = None
    off, stats = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert off.item() == pytest.approx((5.0 - 2.56) / 2, rel=RTOL, abs=ATOL)
    off.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[2.5, 0.0]]), rtol=RTOL, atol=ATOL)
    assert stats["clip_frac_dual"].item() == 0.0
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logp, old, adv, mask, dual_clip=1.0)


def test_kl_term_by_hand():
    logp, old, adv, mask = one_by_four()
    # d = ref - logp = [0, 0.5, (masked), -1]; k3 = e^d - d - 1:
    # t0: 0; t1: 1.648721 - 1.5 = 0.148721; t3: 0.367879 + 1 - 1 = 0.367879. Mean 0.172200.
    ref = logp.detach() + torch.tensor([[0.0, 0.5, 100.0, -1.0]])  # (1, 4)
    kl_hand = (0.0 + (math.exp(0.5) - 1.5) + math.exp(-1.0)) / 3
    pg, _ = policy_loss(logp, old, adv, mask)
    loss, stats = policy_loss(logp, old, adv, mask, ref_logprobs=ref, kl_coef=0.1)
    assert stats["kl_ref"].item() == pytest.approx(kl_hand, rel=RTOL, abs=ATOL)
    assert loss.item() == pytest.approx(pg.item() + 0.1 * kl_hand, rel=RTOL, abs=ATOL)
    assert torch.isfinite(loss)
    # one micro-batch of a mini-batch of 12 tokens: the loss term is over the mini-batch
    # (sum 0.516600 / 12), the logged statistic stays this call's token mean (so the module's
    # token-weighted mean over micro-batches is the mini-batch's)
    loss, stats = policy_loss(logp, old, adv, mask, ref_logprobs=ref, kl_coef=0.1,
                              normalizer=12.0)
    pg, _ = policy_loss(logp, old, adv, mask, normalizer=12.0)
    assert loss.item() == pytest.approx(pg.item() + 0.1 * 3 * kl_hand / 12, rel=RTOL, abs=ATOL)
    assert stats["kl_ref"].item() == pytest.approx(kl_hand, rel=RTOL, abs=ATOL)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logp, old, adv, mask, kl_coef=0.1)


def test_a_normalizer_below_one_is_used_as_given():
    """Over W ranks the divisor is the mini-batch's policy tokens over all ranks / W: one
    token on 2 ranks gives 0.5, and the rank holding it must contribute -A / 0.5 = -2 (DDP's
    mean over the 2 ranks then makes it the token mean, -1), not -A / 1."""
    logp = torch.zeros(1, 2, requires_grad=True)  # (1, 2): ratio 1
    adv = torch.tensor([[1.0, 0.0]])  # (1, 2)
    mask = torch.tensor([[1.0, 0.0]])  # (1, 2): one policy token
    loss, _ = policy_loss(logp, logp.detach(), adv, mask, normalizer=0.5)
    assert loss.item() == pytest.approx(-2.0)
    loss.backward()
    assert logp.grad[0, 0].item() == pytest.approx(-2.0)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"normalizer \(.*\) must be > 0"):
            policy_loss(logp, logp.detach(), adv, mask, normalizer=bad)


def test_token_mean_by_hand():
    # Seq 0: 1 token with pg -1; seq 1: 3 tokens with pg -2 each (ratio 1, A = 2): every
    # token weighs the same, (-1 - 6) / 4 = -1.75 (a mean per sequence first would be -1.5)
    logp = torch.zeros(2, 3)  # (2, 3)
    adv = torch.tensor([[1.0, 0.0, 0.0], [2.0, 2.0, 2.0]])  # (2, 3)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])  # (2, 3)
    tm, _ = policy_loss(logp, logp, adv, mask)
    assert tm.item() == pytest.approx(-1.75, rel=RTOL)


def test_microbatch_sum_equals_full_batch():
    g = torch.Generator().manual_seed(0)
    b, t = 6, 10
    logp = (-torch.rand(b, t, generator=g) * 3).requires_grad_(True)  # (B, T)
    old = logp.detach() + 0.3 * torch.randn(b, t, generator=g)  # (B, T)
    adv = torch.randn(b, t, generator=g)  # (B, T)
    ref = logp.detach() + 0.2 * torch.randn(b, t, generator=g)  # (B, T)
    mask = (torch.rand(b, t, generator=g) < 0.6).float()  # (B, T)
    mask[0] = 0.0  # a sequence with no policy tokens must not count
    kw = dict(kl_coef=0.05)
    full, _ = policy_loss(logp, old, adv, mask, ref_logprobs=ref, **kw)
    (full_grad,) = torch.autograd.grad(full, logp)
    normalizer = mask.sum().item()
    parts = [slice(0, 2), slice(2, 3), slice(3, 6)]
    total = sum(policy_loss(logp[s], old[s], adv[s], mask[s], ref_logprobs=ref[s],
                            normalizer=normalizer, **kw)[0] for s in parts)
    (part_grad,) = torch.autograd.grad(total, logp)
    torch.testing.assert_close(total, full, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(part_grad, full_grad, rtol=1e-6, atol=1e-7)


def test_entropy_stat_and_nan_safety():
    logp, old, adv, mask = one_by_four()
    old = old.clone()
    old[0, 2] = -1e9  # masked position: exp(logp - old) would overflow
    ent = torch.tensor([[9.0, 1.0, 100.0, 2.0]])  # (1, 4): mean over mask (9 + 1 + 2)/3 = 4
    loss, stats = policy_loss(logp, old, adv, mask, entropy=ent)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert stats["entropy"].item() == pytest.approx(4.0, rel=RTOL)


def test_token_logprobs_matches_naive():
    g = torch.Generator().manual_seed(1)
    b, t, v = 2, 5, 11
    logits = torch.randn(b, t, v, generator=g)  # (B, T, V)
    ids = torch.randint(0, v, (b, t), generator=g)  # (B, T)
    logp, ent = token_logprobs(logits, ids, with_entropy=True)
    assert logp.shape == ent.shape == (b, t)
    ls = torch.log_softmax(logits, -1)  # (B, T, V)
    naive = torch.zeros(b, t)  # (B, T)
    naive_ent = torch.zeros(b, t)  # (B, T)
    for i in range(b):
        for j in range(1, t):  # position j is predicted by logits at j - 1
            naive[i, j] = ls[i, j - 1, ids[i, j]]
            naive_ent[i, j] = -(ls[i, j - 1].exp() * ls[i, j - 1]).sum()
    torch.testing.assert_close(logp, naive, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent, naive_ent, rtol=1e-5, atol=1e-6)
    assert logp[:, 0].eq(0).all() and ent[:, 0].eq(0).all()
    # Temperature divides the logits; no entropy unless asked.
    logp_t, none = token_logprobs(logits, ids, temperature=0.5)
    assert none is None
    ls_t = torch.log_softmax(logits / 0.5, -1)  # (B, T, V)
    torch.testing.assert_close(logp_t[0, 3], ls_t[0, 2, ids[0, 3]], rtol=1e-5, atol=1e-6)
    # Gradient flows to the logits.
    logits.requires_grad_(True)
    token_logprobs(logits, ids)[0].sum().backward()
    assert logits.grad is not None and logits.grad[:, -1].abs().sum() == 0  # last logit unused


def test_predictor_loss_by_hand():
    pred = torch.tensor([0.2, 0.9, 0.5], requires_grad=True)  # (3,)
    target = torch.tensor([0.0, 1.0, 0.5])  # (3,)
    weight = torch.tensor([1.0, 3.0, 2.0])  # (3,)
    # squared errors 0.04, 0.01, 0; weighted sum 0.04 + 0.03 + 0 = 0.07; / 6 = 0.0116667.
    loss = weighted_squared_error(pred, target, weight)
    assert loss.item() == pytest.approx(0.07 / 6, rel=RTOL, abs=ATOL)
    loss.backward()
    # d/dp = 2 w (p - y) / sum w = [2*0.2/6, 2*3*(-0.1)/6, 0] = [0.066667, -0.1, 0].
    torch.testing.assert_close(pred.grad, torch.tensor([0.4 / 6, -0.1, 0.0]), rtol=RTOL, atol=ATOL)
    # no weight: 0, not 0 / 0
    assert weighted_squared_error(pred, target, torch.zeros(3)).item() == 0.0


@pytest.mark.parametrize("chunk_elements", [13, 5 * 13, 1 << 28])  # 1 row, 5 rows, one chunk
def test_chunked_token_logprobs_equal_plain(chunk_elements):
    """The chunked custom-autograd path equals the plain float32 path: values, entropy and
    the gradient to the logits under an arbitrary upstream gradient (V = 13, N = 3 x 7 rows,
    so 5-row chunks leave a partial last chunk)."""
    g = torch.Generator().manual_seed(2)
    b, t, v = 3, 7, 13
    base = 3 * torch.randn(b, t, v, generator=g)  # (B, T, V)
    ids = torch.randint(0, v, (b, t), generator=g)  # (B, T)
    up = torch.randn(b, t, generator=g)  # (B, T): upstream gradient on logp
    for temperature in (1.0, 0.7):
        results = []
        for chunk in (None, chunk_elements):
            logits = base.clone().requires_grad_(True)
            logp, ent = token_logprobs(logits, ids, with_entropy=True, temperature=temperature,
                                       chunk_elements=chunk)
            (logp * up).sum().backward()
            assert not ent.requires_grad
            results.append((logp.detach(), ent, logits.grad))
        (lp0, ent0, g0), (lp1, ent1, g1) = results
        torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-6)
        # H = lse - E_p[logit] cancels: both terms are near the largest logit (up to ~9 at
        # 3 x randn), so float32 rounding in two differently ordered reductions
        # (eps 1.2e-7 x 9 x a few operations) leaves up to ~5e-6 between the paths; a wrong
        # entropy is off by 1e-2 or more
        torch.testing.assert_close(ent1, ent0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-6)
        assert g1[:, -1].abs().sum() == 0  # the last position predicts nothing


def test_chunked_token_logprobs_bf16_grad_dtype():
    """bf16 logits: gradient comes back in bf16 and matches the plain path to bf16 rounding."""
    g = torch.Generator().manual_seed(3)
    base = (2 * torch.randn(2, 6, 50, generator=g)).to(torch.bfloat16)  # (B, T, V)
    ids = torch.randint(0, 50, (2, 6), generator=g)  # (B, T)
    grads = []
    for chunk in (None, 3 * 50):
        logits = base.clone().requires_grad_(True)
        logp, _ = token_logprobs(logits, ids, chunk_elements=chunk)
        assert logp.dtype == torch.float32
        logp.sum().backward()
        grads.append(logits.grad)
    assert grads[1].dtype == torch.bfloat16
    torch.testing.assert_close(grads[1].float(), grads[0].float(), rtol=1e-2, atol=1e-2)


def test_masked_token_logprobs_equal_full_on_mask():
    """LM head on mask rows only: same log-probs and entropy on mask tokens (0 elsewhere), and
    the same gradients to the hidden states and the head for a loss that reads mask tokens."""
    g = torch.Generator().manual_seed(4)
    b, t, h, v = 2, 6, 5, 17
    hidden0 = torch.randn(b, t, h, generator=g)  # (B, T, H)
    weight0 = torch.randn(v, h, generator=g)  # (V, H)
    ids = torch.randint(0, v, (b, t), generator=g)  # (B, T)
    mask = torch.tensor([[0, 0, 1, 1, 0, 1], [0, 1, 1, 0, 0, 0]], dtype=torch.float32)
    up = torch.randn(b, t, generator=g)  # (B, T)
    out = []
    for masked in (False, True):
        hidden = hidden0.clone().requires_grad_(True)
        head = torch.nn.Linear(h, v, bias=False)
        head.weight.data.copy_(weight0)
        if masked:
            logp, ent = masked_token_logprobs(hidden, head, ids, mask, with_entropy=True,
                                              chunk_elements=2 * v)
        else:
            logp, ent = token_logprobs(head(hidden), ids, with_entropy=True)
        (logp * up * mask).sum().backward()
        out.append((logp.detach() * mask, ent * mask, hidden.grad, head.weight.grad, logp))
    for full, part in zip(out[0][:4], out[1][:4]):
        torch.testing.assert_close(part, full, rtol=1e-5, atol=1e-6)
    assert out[1][4].detach()[mask == 0].eq(0).all()  # nothing off the mask


def test_row_logprobs_rejects_bad_chunk():
    with pytest.raises(ValueError, match="chunk_elements"):
        row_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), chunk_elements=0)
