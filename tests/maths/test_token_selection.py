"""DPPO, the 80/20 high-entropy selection, Clip-Cov, KL-Cov and OPSM (issue 40): hand-worked values (the
arithmetic in the comments), oracles written here from each source's own definition (verl ``core_algos.py``
``compute_policy_loss_dppo_tv`` / ``_dppo_kl`` / ``_clip_cov`` / ``_kl_cov``, SkyRL ``dppo_policy_loss``,
prime-rl ``default_loss_fn``, TRL ``get_high_entropy_mask`` / ``get_off_policy_mask``, slime
``compute_opsm_mask``), composition with the ratio levels, the four aggregations and the off-policy
weights, and the whole-minibatch selections: equal over micro-batches and over (emulated) ranks."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from lightning_rl import losses as L
from lightning_rl.maths.covariance_regions import ClipCov, KLCov
from lightning_rl.maths.objective import Objective
from lightning_rl.maths.trust_regions import DPPO

F64 = torch.float64
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def t(x, grad=False):
    return torch.tensor(x, dtype=F64, requires_grad=grad)


def grad_of(fn, x):
    x = x.detach().clone().requires_grad_(True)
    value = fn(x)
    (g,) = torch.autograd.grad(value, x)
    return value.detach(), g


def random_batch(seed=0, rows=6, cols=5):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, cols, generator=g, dtype=F64) * 3 - 0.05
    old = logp + 0.4 * torch.randn(rows, cols, generator=g, dtype=F64)
    old = old.clamp(max=-1e-3)  # log-probs of a distribution: p <= 1
    adv = torch.randn(rows, generator=g, dtype=F64)
    lengths = torch.tensor([5, 3, 4, 0, 2, 5][:rows])
    mask = torch.arange(cols)[None, :] < lengths[:, None]
    entropy = torch.rand(rows, cols, generator=g, dtype=F64) * 2
    weights = torch.rand(rows, cols, generator=g, dtype=F64) * 1.5  # off-policy correction weights
    return logp, old, adv, mask, entropy, weights


# ---------------------------------------------------------------------------------------------- DPPO
# One row, 4 tokens: p_old = [.5, .5, .9, .2], p = [.8, .6, .6, .1], A = [1, 1, -1, -1] per token.
# TV (delta 0.2 both sides): p - p_old = [.3, .1, -.3, -.1]: t0 (A>0, .3 > .2) dropped, t1 kept,
# t2 (A<0, -.3 < -.2) dropped, t3 kept. r = p / p_old: t1 1.2, t3 0.5.
# loss per token -A r: t1 -1.2, t3 +0.5; d/dlogp (-A r) = -A r: t1 -1.2, t3 0.5; dropped tokens 0.
P_OLD, P_NEW, ADV4 = [0.5, 0.5, 0.9, 0.2], [0.8, 0.6, 0.6, 0.1], [1.0, 1.0, -1.0, -1.0]


def dppo_inputs():
    logp = t([[math.log(p) for p in P_NEW]], grad=True)
    old = t([[math.log(p) for p in P_OLD]])
    return logp, old, t([ADV4]), torch.ones(1, 4, dtype=torch.bool)


def test_dppo_tv_hand_values():
    logp, old, adv, mask = dppo_inputs()
    out = L.dppo_surrogate(logp - old, adv, "tv", 0.2, 0.2, logp=logp, old_logp=old, mask=mask)
    torch.testing.assert_close(out.loss.detach(), t([[0.0, -1.2, 0.0, 0.5]]))
    (grad,) = torch.autograd.grad(out.loss.sum(), logp)
    torch.testing.assert_close(grad, t([[0.0, -1.2, 0.0, 0.5]]))
    assert out.stats["clip_frac"].tolist() == [[True, False, True, False]]
    assert out.stats["clip_frac_high"].tolist() == [[True, False, False, False]]
    assert out.stats["clip_frac_low"].tolist() == [[False, False, True, False]]


def test_dppo_ratio_cap_truncates_the_gradient_weight():
    # cap 1.1: t1's r = 1.2 -> value -A min(r, 1.1) = -1.1 and gradient -1.1 (verl's truncated weight)
    logp, old, adv, mask = dppo_inputs()
    out = L.dppo_surrogate(logp - old, adv, "tv", 0.2, 0.2, 1.1, logp=logp, old_logp=old, mask=mask)
    torch.testing.assert_close(out.loss.detach(), t([[0.0, -1.1, 0.0, 0.5]]))
    (grad,) = torch.autograd.grad(out.loss.sum(), logp)
    torch.testing.assert_close(grad, t([[0.0, -1.1, 0.0, 0.5]]))
    assert out.stats["ratio_cap_frac"].tolist() == [[False, True, False, False]]


# Binary KL, KL = p_old ln(p_old/p) + (1-p_old) ln((1-p_old)/(1-p)):
# t0: .5 ln(.5/.8) + .5 ln(.5/.2) = .5(-.470004) + .5(.916291) = .223144   (A>0, p > p_old)
# t1: .5 ln(.5/.6) + .5 ln(.5/.4) = .5(-.182322) + .5(.223144) = .020411   (A>0, p > p_old)
# t2: .9 ln(.9/.6) + .1 ln(.1/.4) = .364919 - .138629 = .226289            (A<0, p < p_old)
# t3: .2 ln(.2/.1) + .8 ln(.8/.9) = .138629 - .094226 = .044403            (A<0, p < p_old)
# delta_high .25, delta_low .2: t0 kept (.223 <= .25), t2 dropped (.226 > .2): loss [-1.6, -1.2, 0, .5]
def test_dppo_kl_hand_values():
    logp, old, adv, mask = dppo_inputs()
    out = L.dppo_surrogate(logp - old, adv, "kl", 0.2, 0.25, logp=logp, old_logp=old, mask=mask)
    torch.testing.assert_close(out.loss.detach(), t([[-1.6, -1.2, 0.0, 0.5]]))
    # the same token moving the other way is never dropped: t2 with A > 0 has p < p_old
    out = L.dppo_surrogate(logp - old, t([[1.0, 1.0, 1.0, -1.0]]), "kl", 0.2, 0.01, logp=logp, old_logp=old,
                           mask=mask)
    assert out.stats["clip_frac"].tolist() == [[True, True, False, False]]


def verl_dppo(old, logp, adv, mask, divergence, low, high, cap=20.0):
    """verl ``compute_policy_loss_dppo_{tv,kl}`` (token-mean), written from its source: per token
    ``-A sg(min(r, cap)) logp valid``, ``valid = where(A > 0, positive test, negative test)``."""
    neg_kl = torch.clamp(logp - old, -20.0, 20.0)
    ratio = torch.exp(neg_kl)
    truncated = torch.clamp(ratio, max=cap).detach()
    prob, old_prob = torch.exp(logp), torch.exp(old)
    if divergence == "tv":
        pos, neg = (prob - old_prob) <= high, (prob - old_prob) >= -low
    else:
        bkl = old_prob * (old - logp) \
            + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        pos, neg = (bkl <= high) | (prob <= old_prob), (bkl <= low) | (prob >= old_prob)
    valid = torch.where(adv > 0, pos, neg).detach().float()
    losses = -adv * truncated * logp * valid
    return (losses * mask).sum() / mask.sum()


def skyrl_dppo(logp, mu, adv, mask, divergence, low, high):
    """SkyRL ``dppo_policy_loss`` (token-mean), from its source: ``-(r A mask)`` with the binary mask."""
    ratio = torch.exp(torch.clamp(logp - mu, -20.0, 20.0))
    with torch.no_grad():
        cur, old = torch.exp(logp), torch.exp(mu)
        diff = cur - old
        keep = torch.ones_like(adv)
        if divergence == "tv":
            keep[(adv > 0) & (diff > high)] = 0.0
            keep[(adv < 0) & (-diff > low)] = 0.0
        else:
            bkl = old * (mu - logp) + (1 - old) * torch.log((1 - old + 1e-8) / (1 - cur + 1e-8))
            keep[(adv > 0) & (diff > 0) & (bkl > high)] = 0.0
            keep[(adv < 0) & (diff < 0) & (bkl > low)] = 0.0
    return (-(ratio * adv * keep) * mask).sum() / mask.sum()


@pytest.mark.parametrize("divergence", ["tv", "kl"])
def test_dppo_matches_verl_gradient_and_skyrl_value_and_gradient(divergence):
    logp, old, adv, mask, _, _ = random_batch(1)
    a = adv[:, None].expand_as(logp)
    low, high = (0.15, 0.1) if divergence == "tv" else (0.05, 0.04)
    obj = Objective(trust_region=DPPO(divergence=divergence, low=low, high=high), aggregation="token-mean")
    ours, ours_grad = grad_of(lambda x: obj(x, old, None, adv, mask)[0], logp)
    _, verl_grad = grad_of(lambda x: verl_dppo(old, x, a, mask, divergence, low, high), logp)
    sky, sky_grad = grad_of(lambda x: skyrl_dppo(x, old, a, mask, divergence, low, high), logp)
    torch.testing.assert_close(ours, sky)
    torch.testing.assert_close(ours_grad, sky_grad)
    torch.testing.assert_close(ours_grad, verl_grad)
    dropped = obj(logp, old, None, adv, mask)[1]["policy/clip_frac"]
    assert 0 < dropped < 1  # the batch exercises the mask
    # with a cap that bites, verl's truncated weight
    capped = Objective(trust_region=DPPO(divergence=divergence, low=low, high=high, ratio_cap=1.05),
                       aggregation="token-mean")
    _, capped_grad = grad_of(lambda x: capped(x, old, None, adv, mask)[0], logp)
    _, verl_capped = grad_of(lambda x: verl_dppo(old, x, a, mask, divergence, low, high, cap=1.05), logp)
    torch.testing.assert_close(capped_grad, verl_capped)
    assert not torch.allclose(capped_grad, ours_grad)


def test_dppo_matches_prime_rls_default_loss_without_its_kl_term():
    """prime-rl ``default_loss_fn`` (``kl_tau = 0``, ``adv_tau = 1``): ``-keep A r`` summed; its mask reads
    ``where(A > 0, diff > high, diff < -low)``, DPPO-TV's."""
    logp, old, adv, mask, _, _ = random_batch(2)
    a = adv[:, None].expand_as(logp)

    def prime(x):
        ratio, diff = torch.exp(x - old), torch.exp(x) - torch.exp(old)
        masked = torch.where(a > 0, diff > 0.1, diff < -0.1)
        return -((mask & ~masked) * a * ratio).sum()

    obj = Objective(trust_region=DPPO(low=0.1, high=0.1), aggregation="seq-mean-token-sum")
    n_seq = mask.any(1).sum()
    ours, g = grad_of(lambda x: obj(x, old, None, adv, mask)[0] * n_seq, logp)
    theirs, g_prime = grad_of(prime, logp)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(g, g_prime)


# ------------------------------------------------------------------------------ high-entropy selection
def test_quantile_count_hand_values():
    # n = 5, rho = 0.4: p = 0.6, position (5-1) 0.6 = 2.4 -> from rank ceil(2.4) = 3: 5 - 3 = 2 kept
    # n = 6, rho = 0.2: position 5 x 0.8 = 4.0 (whole) -> from rank 4: 2 kept; rho 0 -> 1; rho 1 -> all
    assert L.quantile_count(5, 0.4) == 2
    assert L.quantile_count(6, 0.2) == 2
    assert L.quantile_count(6, 0.0) == 1 and L.quantile_count(6, 1.0) == 6 and L.quantile_count(0, 0.2) == 0


def test_high_entropy_mask_hand_values():
    # valid entropies .1 .5 .9 | .3 .7 (pad 9.0 ignored); rho 0.4 -> 2 kept: .9 and .7
    # (TRL: torch.quantile([.1 .3 .5 .7 .9], .6) = .5 + .4 (.7 - .5) = .58; >= .58 keeps .7, .9)
    entropy = t([[0.1, 0.5, 0.9], [0.3, 0.7, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert L.high_entropy_mask(entropy, mask, 0.4).tolist() == [[False, False, True], [False, True, False]]


def trl_high_entropy_mask(entropies, mask, threshold):
    """TRL ``GRPOTrainer.get_high_entropy_mask`` on one process, written from its source."""
    local = entropies[mask.bool()].float()
    if local.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    entropy_threshold = torch.quantile(local, threshold)
    return ((entropies * mask.float()) >= entropy_threshold) & mask.bool()


@pytest.mark.parametrize("n", [1, 2, 5, 6, 11, 16, 21, 101])
def test_high_entropy_mask_equals_trls_quantile_rule(n):
    g = torch.Generator().manual_seed(n)
    entropy = torch.rand(1, n + 3, generator=g)
    mask = torch.arange(n + 3)[None] < n
    for rho in (0.0, 0.05, 0.2, 0.25, 0.5, 0.8, 1.0):
        ours = L.high_entropy_mask(entropy, mask, rho)
        assert torch.equal(ours, trl_high_entropy_mask(entropy, mask, 1 - rho)), (n, rho)


# ------------------------------------------------------------------------------------ covariances
# Rows: A = 1 on row 0 (logp -1 -2 -3), A = -1 on row 1 (logp -1 -3, pad). 5 valid tokens:
# mean A = (3 - 2) / 5 = 0.2, mean logp = -10 / 5 = -2.
# cov = (A - .2)(logp + 2): row 0: .8, 0, -.8; row 1: -1.2 (1) = -1.2, -1.2 (-1) = 1.2.
COV_LOGP = [[-1.0, -2.0, -3.0], [-1.0, -3.0, 0.0]]
COV_MASK = [[1, 1, 1], [1, 1, 0]]
COV_LOG_R = [[0.1, 0.2, -0.1], [-0.2, 0.3, 0.0]]


def test_token_covariance_hand_values():
    cov = L.token_covariance(t(COV_LOGP), t([[1.0] * 3, [-1.0] * 3]), torch.tensor(COV_MASK))
    torch.testing.assert_close(cov, t([[0.8, 0.0, -0.8], [-1.2, 1.2, 0.0]]))


# KL-Cov, ratio .4: k = max(1, int(.4 x 5)) = 2 -> the two largest, 1.2 (row 1 t1) and .8 (row 0 t0).
# log r as COV_LOG_R, coefficient 1: per token -A r + sel |log r|:
# row 0: -e^.1 + .1 = -1.005171, -e^.2 = -1.221403, -e^-.1 = -.904837; row 1: e^-.2 = .818731,
# e^.3 + .3 = 1.649859. token-mean: -0.662821 / 5 = -0.132564.
# d/dlogp: -A r + sel sign(log r): row 0 t0 -1.105171 + 1 = -.105171, row 1 t1 1.349859 + 1 = 2.349859.
def test_kl_cov_hand_values():
    logp = t(COV_LOGP, grad=True)
    mask = torch.tensor(COV_MASK)
    old = logp.detach() - t(COV_LOG_R)
    obj = Objective(trust_region=KLCov(ratio=0.4), aggregation="token-mean")
    selection = obj.select(logp.detach(), old, t([1.0, -1.0]), mask, None)
    assert selection.selected.tolist() == [[True, False, False], [False, True, False]]
    loss, metrics = obj(logp, old, None, t([1.0, -1.0]), mask, selection=selection)
    torch.testing.assert_close(loss.detach(), t(-0.662821 / 5), atol=1e-6, rtol=0)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = t([[-0.105171, -1.221403, -0.904837], [0.818731 + 0.0, 2.349859, 0.0]]) / 5
    expected[1, 0] = math.exp(-0.2) / 5  # row 1 t0: -A r = e^-.2, unselected
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(metrics["policy/cov_frac"], t(2 / 5))


# Clip-Cov, clip .2/.2: r row 0 = e^.1 1.105, e^.2 1.221 (> 1.2, A > 0: clipped), e^-.1; row 1 (A < 0)
# e^-.2 .819 (>= .8: unclipped), e^.3. Band (.5, 1.5): candidates .8 (row 0 t0) and 1.2 (row 1 t1);
# ratio .2: k = max(1, int(1.0)) = 1, the candidate of the smaller key. Band (.5, 1.0): row 0 t0 only.
def test_clip_cov_hand_values():
    logp = t(COV_LOGP, grad=True)
    mask = torch.tensor(COV_MASK)
    old = logp.detach() - t(COV_LOG_R)
    adv = t([1.0, -1.0])
    keys = t([[0.7, 0.1, 0.1], [0.1, 0.3, 0.0]])  # row 0 t1 has the smallest key but PPO clips it
    wide = Objective(trust_region=ClipCov(ratio=0.2, lb=0.5, ub=1.5))
    assert wide.select(logp.detach(), old, adv, mask, None, keys=keys).selected.tolist() == \
        [[False, False, False], [False, True, False]]
    narrow = Objective(trust_region=ClipCov(ratio=0.2, lb=0.5, ub=1.0), aggregation="token-mean")
    selection = narrow.select(logp.detach(), old, adv, mask, None, keys=keys)
    assert selection.selected.tolist() == [[True, False, False], [False, False, False]]
    loss, metrics = narrow(logp, old, None, adv, mask, selection=selection)
    # per token: 0 (selected), -1.2 (clipped), -e^-.1, e^-.2, e^.3; token-mean over 5
    expected = (-1.2 - math.exp(-0.1) + math.exp(-0.2) + math.exp(0.3)) / 5
    torch.testing.assert_close(loss.detach(), t(expected))
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, t([[0.0, 0.0, -math.exp(-0.1)], [math.exp(-0.2), math.exp(0.3), 0]]) / 5)
    torch.testing.assert_close(metrics["policy/cov_frac"], t(1 / 5))
    torch.testing.assert_close(metrics["policy/clip_frac"], t(1 / 5))


def verl_clip_cov(old, logp, adv, mask, low, high, ratio_c, lb, ub, perm):
    """verl ``compute_policy_loss_clip_cov`` (token-mean), from its source, with its ``randperm`` given."""
    ratio = torch.exp(logp - old)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip_by_origin = (pg2 > pg1) & (mask > 0)
    n = mask.sum()
    cov = (adv - (adv * mask).sum() / n) * (logp - (logp.detach() * mask).sum() / n)
    cov[mask == 0] = -torch.inf
    cov[clip_by_origin] = -torch.inf
    clip_num = max(int(ratio_c * mask.sum().item()), 1)
    idx = torch.nonzero((cov < ub) & (cov > lb) & (mask > 0))
    idx = idx[perm(len(idx))[: min(clip_num, len(idx))]] if len(idx) else idx
    corr = torch.ones_like(adv)
    corr[idx[:, 0], idx[:, 1]] = 0
    return (torch.maximum(pg1, pg2) * corr * mask).sum() / n, corr == 0


def verl_kl_cov(old, logp, adv, mask, ratio_k, coef):
    """verl ``compute_policy_loss_kl_cov`` (token-mean), from its source."""
    log_r = logp - old
    pg1 = -adv * torch.exp(log_r)
    pg_kl = pg1 + coef * log_r.abs()
    valid = mask > 0
    valid_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    a, lp = adv[valid].detach().reshape(-1), logp[valid].detach().reshape(-1)
    cov = (a - a.mean()) * (lp - lp.mean())
    top = valid_idx[torch.topk(cov, max(1, int(len(cov) * ratio_k)), largest=True).indices]
    rows, cols = top // adv.shape[1], top % adv.shape[1]
    losses = pg1.clone()
    losses[rows, cols] = pg_kl[rows, cols]
    return (losses * mask).sum() / mask.sum()


def test_kl_cov_equals_verls_definition():
    logp, old, adv, mask, _, _ = random_batch(3)
    a = adv[:, None].expand_as(logp)
    obj = Objective(trust_region=KLCov(ratio=0.2, coef=0.7), aggregation="token-mean")
    sel = obj.select(logp, old, adv, mask, None)
    assert int(sel.selected.sum()) == max(1, int(0.2 * int(mask.sum())))
    ours, g = grad_of(lambda x: obj(x, old, None, adv, mask, selection=sel)[0], logp)
    theirs, g_verl = grad_of(lambda x: verl_kl_cov(old, x, a, mask.double(), 0.2, 0.7), logp)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(g, g_verl)


def test_clip_cov_equals_verls_definition_when_the_draw_takes_every_candidate():
    logp, old, adv, mask, _, _ = random_batch(4)
    a = adv[:, None].expand_as(logp)
    obj = Objective(trust_region=ClipCov(low=0.1, high=0.1, ratio=1.0, lb=0.05, ub=0.6),
                    aggregation="token-mean")
    sel = obj.select(logp, old, adv, mask, None, keys=torch.rand(logp.shape, dtype=F64))
    ours, g = grad_of(lambda x: obj(x, old, None, adv, mask, selection=sel)[0], logp)
    theirs, g_verl = grad_of(lambda x: verl_clip_cov(old, x, a, mask.double(), 0.1, 0.1, 1.0, 0.05, 0.6,
                                                     torch.randperm)[0], logp)
    _, corr = verl_clip_cov(old, logp, a, mask.double(), 0.1, 0.1, 1.0, 0.05, 0.6, torch.randperm)
    assert sel.selected.any() and torch.equal(sel.selected, corr & mask)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(g, g_verl)


def test_clip_cov_draws_k_of_the_candidates_by_key():
    logp, old, adv, mask, _, _ = random_batch(5)
    obj = Objective(trust_region=ClipCov(ratio=0.1, lb=-10.0, ub=10.0))
    keys = torch.rand(logp.shape, dtype=F64, generator=torch.Generator().manual_seed(0))
    sel = obj.select(logp, old, adv, mask, None, keys=keys).selected
    k = max(1, int(0.1 * int(mask.sum())))
    assert int(sel.sum()) == k
    unclipped = mask & ~L.clipped_surrogate(torch.where(mask, logp - old, 0.0), adv[:, None].expand_as(logp)
                                            ).stats["clip_frac"]
    assert sorted(keys[sel].tolist()) == sorted(keys[unclipped].tolist())[:k]  # the k smallest keys


def test_token_keys_ignore_padding_and_position_of_the_row():
    prompt = torch.tensor([[0, 5, 6], [7, 8, 9]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    comp = torch.tensor([[3, 4, 0], [3, 4, 2]])
    comp_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    keys = L.token_keys(prompt, prompt_mask, comp, comp_mask, seed=3)
    # the same row alone, with one padding column less on the left and none on the right
    alone = L.token_keys(prompt[:1, 1:], prompt_mask[:1, 1:], comp[:1, :2], comp_mask[:1, :2], seed=3)
    torch.testing.assert_close(alone, keys[:1, :2])
    assert ((keys >= 0) & (keys < 1)).all() and len(set(keys.flatten().tolist())) == 6
    assert not torch.equal(keys, L.token_keys(prompt, prompt_mask, comp, comp_mask, seed=4))


# ------------------------------------------------------------------------------------------------ OPSM
# Rows (sampler - current log-probs per token): row 0 A = -1, diffs .5, 1.0 -> mean .75 > .5: dropped;
# row 1 A = -1, diffs .1, .2 (pad) -> .15: kept; row 2 A = +1, diffs .5, 1.0: kept (A >= 0).
def test_opsm_hand_values():
    logp = t([[-1.0, -2.0, -1.0], [-1.0, -1.0, 0.0], [-1.0, -2.0, -1.0]])
    sampler = logp + t([[0.5, 1.0, 0.0], [0.1, 0.2, 9.0], [0.5, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0]])
    adv = t([[-1.0] * 3, [-1.0] * 3, [1.0] * 3])
    keep = L.off_policy_sequence_mask(logp, sampler, adv, mask, 0.5)
    assert keep[:, :2].tolist() == [[False, False], [True, True], [True, True]]


def trl_off_policy_mask(advantages, logps, sampling_logps, mask, threshold):
    """TRL ``get_off_policy_mask``, from its source: keep ``A >= 0`` or mean KL <= delta; ``(B, 1)``."""
    kl = sampling_logps - logps.detach()
    avg = (kl * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (avg <= threshold)).to(mask.dtype)


def slime_opsm(logps, old_logps, advantages, masks, delta):
    """slime ``compute_opsm_mask`` per sample, from its source: 0 where A < 0 and seq KL > delta."""
    out = []
    for lp, olp, a, m in zip(logps, old_logps, advantages, masks, strict=True):
        seq_kl = ((olp - lp) * m).sum() / torch.clamp_min(m.sum(), 1)
        out.append(1 - ((a < 0) & (seq_kl > delta)).float())
    return torch.stack(out)


def test_opsm_equals_trl_and_slime_and_masks_only_the_surrogate():
    logp, old, _, mask, _, _ = random_batch(6)
    adv = t([-1.0, -0.5, 0.7, -2.0, -1.5, 0.3])
    noise = 0.1 * torch.randn(old.shape, dtype=F64, generator=torch.Generator().manual_seed(1))
    shift = t([0.3, 0.0, 0.3, 0.3, 0.3, 0.0])[:, None]  # rows 0 and 4 (A < 0) go past delta = 0.2
    sampler = torch.where(mask, logp + shift + noise, 0.0)
    a = adv[:, None].expand_as(logp)
    keep = L.off_policy_sequence_mask(logp, sampler, a, mask, 0.2)
    trl = trl_off_policy_mask(adv[:, None], torch.where(mask, logp, 0.0), sampler, mask.double(), 0.2)
    slime = slime_opsm(torch.where(mask, logp, 0.0), sampler, a, mask.double(), 0.2)
    assert torch.equal(keep.double(), trl.expand_as(keep)) and torch.equal(keep.double(), slime)
    assert not keep[mask].all() and keep[mask].any()
    ref = logp + 0.1
    plain = Objective(kl_coef=0.1, aggregation="token-mean")
    opsm = Objective(kl_coef=0.1, aggregation="token-mean", off_policy_mask_threshold=0.2)
    _, g = grad_of(lambda x: opsm(x, old, ref, adv, mask, sampler_logp=sampler)[0], logp)
    _, g_plain = grad_of(lambda x: plain(x, old, ref, adv, mask)[0], logp)
    _, g_kl = grad_of(lambda x: Objective(kl_coef=0.1, aggregation="token-mean")(
        x, old, ref, torch.zeros_like(adv), mask)[0], logp)
    torch.testing.assert_close(g, torch.where(keep, g_plain, g_kl))  # dropped tokens keep their KL term
    metrics = opsm(logp, old, ref, adv, mask, sampler_logp=sampler)[1]
    torch.testing.assert_close(metrics["policy/opsm_masked_frac"], (~keep[mask]).double().mean())


# ------------------------------------------------------------- composition: levels, aggregations, weights
def oracle_per_token(option, logp, old, adv, mask, ratio_level, selection, sampler):
    """The surrogate each option defines, from the formulas of the sources, at either ratio level
    (``sequence``: GSPO-token's ratio, row-mean advantages); then masked as the option says."""
    a = adv[:, None].expand_as(logp)
    if ratio_level == "sequence":
        log_r = L.sequence_log_ratio(logp, old, mask)
        a = (a * mask).sum(1, keepdim=True).div(mask.sum(1, keepdim=True).clamp_min(1)).expand_as(logp)
    else:
        log_r = torch.where(mask, logp - old, 0.0)
    r = torch.exp(log_r)
    if option == "dppo":
        diff = torch.exp(torch.where(mask, logp, 0.0)).detach() - torch.exp(torch.where(mask, old, 0.0))
        valid = torch.where(a > 0, diff <= 0.1, diff >= -0.1)
        return torch.where(valid, -a * r, 0.0)
    clip = torch.maximum(-a * r, -a * torch.clamp(r, 0.8, 1.2))
    if option == "clip_cov":
        return torch.where(selection.selected, 0.0, clip)
    if option == "kl_cov":
        return -a * r + torch.where(selection.selected, 0.5 * log_r.abs(), 0.0)
    if option == "entropy":
        return torch.where(selection.high_entropy, clip, 0.0)
    keep = trl_off_policy_mask(a, torch.where(mask, logp, 0.0), sampler, mask.double(), 0.1).bool()
    return torch.where(keep, clip, 0.0)


OPTIONS = {
    "dppo": dict(trust_region=DPPO(low=0.1, high=0.1)),
    "clip_cov": dict(trust_region=ClipCov(ratio=0.1, lb=-5.0, ub=5.0)),
    "kl_cov": dict(trust_region=KLCov(ratio=0.2, coef=0.5)),
    "entropy": dict(top_entropy_quantile=0.3),
    "opsm": dict(off_policy_mask_threshold=0.1),
}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_each_option_composes_with_levels_aggregations_and_weights(option, ratio_level):
    logp, old, adv, mask, entropy, weights = random_batch(7)
    sampler = torch.where(mask, old + 0.2, 0.0)
    keys = torch.rand(logp.shape, dtype=F64, generator=torch.Generator().manual_seed(2))
    for mode in AGGS:
        obj = Objective(ratio_level=ratio_level, aggregation=mode, aggregation_length=5, **OPTIONS[option])
        sel = obj.select(logp, old, adv, mask, entropy, keys=keys) if obj.selects_tokens else None
        for w in (None, weights):
            ours, g = grad_of(lambda x, obj=obj, sel=sel, w=w: obj(
                x, old, None, adv, mask, selection=sel, sampler_logp=sampler, token_weights=w)[0], logp)

            def oracle(x, mode=mode, sel=sel, w=w):
                per_token = oracle_per_token(option, x, old, adv, mask, ratio_level, sel, sampler)
                per_token = per_token if w is None else per_token * w
                return L.aggregate(per_token, mask, mode, norm_length=5)

            theirs, g_oracle = grad_of(oracle, logp)
            torch.testing.assert_close(ours, theirs, msg=f"{option} {ratio_level} {mode} {w is None}")
            torch.testing.assert_close(g, g_oracle, msg=f"{option} {ratio_level} {mode} {w is None}")


# -------------------------------------------------------------- whole-minibatch: micro-batches and ranks
SELECTING = {k: v for k, v in OPTIONS.items() if k in ("clip_cov", "kl_cov", "entropy")}


@pytest.mark.parametrize("option", list(SELECTING))
def test_selection_made_once_makes_micro_batches_add_up(option):
    logp, old, adv, mask, entropy, _ = random_batch(8)
    keys = torch.rand(logp.shape, dtype=F64, generator=torch.Generator().manual_seed(3))
    for mode in AGGS:
        obj = Objective(aggregation=mode, aggregation_length=5, **SELECTING[option])
        sel = obj.select(logp, old, adv, mask, entropy, keys=keys)
        whole, g_whole = grad_of(lambda x, obj=obj, sel=sel: obj(x, old, None, adv, mask, selection=sel)[0],
                                 logp)
        n_tok, n_seq = L.normalizer_counts(mask)

        def micro(x, obj=obj, sel=sel, n_tok=n_tok, n_seq=n_seq):
            parts = [slice(0, 2), slice(2, 3), slice(3, 6)]
            return sum(obj(x[s], old[s], None, adv[s], mask[s], num_tokens=n_tok, num_seqs=n_seq,
                           selection=L.TokenSelection(*(None if m is None else m[s] for m in sel)))[0]
                       for s in parts)

        parts, g_parts = grad_of(micro, logp)
        torch.testing.assert_close(parts, whole)
        torch.testing.assert_close(g_parts, g_whole)


def test_a_selection_made_per_micro_batch_would_differ():
    # guards the test above: the same rule on a micro-batch's own tokens picks other tokens
    logp, old, adv, mask, entropy, _ = random_batch(8)
    obj = Objective(top_entropy_quantile=0.3)
    whole = obj.select(logp, old, adv, mask, entropy).high_entropy
    local = [obj.select(logp[s], old[s], adv[s], mask[s], entropy[s]).high_entropy
             for s in (slice(0, 2), slice(2, 3), slice(3, 6))]
    assert not torch.equal(torch.cat(local), whole)


class FakeRanks:
    """``world`` threads that each hold a part of the batch and meet at every collective (a barrier), as
    gloo ranks do: ``total`` sums, ``gather`` concatenates in rank order."""

    def __init__(self, world: int) -> None:
        self.world, self.slots, self.barrier = world, [None] * world, threading.Barrier(world, timeout=20)

    def _meet(self, rank, value, combine):
        self.slots[rank] = value
        self.barrier.wait()
        out = combine(list(self.slots))
        self.barrier.wait()
        return out

    def run(self, fn):
        results, errors = [None] * self.world, []

        def body(rank):
            try:
                results[rank] = fn(rank, lambda v: self._meet(rank, v, lambda s: sum(s[1:], s[0])),
                                   lambda v: self._meet(rank, v, torch.cat))
            except Exception as error:  # surfaced below
                errors.append(error)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]
        return results


@pytest.mark.parametrize("option", list(SELECTING))
def test_selection_over_ranks_equals_the_whole_batchs(option):
    """Rows dealt ``rank::2`` (rank 1 gets the empty row and fewer tokens): each rank's selection of its own
    rows, with sums and gathers over both, is the whole batch's selection of those rows."""
    logp, old, adv, mask, entropy, _ = random_batch(9)
    keys = torch.rand(logp.shape, dtype=F64, generator=torch.Generator().manual_seed(4))
    obj = Objective(**SELECTING[option])
    whole = obj.select(logp, old, adv, mask, entropy, keys=keys)

    def on_rank(rank, total, gather):
        rows = slice(rank, None, 2)
        return obj.select(logp[rows], old[rows], adv[rows], mask[rows], entropy[rows], keys=keys[rows],
                          total=total, gather=gather)

    parts = FakeRanks(2).run(on_rank)
    for rank, part in enumerate(parts):
        for mine, theirs in zip(part, whole, strict=True):
            assert (mine is None) == (theirs is None)
            if mine is not None:
                assert torch.equal(mine, theirs[rank::2]), (option, rank)
    chosen = whole.high_entropy if whole.high_entropy is not None else whole.selected
    assert chosen.any() and not chosen[mask].all()


def test_an_objective_that_selects_refuses_a_call_without_the_selection():
    logp, old, adv, mask, entropy, _ = random_batch(0)
    for kwargs in SELECTING.values():
        obj = Objective(**kwargs)
        assert obj.selects_tokens
        with pytest.raises(ValueError, match="selection"):
            obj(logp, old, None, adv, mask)
    assert not Objective(trust_region=DPPO()).selects_tokens
    assert not Objective(off_policy_mask_threshold=0.1).selects_tokens
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        Objective(top_entropy_quantile=0.5).select(logp, old, adv, mask, None)
