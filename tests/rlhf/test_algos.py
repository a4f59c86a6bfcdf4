"""rlhf/algos.py against naive references written as plain Python loops over batch and time
(lists of floats and the math module, nothing vectorised).

Masks are prefix masks (valid tokens, then padding) with variable lengths, always including an
all-padding row and a length-1 row. Padded positions of the inputs hold large garbage values so
that anything leaking past the last valid token shows up.

Note: kl_penalty, grpo_advantages, entropy_from_logits and logprobs_from_logits compute in float32
(they call `.float()`), so their comparisons use float32 tolerances; everything else is checked in
float64 at 1e-6 or tighter.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from rlhf.algos import (
    AdaptiveKLController,
    FixedKLController,
    aggregate,
    entropy_from_logits,
    explained_variance,
    gae_advantages,
    grpo_advantages,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss,
    token_rewards,
    value_loss,
)

F64 = torch.float64
TOL = 1e-6  # float64 comparisons
TOL32 = 2e-5  # functions that compute in float32
GARBAGE = 1e4  # written into padded positions


# ----------------------------------------------------------------------------------------------
# Fixtures / helpers


def make_lengths(B: int, T: int, seed: int) -> list[int]:
    """Lengths for B rows of width T: always an empty row, a length-1 row and a full row."""
    rng = random.Random(seed)
    lengths = [0, 1, T] + [rng.randint(1, T) for _ in range(B - 3)]
    rng.shuffle(lengths)
    return lengths


def prefix_mask(lengths: list[int], T: int) -> torch.Tensor:
    return torch.tensor([[1.0 if t < L else 0.0 for t in range(T)] for L in lengths], dtype=F64)


def pad_garbage(x: torch.Tensor, lengths: list[int], value: float = GARBAGE) -> torch.Tensor:
    """Fill positions past each row's length with `value` (to detect leaks)."""
    x = x.clone()
    for b, L in enumerate(lengths):
        x[b, L:] = value
    return x


def rows(x: torch.Tensor) -> list[list[float]]:
    return x.tolist()


def close(a: float, b: float, tol: float = TOL) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(b))


def assert_2d_close(got: torch.Tensor, expected: list[list[float]], tol: float = TOL) -> None:
    g = got.tolist()
    assert len(g) == len(expected)
    for b, (grow, erow) in enumerate(zip(g, expected)):
        assert len(grow) == len(erow)
        for t, (x, y) in enumerate(zip(grow, erow)):
            assert close(x, y, tol), f"[{b}, {t}]: got {x}, expected {y}"


def assert_scalar_close(got, expected: float, tol: float = TOL) -> None:
    x = float(got)
    assert close(x, expected, tol), f"got {x}, expected {expected}"


B, T = 8, 9


@pytest.fixture(params=[0, 1, 2])
def seed(request):
    return request.param


@pytest.fixture
def lengths(seed):
    return make_lengths(B, T, seed)


@pytest.fixture
def mask(lengths):
    return prefix_mask(lengths, T)


def randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=F64) * scale


# ----------------------------------------------------------------------------------------------
# Naive references


def naive_valid(x: list[list[float]], lengths: list[int]) -> list[float]:
    return [x[b][t] for b in range(len(lengths)) for t in range(lengths[b])]


def naive_mean(vals: list[float]) -> float:
    return sum(vals) / len(vals) if vals else 0.0


def naive_var(vals: list[float], unbiased: bool = True) -> float:
    n = len(vals)
    if n == 0:
        return 0.0
    m = naive_mean(vals)
    ss = sum((v - m) ** 2 for v in vals)
    return ss / (n - 1) if (unbiased and n > 1) else ss / n


def naive_gae(r, v, lengths, gamma, lam):
    adv = [[0.0] * T for _ in lengths]
    ret = [[0.0] * T for _ in lengths]
    for b, L in enumerate(lengths):
        last = 0.0
        for t in reversed(range(L)):
            next_v = v[b][t + 1] if t + 1 < L else 0.0
            delta = r[b][t] + gamma * next_v - v[b][t]
            last = delta + gamma * lam * last
            adv[b][t] = last
            ret[b][t] = last + v[b][t]
    return adv, ret


def naive_token_rewards(scores, kl, lengths, coef):
    out = [[0.0] * T for _ in lengths]
    for b, L in enumerate(lengths):
        for t in range(L):
            out[b][t] = -coef * kl[b][t]
        if L > 0:
            out[b][L - 1] += scores[b]
    return out


def naive_kl(lp: float, ref: float, estimator: str) -> float:
    lr = lp - ref
    if estimator == "k1":
        return lr
    if estimator == "k2":
        return 0.5 * lr * lr
    if estimator == "k3":
        r = math.exp(-lr)  # q(x) / p(x)
        return (r - 1.0) - math.log(r)
    raise ValueError(estimator)


def naive_ppo_token(lp, old, a, clip, dual):
    lr = min(max(lp - old, -20.0), 20.0)
    r = math.exp(lr)
    l1 = -a * r
    l2 = -a * min(max(r, 1.0 - clip), 1.0 + clip)
    loss = max(l1, l2)
    if dual > 1.0 and a < 0:
        loss = min(loss, -a * dual)
    return loss, r, l1, l2


def naive_aggregate(loss, lengths, mode, normalizer=None):
    if mode == "token_mean":
        tot = sum(loss[b][t] for b, L in enumerate(lengths) for t in range(L))
        n = sum(lengths)
        denom = max(n, 1) if normalizer is None else normalizer
        return tot / denom
    if mode == "seq_mean":
        per_seq = [sum(loss[b][t] for t in range(L)) / L for b, L in enumerate(lengths) if L > 0]
        denom = max(len(per_seq), 1) if normalizer is None else normalizer
        return sum(per_seq) / denom
    raise ValueError(mode)


def naive_log_softmax(logits: list[float]) -> list[float]:
    m = max(logits)
    lse = m + math.log(sum(math.exp(x - m) for x in logits))
    return [x - lse for x in logits]


# ----------------------------------------------------------------------------------------------
# masked_mean / masked_var / masked_whiten


def test_masked_mean_and_var(seed, lengths, mask):
    x = pad_garbage(randn(B, T, seed=seed) * 3 + 1, lengths)
    vals = naive_valid(rows(x), lengths)
    assert_scalar_close(masked_mean(x, mask), naive_mean(vals))
    assert_scalar_close(masked_var(x, mask), naive_var(vals, unbiased=True))
    assert_scalar_close(masked_var(x, mask, unbiased=False), naive_var(vals, unbiased=False))
    per_row = masked_mean(x, mask, dim=-1).tolist()
    for b, L in enumerate(lengths):
        expected = naive_mean([x[b, t].item() for t in range(L)])
        assert close(per_row[b], expected), (b, per_row[b], expected)
    assert per_row[lengths.index(0)] == 0.0


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten(seed, lengths, mask, shift_mean):
    x = pad_garbage(randn(B, T, seed=seed) * 2.5 - 4.0, lengths)
    out = masked_whiten(x, mask, shift_mean=shift_mean)
    xs = rows(x)
    vals = naive_valid(xs, lengths)
    m, var = naive_mean(vals), naive_var(vals)
    std = math.sqrt(var + 1e-8)
    expected = [[0.0] * T for _ in lengths]
    for b, L in enumerate(lengths):
        for t in range(L):
            expected[b][t] = (xs[b][t] - m) / std + (0.0 if shift_mean else m)
    assert_2d_close(out, expected)
    # masked-out positions are exactly zero
    o = out.tolist()
    for b, L in enumerate(lengths):
        assert all(o[b][t] == 0.0 for t in range(L, T))
    if shift_mean:
        w = naive_valid(o, lengths)
        assert abs(naive_mean(w)) < TOL
        assert abs(math.sqrt(naive_var(w)) - 1.0) < TOL


# ----------------------------------------------------------------------------------------------
# kl_penalty


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_matches_naive(seed, estimator):
    lp = randn(B, T, seed=seed, scale=0.7) - 2.0
    ref = randn(B, T, seed=seed + 100, scale=0.7) - 2.0
    out = kl_penalty(lp, ref, estimator)
    expected = [[naive_kl(lp[b, t].item(), ref[b, t].item(), estimator) for t in range(T)] for b in range(B)]
    assert_2d_close(out, expected, tol=TOL32)
    if estimator in ("k2", "k3"):
        assert (out >= 0).all()


def test_kl_penalty_k3_nonnegative_and_zero_at_equality():
    lr = torch.linspace(-15.0, 15.0, 3001, dtype=F64)[None]
    ref = torch.zeros_like(lr)
    assert (kl_penalty(lr, ref, "k3") >= 0).all()
    same = randn(3, 5, seed=7)
    for est in ("k1", "k2", "k3"):
        assert kl_penalty(same, same, est).abs().max().item() == 0.0


def test_kl_penalty_unknown_estimator():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError):
        kl_penalty(x, x, "k4")


P = [0.5, 0.25, 0.15, 0.1]  # actor (sampling) distribution
Q = [0.3, 0.3, 0.2, 0.2]  # reference distribution
TRUE_KL = sum(p * math.log(p / q) for p, q in zip(P, Q))


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_estimators_unbiased_exact_expectation(estimator):
    """E_{x~p}[k(x)] computed exactly (sum over the support) equals KL(p || q)."""
    lp = torch.tensor([[math.log(p) for p in P]], dtype=F64)
    ref = torch.tensor([[math.log(q) for q in Q]], dtype=F64)
    k = kl_penalty(lp, ref, estimator)[0].tolist()
    expectation = sum(p * ki for p, ki in zip(P, k))
    assert abs(expectation - TRUE_KL) < 1e-6


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_estimators_unbiased_monte_carlo(estimator):
    """Mean of the estimator over samples x ~ p converges to KL(p || q) (5 standard errors)."""
    n = 200_000
    g = torch.Generator().manual_seed(1234)
    x = torch.multinomial(torch.tensor(P, dtype=F64), n, replacement=True, generator=g)
    logp = torch.log(torch.tensor(P, dtype=F64))
    logq = torch.log(torch.tensor(Q, dtype=F64))
    k = kl_penalty(logp[x][None], logq[x][None], estimator)[0].double()
    se = k.std().item() / math.sqrt(n)
    assert abs(k.mean().item() - TRUE_KL) < 5 * se + 1e-6, (k.mean().item(), TRUE_KL, se)
    # k3 has lower variance than k1 here (the reason it exists)
    if estimator == "k3":
        k1 = kl_penalty(logp[x][None], logq[x][None], "k1")[0].double()
        assert k.std() < k1.std()


# ----------------------------------------------------------------------------------------------
# token_rewards


@pytest.mark.parametrize("kl_coef", [0.0, 0.05, 0.7])
def test_token_rewards(seed, lengths, mask, kl_coef):
    scores = randn(B, seed=seed + 10) * 2
    kl = pad_garbage(randn(B, T, seed=seed, scale=0.3), lengths)
    out = token_rewards(scores, kl, mask, kl_coef)
    expected = naive_token_rewards(scores.tolist(), rows(kl), lengths, kl_coef)
    assert_2d_close(out, expected)
    o = out.tolist()
    for b, L in enumerate(lengths):
        assert all(o[b][t] == 0.0 for t in range(L, T)), "reward outside the valid tokens"
    # the empty row gets nothing, the length-1 row gets its score at t=0
    assert all(v == 0.0 for v in o[lengths.index(0)])
    b1 = lengths.index(1)
    assert close(o[b1][0], scores[b1].item() - kl_coef * kl[b1, 0].item())


def test_token_rewards_score_at_last_valid_token_only():
    lengths = [3, 0, 1, 5]
    mask = prefix_mask(lengths, 5)[:, :5]
    out = token_rewards(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F64), torch.zeros(4, 5, dtype=F64), mask, 0.1)
    assert out.tolist() == [
        [0, 0, 1, 0, 0],
        [0, 0, 0, 0, 0],
        [3, 0, 0, 0, 0],
        [0, 0, 0, 0, 4],
    ]


# ----------------------------------------------------------------------------------------------
# GAE


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.95), (0.9, 0.0), (1.0, 0.0), (0.5, 0.5)])
def test_gae_matches_naive(seed, lengths, mask, gamma, lam):
    r = pad_garbage(randn(B, T, seed=seed), lengths)
    v = pad_garbage(randn(B, T, seed=seed + 50), lengths, value=-GARBAGE)
    adv, ret = gae_advantages(r, v, mask, gamma, lam)
    exp_adv, exp_ret = naive_gae(rows(r), rows(v), lengths, gamma, lam)
    assert_2d_close(adv, exp_adv)
    assert_2d_close(ret, exp_ret)


def test_gae_padding_does_not_leak(seed, lengths, mask):
    """Changing rewards/values beyond the last valid token changes nothing."""
    r = randn(B, T, seed=seed)
    v = randn(B, T, seed=seed + 1)
    a1, r1 = gae_advantages(pad_garbage(r, lengths, 0.0), pad_garbage(v, lengths, 0.0), mask, 0.99, 0.95)
    a2, r2 = gae_advantages(pad_garbage(r, lengths, 1e6), pad_garbage(v, lengths, -3e5), mask, 0.99, 0.95)
    assert torch.equal(a1, a2) and torch.equal(r1, r2)
    for b, L in enumerate(lengths):
        assert (a1[b, L:] == 0).all() and (r1[b, L:] == 0).all()


def test_gae_closed_forms(seed, lengths, mask):
    r = pad_garbage(randn(B, T, seed=seed), lengths)
    v = pad_garbage(randn(B, T, seed=seed + 3), lengths)
    rs, vs = rows(r), rows(v)
    # gamma = lam = 1: A_t = sum_{k >= t} r_k - V_t, returns = reward-to-go
    adv, ret = gae_advantages(r, v, mask, 1.0, 1.0)
    # lam = 0: A_t = one-step TD error, V after the last valid token is 0
    adv0, _ = gae_advantages(r, v, mask, 0.9, 0.0)
    for b, L in enumerate(lengths):
        for t in range(L):
            togo = sum(rs[b][t:L])
            assert close(adv[b, t].item(), togo - vs[b][t])
            assert close(ret[b, t].item(), togo)
            nv = vs[b][t + 1] if t + 1 < L else 0.0
            assert close(adv0[b, t].item(), rs[b][t] + 0.9 * nv - vs[b][t])


# ----------------------------------------------------------------------------------------------
# GRPO


@pytest.mark.parametrize("normalize_std", [True, False])
def test_grpo_advantages(seed, lengths, mask, normalize_std):
    # interleaved, non-contiguous group ids, including a singleton group
    group_ids = [0, 1, 2, 0, 1, 2, 0, 3]
    random.Random(seed).shuffle(group_ids)
    scores = (randn(B, seed=seed + 20) * 3).float()
    adv = grpo_advantages(scores, torch.tensor(group_ids), mask, normalize_std=normalize_std)
    s = scores.tolist()
    members: dict[int, list[int]] = {}
    for i, gid in enumerate(group_ids):
        members.setdefault(gid, []).append(i)
    per_seq = [0.0] * B
    for gid, idx in members.items():
        vals = [s[i] for i in idx]
        m = sum(vals) / len(vals)
        std = math.sqrt(sum((x - m) ** 2 for x in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
        for i in idx:
            per_seq[i] = (s[i] - m) / (std + 1e-6) if normalize_std else (s[i] - m)
    expected = [[per_seq[b] if t < L else 0.0 for t in range(T)] for b, L in enumerate(lengths)]
    assert_2d_close(adv, expected, tol=TOL32)
    # group-level properties of the per-sequence advantages
    for gid, idx in members.items():
        vals = [per_seq[i] for i in idx]
        assert abs(sum(vals) / len(vals)) < 1e-5
        if len(vals) > 1 and normalize_std:
            m = sum(vals) / len(vals)
            assert abs(math.sqrt(sum((x - m) ** 2 for x in vals) / (len(vals) - 1)) - 1.0) < 1e-4
        if len(vals) == 1:
            assert vals[0] == 0.0


def test_grpo_constant_group_is_zero():
    scores = torch.tensor([2.0, 2.0, 2.0, 1.0, 5.0])
    mask = torch.ones(5, 3)
    adv = grpo_advantages(scores, torch.tensor([7, 7, 7, 9, 9]), mask)
    assert adv[:3].abs().max().item() == 0.0
    # group {1, 5}: mean 3, unbiased std sqrt(8)
    assert close(adv[3, 0].item(), -2.0 / (math.sqrt(8) + 1e-6), TOL32)
    assert close(adv[4, 0].item(), 2.0 / (math.sqrt(8) + 1e-6), TOL32)


# ----------------------------------------------------------------------------------------------
# aggregate


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean"])
def test_aggregate_matches_naive(seed, lengths, mask, mode):
    loss = pad_garbage(randn(B, T, seed=seed), lengths)
    got = aggregate(loss, mask, mode)
    assert_scalar_close(got, naive_aggregate(rows(loss), lengths, mode))


def test_aggregate_unknown_mode():
    with pytest.raises(ValueError):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "sum")


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean"])
def test_aggregate_normalizer_micro_batches_sum_to_full(seed, lengths, mask, mode):
    loss = pad_garbage(randn(B, T, seed=seed), lengths)
    full = aggregate(loss, mask, mode).item()
    if mode == "token_mean":
        normalizer = float(sum(lengths))
    else:
        normalizer = float(sum(1 for L in lengths if L > 0))
    split = B // 2 - 1  # uneven split
    micro = [
        aggregate(loss[:split], mask[:split], mode, normalizer=normalizer).item(),
        aggregate(loss[split:], mask[split:], mode, normalizer=normalizer).item(),
    ]
    assert close(sum(micro), full), (micro, full)
    # and without the normalizer the micro means generally do not add up
    naive_sum = aggregate(loss[:split], mask[:split], mode).item() + aggregate(loss[split:], mask[split:], mode).item()
    assert not close(naive_sum, full)


# ----------------------------------------------------------------------------------------------
# policy loss


def ppo_inputs(seed, lengths):
    lp = randn(B, T, seed=seed, scale=0.3) - 1.5
    # log-ratios spread widely: many tokens inside, below and above the clip range, some huge
    diff = randn(B, T, seed=seed + 1, scale=0.6)
    adv = randn(B, T, seed=seed + 2)
    full = lengths.index(T)  # forced cases on the full-length row, so they are valid tokens
    diff[full, 0], adv[full, 0] = 2.0, -1.0  # ratio e^2 > dual clip with A < 0
    diff[full, 1], adv[full, 1] = -2.5, 0.5
    diff[full, 2] = 25.0  # beyond the +-20 clamp
    diff[full, 3] = -25.0
    old = lp - diff
    return pad_garbage(lp, lengths, 3.0), pad_garbage(old, lengths, -3.0), pad_garbage(adv, lengths, -GARBAGE)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("clip,dual", [(0.2, 0.0), (0.2, 3.0), (0.1, 1.5), (0.3, 1.0)])
def test_policy_loss(seed, lengths, mask, aggregation, clip, dual):
    lp, old, adv = ppo_inputs(seed, lengths)
    loss, stats = policy_loss(lp, old, adv, mask, clip, dual_clip=dual, aggregation=aggregation)
    per_tok = [[0.0] * T for _ in range(B)]
    n = lower = upper = pgc = dualc = 0
    ratios = []
    for b, L in enumerate(lengths):
        for t in range(L):
            a = adv[b, t].item()
            tok_loss, r, l1, l2 = naive_ppo_token(lp[b, t].item(), old[b, t].item(), a, clip, dual)
            per_tok[b][t] = tok_loss
            n += 1
            lower += r < 1 - clip
            upper += r > 1 + clip
            pgc += l2 > l1
            dualc += a < 0 and l1 > -a * dual
            ratios.append(r)
    assert 0 < lower < n and 0 < upper < n  # the inputs do exercise both clip sides
    assert_scalar_close(loss, naive_aggregate(per_tok, lengths, aggregation))
    assert_scalar_close(stats["clip_fraction_lower"], lower / n)
    assert_scalar_close(stats["clip_fraction_upper"], upper / n)
    assert_scalar_close(stats["clip_fraction"], (lower + upper) / n)
    assert_scalar_close(stats["pg_clipfrac"], pgc / n)
    assert_scalar_close(stats["ratio_mean"], sum(ratios) / n)
    expected_kl = sum(0.5 * math.log(r) ** 2 for r in ratios) / n
    assert_scalar_close(stats["approx_kl"], expected_kl)
    if dual > 1.0:
        assert dualc > 0
        assert_scalar_close(stats["dual_clip_fraction"], dualc / n)
    else:
        assert "dual_clip_fraction" not in stats


def test_policy_loss_clip_fraction_near_boundaries():
    c, d = 0.2, 1e-6
    ratios = [1 - c - d, 1 - c + d, 1.0, 1 + c - d, 1 + c + d, 0.5]
    lp = torch.tensor([[math.log(r) for r in ratios]], dtype=F64)
    old = torch.zeros_like(lp)
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, -1.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]], dtype=F64)  # last token is padding
    _, stats = policy_loss(lp, old, adv, mask, c)
    assert_scalar_close(stats["clip_fraction_lower"], 1 / 5)
    assert_scalar_close(stats["clip_fraction_upper"], 1 / 5)
    assert_scalar_close(stats["clip_fraction"], 2 / 5)
    # A > 0: the clipped term is larger only below the range (-A * (1-c) > -A * r)
    assert_scalar_close(stats["pg_clipfrac"], 1 / 5)


def test_policy_loss_dual_clip_bounds_negative_advantage_loss(seed, lengths, mask):
    lp, old, adv = ppo_inputs(seed, lengths)
    dual = 3.0
    loss_d, _ = policy_loss(lp, old, adv, mask, 0.2, dual_clip=dual)
    loss_n, _ = policy_loss(lp, old, adv, mask, 0.2)
    # dual clip only ever lowers the loss (caps -A*r at -A*dual for A < 0)
    assert loss_d.item() < loss_n.item()


def test_policy_loss_gradient_zero_where_clipped(seed, lengths, mask):
    lp, old, adv = ppo_inputs(seed, lengths)
    lp = lp.clone().requires_grad_(True)
    loss, _ = policy_loss(lp, old, adv, mask, 0.2, aggregation="token_mean")
    loss.backward()
    grad = lp.grad
    n = sum(lengths)
    for b, L in enumerate(lengths):
        for t in range(L):
            a = adv[b, t].item()
            _, r, l1, l2 = naive_ppo_token(lp[b, t].item(), old[b, t].item(), a, 0.2, 0.0)
            lr = lp[b, t].item() - old[b, t].item()
            if l2 > l1 or abs(lr) >= 20.0:
                assert grad[b, t].item() == 0.0
            else:
                assert close(grad[b, t].item(), -a * r / n)
        assert (grad[b, L:] == 0).all()


# ----------------------------------------------------------------------------------------------
# value loss


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("clip", [0.0, 0.2, 1.0])
def test_value_loss(seed, lengths, mask, aggregation, clip):
    old = randn(B, T, seed=seed)
    values = old + randn(B, T, seed=seed + 1, scale=0.4)
    returns = randn(B, T, seed=seed + 2)
    values, old, returns = (pad_garbage(x, lengths, c) for x, c in ((values, GARBAGE), (old, -GARBAGE), (returns, 0.0)))
    loss, stats = value_loss(values, old, returns, mask, clip, aggregation=aggregation)
    per_tok = [[0.0] * T for _ in range(B)]
    n = clipped_n = 0
    for b, L in enumerate(lengths):
        for t in range(L):
            v, vo, R = values[b, t].item(), old[b, t].item(), returns[b, t].item()
            unclipped = (v - R) ** 2
            if clip > 0:
                vc = vo + min(max(v - vo, -clip), clip)
                clipped = (vc - R) ** 2
                per_tok[b][t] = 0.5 * max(unclipped, clipped)
                clipped_n += clipped > unclipped
            else:
                per_tok[b][t] = 0.5 * unclipped
            n += 1
    assert_scalar_close(loss, naive_aggregate(per_tok, lengths, aggregation))
    assert_scalar_close(stats["value_clip_fraction"], clipped_n / n)
    if clip == 0.2:
        assert clipped_n > 0


def test_value_and_policy_loss_normalizer_micro_batches(seed, lengths, mask):
    lp, old, adv = ppo_inputs(seed, lengths)
    v_old = randn(B, T, seed=seed + 5)
    v = v_old + randn(B, T, seed=seed + 6, scale=0.3)
    R = randn(B, T, seed=seed + 7)
    n_tok = float(sum(lengths))
    n_seq = float(sum(1 for L in lengths if L > 0))
    s = 3
    for agg, norm in (("token_mean", n_tok), ("seq_mean", n_seq)):
        full_p, _ = policy_loss(lp, old, adv, mask, 0.2, dual_clip=3.0, aggregation=agg)
        parts_p = sum(policy_loss(lp[i], old[i], adv[i], mask[i], 0.2, dual_clip=3.0, aggregation=agg,
                                  normalizer=norm)[0].item() for i in (slice(0, s), slice(s, B)))
        assert close(parts_p, full_p.item())
        full_v, _ = value_loss(v, v_old, R, mask, 0.2, aggregation=agg)
        parts_v = sum(value_loss(v[i], v_old[i], R[i], mask[i], 0.2, aggregation=agg,
                                 normalizer=norm)[0].item() for i in (slice(0, s), slice(s, B)))
        assert close(parts_v, full_v.item())


# ----------------------------------------------------------------------------------------------
# entropy / logprobs


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_entropy_and_logprobs_from_logits(seed, dtype):
    V = 11
    logits = (randn(3, 5, V, seed=seed, scale=3.0) + 50.0).to(dtype)  # large offset: needs a stable softmax
    tokens = torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(seed))
    ent = entropy_from_logits(logits)
    lps = logprobs_from_logits(logits, tokens)
    assert ent.shape == (3, 5) and lps.shape == (3, 5)
    L = logits.double().tolist()
    for b in range(3):
        for t in range(5):
            logp = naive_log_softmax(L[b][t])
            h = -sum(math.exp(x) * x for x in logp)
            assert close(ent[b, t].item(), h, TOL32), (ent[b, t].item(), h)
            assert close(lps[b, t].item(), logp[tokens[b, t].item()], TOL32)
            assert 0.0 <= ent[b, t].item() <= math.log(V) + 1e-5


def test_entropy_extremes():
    uniform = torch.zeros(2, 7)
    assert torch.allclose(entropy_from_logits(uniform).double(), torch.full((2,), math.log(7), dtype=F64), atol=1e-6)
    peaked = torch.tensor([[0.0, -1e4, -1e4]])
    assert abs(entropy_from_logits(peaked).item()) < 1e-6


# ----------------------------------------------------------------------------------------------
# explained variance


def test_explained_variance(seed, lengths, mask):
    R = pad_garbage(randn(B, T, seed=seed) * 2, lengths)
    V = pad_garbage(R + randn(B, T, seed=seed + 1, scale=0.7), lengths, -GARBAGE)
    Rv = naive_valid(rows(R), lengths)
    Vv = naive_valid(rows(V), lengths)
    expected = 1.0 - naive_var([r - v for r, v in zip(Rv, Vv)]) / naive_var(Rv)
    assert_scalar_close(explained_variance(V, R, mask), expected)
    # perfect prediction -> 1; a constant prediction -> 0
    assert_scalar_close(explained_variance(R, R, mask), 1.0)
    const = torch.full_like(R, 0.123)
    assert_scalar_close(explained_variance(const, R, mask), 0.0)


# ----------------------------------------------------------------------------------------------
# KL controllers


def test_fixed_kl_controller():
    c = FixedKLController(0.05)
    for kl in (0.0, 1.0, 100.0):
        c.update(kl, 64)
    assert c.value == 0.05
    c2 = FixedKLController(1.0)
    c2.load_state_dict(c.state_dict())
    assert c2.value == 0.05


def test_adaptive_kl_controller_matches_ziegler_formula():
    target, horizon = 6.0, 10000
    c = AdaptiveKLController(0.2, target, horizon)
    expected = 0.2
    rng = random.Random(0)
    for _ in range(50):
        kl = rng.uniform(0.0, 15.0)
        n = rng.randint(1, 512)
        c.update(kl, n)
        err = min(max(kl / target - 1.0, -0.2), 0.2)
        expected *= 1.0 + err * n / horizon
        assert abs(c.value - expected) <= 1e-12 * expected


def test_adaptive_kl_controller_direction_and_clipping():
    def after(kl, n=256):
        c = AdaptiveKLController(0.1, 6.0, 10000)
        c.update(kl, n)
        return c.value

    assert after(8.0) > 0.1  # KL above target -> stronger penalty
    assert after(4.0) < 0.1  # below -> weaker
    assert after(6.0) == 0.1
    # error clipped to +-0.2
    assert close(after(7.2), 0.1 * (1 + 0.2 * 256 / 10000), 1e-12)
    assert after(60.0) == after(7.2)
    assert after(0.0) == after(4.8)
    assert close(after(0.0), 0.1 * (1 - 0.2 * 256 / 10000), 1e-12)
    # non-finite KL is ignored
    assert after(float("nan")) == 0.1 and after(float("inf")) == 0.1


def test_adaptive_kl_controller_state_round_trip():
    c = AdaptiveKLController(0.1, 6.0, 10000)
    c.update(9.0, 500)
    d = AdaptiveKLController(0.5, 6.0, 10000)
    d.load_state_dict(c.state_dict())
    assert d.value == c.value
    c.update(3.0, 100)
    d.update(3.0, 100)
    assert d.value == c.value


# ---------------------------------------------------------------- the estimator table
def _inputs(rewards, values, scores, groups, mask):
    from rlhf.algos import AdvantageInputs
    t = lambda x: None if x is None else torch.tensor(x, dtype=torch.float32)  # noqa: E731
    return AdvantageInputs(token_rewards=t(rewards), sequence_rewards=t(scores), values=t(values),
                           group_ids=torch.tensor(groups), mask=t(mask))


def test_gae_entry_by_hand_with_the_configs_gamma_and_lambda():
    """gamma 0.9, lambda 0.8 on 3 valid tokens (a garbage value on the padding):
    deltas 0.9*0.4 - 0.5 = -0.14, 0.9*0.3 - 0.4 = -0.13, 1 - 0.3 = 0.7 (no value after the end);
    A2 = 0.7, A1 = -0.13 + 0.72 * 0.7 = 0.374, A0 = -0.14 + 0.72 * 0.374 = 0.12928; returns A + V."""
    from rlhf.algos import ADVANTAGE_ESTIMATORS
    from rlhf.config import PPOConfig
    inputs = _inputs([[0.0, 0.0, 1.0, 5.0]], [[0.5, 0.4, 0.3, 9.0]], [1.0], [0], [[1, 1, 1, 0]])
    adv, returns = ADVANTAGE_ESTIMATORS["gae"].compute(inputs, PPOConfig(gamma=0.9, lam=0.8))
    assert adv.tolist()[0] == pytest.approx([0.12928, 0.374, 0.7, 0.0], abs=1e-6)
    assert returns.tolist()[0] == pytest.approx([0.62928, 0.774, 1.0, 0.0], abs=1e-6)
    # The defaults (gamma 1, lambda 0.95) give other numbers: the config's values are the ones used.
    adv_default, _ = ADVANTAGE_ESTIMATORS["gae"].compute(inputs, PPOConfig())
    assert adv_default.tolist()[0][0] != pytest.approx(0.12928, abs=1e-3)


@pytest.mark.parametrize("normalize, expected", [
    (True, [1 / math.sqrt(2), -1 / math.sqrt(2), 0.0, 0.0]),  # (score - 0.5) / std, std = sqrt(0.5); a tied group: 0
    (False, [0.5, -0.5, 0.0, 0.0]),
])
def test_grpo_entry_by_hand_with_and_without_std(normalize, expected):
    """Two prompts of two samples: scores 1 and 0 (mean 0.5), then 0.5 and 0.5. The sequence
    rewards are what the group baseline reads; the token rewards and values are not."""
    from rlhf.algos import ADVANTAGE_ESTIMATORS
    from rlhf.config import PPOConfig
    inputs = _inputs([[9.0, 9.0]] * 4, None, [1.0, 0.0, 0.5, 0.5], [0, 0, 1, 1], [[1, 1], [1, 0], [1, 1], [1, 1]])
    ppo = PPOConfig(adv_estimator="grpo", samples_per_prompt=2, grpo_normalize_std=normalize)
    adv, returns = ADVANTAGE_ESTIMATORS["grpo"].compute(inputs, ppo)
    assert returns is None
    assert adv[:, 0].tolist() == pytest.approx(expected, abs=1e-5)
    assert adv[1, 1].item() == 0.0  # the padding of the second sequence


def test_a_new_estimator_is_one_table_entry_and_an_unknown_one_is_refused(monkeypatch):
    """What the trainer runs is the table's entry: an estimator added to the table alone is accepted
    by the config and computed by `PPOTrainer.compute_advantages`; a name not in it is refused."""
    import types

    from rlhf import algos
    from rlhf.batch import Batch
    from rlhf.config import PPOConfig
    from rlhf.errors import ConfigError
    from rlhf.trainer import PPOTrainer

    def sevens(inputs, ppo):
        return torch.full_like(inputs.mask, 7.0) * inputs.mask, None

    with pytest.raises(ConfigError, match=r"ppo.adv_estimator = 'sevens' is invalid: must be one of 'gae', 'grpo'$"):
        PPOConfig(adv_estimator="sevens")
    monkeypatch.setitem(algos.ADVANTAGE_ESTIMATORS, "sevens", algos.AdvantageEstimator(sevens, uses_critic=False))
    ppo = PPOConfig(adv_estimator="sevens", whiten_advantages=False)
    assert not ppo.uses_critic and ppo.estimator.compute is sevens
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    batch = Batch({"response_mask": mask, "scores": torch.tensor([1.0, 0.0]), "group_ids": torch.tensor([0, 1])})
    trainer = types.SimpleNamespace(ppo=ppo, kl_ctl=algos.FixedKLController(0.1), critic=None)
    trainer.token_kl = lambda b: PPOTrainer.token_kl(trainer, b)
    trainer.kl_metrics = lambda b: PPOTrainer.kl_metrics(trainer, b)
    PPOTrainer.compute_advantages(trainer, batch)
    assert batch["advantages"].tolist() == [[7.0, 7.0, 0.0], [7.0, 0.0, 0.0]] and "returns" not in batch
