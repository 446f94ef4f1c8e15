"""Tests for lightning_rl.maths.losses: hand-computed values (arithmetic in the comments), edge cases,
gradcheck,
micro-batch gradient invariance and every validation error."""

import inspect
import math

import pytest
import torch

from lightning_rl import losses as L

F64 = torch.float64


def t(x, dtype=F64, grad=False):
    return torch.tensor(x, dtype=dtype, requires_grad=grad)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=F64), t(expected), atol=atol, rtol=0)


def finite(x):
    return bool(torch.isfinite(x).all())


# ------------------------------------------------------------------------------------------- contract
@pytest.mark.parametrize(
    ("fn", "params"),
    [
        (L.ppo_policy_loss, "logp old_logp advantages mask clip_eps=0.2 aggregation=token-mean"),
        (
            L.grpo_loss,
            "logp old_logp ref_logp advantages mask clip_eps=0.2 beta=0.04 aggregation=seq-mean-token-mean",
        ),
        (L.gspo_loss, "logp old_logp advantages mask clip_low=0.0003 clip_high=0.0004"),
        (L.dapo_loss, "logp old_logp advantages mask clip_low=0.2 clip_high=0.28 aggregation=token-mean"),
        (
            L.sapo_loss,
            "logp old_logp advantages mask tau_pos=1.0 tau_neg=1.05 aggregation=seq-mean-token-mean",
        ),
        (L.value_loss, "values old_values returns mask clip_eps=0.2"),
        (L.dpo_loss, "chosen_logps rejected_logps ref_chosen_logps ref_rejected_logps beta=0.1"),
        (L.group_advantages, "rewards group_size eps=1e-08 scale=True"),
        (L.gae_advantages, "rewards values mask gamma=1.0 lam=0.95"),
        (L.kl_penalty, "logp ref_logp estimator=k3"),
        (L.overlong_penalty, "lengths max_len cache_len"),
        (L.dapo_group_keep, "correct group_size"),
        (L.aggregate, "x mask mode=token-mean"),
    ],
)
def test_contract_positional_signature(fn, params):
    positional = [p for p in inspect.signature(fn).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    got = " ".join(p.name if p.default is p.empty else f"{p.name}={p.default}" for p in positional)
    assert got == params


def test_micro_batch_keywords_are_keyword_only():
    for fn in (L.ppo_policy_loss, L.grpo_loss, L.dapo_loss, L.sapo_loss, L.aggregate):
        sig = inspect.signature(fn).parameters
        assert sig["num_tokens"].kind is inspect.Parameter.KEYWORD_ONLY
        assert sig["num_seqs"].kind is inspect.Parameter.KEYWORD_ONLY
    assert inspect.signature(L.gspo_loss).parameters["num_seqs"].kind is inspect.Parameter.KEYWORD_ONLY
    assert inspect.signature(L.value_loss).parameters["num_tokens"].kind is inspect.Parameter.KEYWORD_ONLY


# --------------------------------------------------------------------------------------------- helpers
def test_masked_mean_and_empty():
    x = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 1, 0], [0, 0, 0]])
    close(L.masked_mean(x, m), 1.5)  # (1 + 2) / 2
    close(L.masked_mean(x, m, dim=-1), [1.5, 0.0])  # empty row -> 0, not NaN
    close(L.masked_mean(x, torch.zeros_like(m)), 0.0)


def test_entropy_from_logits():
    # uniform over 4 -> ln 4 = 1.386294; p = (1/4, 3/4) -> -(.25 ln .25 + .75 ln .75) = 0.562335
    logits = torch.stack([torch.zeros(4, dtype=F64), torch.log(t([1.0, 3.0, 1e-300, 1e-300]))])
    close(L.entropy_from_logits(logits), [1.3862944, 0.5623351])
    close(L.entropy_from_logits(t([[0.0, -1e4]])), [0.0])  # (near-)deterministic -> 0


X = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
M = [[1, 1, 0], [1, 0, 0], [0, 0, 0]]  # third row has no valid token


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-mean", 2.75),  # ((1+2)/2 + 4/1) / 2 non-empty rows = (1.5 + 4) / 2
        ("seq-mean-token-sum", 3.5),  # ((1+2) + 4) / 2 non-empty rows
        ("seq-mean-token-sum-norm", 7 / 6),  # ((1+2) + 4) / (2 non-empty rows * T = 3)
    ],
)
def test_aggregate_modes(mode, expected):
    close(L.aggregate(t(X), torch.tensor(M, dtype=torch.bool), mode), expected)
    close(L.aggregate(t(X), t(M), mode), expected)  # float 0/1 mask works the same


@pytest.mark.parametrize(
    ("mode", "kw", "expected"),
    [
        ("token-mean", {"num_tokens": 10}, 0.7),  # 7 / 10
        ("seq-mean-token-mean", {"num_seqs": 5}, 1.1),  # 5.5 / 5
        ("seq-mean-token-sum", {"num_seqs": t(7.0)}, 1.0),  # 7 / 7
        ("token-mean", {"num_seqs": 99}, 7 / 3),  # num_seqs ignored by token-mean
        ("seq-mean-token-sum", {"num_tokens": 99}, 3.5),  # num_tokens ignored by seq modes
        ("seq-mean-token-sum-norm", {"norm_length": 4}, 0.875),  # 7 / (2 rows * 4)
        ("seq-mean-token-sum-norm", {"num_seqs": 7, "norm_length": 2}, 0.5),  # 7 / (7 * 2)
        ("seq-mean-token-mean", {"norm_length": 4}, 2.75),  # norm_length ignored by the other modes
    ],
)
def test_aggregate_uses_given_normalizers(mode, kw, expected):
    close(L.aggregate(t(X), torch.tensor(M), mode, **kw), expected)


def test_aggregate_ignores_nan_padding_and_all_masked_is_zero():
    x = t([[1.0, float("nan")], [float("inf"), 3.0]], grad=True)
    m = torch.tensor([[1, 0], [0, 1]])
    out = L.aggregate(x, m, "token-mean")
    out.backward()
    close(out, 2.0)  # (1 + 3) / 2, NaN/inf on padding never read
    close(x.grad, [[0.5, 0.0], [0.0, 0.5]])
    for mode in L.AGGREGATIONS:
        x = t(X, grad=True)
        out = L.aggregate(x, torch.zeros(3, 3), mode)
        out.backward()
        assert out.item() == 0.0 and (x.grad == 0).all()


def test_normalizer_counts():
    n_tok, n_seq = L.normalizer_counts(torch.tensor(M))
    assert (n_tok.item(), n_seq.item()) == (3, 2)


# ------------------------------------------------------------------- seq-mean-token-sum-norm (Dr. GRPO)
# two rows of unequal length, every row with a token; budget L = 4:
#   row sums (1 + 2) = 3 and (4 + 5 + 6) = 15 -> (3 + 15) / (2 rows * 4) = 18 / 8 = 2.25
DR_X = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
DR_M = [[1, 1, 0], [1, 1, 1]]


def test_seq_mean_token_sum_norm_equals_trls_dr_grpo():
    x, mask = t(DR_X), t(DR_M)
    # TRL 1.x grpo_trainer.py, loss_type="dr_grpo":
    #   (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    trl = (x * mask).sum() / (x.size(0) * 4)
    close(trl, 2.25)
    close(L.aggregate(x, mask, "seq-mean-token-sum-norm", norm_length=4), trl)
    # the same through a policy loss: r = 1, A = (1, -2) -> per-token loss -A: (-1 - 1 + 2 + 2 + 2) / 8 = 0.5
    logp = torch.zeros(2, 3, dtype=F64)
    per_token_trl = -t([[1.0], [-2.0]]).expand(2, 3)
    close(L.ppo_policy_loss(logp, logp, t([1.0, -2.0]), mask, 0.2, "seq-mean-token-sum-norm",
                            aggregation_length=4)[0], (per_token_trl * mask).sum() / (2 * 4))
    close((per_token_trl * mask).sum() / (2 * 4), 0.5)


def test_seq_mean_token_sum_norm_is_verls_divided_by_the_micro_batch_rows():
    """verl's ``agg_loss(..., "seq-mean-token-sum-norm", loss_scale_factor=L)`` is ``sum(seq_losses) / L`` per
    micro-batch, no division by the rows; dp_actor then scales each micro-batch by ``1 / grad_accumulation``.
    """

    def verl(x, mask, length):  # core_algos.agg_loss, re-derived
        return torch.sum(torch.sum(x * mask, dim=-1)) / length

    x = t(DR_X + [[7.0, 8.0, 9.0], [1.0, 1.0, 1.0]])
    mask = t(DR_M + [[1, 0, 0], [1, 1, 0]])  # row sums 3, 15, 7, 2: total 27
    ours = L.aggregate(x, mask, "seq-mean-token-sum-norm", norm_length=4)
    close(ours, 27 / 16)  # 27 / (4 rows * 4)
    close(ours * 4, verl(x, mask, 4))  # one micro-batch of B = 4 rows: verl = ours * B = 27 / 4
    # 2 micro-batches of 2 rows, accumulated with 1/2 each: verl = (18 / 4 + 9 / 4) / 2 = 27 / 8 = ours * 2
    n_seq = L.normalizer_counts(mask)[1]
    verl_step = sum(verl(x[s], mask[s], 4) / 2 for s in (slice(0, 2), slice(2, 4)))
    ours_step = sum(L.aggregate(x[s], mask[s], "seq-mean-token-sum-norm", num_seqs=n_seq, norm_length=4)
                    for s in (slice(0, 2), slice(2, 4)))
    close(ours_step, ours)  # micro-batching leaves ours unchanged
    close(verl_step, ours * 2)  # verl's scales with its micro-batch size


def test_seq_mean_token_sum_norm_micro_batches_of_their_own_padding_add_up():
    # micro-batches trimmed to their own longest row (T = 3 and T = 1): with a fixed L the parts add up to the
    # whole; with L = T each part has its own divisor and they do not
    x, mask = t(DR_X + [[7.0, 8.0, 9.0]]), t(DR_M + [[1, 0, 0]])  # row sums 3, 15, 7
    n_seq = L.normalizer_counts(mask)[1]
    whole = L.aggregate(x, mask, "seq-mean-token-sum-norm", norm_length=8)
    close(whole, 25 / 24)  # 25 / (3 rows * 8)

    def parts(length):
        return (L.aggregate(x[:2], mask[:2], "seq-mean-token-sum-norm", num_seqs=n_seq, norm_length=length)
                + L.aggregate(x[2:, :1], mask[2:, :1], "seq-mean-token-sum-norm", num_seqs=n_seq,
                              norm_length=length))

    close(parts(8), whole)
    close(parts(None), 18 / 9 + 7 / 3)  # 18 / (3 * 3) + 7 / (3 * 1): not 25 / 9
    with pytest.raises(ValueError, match="`norm_length` must be >= 1"):
        L.aggregate(x, mask, "seq-mean-token-sum-norm", norm_length=0)


# ----------------------------------------------------------------------------------------------- PPO
# five tokens, one per case, eps = 0.2:
#  a: log r = 0.3 -> r = e^0.3 = 1.349859, A=+1 -> above 1.2, clipped: -1.2               (clip high)
#  b: log r = 0.3, A=-1 -> max(1.349859, 1.2) = 1.349859                                   (unclipped)
#  c: log r = -0.3 -> r = e^-0.3 = 0.740818, A=-1 -> max(0.740818, 0.8) = 0.8             (clip low)
#  d: log r = -0.3, A=+1 -> max(-0.740818, -0.8) = -0.740818                               (unclipped)
#  e: log r = 0.1 -> r = 1.105171, A=+2 -> -2.210342                                        (in range)
# token-mean = (-1.2 + 1.349859 + 0.8 - 0.740818 - 2.210342) / 5 = -2.001301 / 5 = -0.400260
PPO_LOG_R = [[0.3, 0.3, -0.3, -0.3, 0.1]]
PPO_ADV = [[1.0, -1.0, -1.0, 1.0, 2.0]]


def _ppo_case():
    old = t([[-1.0, -2.0, -0.5, -1.5, -3.0]])
    logp = (old + t(PPO_LOG_R)).detach().requires_grad_()
    return logp, old, t(PPO_ADV), torch.ones(1, 5, dtype=torch.bool)


def test_ppo_hand_values_both_sides_and_signs():
    logp, old, adv, mask = _ppo_case()
    loss, m = L.ppo_policy_loss(logp, old, adv, mask)
    close(loss, -0.4002602)
    loss.backward()
    # d/dlogp of -A r / 5 on unclipped tokens; clipped tokens get 0:
    # b: 1.349859/5 = 0.269972; d: -0.740818/5 = -0.148164; e: -2*1.105171/5 = -0.442068
    close(logp.grad, [[0.0, 0.2699718, 0.0, -0.1481636, -0.4420684]])
    close(m["policy/clip_frac"], 0.4)  # a and c
    close(m["policy/clip_frac_low"], 0.2)
    close(m["policy/clip_frac_high"], 0.2)
    close(m["policy/ratio_mean"], 1.0573050)  # (2*1.349859 + 2*0.740818 + 1.105171) / 5
    # k3 = r - 1 - log r: 2*(0.049859) + 2*(0.040818) + 0.005171 = 0.186525 / 5
    close(m["policy/approx_kl"], 0.0373050)
    assert "policy/clip_frac_dual" not in m
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())


def test_ppo_asymmetric_clip_high():
    # A = +1. log r = 0.25 -> r = 1.284025: clipped at 1.2 by default, at 1.28 with eps_high = 0.28
    #         log r = 0.2  -> r = 1.221403: clipped at 1.2 by default, inside [0.8, 1.28] with eps_high
    old = t([[0.0, 0.0]])
    logp = t([[0.25, 0.2]])
    mask, adv = torch.ones(1, 2), t([1.0])
    close(L.ppo_policy_loss(logp, old, adv, mask)[0], -1.2)  # (-1.2 - 1.2) / 2
    loss, m = L.ppo_policy_loss(logp, old, adv, mask, clip_eps_high=0.28)
    close(loss, (-1.28 - 1.2214028) / 2)
    close(m["policy/clip_frac_high"], 0.5)


def test_ppo_dual_clip():
    # c = 3, eps = 0.2:  r=4, A=-1 -> max(4, 1.2) = 4 -> min(4, 3) = 3 (dual active)
    #                    r=2, A=-1 -> 2 < 3 -> 2;  r=4, A=+1 -> -1.2 (dual clip only for A<0)
    old = torch.zeros(1, 3, dtype=F64)
    logp = t([[math.log(4.0), math.log(2.0), math.log(4.0)]], grad=True)
    loss, m = L.ppo_policy_loss(logp, old, t([[-1.0, -1.0, 1.0]]), torch.ones(1, 3), clip_ratio_c=3.0)
    close(loss, (3.0 + 2.0 - 1.2) / 3)
    loss.backward()
    close(logp.grad, [[0.0, 2.0 / 3, 0.0]])  # d(-A r)/dlogp = r = 2, /3 tokens
    close(m["policy/clip_frac_dual"], 1 / 3)
    close(m["policy/clip_frac_high"], 1 / 3)
    no_dual, _ = L.ppo_policy_loss(logp, old, t([[-1.0, -1.0, 1.0]]), torch.ones(1, 3))
    close(no_dual, (4.0 + 2.0 - 1.2) / 3)


# r = 1 everywhere so per-token loss = -A; row0 A=1 on 3 tokens, row1 A=-2 on 1 token, row2 empty
AGG_CASES = [
    ("token-mean", -0.25),  # (-3 + 2) / 4 tokens
    ("seq-mean-token-mean", 0.5),  # (-1 + 2) / 2 rows
    ("seq-mean-token-sum", -0.5),  # (-3 + 2) / 2 rows
    ("seq-mean-token-sum-norm", -1 / 6),  # (-3 + 2) / (2 rows * T = 3)
]


@pytest.mark.parametrize(("mode", "expected"), AGG_CASES)
def test_ppo_aggregations_with_sequence_advantages(mode, expected):
    logp = torch.zeros(3, 3, dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    loss, _ = L.ppo_policy_loss(logp, logp, t([1.0, -2.0, 5.0]), mask, 0.2, mode)
    close(loss, expected)


def test_dapo_clip_range():
    # [1-0.2, 1+0.28]: r=e^0.3=1.349859, A=+1 -> -1.28; r=e^-0.3=0.740818, A=-1 -> 0.8; r=1.25, A=+1 -> -1.25
    logp = t([[0.3, -0.3, math.log(1.25)]])
    loss, m = L.dapo_loss(logp, torch.zeros(1, 3, dtype=F64), t([[1.0, -1.0, 1.0]]), torch.ones(1, 3))
    close(loss, (-1.28 + 0.8 - 1.25) / 3)
    close(m["policy/clip_frac"], 2 / 3)


def test_single_token_completions_all_modes_agree():
    # T = 1: every mode is the plain mean over rows of -A r; r = e^0.1 = 1.105171 (in range)
    logp = t([[0.1], [0.1], [0.1]])
    old = torch.zeros(3, 1, dtype=F64)
    expected = -(1.0 + 2.0 - 0.5) * 1.1051709 / 3
    for mode in L.AGGREGATIONS:
        close(L.ppo_policy_loss(logp, old, t([1.0, 2.0, -0.5]), torch.ones(3, 1), 0.2, mode)[0], expected)


def test_empty_row_with_nan_padding_is_left_out():
    nan = float("nan")
    logp = t([[0.1, nan], [nan, nan]], grad=True)
    old = t([[0.0, 5.0], [nan, 1.0]])
    mask = torch.tensor([[1, 0], [0, 0]])
    for mode in L.AGGREGATIONS:  # aggregation_length 1: seq-mean-token-sum-norm's L (the others ignore it)
        logp.grad = None
        loss, m = L.ppo_policy_loss(logp, old, t([1.0, 3.0]), mask, 0.2, mode, aggregation_length=1)
        loss.backward()
        close(loss, -1.1051709)  # only token (0, 0): -1 * e^0.1
        close(logp.grad, [[-1.1051709, 0.0], [0.0, 0.0]])
        assert all(finite(v) for v in m.values())


def _all_losses(logp, old, adv, mask):
    yield L.ppo_policy_loss(logp, old, adv, mask)
    yield L.grpo_loss(logp, old, old - 0.3, adv, mask)
    yield L.dapo_loss(logp, old, adv, mask)
    yield L.gspo_loss(logp, old, adv, mask)
    yield L.sapo_loss(logp, old, adv, mask)
    for mode in L.AGGREGATIONS:
        yield L.ppo_policy_loss(logp, old, adv, mask, aggregation=mode)


def test_all_masked_batch_gives_zero_loss_zero_grad():
    logp = t([[0.5, -0.2], [0.1, 0.3]], grad=True)
    old, adv, mask = torch.zeros(2, 2, dtype=F64), t([1.0, -1.0]), torch.zeros(2, 2)
    for loss, metrics in _all_losses(logp, old, adv, mask):
        logp.grad = None
        loss.backward()
        assert loss.item() == 0.0 and (logp.grad == 0).all()
        assert all(finite(v) for v in metrics.values())
    v = t([[1.0, 2.0]], grad=True)
    loss, _ = L.value_loss(v, v.detach(), t([[0.0, 0.0]]), torch.zeros(1, 2))
    loss.backward()
    assert loss.item() == 0.0 and (v.grad == 0).all()


# ---------------------------------------------------------------------------------------------- GRPO
def test_grpo_hand_value_with_k3():
    # r = 1, A = 1; ref - logp = +0.5, -0.5:
    # k3 = e^0.5 - 0.5 - 1 = 0.148721 ; e^-0.5 + 0.5 - 1 = 0.106531 ; mean = 0.127626
    # loss = -(1 - 0.1 * 0.127626) = -0.987237
    logp = t([[-1.0, -2.0]], grad=True)
    ref = t([[-0.5, -2.5]])
    loss, m = L.grpo_loss(logp, logp.detach(), ref, t([1.0]), torch.ones(1, 2), 0.2, 0.1)
    close(loss, -0.9872374)
    close(m["policy/kl_ref"], 0.1276260)
    loss.backward()
    # d/dlogp: -A r / 2 + beta * (1 - e^(ref-logp)) / 2 = -0.5 + 0.05*(1 - 1.648721) and 0.05*(1 - 0.606531)
    close(logp.grad, [[-0.5324361, -0.4803265]])


@pytest.mark.parametrize(("est", "kl"), [("k1", 0.0), ("k2", 0.125)])  # k1: (-0.5+0.5)/2; k2: .5*.25
def test_grpo_other_estimators(est, kl):
    logp = t([[-1.0, -2.0]])
    _, m = L.grpo_loss(logp, logp, t([[-0.5, -2.5]]), t([1.0]), torch.ones(1, 2), kl_estimator=est)
    close(m["policy/kl_ref"], kl)


def test_grpo_without_reference_matches_ppo():
    logp, old, adv, mask = _ppo_case()
    loss, m = L.grpo_loss(logp, old, None, adv, mask, 0.2, 0.0, "token-mean")
    close(loss, -0.4002602)
    assert "policy/kl_ref" not in m
    loss, m = L.grpo_loss(logp, old, old, adv, mask, 0.2, 0.0, "token-mean")
    close(loss, -0.4002602)  # ref given but beta 0: metric only
    assert "policy/kl_ref" in m


# ---------------------------------------------------------------------------------------------- GSPO
# row0: log r = (0.2, 0.4) -> mean 0.3 -> s = 1.349859, A=+1 -> clip at 1.0004 -> -1.0004      (high)
# row1: log r = (-0.001, masked) -> s = e^-0.001 = 0.999000, A=-1 -> max(0.9990, 0.9997) = 0.9997 (low)
# row2: log r = (1e-4, 3e-4) -> s = e^2e-4 = 1.0002, A=+2 -> in [0.9997, 1.0004] -> -2.0004
# row3: empty. loss = (-1.0004 + 0.9997 - 2.0004) / 3 = -0.6670333
GSPO_LOG_R = [[0.2, 0.4], [-0.001, 7.0], [1e-4, 3e-4], [9.0, 9.0]]
GSPO_MASK = [[1, 1], [1, 0], [1, 1], [0, 0]]


@pytest.mark.parametrize("adv", [[1.0, -1.0, 2.0, 4.0], [[1.0, 1.0], [-1.0, -1.0], [2.0, 2.0], [4.0, 4.0]]])
def test_gspo_hand_values(adv):
    logp = t(GSPO_LOG_R, grad=True)
    loss, m = L.gspo_loss(logp, torch.zeros(4, 2, dtype=F64), t(adv), torch.tensor(GSPO_MASK))
    close(loss, -0.6670333)
    loss.backward()
    # only row2 is unclipped: d(-A s)/dlogp_t = -A s / n = -2 * 1.0002 / 2, then / 3 rows
    close(logp.grad, [[0.0, 0.0], [0.0, 0.0], [-0.3334000, -0.3334000], [0.0, 0.0]])
    close(m["policy/clip_frac"], 2 / 3)
    close(m["policy/clip_frac_low"], 1 / 3)
    close(m["policy/clip_frac_high"], 1 / 3)
    close(m["policy/ratio_mean"], (1.3498588 + 0.9990005 + 1.0002000) / 3)


# ---------------------------------------------------------------------------------------------- SAPO
def test_sapo_on_policy_gradient_equals_policy_gradient():
    # r = 1 -> sigmoid(0) = 0.5: A=+1, tau=1 -> f = 4*0.5 = 2; A=-1, tau=1.05 -> f = 2/1.05 = 1.904762
    # loss = -(2*1 + 1.904762*(-1)) / 2 rows = -0.047619; gradient at r=1 is -A (gate weight 1), / 2 rows
    logp = t([[-1.0], [-2.0]], grad=True)
    loss, m = L.sapo_loss(logp, logp.detach(), t([1.0, -1.0]), torch.ones(2, 1))
    close(loss, -0.0476190)
    loss.backward()
    close(logp.grad, [[-0.5], [0.5]])
    close(m["policy/gate_weight_mean"], 1.0)
    close(m["policy/ratio_mean"], 1.0)


def test_sapo_off_policy_and_clamp():
    # r = e^0.5 = 1.648721, tau=1: s = sigmoid(0.648721) = 0.656722; f = 2.626889, w = 4 s (1-s) = 0.901753
    # grad = -A w r = -0.901753 * 1.648721 = -1.486739
    logp = t([[0.5, 50.0]], grad=True)
    mask = torch.tensor([[1, 0]])
    loss, m = L.sapo_loss(logp, torch.zeros(1, 2, dtype=F64), t([1.0]), mask)
    loss.backward()
    close(loss, -2.6268890)
    close(logp.grad, [[-1.4867386, 0.0]])
    close(m["policy/gate_weight_mean"], 0.9017526)
    # log-ratio 50 is clamped to 20: finite loss, zero gradient through the clamp
    logp = t([[50.0]], grad=True)
    loss, _ = L.sapo_loss(logp, torch.zeros(1, 1, dtype=F64), t([-1.0]), torch.ones(1, 1))
    loss.backward()
    assert finite(loss) and logp.grad.item() == 0.0


# --------------------------------------------------------------------------------------------- value
def test_value_loss_hand_values():
    # tok1: (1-2)^2 = 1 vs (0.5 + clip(0.5, +-0.2) - 2)^2 = (-1.3)^2 = 1.69 -> 1.69 (clipped)
    # tok2: (2-1)^2 = 1 vs (2 + 0 - 1)^2 = 1 -> 1 ; loss = 0.5 * (1.69 + 1) / 2 = 0.6725
    v = t([[1.0, 2.0, 9.0]], grad=True)
    mask = torch.tensor([[1, 1, 0]])
    loss, m = L.value_loss(v, t([[0.5, 2.0, 0.0]]), t([[2.0, 1.0, 0.0]]), mask)
    close(loss, 0.6725)
    loss.backward()
    close(v.grad, [[0.0, 0.5, 0.0]])  # tok1 clipped -> 0; tok2: 0.5 * 2 (v-R) / 2 = 0.5
    close(m["value/clip_frac"], 0.5)
    close(m["value/mean"], 1.5)
    close(m["value/returns_mean"], 1.5)
    close(m["value/error"], 1.0)


# ----------------------------------------------------------------------------------------------- DPO
# pair0: h = (-1 - -1.5) - (-2 - -1.5) = 0.5 + 0.5 = 1 ; pair1: h = -1 (chosen/rejected swapped)
# beta = 0.1: softplus(-0.1) = 0.644397, softplus(0.1) = 0.744397
DPO_ARGS = ([-1.0, -2.0], [-2.0, -1.0], [-1.5, -1.5], [-1.5, -1.5])


@pytest.mark.parametrize(
    ("loss_type", "ls", "expected"),
    [
        ("sigmoid", 0.0, (0.6443967 + 0.7443967) / 2),  # -logsig(0.1), -logsig(-0.1)
        # cDPO: pair0 0.9*0.644397 + 0.1*0.744397 = 0.654397; pair1 0.9*0.744397 + 0.1*0.644397 = 0.734397
        ("sigmoid", 0.1, (0.6543967 + 0.7343967) / 2),
        # rDPO: pair0 (0.9*0.644397 - 0.1*0.744397)/0.8 = 0.631897; pair1 (0.9*0.744397 - 0.1*0.644397)/0.8
        ("robust", 0.1, (0.6318967 + 0.7568967) / 2),
        ("ipo", 0.0, (16.0 + 36.0) / 2),  # (1 - 1/0.2)^2 = 16 ; (-1 - 5)^2 = 36
        ("hinge", 0.0, (0.9 + 1.1) / 2),  # relu(1 - 0.1) ; relu(1 + 0.1)
    ],
)
def test_dpo_variants_hand_values(loss_type, ls, expected):
    loss, m = L.dpo_loss(*(t(a) for a in DPO_ARGS), 0.1, loss_type=loss_type, label_smoothing=ls)
    close(loss, expected)
    close(m["rewards/chosen"], 0.0)  # 0.1 * (0.5 + -0.5) / 2
    close(m["rewards/rejected"], 0.0)  # 0.1 * (-0.5 + 0.5) / 2
    close(m["rewards/accuracy"], 0.5)  # 0.05 > -0.05 yes ; -0.05 > 0.05 no
    close(m["rewards/margin"], 0.0)  # (0.1 + -0.1) / 2


def test_dpo_accuracy_is_strict_and_sigmoid_gradient():
    # h = 0 -> loss ln 2, accuracy 0 (tie is not a win); d/dc [-logsig(beta h)] = -beta * sigmoid(-0) = -0.05
    c = t([-1.0], grad=True)
    r = t([-1.0], grad=True)
    loss, m = L.dpo_loss(c, r, t([-1.0]), t([-1.0]))
    loss.backward()
    close(loss, math.log(2.0))
    close(m["rewards/accuracy"], 0.0)
    close(c.grad, [-0.05])
    close(r.grad, [0.05])


# -------------------------------------------------------------------------------- advantages & shaping
def test_group_advantages():
    # group [1,0,0,1]: mean 0.5, Bessel std sqrt(4 * 0.25 / 3) = 0.577350 -> +-0.5/0.577350 = +-0.866025
    # group [2,2,2,2]: equal rewards -> 0 / (0 + eps) = 0
    rewards = t([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    a = 0.8660254
    close(L.group_advantages(rewards, 4), [a, -a, -a, a, 0, 0, 0, 0])
    close(L.group_advantages(rewards, 4, scale=False), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    # groups of 2: [1,0] -> std = 0.707107 -> +-0.5/0.707107 = +-0.707107 ; [0,1] likewise
    close(L.group_advantages(rewards, 2)[:4], [0.7071068, -0.7071068, -0.7071068, 0.7071068])
    out = L.group_advantages(torch.tensor([1, 1, 0, 1]), 2)  # integer rewards are accepted
    assert out.is_floating_point() and finite(out)


def test_gae_three_step_example():
    # gamma = 0.9, lam = 0.8 (gamma*lam = 0.72); rewards (0, 0, 1), values (0.5, 0.6, 0.7), V_3 = 0
    # t=2: delta = 1 - 0.7 = 0.3 ; A = 0.3
    # t=1: delta = 0.9*0.7 - 0.6 = 0.03 ; A = 0.03 + 0.72*0.3 = 0.246
    # t=0: delta = 0.9*0.6 - 0.5 = 0.04 ; A = 0.04 + 0.72*0.246 = 0.21712
    # returns = A + V = (0.71712, 0.846, 1.0); row1: 1 token, r=2, v=1 -> A = 1, ret = 2
    rewards = t([[0.0, 0.0, 1.0, 3.0], [2.0, 5.0, 5.0, 5.0]])  # padding holds garbage
    values = t([[0.5, 0.6, 0.7, 5.0], [1.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    adv, ret = L.gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.21712, 0.246, 0.3, 0.0], [1.0, 0.0, 0.0, 0.0]])
    close(ret, [[0.71712, 0.846, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0]])


def test_gae_skips_holes_in_the_mask_like_an_episode_observation():
    # the three-step example with two observation tokens (mask 0, garbage values) between its tokens 1 and 2:
    # the same advantages on the valid tokens as the contiguous row, 0 on the holes; the score sits on the
    # last valid token (token_rewards finds it past the holes)
    values = t([[0.5, 0.6, 9.0, 9.0, 0.7, 0.0]])
    mask = torch.tensor([[1, 1, 0, 0, 1, 0]])
    rewards = L.token_rewards(torch.tensor([1.0]), mask)
    close(rewards, [[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    adv, ret = L.gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.21712, 0.246, 0.0, 0.0, 0.3, 0.0]])
    close(ret, [[0.71712, 0.846, 0.0, 0.0, 1.0, 0.0]])


def test_gae_defaults_gamma_one():
    # gamma=1, lam=0.95, rewards (0, 1), values (0, 0): t=1: A = 1 ; t=0: A = 0 + 0.95*1 = 0.95
    adv, _ = L.gae_advantages(t([[0.0, 1.0]]), t([[0.0, 0.0]]), torch.ones(1, 2))
    close(adv, [[0.95, 1.0]])


@pytest.mark.parametrize(
    ("est", "expected"),
    [("k1", -0.6931472), ("k2", 0.2402265), ("k3", 0.3068528)],  # d = ln 2: -d ; d^2/2 ; 2 - d - 1
)
def test_kl_estimators_known_values(est, expected):
    logp = t([[0.0, -1.0]])
    ref = t([[math.log(2.0), -1.0]])  # second token: ref == logp -> 0 for every estimator
    close(L.kl_penalty(logp, ref, est), [[expected, 0.0]])


def test_overlong_penalty_boundaries():
    # max 10, cache 4 -> expected 6: L<=6 -> 0 ; 7 -> (6-7)/4 = -0.25 ; 9 -> -0.75 ; 10 -> -1 ; 11 -> -1
    close(L.overlong_penalty(torch.tensor([0, 6, 7, 9, 10, 11]), 10, 4), [0, 0, -0.25, -0.75, -1.0, -1.0])
    close(L.overlong_penalty(torch.tensor([10, 11]), 10, 0), [0.0, -1.0])  # no buffer: 0 or -1
    close(L.overlong_penalty(torch.tensor([0, 5, 10]), 10, 10), [0.0, -0.5, -1.0])  # whole range is buffer
    assert L.overlong_penalty(torch.tensor([7]), 10, 4).is_floating_point()


def test_dapo_group_keep():
    correct = torch.tensor([1, 1, 1, 0, 0, 0, 1, 0, 0])  # 3/3, 0/3, 1/3 correct
    assert L.dapo_group_keep(correct, 3).tolist() == [False, False, True]
    assert L.dapo_group_keep(correct.bool()[:8], 2).tolist() == [False, True, False, True]


# ------------------------------------------------------------------------------------------- gradcheck
def _gc_batch():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 4, generator=g, dtype=F64) - 0.5
    # small log-ratios stay away from the clip kinks at 0.8 / 1.2 (|log r| <= 0.15), plus one clipped token
    logp = old + 0.3 * (torch.rand(3, 4, generator=g, dtype=F64) - 0.5)
    logp[0, 0] = old[0, 0] + 0.5
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    return logp.requires_grad_(), old, t([1.0, -0.7, 0.4]), mask


@pytest.mark.parametrize("mode", L.AGGREGATIONS)
def test_gradcheck_policy_losses(mode):
    logp, old, adv, mask = _gc_batch()
    ref = old - 0.2
    fns = [
        lambda x: L.ppo_policy_loss(x, old, adv, mask, 0.2, mode)[0],
        lambda x: L.ppo_policy_loss(x, old, -adv, mask, 0.2, mode, clip_ratio_c=1.1)[0],
        lambda x: L.grpo_loss(x, old, ref, adv, mask, 0.2, 0.1, mode)[0],
        lambda x: L.dapo_loss(x, old, adv, mask, aggregation=mode)[0],
        lambda x: L.sapo_loss(x, old, adv, mask, aggregation=mode)[0],
    ]
    for fn in fns:
        assert torch.autograd.gradcheck(fn, (logp,))


def test_gradcheck_gspo_value_dpo():
    logp, old, adv, mask = _gc_batch()
    assert torch.autograd.gradcheck(lambda x: L.gspo_loss(x, old, adv, mask, 0.2, 0.3)[0], (logp,))
    values = (old * 2).detach().requires_grad_()
    vfn = lambda x: L.value_loss(x, old, old + 0.1, mask, 0.1)[0]  # noqa: E731
    assert torch.autograd.gradcheck(vfn, (values,))
    c, r = t([-1.0, -3.0, -2.0], grad=True), t([-2.0, -1.0, -2.5], grad=True)
    rc, rr = t([-1.2, -2.0, -2.2]), t([-1.8, -1.6, -2.0])
    for lt in L.DPO_LOSS_TYPES:
        fn = lambda a, b, lt=lt: L.dpo_loss(a, b, rc, rr, 0.3, loss_type=lt, label_smoothing=0.1)[0]  # noqa: E731
        assert torch.autograd.gradcheck(fn, (c, r))


# ------------------------------------------------------------------------------ micro-batch invariance
def _mb_batch():
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(4, 5, generator=g, dtype=F64) - 0.2
    logp = old + 0.8 * (torch.rand(4, 5, generator=g, dtype=F64) - 0.5)  # some tokens clipped, some not
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    adv = t([0.9, -1.3, 0.5, 2.0])
    return logp, old, old - 0.1, adv, mask


MB_LOSSES = {
    "ppo": lambda lp, o, r, a, m, mode, **kw: L.ppo_policy_loss(
        lp, o, a, m, 0.2, mode, clip_ratio_c=3.0, **kw
    ),
    "grpo": lambda lp, o, r, a, m, mode, **kw: L.grpo_loss(lp, o, r, a, m, 0.2, 0.04, mode, **kw),
    "dapo": lambda lp, o, r, a, m, mode, **kw: L.dapo_loss(lp, o, a, m, 0.2, 0.28, mode, **kw),
    "sapo": lambda lp, o, r, a, m, mode, **kw: L.sapo_loss(lp, o, a, m, 1.0, 1.05, mode, **kw),
}


def _micro_vs_full(loss_fn):
    logp, old, ref, adv, mask = _mb_batch()
    full_x = logp.clone().requires_grad_()
    full = loss_fn(full_x, old, ref, adv, mask)
    full.backward()
    n_tok, n_seq = L.normalizer_counts(mask)
    micro_x = logp.clone().requires_grad_()
    total = 0.0
    for sl in (slice(0, 1), slice(1, 3), slice(3, 4)):  # micro-batches of 1, 2, 1 rows
        total = total + loss_fn(
            micro_x[sl], old[sl], ref[sl], adv[sl], mask[sl], num_tokens=n_tok, num_seqs=n_seq
        )
    total.backward()
    torch.testing.assert_close(total, full, atol=1e-10, rtol=0)
    torch.testing.assert_close(micro_x.grad, full_x.grad, atol=1e-10, rtol=0)
    assert full_x.grad.abs().sum() > 0  # the property is not trivially about zeros


@pytest.mark.parametrize("mode", L.AGGREGATIONS)
@pytest.mark.parametrize("name", sorted(MB_LOSSES))
def test_micro_batch_invariance(name, mode):
    _micro_vs_full(lambda *args, **kw: MB_LOSSES[name](*args, mode, **kw)[0])


def test_micro_batch_invariance_gspo_and_value():
    _micro_vs_full(
        lambda lp, o, r, a, m, **kw: L.gspo_loss(lp, o, a, m, 0.2, 0.3, num_seqs=kw.get("num_seqs"))[0]
    )
    _micro_vs_full(
        lambda lp, o, r, a, m, **kw: L.value_loss(lp, o, r, m, 0.05, num_tokens=kw.get("num_tokens"))[0]
    )


def test_micro_batch_local_counts_differ_without_normalizers():
    # guards the test above: with local counts the micro losses do NOT add up to the full loss
    logp, old, _, adv, mask = _mb_batch()
    full = L.ppo_policy_loss(logp, old, adv, mask)[0]
    parts = sum(L.ppo_policy_loss(logp[s], old[s], adv[s], mask[s])[0] for s in (slice(0, 2), slice(2, 4)))
    assert not torch.isclose(parts, full)


# ----------------------------------------------------------------------- trust-region protocol, CISPO
def test_every_trust_region_is_a_dataclass_of_its_options_calling_its_function():
    """Each region's ``surrogate`` is its pure function applied with its own fields: the same numbers as the
    function called directly (positional form kept for direct callers)."""
    torch.manual_seed(0)
    logp, log_ratio, adv = (torch.randn(2, 3, dtype=F64) * 0.3 for _ in range(3))
    mask = torch.ones(2, 3, dtype=torch.bool)
    x = L.SurrogateInputs(logp=logp, old_logp=logp - log_ratio, log_ratio=log_ratio, adv=adv, mask=mask)
    selected = torch.tensor([[True, False, False], [False, False, True]])
    cases = [
        (L.Clip(0.1, 0.28, 3.0), L.clipped_surrogate(log_ratio, adv, 0.1, 0.28, 3.0)),
        (L.SoftGate(1.0, 2.0), L.soft_gate_surrogate(log_ratio, adv, 1.0, 2.0)),
        (L.CISPO(0.3), L.cispo_surrogate(log_ratio, adv, 0.3, logp=logp)),
        (L.DPPO("kl", 0.1, 0.05, 1.5), L.dppo_surrogate(log_ratio, adv, "kl", 0.1, 0.05, 1.5, logp=logp,
                                                         old_logp=logp - log_ratio)),
    ]
    for region, expected in cases:
        out = region.surrogate(x)
        assert isinstance(out, L.Surrogate) and out.loss.shape == (2, 3), region
        torch.testing.assert_close(out.loss, expected.loss)
    for region, fn in ((L.ClipCov(0.2, 0.2, 0.5, -1.0, 1.0), L.clip_cov_surrogate),
                       (L.KLCov(0.5, 0.7), L.kl_cov_surrogate)):
        out = region.surrogate(x._replace(selected=selected))
        args = (0.2, 0.2, 0.5, -1.0, 1.0) if fn is L.clip_cov_surrogate else (0.5, 0.7)
        expected = fn(log_ratio, adv, *args, logp=logp, mask=mask, selected=selected)
        torch.testing.assert_close(out.loss, expected.loss)
        assert out.stats["cov_frac"].tolist() == selected.tolist()


def test_a_new_trust_region_needs_only_its_class():
    """A region written outside the package (a subclass of ``TrustRegion``) runs through ``policy_loss`` and
    ``Objective`` unchanged, and sees padding zeroed before it."""
    from dataclasses import dataclass

    from lightning_rl.maths.objective import Objective

    seen = {}

    @dataclass(frozen=True)
    class CovRegion(L.TrustRegion):  # a Clip-Cov-like region: keeps the tokens of covariance <= k * mean
        k: float = 1.0

        def surrogate(self, x):
            seen.update(logp=x.logp.detach().clone(), mask=x.mask, k=self.k)
            n = x.mask.sum()
            centered = (torch.where(x.mask, x.logp - x.logp.sum() / n, 0.0)
                        * torch.where(x.mask, x.adv - x.adv.sum() / n, 0.0))
            keep = centered.detach() <= self.k * centered.detach().sum() / n
            ratio = torch.exp(x.log_ratio)
            return L.Surrogate(-torch.where(keep, ratio, 0.0) * x.adv, ratio, {})

    logp = t([[-1.0, -2.0, math.nan], [-0.5, -1.5, -3.0]], grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, _ = L.policy_loss(logp, logp.detach(), None, t([1.0, -1.0]), mask, trust_region=CovRegion(0.5))
    assert torch.isfinite(loss) and seen["k"] == 0.5 and seen["mask"].dtype == torch.bool
    close(seen["logp"], [[-1.0, -2.0, 0.0], [-0.5, -1.5, -3.0]])  # padding zeroed before the region
    same, _ = Objective(trust_region=CovRegion(0.5))(logp, logp.detach(), None, t([1.0, -1.0]), mask)
    close(same, loss.detach())


# CISPO on a [2, 3] batch, clip_high = 0.28 (cap 1.28). log r: row 0 [0, ln 2, -ln 2], row 1 [0, ln 1.5, pad];
# r = [1, 2, 0.5], [1, 1.5]; weights sg(min(r, 1.28)) = [1, 1.28, 0.5], [1, 1.28]; A = [1, -2] per row;
# logp = [-1, -2, -0.5], [-0.5, -1, NaN (padding)].
# per token -w A logp: row 0: -1*1*(-1) = 1, -1.28*1*(-2) = 2.56, -0.5*1*(-0.5) = 0.25 (sum 3.81);
# row 1: -1*(-2)*(-0.5) = -1, -1.28*(-2)*(-1) = -2.56 (sum -3.56).
# token-mean (3.81 - 3.56) / 5 = 0.05; seq-mean-token-mean (3.81/3 - 3.56/2) / 2 = (1.27 - 1.78) / 2 = -0.255
# gradient (token-mean) -w A / 5: [-0.2, -0.256, -0.1], [0.4, 0.512, 0]
def _cispo_case():
    mask = torch.tensor([[True, True, True], [True, True, False]])
    logp = t([[-1.0, -2.0, -0.5], [-0.5, -1.0, math.nan]], grad=True)
    log_r = t([[0.0, math.log(2.0), -math.log(2.0)], [0.0, math.log(1.5), 0.0]])
    old = (logp.detach() - log_r).masked_fill(~mask, math.inf)
    return logp, old, t([1.0, -2.0]), mask


def test_cispo_hand_values_and_gradient():
    logp, old, adv, mask = _cispo_case()
    cispo = {"trust_region": L.CISPO(high=0.28)}
    loss, m = L.policy_loss(logp, old, None, adv, mask, aggregation="token-mean", **cispo)
    close(loss, 0.05)
    loss.backward()
    close(logp.grad, [[-0.2, -0.256, -0.1], [0.4, 0.512, 0.0]])
    close(m["policy/clip_frac"], 0.4)  # r = 2 and r = 1.5 exceed 1.28, whatever the sign of A
    close(m["policy/clip_frac_high"], 0.4)
    close(m["policy/ratio_mean"], 1.2)  # (1 + 2 + 0.5 + 1 + 1.5) / 5
    # k3 = r - 1 - log r: 0 + (1 - ln 2) + (-0.5 + ln 2) + 0 + (0.5 - ln 1.5) = 0.594535; / 5
    close(m["policy/approx_kl"], 0.118907)
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())
    seq_loss, _ = L.policy_loss(logp, old, None, adv, mask, aggregation="seq-mean-token-mean", **cispo)
    close(seq_loss, -0.255)


def test_cispo_with_sequence_ratio_weights_each_row_by_its_capped_sequence_ratio():
    # mean log r: row 0 (0 + ln 2 - ln 2) / 3 = 0 -> s = 1; row 1 ln 1.5 / 2 -> s = sqrt(1.5) = 1.224745,
    # capped at 1.2 (clip_high 0.2). -w A sum(logp): row 0 -1*1*(-3.5) = 3.5; row 1 -1.2*(-2)*(-1.5) = -3.6;
    # token-mean (3.5 - 3.6) / 5 = -0.02; gradient -w A / 5: row 0 -0.2, row 1 2.4 / 5 = 0.48
    logp, old, adv, mask = _cispo_case()
    loss, m = L.policy_loss(logp, old, None, adv, mask, ratio_level="sequence",
                            trust_region=L.CISPO(high=0.2), aggregation="token-mean")
    close(loss, -0.02)
    loss.backward()
    close(logp.grad, [[-0.2, -0.2, -0.2], [0.48, 0.48, 0.0]])
    close(m["policy/clip_frac"], 0.5)  # a mean over sequences: row 1 of 2
    close(m["policy/ratio_mean"], (1.0 + math.sqrt(1.5)) / 2)


def _verl_cispo(old_log_prob, log_prob, advantages, response_mask, clip_ratio_high):
    # verl's compute_policy_loss_cispo without a lower clip, loss_agg_mode="token-mean" (our own re-write)
    ratio = torch.exp(log_prob - old_log_prob)
    clipped = torch.clamp(ratio, max=1.0 + clip_ratio_high).detach()
    pg_losses = -advantages * clipped * log_prob
    return (pg_losses * response_mask).sum() / response_mask.sum()


def _trl_cispo(per_token_logps, old_per_token_logps, advantages, completion_mask, epsilon_high):
    # TRL GRPOTrainer loss_type="cispo": epsilon_high is the cap itself; normalised by the total token count
    coef_1 = torch.exp(per_token_logps - old_per_token_logps)
    clamped = torch.clamp(coef_1, max=epsilon_high).detach()
    per_token_loss = -clamped * advantages.unsqueeze(1) * per_token_logps
    return (per_token_loss * completion_mask).sum() / completion_mask.sum()


def test_cispo_matches_verl_and_trl():
    from lightning_rl.maths.objective import Objective

    torch.manual_seed(0)
    logp = (torch.randn(4, 6, dtype=F64) - 1.0).requires_grad_()
    old = logp.detach() + 0.4 * torch.randn(4, 6, dtype=F64)  # ratios well on both sides of the cap
    adv = torch.randn(4, dtype=F64)
    mask = torch.rand(4, 6) > 0.3
    mask[:, 0] = True
    m = mask.to(F64)
    ours = Objective(trust_region=L.CISPO(high=0.28), aggregation="token-mean")
    loss, grad = ([] for _ in range(2))
    for fn in (lambda x: ours(x, old, None, adv, mask)[0],
               lambda x: _verl_cispo(old, x, adv[:, None].expand(4, 6), m, 0.28),
               lambda x: _trl_cispo(x, old, adv, m, 1.28)):
        x = logp.detach().clone().requires_grad_()
        value = fn(x)
        value.backward()
        loss.append(value.detach())
        grad.append(x.grad)
    assert (torch.exp(logp - old)[mask] > 1.28).any() and (torch.exp(logp - old)[mask] < 1.0).any()
    for value, g in zip(loss[1:], grad[1:], strict=True):
        torch.testing.assert_close(loss[0], value)
        torch.testing.assert_close(grad[0], g)


@pytest.mark.parametrize("mode", L.AGGREGATIONS)
def test_cispo_on_policy_gradient_is_the_policy_gradient(mode):
    # r = 1: the weight is 1, so the gradient is -A grad logp aggregated: PPO's on-policy gradient
    torch.manual_seed(1)
    logp, adv = torch.randn(3, 4, dtype=F64).requires_grad_(), torch.randn(3, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]).bool()
    cispo, _ = L.policy_loss(logp, logp.detach(), None, adv, mask, trust_region=L.CISPO(), aggregation=mode)
    ppo, _ = L.policy_loss(logp, logp.detach(), None, adv, mask, aggregation=mode)
    g_cispo, = torch.autograd.grad(cispo, logp)
    g_ppo, = torch.autograd.grad(ppo, logp)
    torch.testing.assert_close(g_cispo, g_ppo)


# ------------------------------------------------------------------------------------------ validation
def _ok():
    return torch.zeros(2, 3, dtype=F64), torch.zeros(2, 3, dtype=F64), t([1.0, -1.0]), torch.ones(2, 3)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda lp, o, a, m: L.ppo_policy_loss(lp, o[:, :2], a, m),
            r"`old_logp` has shape \(2, 2\) but `logp` has \(2, 3\)",
        ),
        (lambda lp, o, a, m: L.ppo_policy_loss(lp, o, a, m[:1]), "`mask` has shape"),
        (lambda lp, o, a, m: L.ppo_policy_loss(lp[0], o[0], a, m[0]), "`logp` must be 2-D"),
        (lambda lp, o, a, m: L.ppo_policy_loss(lp, o, t([1.0, 2.0, 3.0]), m), "`advantages` must have shape"),
        (lambda lp, o, a, m: L.ppo_policy_loss(lp, o, a, m, aggregation="mean"), "aggregation.*token-mean"),
        (lambda lp, o, a, m: L.ppo_policy_loss(lp, o, a, m, 0.0), "`clip_eps` must be"),
        (lambda lp, o, a, m: L.ppo_policy_loss(lp, o, a, m, 1.0), "`clip_eps` must be"),
        (lambda lp, o, a, m: L.ppo_policy_loss(lp, o, a, m, clip_eps_high=-0.1), "`clip_eps_high` must be"),
        (lambda lp, o, a, m: L.ppo_policy_loss(lp, o, a, m, clip_ratio_c=1.0), "`clip_ratio_c` must be > 1"),
        (lambda lp, o, a, m: L.grpo_loss(lp, o, None, a, m), "`ref_logp`"),
        (lambda lp, o, a, m: L.grpo_loss(lp, o, o[:1], a, m), "`ref_logp` has shape"),
        (lambda lp, o, a, m: L.grpo_loss(lp, o, o, a, m, beta=-1.0), "`beta` must be"),
        (lambda lp, o, a, m: L.grpo_loss(lp, o, o, a, m, kl_estimator="k4"), "`kl_estimator`"),
        (lambda lp, o, a, m: L.dapo_loss(lp, o, a, m, clip_low=0.0), "`clip_low` must be"),
        (lambda lp, o, a, m: L.dapo_loss(lp, o, a, m, clip_high=0.0), "`clip_high` must be"),
        (lambda lp, o, a, m: L.gspo_loss(lp, o, a, m, clip_low=-1.0), "`clip_low` must be"),
        (lambda lp, o, a, m: L.gspo_loss(lp, o, a, m, clip_high=0.0), "`clip_high` must be"),
        (lambda lp, o, a, m: L.gspo_loss(lp, o[:1], a, m), "`old_logp` has shape"),
        (lambda lp, o, a, m: L.sapo_loss(lp, o, a, m, tau_pos=0.0), "`tau_pos` must be"),
        (lambda lp, o, a, m: L.sapo_loss(lp, o, a, m, tau_neg=-1.0), "`tau_neg` must be"),
        (lambda lp, o, a, m: L.sapo_loss(lp, o, a, m, aggregation="sum"), "aggregation"),
        (lambda lp, o, a, m: L.value_loss(lp, o, o[:, :1], m), "`returns` has shape"),
        (lambda lp, o, a, m: L.value_loss(lp, o, o, m, clip_eps=0.0), "`clip_eps` must be"),
        (lambda lp, o, a, m: L.kl_penalty(lp, o, "k5"), "`estimator`"),
        (lambda lp, o, a, m: L.kl_penalty(lp, o[:1]), "`ref_logp` has shape"),
        (lambda lp, o, a, m: L.aggregate(lp, m, "foo"), "aggregation.*seq-mean-token-sum"),
        (lambda lp, o, a, m: L.aggregate(lp, m[:, :2]), "`mask` has shape"),
        (lambda lp, o, a, m: L.masked_mean(lp, m[:1]), "`mask` has shape"),
        (lambda lp, o, a, m: L.normalizer_counts(m[0]), "`mask` must be 2-D"),
        (lambda lp, o, a, m: L.gae_advantages(lp, o[:1], m), "`values` has shape"),
        (lambda lp, o, a, m: L.gae_advantages(lp, o, m, gamma=1.5), "`gamma`"),
        (lambda lp, o, a, m: L.gae_advantages(lp, o, m, lam=-0.1), "`lam`"),
        (lambda lp, o, a, m: L.policy_loss(lp, o, None, a, m, trust_region=L.CISPO(high=0.0)),
         "`model.objective.trust_region.high` must be > 0"),
    ],
)
def test_policy_validation_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call(*_ok())


def test_a_trust_region_given_by_name_is_refused_naming_the_classes():
    with pytest.raises(TypeError, match="`trust_region` must be a TrustRegion .*Clip, SoftGate, CISPO"):
        L.policy_loss(*_ok()[:2], None, *_ok()[2:], trust_region="cispo")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"beta": 0.0}, "`beta` must be"),
        ({"loss_type": "kto"}, r"`loss_type`.*sigmoid"),
        ({"label_smoothing": 0.5}, "`label_smoothing`"),
        ({"label_smoothing": -0.1}, "`label_smoothing`"),
    ],
)
def test_dpo_validation_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        L.dpo_loss(t([0.0]), t([0.0]), t([0.0]), t([0.0]), **kwargs)


def test_dpo_shape_error():
    with pytest.raises(ValueError, match="`ref_rejected_logps` has shape"):
        L.dpo_loss(t([0.0, 1.0]), t([0.0, 1.0]), t([0.0, 1.0]), t([0.0]))
    with pytest.raises(ValueError, match="`chosen_logps` must be 1-D"):
        L.dpo_loss(t([[0.0]]), t([[0.0]]), t([[0.0]]), t([[0.0]]))


@pytest.mark.parametrize("group_size", [1, 0, 3])
def test_group_size_errors(group_size):
    with pytest.raises(ValueError, match="`group_size`"):
        L.group_advantages(torch.zeros(8), group_size)
    with pytest.raises(ValueError, match="`group_size`"):
        L.dapo_group_keep(torch.zeros(8), group_size)


def test_shaping_errors():
    with pytest.raises(ValueError, match="`rewards` must be 1-D"):
        L.group_advantages(torch.zeros(2, 4), 2)
    with pytest.raises(ValueError, match="`correct` must be 1-D"):
        L.dapo_group_keep(torch.zeros(2, 4), 2)
    for cache_len in (-1, 11):
        with pytest.raises(ValueError, match="`cache_len`"):
            L.overlong_penalty(torch.tensor([5]), 10, cache_len)
    with pytest.raises(ValueError, match="`max_len`"):
        L.overlong_penalty(torch.tensor([5]), 0, 0)


def test_kl_clamp_bounds_a_spike_and_logs_the_max_and_how_often():
    # two tokens, ratio 1 (logp == old_logp), advantage 0: the loss is the KL term alone, token-mean.
    # token 0: ref - logp = 5 -> k3 = e^5 - 5 - 1 = 142.4132; token 1: ref - logp = ln 2 -> k3 = 0.3068528.
    # clamp 10: loss = 0.1 * (10 + 0.3068528) / 2 = 0.5153426; unclamped 0.1 * 142.7200 / 2 = 7.136002.
    # The clamped token gives no gradient; token 1's d k3 / d logp = 1 - e^(ref - logp) = -1, times 0.1 / 2.
    logp = torch.tensor([[-5.0, -math.log(2)]], requires_grad=True)
    ref = torch.zeros(1, 2)
    adv, mask = torch.zeros(1), torch.ones(1, 2)
    loss, m = L.policy_loss(logp, logp.detach(), ref, adv, mask, aggregation="token-mean", kl_coef=0.1,
                            kl_clamp=10.0)
    assert loss.item() == pytest.approx(0.5153426, rel=1e-5)
    loss.backward()
    close(logp.grad, [[0.0, -0.05]])
    assert m["policy/kl_ref_max"].item() == pytest.approx(142.4132, rel=1e-5)
    assert m["policy/kl_clamp_frac"].item() == pytest.approx(0.5)
    assert m["policy/kl_ref"].item() == pytest.approx((142.4132 + 0.3068528) / 2, rel=1e-5)  # unclamped
    free, m = L.policy_loss(logp, logp.detach(), ref, adv, mask, aggregation="token-mean", kl_coef=0.1)
    assert free.item() == pytest.approx(7.136002, rel=1e-5) and "policy/kl_clamp_frac" not in m
    from lightning_rl.maths.objective import Objective

    with pytest.raises(ValueError, match="model.objective.kl_clamp"):
        Objective(kl_coef=0.1, kl_clamp=0.0)
    assert Objective().kl_clamp is None  # off unless set: the shipped configs are measured without it
