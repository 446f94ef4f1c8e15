"""Tests for lightning_rl.maths.objective: every named preset of ``Objective`` equals its contract loss in
``losses.py`` in value and gradient, and both equal a naive re-implementation written here from the
formulas of DESIGN.md (so a bug shared by the two library paths cannot hide). Hand-worked values are
in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_rl import losses as L
from lightning_rl.maths.covariance_regions import ClipCov, KLCov
from lightning_rl.maths.objective import Objective
from lightning_rl.maths.trust_regions import CISPO, DPPO, Clip, SoftGate

F64 = torch.float64
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


# ----------------------------------------------------------------------------------- naive reference
def naive_aggregate(x: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Row by row, straight from DESIGN.md: rows with no valid token are left out of sequence means;
    ``seq-mean-token-sum-norm`` divides the sequence mean of token sums by ``T`` (its default length)."""
    rows = [x[i][mask[i]] for i in range(x.shape[0])]
    if mode == "token-mean":
        return torch.cat(rows).sum() / max(sum(len(r) for r in rows), 1)
    per_row = [r.mean() if mode == "seq-mean-token-mean" else r.sum() for r in rows if len(r)]
    return torch.stack(per_row).mean() / (x.shape[1] if mode == "seq-mean-token-sum-norm" else 1)


def naive_clip_objective(logp, old, adv, mask, low, high, c=None):
    """Per-token PPO objective (to maximise): min(r A, clip(r, 1-low, 1+high) A), dual clip max(., c A)."""
    r = torch.exp(torch.where(mask, logp - old, 0.0))
    a = adv[:, None].expand_as(logp)
    obj = torch.minimum(r * a, torch.clamp(r, 1 - low, 1 + high) * a)
    if c is not None:
        obj = torch.where(a < 0, torch.maximum(obj, c * a), obj)
    return obj


def naive_k3(logp, ref, mask):
    d = torch.where(mask, ref - logp, 0.0)
    return torch.exp(d) - d - 1


def naive_sapo(logp, old, adv, mask, tau_pos, tau_neg, mode):
    r = torch.exp(torch.where(mask, logp - old, 0.0))
    a = adv[:, None].expand_as(logp)
    tau = torch.where(a > 0, torch.full_like(a, tau_pos), torch.full_like(a, tau_neg))
    return -naive_aggregate(4 / tau * torch.sigmoid(tau * (r - 1)) * a, mask, mode)


def naive_gspo(logp, old, adv, mask, low, high):
    """-mean over non-empty rows of min(s A, clip(s) A), s = exp(mean_t log r_t)."""
    terms = []
    for i in range(logp.shape[0]):
        m = mask[i]
        if not m.any():
            continue
        s = torch.exp((logp[i][m] - old[i][m]).mean())
        terms.append(torch.minimum(s * adv[i], torch.clamp(s, 1 - low, 1 + high) * adv[i]))
    return -torch.stack(terms).mean()


def naive_cispo(logp, old, adv, mask, high, mode):
    """-aggregate(sg(min(r, 1 + high)) A logp): the capped ratio is a detached weight on REINFORCE."""
    r = torch.exp(torch.where(mask, logp - old, 0.0))
    a = adv[:, None].expand_as(logp)
    weight = torch.clamp(r, max=1 + high).detach()
    return naive_aggregate(-weight * a * torch.where(mask, logp, 0.0), mask, mode)


# ---------------------------------------------------------------------------------------------- data
def batch(seed: int = 0):
    """B=6, T=9, float64: ratios spread around 1 (some tokens clipped on both sides), row 2 fully
    masked, row 0 fully valid, advantages of both signs, one token with ratio e^1.5 = 4.48 under a
    negative advantage (the dual clip at c=3 bites there)."""
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 9
    logp = -(torch.rand(B, T, generator=g, dtype=F64) * 2 + 0.05)
    old = logp + torch.randn(B, T, generator=g, dtype=F64) * 0.35
    old[1, 0] = logp[1, 0] - 1.5
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0] = True
    mask[2] = False
    mask[1, 0] = True
    adv = torch.tensor([0.9, -1.3, 0.7, -0.4, 1.6, -0.8], dtype=F64)
    ref = logp + torch.randn(B, T, generator=g, dtype=F64) * 0.3
    return logp, old, ref, adv, mask


def gspo_batch():
    """Per-row mean log-ratios chosen around GSPO's band [1 - 3e-4, 1 + 4e-4]:
    row 0: 1e-4 inside (unclipped); row 1: 1e-3, A > 0 -> clipped high; row 2: -1e-3, A < 0 -> clipped low;
    row 3: -1e-3 but A > 0 -> not clipped; row 4 fully masked; row 5: 5e-4 but A < 0 -> not clipped.
    Token log-ratios scatter around the row mean (zero-mean noise over the valid tokens)."""
    logp, _, _, _, mask = batch(1)
    mask[4] = False
    mask[2] = mask[0]  # row 2 gets valid tokens here
    g = torch.Generator().manual_seed(5)
    noise = torch.randn(logp.shape, generator=g, dtype=F64) * 1e-3
    noise = noise - L.masked_mean(noise, mask, dim=-1)[:, None]
    row_mean = torch.tensor([1e-4, 1e-3, -1e-3, -1e-3, 2e-4, 5e-4], dtype=F64)
    old = logp - (row_mean[:, None] + noise)
    adv = torch.tensor([0.8, 1.1, -0.6, 0.5, 1.0, -0.9], dtype=F64)
    return logp, old, adv, mask


def value_and_grad(fn, logp):
    x = logp.detach().clone().requires_grad_(True)
    loss = fn(x)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad


def assert_same(fns, logp):
    """All callables give the same loss and the same gradient wrt logp (float64)."""
    results = [value_and_grad(f, logp) for f in fns]
    base_loss, base_grad = results[0]
    assert torch.isfinite(base_grad).all()
    assert base_grad.abs().sum() > 0  # the comparison is not between zeros
    for loss, grad in results[1:]:
        torch.testing.assert_close(loss, base_loss, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(grad, base_grad, atol=1e-12, rtol=1e-10)
    return base_loss, base_grad


def test_batch_exercises_the_clip_on_both_sides():
    logp, old, _, adv, mask = batch()
    r = torch.exp(logp - old)
    a = adv[:, None].expand_as(r)
    assert ((r > 1.2) & (a > 0) & mask).any()  # clipped high (GRPO / PPO range)
    assert ((r > 1.28) & (a > 0) & mask).any()  # clipped high (DAPO range)
    assert ((r < 0.8) & (a < 0) & mask).any()  # clipped low
    assert (((r - 1).abs() < 0.2) & mask).any()  # and unclipped tokens
    assert ((r > 3) & (a < 0) & mask).any()  # dual clip at 3 is active
    assert not mask[2].any() and mask.any(-1).sum() == 5


# ------------------------------------------------------------------------------------------- presets
def test_grpo_preset_equals_grpo_loss():
    logp, old, ref, adv, mask = batch()
    obj = Objective(ratio_level="token", trust_region=Clip(low=0.2, high=0.2),
                    aggregation="seq-mean-token-mean",
                    kl_coef=0.04, kl_estimator="k3")

    def naive(x):
        per_token = naive_clip_objective(x, old, adv, mask, 0.2, 0.2) - 0.04 * naive_k3(x, ref, mask)
        return -naive_aggregate(per_token, mask, "seq-mean-token-mean")

    assert_same([
        lambda x: obj(x, old, ref, adv, mask)[0],
        lambda x: L.grpo_loss(x, old, ref, adv, mask, 0.2, 0.04, "seq-mean-token-mean")[0],
        naive,
    ], logp)
    _, m_obj = obj(logp, old, ref, adv, mask)
    _, m_ref = L.grpo_loss(logp, old, ref, adv, mask, 0.2, 0.04, "seq-mean-token-mean")
    for key in ("policy/kl_ref", "policy/clip_frac", "policy/clip_frac_low", "policy/clip_frac_high",
                "policy/approx_kl", "policy/ratio_mean"):
        torch.testing.assert_close(m_obj[key], m_ref[key])
    assert m_obj["policy/clip_frac_low"] > 0 and m_obj["policy/clip_frac_high"] > 0
    # k3 by hand on the valid tokens: mean(exp(d) - d - 1), d = ref - logp
    d = (ref - logp)[mask]
    torch.testing.assert_close(m_obj["policy/kl_ref"], (torch.exp(d) - d - 1).mean())


@pytest.mark.parametrize("mode", AGGS)
def test_ppo_symmetric_clip_preset_equals_ppo_policy_loss(mode):
    logp, old, _, adv, mask = batch()
    obj = Objective(trust_region=Clip(low=0.2, high=0.2), aggregation=mode)
    assert_same([
        lambda x: obj(x, old, None, adv, mask)[0],
        lambda x: L.ppo_policy_loss(x, old, adv, mask, 0.2, mode)[0],
        lambda x: -naive_aggregate(naive_clip_objective(x, old, adv, mask, 0.2, 0.2), mask, mode),
    ], logp)


def test_dapo_preset_equals_dapo_loss():
    logp, old, _, adv, mask = batch()
    obj = Objective(ratio_level="token", trust_region=Clip(low=0.2, high=0.28), aggregation="token-mean")
    assert_same([
        lambda x: obj(x, old, None, adv, mask)[0],
        lambda x: L.dapo_loss(x, old, adv, mask, 0.2, 0.28, "token-mean")[0],
        lambda x: -naive_aggregate(naive_clip_objective(x, old, adv, mask, 0.2, 0.28), mask, "token-mean"),
    ], logp)
    _, m_obj = obj(logp, old, None, adv, mask)
    _, m_ref = L.dapo_loss(logp, old, adv, mask, 0.2, 0.28, "token-mean")
    for key in ("policy/clip_frac_low", "policy/clip_frac_high", "policy/approx_kl", "policy/ratio_mean"):
        torch.testing.assert_close(m_obj[key], m_ref[key])
    # clip fractions by hand over the valid tokens
    r, a = torch.exp(logp - old)[mask], adv[:, None].expand_as(logp)[mask]
    torch.testing.assert_close(m_obj["policy/clip_frac_high"], ((r > 1.28) & (a > 0)).double().mean())
    torch.testing.assert_close(m_obj["policy/clip_frac_low"], ((r < 0.8) & (a < 0)).double().mean())
    assert "policy/kl_ref" not in m_obj


def test_dual_clip_preset_equals_ppo_policy_loss_with_clip_ratio_c():
    logp, old, _, adv, mask = batch()
    obj = Objective(trust_region=Clip(low=0.2, high=0.2, dual_clip=3.0), aggregation="token-mean")
    loss, _ = assert_same([
        lambda x: obj(x, old, None, adv, mask)[0],
        lambda x: L.ppo_policy_loss(x, old, adv, mask, 0.2, "token-mean", clip_ratio_c=3.0)[0],
        lambda x: -naive_aggregate(naive_clip_objective(x, old, adv, mask, 0.2, 0.2, c=3.0), mask,
                                   "token-mean"),
    ], logp)
    plain = Objective(trust_region=Clip(low=0.2, high=0.2), aggregation="token-mean")
    plain = plain(logp, old, None, adv, mask)[0]
    assert loss < plain  # the dual clip caps the loss of token (1, 0): it did change the value
    _, metrics = obj(logp, old, None, adv, mask)
    assert metrics["policy/clip_frac_dual"] > 0


def test_clip_hand_values():
    # one row, two tokens, r = (1.5, 0.5), eps 0.2, seq-mean-token-mean:
    # A = +1: min(1.5, 1.2) = 1.2 and min(0.5, 0.5) = 0.5 -> objective mean 0.85 -> loss -0.85
    # A = -1: min(-1.5, -1.2) = -1.5 and min(-0.5, -0.8) = -0.8 -> mean -1.15 -> loss 1.15
    logp = torch.log(torch.tensor([[1.5, 0.5]], dtype=F64))
    old = torch.zeros_like(logp)
    mask = torch.ones_like(logp, dtype=torch.bool)
    obj = Objective()
    assert obj(logp, old, None, torch.tensor([1.0], dtype=F64), mask)[0].item() == pytest.approx(-0.85)
    assert obj(logp, old, None, torch.tensor([-1.0], dtype=F64), mask)[0].item() == pytest.approx(1.15)
    # dual clip c = 3, r = 4, A = -1: PPO gives max(4, 3.2)... as loss -min(-4, -1.2) = 4, capped at -cA = 3
    logp4 = torch.log(torch.tensor([[4.0]], dtype=F64))
    one = torch.ones(1, 1, dtype=torch.bool)
    dual = Objective(trust_region=Clip(dual_clip=3.0))
    neg = torch.tensor([-1.0], dtype=F64)
    assert dual(logp4, torch.zeros_like(logp4), None, neg, one)[0].item() == pytest.approx(3.0)
    assert Objective()(logp4, torch.zeros_like(logp4), None, neg, one)[0].item() == pytest.approx(4.0)


def test_gspo_preset_equals_gspo_loss_with_clipped_sequences():
    logp, old, adv, mask = gspo_batch()
    # which rows clip, worked out from the chosen means (see gspo_batch)
    s = torch.exp(L.masked_mean(logp - old, mask, dim=-1))
    clipped = ((s > 1 + 4e-4) & (adv > 0)) | ((s < 1 - 3e-4) & (adv < 0))
    assert clipped.tolist() == [False, True, True, False, False, False]
    obj = Objective(ratio_level="sequence", trust_region=Clip(low=3e-4, high=4e-4),
                    aggregation="seq-mean-token-mean")
    loss, grad = assert_same([
        lambda x: obj(x, old, None, adv, mask)[0],
        lambda x: L.gspo_loss(x, old, adv, mask, 3e-4, 4e-4)[0],
        lambda x: naive_gspo(x, old, adv, mask, 3e-4, 4e-4),
    ], logp)
    # clipped rows get no gradient; the others get -A_i s_i / (L_i N_seq) on each valid token
    n_seq = 5
    for i in range(6):
        expected = torch.zeros(logp.shape[1], dtype=F64)
        if mask[i].any() and not clipped[i]:
            expected[mask[i]] = -adv[i] * s[i] / mask[i].sum() / n_seq
        torch.testing.assert_close(grad[i], expected, atol=1e-12, rtol=1e-9)


def test_gspo_metrics_are_per_sequence_in_training_and_contract():
    # Rows of unequal length, so token-weighted and sequence-weighted means differ:
    # row 0: 3 tokens, log r = (0.01, 0.02, 0.03) -> log s = 0.02, s = 1.0202013 > 1 + 4e-4, A = +1:
    #        clipped high
    # row 1: 1 token,  log r = -1e-4            -> s = 0.9999000, inside [1 - 3e-4, 1 + 4e-4]: not clipped
    # per sequence: clip_frac = 1/2, clip_frac_high = 1/2, clip_frac_low = 0
    #   ratio_mean = (1.0202013 + 0.9999000) / 2 = 1.0100507
    #   approx_kl = mean of (s - 1) - log s: row 0 0.0202013 - 0.02 = 2.01340e-4, row 1 -1e-4 + 1e-4 = 5.0e-9
    #   -> (2.0134003e-4 + 5.0e-9) / 2 = 1.0067251e-4
    # (token-weighted, clip_frac would be 3/4 and ratio_mean (3 * 1.0202013 + 0.9999) / 4 = 1.0151260)
    logp = torch.tensor([[0.01, 0.02, 0.03], [-1e-4, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    old, adv = torch.zeros(2, 3, dtype=F64), torch.tensor([1.0, 1.0], dtype=F64)
    expected = {"policy/clip_frac": 0.5, "policy/clip_frac_high": 0.5, "policy/clip_frac_low": 0.0,
                "policy/ratio_mean": 1.0100507, "policy/approx_kl": 1.0067251e-4}
    training = Objective(ratio_level="sequence", trust_region=Clip(low=3e-4, high=4e-4))
    training = training(logp, old, None, adv, mask)[1]
    contract = L.gspo_loss(logp, old, adv, mask)[1]
    for metrics in (training, contract):
        for key, value in expected.items():
            assert metrics[key].item() == pytest.approx(value, rel=1e-6, abs=1e-12), key
    assert training.keys() == contract.keys()


def test_gspo_hand_value():
    # two tokens with log-ratios 1e-3 and 3e-3: s = e^0.002 = 1.002002 > 1 + 4e-4, A = +1:
    # objective min(1.002002, 1.0004) = 1.0004 -> loss -1.0004, gradient 0
    logp = torch.tensor([[1e-3, 3e-3]], dtype=F64, requires_grad=True)
    obj = Objective(ratio_level="sequence", trust_region=Clip(low=3e-4, high=4e-4))
    loss, _ = obj(logp, torch.zeros(1, 2, dtype=F64), None, torch.tensor([1.0], dtype=F64),
                  torch.ones(1, 2, dtype=torch.bool))
    assert loss.item() == pytest.approx(-1.0004, abs=1e-12)
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(1, 2, dtype=F64))


@pytest.mark.parametrize("mode", AGGS)
def test_sapo_preset_equals_sapo_loss(mode):
    logp, old, _, adv, mask = batch()
    obj = Objective(ratio_level="token", trust_region=SoftGate(tau_pos=1.0, tau_neg=1.05), aggregation=mode)
    assert_same([
        lambda x: obj(x, old, None, adv, mask)[0],
        lambda x: L.sapo_loss(x, old, adv, mask, 1.0, 1.05, mode)[0],
        lambda x: naive_sapo(x, old, adv, mask, 1.0, 1.05, mode),
    ], logp)
    _, m_obj = obj(logp, old, None, adv, mask)
    _, m_ref = L.sapo_loss(logp, old, adv, mask, 1.0, 1.05, mode)
    torch.testing.assert_close(m_obj["policy/gate_weight_mean"], m_ref["policy/gate_weight_mean"])
    assert "policy/clip_frac_high" not in m_obj


def test_sapo_hand_value_on_policy():
    # r = 1, A = 1, tau = 1: f = 4 sigmoid(0) = 2 -> loss -2; d f / d log r = 4 sigmoid'(0) r = 1 -> grad -1
    # A = -2, tau = 1.05: loss = -(4 / 1.05) * 0.5 * (-2) = 3.8095238; grad = -A = 2
    logp = torch.zeros(2, 1, dtype=F64, requires_grad=True)
    obj = Objective(trust_region=SoftGate())
    loss, metrics = obj(logp, torch.zeros(2, 1, dtype=F64), None, torch.tensor([1.0, -2.0], dtype=F64),
                        torch.ones(2, 1, dtype=torch.bool))
    assert loss.item() == pytest.approx((-2.0 + 4 / 1.05) / 2)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5], [1.0]], dtype=F64))  # / 2 sequences
    assert metrics["policy/gate_weight_mean"].item() == pytest.approx(1.0)


@pytest.mark.parametrize("mode", AGGS)
def test_cispo_objective_equals_policy_loss_and_naive(mode):
    logp, old, _, adv, mask = batch()
    obj = Objective(trust_region=CISPO(high=0.28), aggregation=mode)
    r = torch.exp(logp - old)
    assert ((r > 1.28) & mask).any() and ((r < 1.28) & mask).any()  # capped and uncapped tokens
    assert_same([
        lambda x: obj(x, old, None, adv, mask)[0],
        lambda x: L.policy_loss(x, old, None, adv, mask, trust_region=CISPO(high=0.28), aggregation=mode)[0],
        lambda x: naive_cispo(x, old, adv, mask, 0.28, mode),
    ], logp)
    _, metrics = obj(logp, old, None, adv, mask)
    capped = ((r > 1.28) & mask).sum() / mask.sum()
    torch.testing.assert_close(metrics["policy/clip_frac"], capped.to(F64))
    torch.testing.assert_close(metrics["policy/clip_frac_high"], metrics["policy/clip_frac"])


def test_cispo_with_sequence_ratio_runs():
    logp, old, adv, mask = gspo_batch()
    obj = Objective(ratio_level="sequence", trust_region=CISPO(high=4e-4))
    loss, grad = value_and_grad(lambda x: obj(x, old, None, adv, mask)[0], logp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and grad.abs().sum() > 0


# --------------------------------------------------------------------------------------- combinations
def test_sequence_ratio_with_token_mean_runs_and_has_finite_gradient():
    logp, old, adv, mask = gspo_batch()
    obj = Objective(ratio_level="sequence", trust_region=Clip(low=3e-4, high=4e-4), aggregation="token-mean")
    loss, grad = value_and_grad(lambda x: obj(x, old, None, adv, mask)[0], logp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    # every valid token carries its row's term: loss = -sum_i L_i min(s_i A_i, clip(s_i) A_i) / N_tok
    s = torch.exp(L.masked_mean(logp - old, mask, dim=-1))
    lengths = mask.sum(-1).double()
    term = torch.minimum(s * adv, s.clamp(1 - 3e-4, 1 + 4e-4) * adv)
    assert loss.item() == pytest.approx((-(lengths * term).sum() / lengths.sum()).item(), rel=1e-12)
    clipped = torch.tensor([False, True, True, False, False, False])
    assert (grad[clipped] == 0).all() and (grad[~clipped & mask.any(-1)].abs().sum(-1) > 0).all()


def test_sequence_ratio_with_soft_gate_runs():
    logp, old, adv, mask = gspo_batch()
    obj = Objective(ratio_level="sequence", trust_region=SoftGate(), aggregation="seq-mean-token-sum")
    loss, grad = value_and_grad(lambda x: obj(x, old, None, adv, mask)[0], logp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.parametrize("preset", [
    dict(kl_coef=0.04),
    dict(trust_region=Clip(high=0.28), aggregation="token-mean"),
    dict(ratio_level="sequence", trust_region=Clip(low=3e-4, high=4e-4)),
    dict(trust_region=SoftGate()),
    dict(trust_region=CISPO(high=0.28)),
])
def test_garbage_in_padding_does_not_leak(preset):
    logp, old, ref, adv, mask = batch()
    obj = Objective(**preset)
    clean, clean_grad = value_and_grad(lambda x: obj(x, old, ref, adv, mask)[0], logp)
    dirty_logp = logp.masked_fill(~mask, math.nan)
    dirty_old = old.masked_fill(~mask, math.inf)
    dirty_ref = ref.masked_fill(~mask, -math.inf)
    dirty, dirty_grad = value_and_grad(lambda x: obj(x, dirty_old, dirty_ref, adv, mask)[0], dirty_logp)
    torch.testing.assert_close(dirty, clean)
    torch.testing.assert_close(dirty_grad, clean_grad.masked_fill(~mask, 0.0))


def test_kl_off_with_reference_reports_kl_but_leaves_loss():
    logp, old, ref, adv, mask = batch()
    with_ref, metrics = Objective(kl_coef=0.0)(logp, old, ref, adv, mask)
    without, _ = Objective(kl_coef=0.0)(logp, old, None, adv, mask)
    torch.testing.assert_close(with_ref, without)
    assert metrics["policy/kl_ref"] > 0


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimators_in_loss(est):
    logp, old, ref, adv, mask = batch()
    base = Objective(kl_coef=0.0)(logp, old, None, adv, mask)[0]
    loss = Objective(kl_coef=0.5, kl_estimator=est)(logp, old, ref, adv, mask)[0]
    d = torch.where(mask, ref - logp, 0.0)
    kl = {"k1": -d, "k2": 0.5 * d**2, "k3": torch.exp(d) - d - 1}[est]
    torch.testing.assert_close(loss - base, 0.5 * naive_aggregate(kl, mask, "seq-mean-token-mean"))


@pytest.mark.parametrize("trust_region", [Clip(high=0.28), CISPO(high=0.28)], ids=["clip", "cispo"])
def test_micro_batch_normalizers_make_objective_split_invariant(trust_region):
    logp, old, ref, adv, mask = batch()
    for mode in AGGS:
        obj = Objective(trust_region=trust_region, kl_coef=0.1, aggregation=mode)
        whole, whole_grad = value_and_grad(lambda x, obj=obj: obj(x, old, ref, adv, mask)[0], logp)
        n_tok, n_seq = L.normalizer_counts(mask)

        def split(x, obj=obj, n_tok=n_tok, n_seq=n_seq):
            return sum(obj(x[i:i + 2], old[i:i + 2], ref[i:i + 2], adv[i:i + 2], mask[i:i + 2],
                           num_tokens=n_tok, num_seqs=n_seq)[0] for i in range(0, 6, 2))

        parts, parts_grad = value_and_grad(split, logp)
        torch.testing.assert_close(parts, whole)
        torch.testing.assert_close(parts_grad, whole_grad)


def test_the_objectives_aggregation_length_is_dr_grpos_constant():
    """``aggregation_length`` L reaches the loss: seq-mean-token-sum-norm is seq-mean-token-sum / L (value and
    gradient, the entropy-free loss here), and micro-batches of their own padding add up with a fixed L."""
    logp, old, ref, adv, mask = batch()
    norm = Objective(kl_coef=0.1, aggregation="seq-mean-token-sum-norm", aggregation_length=16)
    summed = Objective(kl_coef=0.1, aggregation="seq-mean-token-sum")
    loss, grad = value_and_grad(lambda x: norm(x, old, ref, adv, mask)[0], logp)
    loss_sum, grad_sum = value_and_grad(lambda x: summed(x, old, ref, adv, mask)[0], logp)
    torch.testing.assert_close(loss, loss_sum / 16)
    torch.testing.assert_close(grad, grad_sum / 16)
    n_tok, n_seq = L.normalizer_counts(mask)

    def trimmed(x):  # each micro-batch cut to its own longest row, as a padding-free micro-batch would be
        total = 0.0
        for i in range(0, 6, 2):
            t = int(mask[i:i + 2].any(0).nonzero().max()) + 1 if mask[i:i + 2].any() else 1
            s = (slice(i, i + 2), slice(0, t))
            total = total + norm(x[s], old[s], ref[s], adv[i:i + 2], mask[s], num_tokens=n_tok,
                                 num_seqs=n_seq)[0]
        return total

    parts, parts_grad = value_and_grad(trimmed, logp)
    torch.testing.assert_close(parts, loss)
    torch.testing.assert_close(parts_grad, grad)


# ------------------------------------------------------------------------------------------ validation
TR = "trust_region"


@pytest.mark.parametrize(("kwargs", "key"), [
    (dict(aggregation="seq-sum"), "aggregation"),
    (dict(ratio_level="group"), "ratio_level"),
    (dict(trust_region="kl"), "trust_region"),
    (dict(kl_estimator="k4"), "kl_estimator"),
    (dict(kl_coef=-0.01), "kl_coef"),
    (dict(kl_clamp=0.0), "kl_clamp"),
    (dict(aggregation="seq-mean-token-sum-norm", aggregation_length=0), "aggregation_length"),
    (dict(top_entropy_quantile=-0.1), "top_entropy_quantile"),
    (dict(top_entropy_quantile=1.2), "top_entropy_quantile"),
    (dict(off_policy_mask_threshold=-0.5), "off_policy_mask_threshold"),
])
def test_invalid_combinations_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=f"model.objective.{key}"):
        Objective(**kwargs)


@pytest.mark.parametrize(("region", "kwargs", "key"), [
    (Clip, dict(dual_clip=1.0), "dual_clip"),
    (Clip, dict(dual_clip=0.5), "dual_clip"),
    (Clip, dict(low=0.0), "low"),
    (Clip, dict(low=1.0), "low"),
    (Clip, dict(high=-0.1), "high"),
    (SoftGate, dict(tau_pos=0.0), "tau_pos"),
    (SoftGate, dict(tau_neg=-1.0), "tau_neg"),
    (CISPO, dict(high=0.0), "high"),
    (DPPO, dict(divergence="js"), "divergence"),
    (DPPO, dict(low=0.0), "low"),
    (DPPO, dict(high=-0.1), "high"),
    (DPPO, dict(ratio_cap=0.0), "ratio_cap"),
    (ClipCov, dict(ratio=0.0), "ratio"),
    (ClipCov, dict(ratio=1.5), "ratio"),
    (ClipCov, dict(lb=2.0, ub=1.0), "ub"),
    (ClipCov, dict(low=1.0), "low"),
    (KLCov, dict(ratio=0.0), "ratio"),
    (KLCov, dict(coef=-1.0), "coef"),
])
def test_a_trust_regions_bad_option_names_its_key_and_range(region, kwargs, key):
    with pytest.raises(ValueError, match=rf"`model\.objective\.trust_region\.{key}` must be"):
        region(**kwargs)


@pytest.mark.parametrize(("region", "key"), [
    (CISPO, "low"), (CISPO, "dual_clip"), (SoftGate, "high"), (Clip, "tau_pos"), (DPPO, "dual_clip"),
    (ClipCov, "dual_clip"), (KLCov, "low"), (SoftGate, "coef"),
])
def test_another_regions_option_cannot_be_written(region, key):
    """Each trust region holds only its own options: another region's is not a keyword it takes (and, in
    YAML, a key jsonargparse refuses), so nothing can be set and ignored silently."""
    with pytest.raises(TypeError, match=key):
        region(**{key: 0.5})


def test_each_region_declares_its_options_once_as_dataclass_fields():
    import dataclasses

    options = {cls.__name__: [f.name for f in dataclasses.fields(cls)]
               for cls in (Clip, SoftGate, CISPO, DPPO, ClipCov, KLCov)}
    assert options == {"Clip": ["low", "high", "dual_clip"], "SoftGate": ["tau_pos", "tau_neg"],
                       "CISPO": ["high"], "DPPO": ["divergence", "low", "high", "ratio_cap"],
                       "ClipCov": ["low", "high", "ratio", "lb", "ub"], "KLCov": ["ratio", "coef"]}
    assert [cls.selects_tokens for cls in (Clip, SoftGate, CISPO, DPPO, ClipCov, KLCov)] == \
        [False, False, False, False, True, True]


def test_kl_on_without_reference_at_call_names_kl_coef():
    logp, old, _, adv, mask = batch()
    obj = Objective(kl_coef=0.04)
    assert obj.needs_reference and not Objective().needs_reference
    with pytest.raises(ValueError, match="kl_coef"):
        obj(logp, old, None, adv, mask)


def test_algorithm_presets_build_these_objectives():
    from lightning_rl.algorithms import DAPO, GRPO, GSPO, SAPO
    from lightning_rl.algorithms.options import PolicyOptions
    from lightning_rl.algorithms.sampler_options import SamplingOptions

    common = dict(policy=PolicyOptions(model="builtin:tiny-sort", max_prompt_length=16),
                  sampling=SamplingOptions(max_new_tokens=8, num_generations=2))
    assert GRPO(**common).objective == Objective(ratio_level="token", trust_region=Clip(0.2, 0.2, None),
                                                 aggregation="seq-mean-token-mean", kl_coef=0.04)
    assert GSPO(**common).objective == Objective(ratio_level="sequence", trust_region=Clip(3e-4, 4e-4))
    assert DAPO(**common).objective == Objective(trust_region=Clip(0.2, 0.28), aggregation="token-mean")
    assert SAPO(**common).objective == Objective(trust_region=SoftGate(tau_pos=1.0, tau_neg=1.05))
    # the composed axes stay open on every preset
    token_mean = SAPO.configured(**common, objective={"aggregation": "token-mean"})
    assert token_mean.objective.aggregation == "token-mean"
    # a trust region is replaced whole: GSPO's clip range cannot leak into the soft gate
    gated = GSPO.configured(**common, objective={"trust_region": SoftGate()})
    assert gated.objective.ratio_level == "sequence" and gated.objective.trust_region == SoftGate()
    cispo = DAPO.configured(**common, objective={"trust_region": CISPO(high=0.28)})
    assert cispo.objective.trust_region == CISPO(high=0.28) and cispo.objective.aggregation == "token-mean"
