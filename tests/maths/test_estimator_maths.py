"""Tests for the estimators added to lightning_rl.maths.advantages (RLOO, REINFORCE++-baseline) and the
rollout-engine importance weights and mismatch stats of lightning_rl.maths.rollout_weights: hand-worked
values (arithmetic in the comments), the global-moments form, garbage on invalid tokens, detachment and
every validation error."""

import math

import pytest
import torch

from lightning_rl import losses as L

F64 = torch.float64


def t(x, dtype=F64, grad=False):
    return torch.tensor(x, dtype=dtype, requires_grad=grad)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=F64), t(expected), atol=atol, rtol=0)


def lengths_mask(lengths, width):
    return torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]


# ------------------------------------------------------------------------------------------------ RLOO
def test_rloo_hand_values():
    # group [1, 0, 0], sum 1: 1 - (1-1)/2 = 1; 0 - (1-0)/2 = -0.5 (twice)
    # group [1, 2, 3], sum 6: 1 - 5/2 = -1.5; 2 - 4/2 = 0; 3 - 3/2 = 1.5
    close(L.rloo_advantages(t([1.0, 0.0, 0.0, 1.0, 2.0, 3.0]), 3), [1.0, -0.5, -0.5, -1.5, 0.0, 1.5])
    # G = 2: each sample's baseline is the other one: [1 - 3, 3 - 1]
    close(L.rloo_advantages(t([1.0, 3.0]), 2), [-2.0, 2.0])


def test_rloo_is_scaled_centering_and_takes_integers():
    rewards = torch.randn(12, dtype=F64)
    # A_i = G / (G - 1) * (r_i - mean_g)
    close(L.rloo_advantages(rewards, 4), 4 / 3 * L.group_advantages(rewards, 4, scale=False))
    out = L.rloo_advantages(torch.tensor([1, 0, 1, 1]), 2)  # ints -> float: [1 - 0, 0 - 1, 1 - 1, 1 - 1]
    assert out.is_floating_point()
    close(out, [1.0, -1.0, 0.0, 0.0])


@pytest.mark.parametrize("group_size", [1, 3, 0])
def test_rloo_group_errors(group_size):
    with pytest.raises(ValueError, match="group_size"):
        L.rloo_advantages(torch.ones(4), group_size)


def test_rloo_needs_one_dimension():
    with pytest.raises(ValueError, match="rewards"):
        L.rloo_advantages(torch.ones(2, 2), 2)


# --------------------------------------------------------------------------------- REINFORCE++-baseline
def reinforce_batch():
    # rewards [3, 1 | 0, 0] (G = 2): x = r - group mean = [1, -1, 0, 0]; row lengths [3, 1, 1, 1] of T = 3
    return t([3.0, 1.0, 0.0, 0.0]), lengths_mask([3, 1, 1, 1], 3)


def test_reinforce_baseline_centered_broadcasts_over_valid_tokens():
    rewards, mask = reinforce_batch()
    x = L.reinforce_baseline_centered(rewards, 2, mask)
    close(x, [[1.0, 1.0, 1.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_reinforce_baseline_hand_values():
    rewards, mask = reinforce_batch()
    # valid tokens 1, 1, 1, -1, 0, 0: n = 6, mean = 2/6 = 1/3, sum of squares 4,
    # Bessel var = (4 - 6 * (1/3)^2) / 5 = (10/3) / 5 = 2/3, std = sqrt(2/3) = 0.816497
    # x = 1: (2/3) / sqrt(2/3) = sqrt(2/3) = 0.816497; x = -1: (-4/3) / sqrt(2/3) = -1.632993;
    # x = 0: (-1/3) / sqrt(2/3) = -0.408248; invalid tokens 0
    a, b, c = 0.816497, -1.632993, -0.408248
    out = L.reinforce_baseline_advantages(rewards, 2, mask, eps=0.0)
    close(out, [[a, a, a], [b, 0.0, 0.0], [c, 0.0, 0.0], [c, 0.0, 0.0]])
    # eps = 1e-8 by default: the same to 1e-6
    close(L.reinforce_baseline_advantages(rewards, 2, mask), out)


def test_reinforce_baseline_matches_torch_statistics():
    torch.manual_seed(0)
    rewards, mask = torch.randn(8, dtype=F64), torch.rand(8, 5) > 0.3
    x = L.reinforce_baseline_centered(rewards, 4, mask)
    valid = x[mask]
    expected = torch.where(mask, (x - valid.mean()) / torch.sqrt(valid.var(unbiased=True) + 1e-8), 0.0)
    close(L.reinforce_baseline_advantages(rewards, 4, mask), expected)


def test_reinforce_baseline_global_moments_equal_the_single_batch_form():
    torch.manual_seed(1)
    rewards, mask = torch.randn(8, dtype=F64), torch.rand(8, 6) > 0.4
    whole = L.reinforce_baseline_advantages(rewards, 2, mask)
    # two "ranks" holding whole groups: each sums its local moments, the all-reduce adds them
    halves = [(rewards[:4], mask[:4]), (rewards[4:], mask[4:])]
    moments = sum(L.masked_moments(L.reinforce_baseline_centered(r, 2, m), m) for r, m in halves)
    parts = [L.reinforce_baseline_advantages(r, 2, m, moments=moments) for r, m in halves]
    close(torch.cat(parts), whole, atol=1e-12)
    # with only local moments a half differs from the whole batch's
    assert not torch.allclose(L.reinforce_baseline_advantages(halves[0][0], 2, halves[0][1]), whole[:4])


def test_reinforce_baseline_errors():
    rewards, mask = reinforce_batch()
    with pytest.raises(ValueError, match="group_size"):
        L.reinforce_baseline_advantages(rewards, 3, mask)
    with pytest.raises(ValueError, match="rewards"):
        L.reinforce_baseline_advantages(rewards[:2], 2, mask)
    with pytest.raises(ValueError, match="mask"):
        L.reinforce_baseline_advantages(rewards, 2, mask[0])


# ---------------------------------------------------------------------------- rollout-engine correction
def rollout_batch():
    # d = old - rollout on valid tokens: row 0 [ln 3, -ln 2, 0], row 1 [ln 1.5, ln 1.2, (padding)]
    # raw token weights exp(d): [3, 0.5, 1], [1.5, 1.2]; sequence weights: row 0 exp(ln 3 - ln 2) = 1.5,
    # row 1 exp(ln 1.5 + ln 1.2) = 1.8
    mask = torch.tensor([[True, True, True], [True, True, False]])
    rollout = t([[-1.0, -2.0, -0.3], [-0.7, -1.1, -math.inf]])  # garbage (-inf) on padding
    d = t([[math.log(3), -math.log(2), 0.0], [math.log(1.5), math.log(1.2), 0.0]])
    old = (rollout.masked_fill(~mask, 0.0) + d).masked_fill(~mask, math.nan).requires_grad_()
    return old, rollout, mask


@pytest.mark.parametrize(("level", "mode", "cap", "expected"), [
    ("token", "truncate", 2.0, [[2.0, 0.5, 1.0], [1.5, 1.2, 0.0]]),  # min(w, 2)
    ("token", "mask", 2.0, [[0.0, 0.5, 1.0], [1.5, 1.2, 0.0]]),  # 3 > 2 dropped
    ("sequence", "truncate", 1.6, [[1.5, 1.5, 1.5], [1.6, 1.6, 0.0]]),  # min(1.8, 1.6) on row 1
    ("sequence", "mask", 1.6, [[1.5, 1.5, 1.5], [0.0, 0.0, 0.0]]),  # 1.8 > 1.6: the whole row dropped
    ("sequence", "mask", 2.0, [[1.5, 1.5, 1.5], [1.8, 1.8, 0.0]]),
    # geometric: row 0 exp((ln 3 - ln 2 + 0) / 3) = 1.5^(1/3) = 1.1447142, row 1 exp((ln 1.5 + ln 1.2) / 2)
    # = sqrt(1.8) = 1.3416408
    ("geometric", "truncate", 2.0, [[1.1447142] * 3, [1.3416408, 1.3416408, 0.0]]),
    ("geometric", "truncate", 1.3, [[1.1447142] * 3, [1.3, 1.3, 0.0]]),
    ("geometric", "mask", 1.3, [[1.1447142] * 3, [0.0, 0.0, 0.0]]),  # 1.34 > 1.3: row 1 dropped
])
def test_rollout_is_weights_hand_values(level, mode, cap, expected):
    old, rollout, mask = rollout_batch()
    w = L.rollout_is_weights(old, rollout, mask, level=level, mode=mode, cap=cap)
    close(w, expected)
    assert not w.requires_grad and w.dtype == F64


def test_rollout_is_weights_defaults_and_dtype():
    old, rollout, mask = rollout_batch()
    # default: token level, truncate at 2
    close(L.rollout_is_weights(old, rollout, mask), [[2.0, 0.5, 1.0], [1.5, 1.2, 0.0]])
    half = L.rollout_is_weights(old.detach().to(torch.bfloat16), rollout.to(torch.bfloat16), mask)
    assert half.dtype == torch.float32  # computed (and returned) in at least float32


def test_rollout_is_weights_cannot_overflow():
    mask = torch.ones(1, 2, dtype=torch.bool)
    old, rollout = torch.tensor([[0.0, 0.0]]), torch.tensor([[-1e4, -1e4]])  # d = 1e4: exp overflows float32
    for level in L.ROLLOUT_IS_LEVELS:
        truncated = L.rollout_is_weights(old, rollout, mask, level=level, cap=3.0)
        masked = L.rollout_is_weights(old, rollout, mask, level=level, mode="mask", cap=3.0)
        assert truncated.tolist() == [[3.0, 3.0]] and masked.tolist() == [[0.0, 0.0]]
        # and the other way, d = -1e4: exp underflows to 0, below any lower bound
        assert L.rollout_is_weights(rollout, old, mask, level, "truncate", low=0.5).tolist() == [[0.5, 0.5]]
        assert L.rollout_is_weights(rollout, old, mask, level, "mask", low=0.5).tolist() == [[0.0, 0.0]]


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(level="group"), "level"),
    (dict(mode="clip"), "mode"),
    (dict(cap=0.5), "cap"),
    (dict(cap=math.nan), "cap"),
    (dict(low=-0.1), "`low` must be in"),
    (dict(low=1.5), "`low` must be in"),  # above 1 an on-policy weight of 1 would be dropped
    (dict(high=0.9), "`high` must be >= 1"),
    (dict(cap=3.0, high=2.5), "alias of `cap`"),
])
def test_rollout_is_weights_errors(kwargs, match):
    old, rollout, mask = rollout_batch()
    with pytest.raises(ValueError, match=match):
        L.rollout_is_weights(old, rollout, mask, **kwargs)


def test_rollout_is_weights_shape_error():
    old, rollout, mask = rollout_batch()
    with pytest.raises(ValueError, match="rollout_logp"):
        L.rollout_is_weights(old, rollout[:, :2], mask)


def test_rollout_mismatch_stats_token_level():
    old, rollout, mask = rollout_batch()
    weights = L.rollout_is_weights(old, rollout, mask, cap=2.0)
    stats = L.rollout_mismatch_stats(old, rollout, mask, weights, 2.0)
    # |d| = ln 3 + ln 2 + 0 + ln 1.5 + ln 1.2 = 1.098612 + 0.693147 + 0.405465 + 0.182322 = 2.379546; / 5
    close(stats["rollout/logp_diff_mean"], 0.475909)
    # k3 = w - 1 - d: 3-1-1.098612 = 0.901388; 0.5-1+0.693147 = 0.193147; 0; 0.5-0.405465 = 0.094535;
    # 0.2-0.182322 = 0.017678; sum 1.206748 / 5 = 0.241350
    close(stats["rollout/mismatch_k3"], 0.241350)
    close(stats["rollout/is_weight_mean"], 1.24)  # (2 + 0.5 + 1 + 1.5 + 1.2) / 5
    close(stats["rollout/is_clipped_frac"], 0.2)  # only w = 3 exceeds 2
    assert all(not v.requires_grad and v.dim() == 0 for v in stats.values())


def test_rollout_mismatch_stats_sequence_level_and_agreement():
    old, rollout, mask = rollout_batch()
    weights = L.rollout_is_weights(old, rollout, mask, level="sequence", mode="mask", cap=1.6)
    stats = L.rollout_mismatch_stats(old, rollout, mask, weights, 1.6, level="sequence", mode="mask")
    close(stats["rollout/is_weight_mean"], 0.9)  # (1.5 * 3 + 0 * 2) / 5
    close(stats["rollout/is_clipped_frac"], 0.4)  # row 1's 1.8 > 1.6 on its 2 tokens
    close(stats["rollout/is_masked_frac"], 0.4)  # and masked: 2 of 5 tokens
    close(stats["rollout/seq_masked_frac"], 0.5)  # 1 of the 2 rows
    # engine and trainer agree: every statistic is exact
    same = L.rollout_mismatch_stats(rollout, rollout, mask, L.rollout_is_weights(rollout, rollout, mask), 2.0)
    assert {k: v.item() for k, v in same.items()} == {
        "rollout/logp_diff_mean": 0.0, "rollout/mismatch_k3": 0.0, "rollout/is_weight_mean": 1.0,
        "rollout/is_clipped_frac": 0.0, "rollout/is_masked_frac": 0.0, "rollout/seq_masked_frac": 0.0,
    }
    # no valid token: zeros, not NaN
    empty = torch.zeros_like(mask)
    nothing = L.rollout_mismatch_stats(old, rollout, empty, torch.zeros_like(rollout), 2.0)
    assert all(v.item() == 0.0 for v in nothing.values())


def test_rollout_mismatch_stats_errors():
    old, rollout, mask = rollout_batch()
    weights = L.rollout_is_weights(old, rollout, mask)
    with pytest.raises(ValueError, match="cap"):
        L.rollout_mismatch_stats(old, rollout, mask, weights, 0.0)
    with pytest.raises(ValueError, match="level"):
        L.rollout_mismatch_stats(old, rollout, mask, weights, 2.0, level="group")
    with pytest.raises(ValueError, match="weights"):
        L.rollout_mismatch_stats(old, rollout, mask, weights[:1], 2.0)
    with pytest.raises(ValueError, match="mode"):
        L.rollout_mismatch_stats(old, rollout, mask, weights, 2.0, mode="clip")
    with pytest.raises(ValueError, match="low"):
        L.rollout_mismatch_stats(old, rollout, mask, weights, 2.0, low=2.0)


# ------------------------------------------------ two-sided bounds, the geometric level, and the peers
@pytest.mark.parametrize(("level", "mode", "bounds", "expected"), [
    # raw token weights [3, 0.5, 1], [1.5, 1.2]; bounds [0.6, 2]
    ("token", "truncate", dict(low=0.6), [[2.0, 0.6, 1.0], [1.5, 1.2, 0.0]]),  # clamp(w, 0.6, 2)
    ("token", "mask", dict(low=0.6), [[0.0, 0.0, 1.0], [1.5, 1.2, 0.0]]),  # 3 > 2 and 0.5 < 0.6 dropped
    ("token", "mask", dict(low=0.45, high=3.5), [[3.0, 0.5, 1.0], [1.5, 1.2, 0.0]]),  # wide: all kept
    # sequence weights 1.5, 1.8 on [1.6, 2]: row 0 below, dropped / raised to 1.6
    ("sequence", "mask", dict(low=1.0, high=1.7), [[1.5] * 3, [0.0, 0.0, 0.0]]),
    ("sequence", "truncate", dict(low=1.0, high=1.7), [[1.5] * 3, [1.7, 1.7, 0.0]]),
    # geometric 1.1447142, 1.3416408 kept only within [0.99, 1.2]: row 1 dropped
    ("geometric", "mask", dict(low=0.99, high=1.2), [[1.1447142] * 3, [0.0, 0.0, 0.0]]),
])
def test_rollout_is_weights_two_sided_hand_values(level, mode, bounds, expected):
    old, rollout, mask = rollout_batch()
    close(L.rollout_is_weights(old, rollout, mask, level, mode, **bounds), expected)


@pytest.mark.parametrize(("level", "mode", "low", "masked", "rows"), [
    ("token", "mask", 0.6, 0.4, 0.0),  # tokens 3 and 0.5 of row 0: 2 of 5; no row loses every token
    ("geometric", "mask", 0.0, 0.4, 0.5),  # cap 1.3: row 1 (2 tokens) dropped, 1 row of 2
    ("token", "truncate", 0.6, 0.0, 0.0),  # truncation masks nothing
])
def test_rollout_mismatch_stats_masked_fractions(level, mode, low, masked, rows):
    old, rollout, mask = rollout_batch()
    cap = 1.3 if level == "geometric" else 2.0
    weights = L.rollout_is_weights(old, rollout, mask, level, mode, cap, low)
    stats = L.rollout_mismatch_stats(old, rollout, mask, weights, cap, level=level, mode=mode, low=low)
    close(stats["rollout/is_masked_frac"], masked)
    close(stats["rollout/seq_masked_frac"], rows)
    close(stats["rollout/is_clipped_frac"], 0.4)  # outside the bounds, masked or truncated
    # the masked fraction is the share of valid tokens whose applied weight is 0
    close(((weights == 0) & mask).sum() / mask.sum(), masked)


def test_rollout_mismatch_stats_key_set_is_fixed():
    old, rollout, mask = rollout_batch()
    keys = set()
    for level in L.ROLLOUT_IS_LEVELS:
        for mode in L.ROLLOUT_IS_MODES:
            weights = L.rollout_is_weights(old, rollout, mask, level, mode)
            keys.add(tuple(sorted(L.rollout_mismatch_stats(old, rollout, mask, weights, 2.0, level=level,
                                                           mode=mode))))
    assert len(keys) == 1


def _mismatched(seed=0, scale=0.4):
    """B=6, T=7, float64: engine log-probs off the trainer's by N(0, scale), rows of 0-7 valid tokens."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(6, 7, generator=g, dtype=F64) * 2
    rollout = old + scale * torch.randn(6, 7, generator=g, dtype=F64)
    mask = lengths_mask([7, 5, 3, 1, 6, 4], 7)
    return old, rollout, mask


def _trl(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.x grpo_trainer.py, vllm_importance_sampling_mode, re-derived (its loss masks padding after)."""
    diff = (old - sampling) * mask
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = clip_min if clip_min is not None else -math.inf
    hi = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize(("clip_min", "clip_max"), [(None, 3.0), (0.5, 2.0), (0.9, 1.1)])
def test_rollout_is_weights_equal_trls_vllm_importance_sampling(mode, clip_min, clip_max):
    old, rollout, mask = _mismatched()
    level, ours_mode = mode.split("_")
    trl = _trl(old, rollout, mask, mode, clip_min, clip_max).expand_as(old) * mask
    ours = L.rollout_is_weights(old, rollout, mask, level, ours_mode, low=clip_min or 0.0, high=clip_max)
    torch.testing.assert_close(ours, trl, atol=1e-12, rtol=1e-12)
    if clip_min == 0.9:  # the bounds bite on both sides
        w = L.rollout_is_weights(old, rollout, mask, level, "truncate", cap=1e6)[mask]
        assert (w < clip_min).any() and (w > clip_max).any()


@pytest.mark.parametrize("kind", ["icepop", "tis"])
def test_rollout_is_weights_equal_openrlhfs_icepop_and_tis(kind):
    old, rollout, mask = _mismatched(1)
    low, high = 0.5, 2.0  # OpenRLHF's vllm_is_truncated_threshold, e.g. [0.5, 2]
    vllm_is = torch.exp(old - rollout)  # openrlhf/models/loss.py PolicyLoss, re-derived
    if kind == "icepop":
        peer = vllm_is * ((vllm_is >= low) & (vllm_is <= high))
    else:
        peer = vllm_is.clamp(min=low, max=high)
    ours = L.rollout_is_weights(old, rollout, mask, "token", "mask" if kind == "icepop" else "truncate",
                                low=low, high=high)
    torch.testing.assert_close(ours, peer * mask, atol=1e-12, rtol=1e-12)
    assert ((vllm_is < low) & mask).any() and ((vllm_is > high) & mask).any()


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_rollout_is_weights_equal_verls_rollout_importance_weights(level, mode):
    """verl 0.6 ``compute_rollout_importance_weights`` (mismatch_helper.py), re-derived: its weights times its
    modified response mask (mask mode drops tokens from the response mask) are ours."""
    old, rollout, mask = _mismatched(2, scale=0.1)
    upper, lower = 1.1, 0.95  # rollout_is_threshold, rollout_is_threshold_lower
    m = mask.to(F64)
    log_ratio = old - rollout
    if level == "token":
        lr = log_ratio
    elif level == "sequence":
        lr = (log_ratio * m).sum(-1, keepdim=True)
    else:  # verl_F.masked_mean: sum / (count + 1e-8)
        lr = (log_ratio * m).sum(-1, keepdim=True) / (m.sum(-1, keepdim=True) + 1e-8)
    w = torch.exp(lr.clamp(-20, 20)).expand_as(old)
    if mode == "truncate":
        w, keep = w.clamp(max=upper), m
    else:
        keep = m * ((w >= lower) & (w <= upper))
    ours = L.rollout_is_weights(old, rollout, mask, level, mode, low=lower if mode == "mask" else 0.0,
                                high=upper)
    torch.testing.assert_close(ours, w * m * keep, atol=1e-7, rtol=1e-7)  # 1e-8 in verl's masked mean
    if mode == "mask":
        assert 0 < (keep.sum() / m.sum()) < 1  # some, not all, dropped


def test_geometric_mask_is_verls_seq_mean_k1_rejection_with_inverted_bounds():
    """verl's rollout_corr_helper.py ``rollout_rs="seq_mean_k1"`` keeps a row when
    ``log(lo) <= mean_t(k1) <= log(hi)``, ``k1 = -(old_logp - rollout_logp)``: the geometric weight ``g``
    then lies in ``[1 / hi, 1 / lo]``, so it is ours with ``low = 1 / hi``, ``high = 1 / lo``."""
    old, rollout, mask = _mismatched(3, scale=0.05)
    lo, hi = 0.99, 1.01  # rollout_rs_threshold "0.99_1.01"
    m = mask.to(F64)
    k1 = -(old - rollout).clamp(-20, 20)
    seq = (k1 * m).sum(-1) / (m.sum(-1) + 1e-8)
    keep = (seq >= math.log(lo)) & (seq <= math.log(hi))
    ours = L.rollout_is_weights(old, rollout, mask, "geometric", "mask", low=1 / hi, high=1 / lo)
    assert ((ours > 0).any(-1) == (keep & mask.any(-1))).all()
    assert 0 < int(keep.sum()) < 6


def test_sequence_mask_with_bounds_keeps_only_sequences_whose_product_ratio_is_inside():
    # engine and trainer swapped: row ratios exp(sum d) = 1 / 1.5 = 0.6666667 and 1 / 1.8 = 0.5555556;
    # low 0.6 keeps row 0 only; the original order (1.5, 1.8) under high 1.7 keeps row 0 only
    old, rollout, mask = rollout_batch()
    swapped = L.rollout_is_weights(rollout, old, mask, "sequence", "mask", low=0.6)
    close(swapped, [[0.6666667] * 3, [0.0] * 3])
    close(L.rollout_is_weights(old, rollout, mask, "sequence", "mask", high=1.7), [[1.5] * 3, [0.0] * 3])



# ------------------------------------------------------------------------------------------------ GDPO
from lightning_rl.maths.multi_reward import batch_normalized, gdpo_advantages, gdpo_group_sum  # noqa: E402


def test_gdpo_keeps_apart_what_grpo_collapses():
    # the GDPO paper's case, two 0/1 reward functions, weights 1, G = 2:
    #   group 1: (f1, f2) = (0,0), (0,1) -> sums [0, 1];  group 2: (0,0), (1,1) -> sums [0, 2]
    # GRPO (sum, then group z-score, eps 0): both groups [-.7071, .7071]: meeting both objectives teaches
    # as much as meeting one
    # GDPO: group 1: z1 = [0, 0] (constant), z2 = [-.7071, .7071] -> [-.7071, .7071]
    #       group 2: z1 = z2 = [-.7071, .7071] -> [-1.4142, 1.4142]
    # batch step: mean 0, Bessel std sqrt((2 * .5 + 2 * 2) / 3) = sqrt(5/3) = 1.29099
    #   -> [-.5477, .5477, -1.0954, 1.0954]
    scores = t([[0.0, 0.0], [0.0, 1.0], [0.0, 0.0], [1.0, 1.0]])
    grpo = L.group_advantages(scores.sum(-1), 2, eps=0.0)
    close(grpo, [-0.7071068, 0.7071068, -0.7071068, 0.7071068])
    close(gdpo_group_sum(scores, 2, eps=0.0), [-0.7071068, 0.7071068, -1.4142136, 1.4142136])
    close(gdpo_advantages(scores, 2, eps=0.0), [-0.5477226, 0.5477226, -1.0954451, 1.0954451])


def test_gdpo_weighted_sum_constant_still_has_signal():
    # (f1, f2) = (1, 0), (0, 2) with weights 1 and .5: GRPO's weighted sums tie at 1, advantages 0
    # GDPO: z1 = [.707, -.707], z2 = [-.707, .707]; 1*z1 + .5*z2 = [.354, -.354]
    scores = t([[1.0, 0.0], [0.0, 2.0]])
    assert L.group_advantages(scores @ t([1.0, 0.5]), 2).abs().max() == 0
    close(gdpo_group_sum(scores, 2, t([1.0, 0.5]), eps=0.0), [0.5 / math.sqrt(2), -0.5 / math.sqrt(2)])


def trl_normalize_then_sum(rewards_per_func, num_generations, weights):
    """An oracle written from TRL 1.16's GRPOTrainer (``multi_objective_aggregation="normalize_then_sum"``),
    element by element in plain Python: per group and function ``(r - mean) / (std + 1e-4)`` with the
    Bessel-corrected std, the weighted sum, then ``(x - mean) / (std + 1e-4)`` over the whole batch."""
    n, k = len(rewards_per_func), len(weights)

    def mean(xs):
        return sum(xs) / len(xs)

    def std(xs):
        m = mean(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))

    summed = [0.0] * n
    for start in range(0, n, num_generations):
        rows = range(start, start + num_generations)
        for j in range(k):
            column = [rewards_per_func[i][j] for i in rows]
            m, s = mean(column), std(column)
            for i in rows:
                summed[i] += weights[j] * (rewards_per_func[i][j] - m) / (s + 1e-4)
    m, s = mean(summed), std(summed)
    return [(x - m) / (s + 1e-4) for x in summed]


def test_gdpo_matches_trl_oracle():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 3, (24, 3), generator=g).double()  # ties and constant groups happen
    scores[:4, 1] = 1.0  # a function constant in the first group
    weights = [1.0, 0.5, 2.0]
    expected = trl_normalize_then_sum(scores.tolist(), 4, weights)
    close(gdpo_advantages(scores, 4, t(weights)), expected, atol=1e-5)


def test_gdpo_global_moments_and_validation():
    scores = torch.randn(12, 2, dtype=F64)
    x = gdpo_group_sum(scores, 3)
    # two "ranks" of two groups each: the moments summed give the one-process batch step
    ones = torch.ones(6, 1)
    moments = L.masked_moments(x[:6, None], ones) + L.masked_moments(x[6:, None], ones)
    close(batch_normalized(x[:6], moments=moments), gdpo_advantages(scores, 3)[:6], atol=1e-5)
    with pytest.raises(ValueError, match="group_size"):
        gdpo_group_sum(scores, 5)
    with pytest.raises(ValueError):
        gdpo_group_sum(scores[:, 0], 3)
