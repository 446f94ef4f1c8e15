"""Policy-gradient and preference losses for RL post-training of causal LMs (pure PyTorch).

Shapes: ``logp`` / ``old_logp`` / ``ref_logp`` are float ``[B, T]`` per-token log-probs of the sampled
completion tokens under the current / behaviour / reference policy; ``mask`` is ``[B, T]`` (bool or 0/1);
``advantages`` is ``[B]`` (broadcast over the row) or ``[B, T]``.

Every ``*_loss`` returns ``(loss, metrics)``: a differentiable scalar to minimise and a dict of detached scalar
tensors. Metrics are masked token means over the local batch. ``policy/approx_kl`` is the k3 estimator of
KL(pi_old || pi_theta) from samples of pi_old: ``mean((r - 1) - log r)`` with ``r = exp(logp - old_logp)``,
which is >= 0 and has lower variance than k1 (``mean(old_logp - logp)``).

Gradient accumulation: losses that aggregate accept keyword-only ``num_tokens`` / ``num_seqs``, the
normaliser counts of the *whole* minibatch (see :func:`normalizer_counts`). When given, the sum of the
micro-batch losses equals the loss of the whole minibatch, in value and gradient.

Padding positions never reach ``exp``: log-ratios are zeroed there first, so garbage (even inf/NaN) in
padded log-probs cannot leak NaN into the loss or its gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
Count = float | Tensor | None

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_ESTIMATORS = ("k1", "k2", "k3")
DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
SAPO_LOG_RATIO_CLAMP = 20.0


# ----------------------------------------------------------------------------------------------- helpers
def _check_shapes(ref_name: str, ref: Tensor, ndim: int | None = None, **others: Tensor | None) -> None:
    """Raise a ValueError naming the argument if ``ref`` is not ``ndim``-D or any of ``others`` differs in shape."""
    if ndim is not None and ref.dim() != ndim:
        raise ValueError(f"`{ref_name}` must be {ndim}-D, got shape {tuple(ref.shape)}")
    for name, t in others.items():
        if t is not None and t.shape != ref.shape:
            raise ValueError(f"`{name}` has shape {tuple(t.shape)} but `{ref_name}` has {tuple(ref.shape)}")


def _check_range(name: str, value: float, low: float = 0.0, high: float | None = None) -> None:
    """Require ``low < value`` (and ``value < high`` when given)."""
    if not value > low or (high is not None and not value < high):
        bound = f"in ({low}, {high})" if high is not None else f"> {low}"
        raise ValueError(f"`{name}` must be {bound}, got {value}")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown `{name}` {value!r}; expected one of {choices}")


def _broadcast_advantages(advantages: Tensor, logp: Tensor) -> Tensor:
    """Return advantages as ``[B, T]``: a ``[B]`` tensor is repeated over each row's tokens."""
    if advantages.shape == logp.shape:
        return advantages
    if advantages.dim() == 1 and advantages.shape[0] == logp.shape[0]:
        return advantages.unsqueeze(-1).expand_as(logp)
    raise ValueError(
        f"`advantages` must have shape (B,) or (B, T) = {tuple(logp.shape)}, got {tuple(advantages.shape)}"
    )


def _masked_log_ratio(logp: Tensor, other: Tensor, mask: Tensor) -> Tensor:
    # zero on padding so exp() downstream never sees padding garbage (NaN-safe forward and backward)
    return torch.where(mask, logp - other, 0.0)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Masked mean ``sum(x * mask, dim) / max(sum(mask, dim), 1)``: 0 (not NaN) where nothing is selected.

    Args:
        x: values, any shape; ``mask``: same shape, bool or 0/1; ``dim``: reduce only this dim (None: all).
    """
    _check_shapes("x", x, mask=mask)
    mask = mask.bool()
    return torch.where(mask, x, 0.0).sum(dim) / mask.sum(dim).clamp_min(1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy (nats) of ``softmax(z)`` over the last axis: ``H = logsumexp(z) - sum_v softmax(z)_v z_v``.

    Args:
        logits: ``[..., V]``, finite (mask with a large negative number, not ``-inf``). Returns ``[...]``.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


# ------------------------------------------------------------------------------------------- aggregation
def normalizer_counts(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Counts to pass as ``num_tokens`` / ``num_seqs`` when splitting this minibatch into micro-batches.

    Args:
        mask: ``[B, T]`` bool or 0/1.

    Returns:
        ``(num_tokens, num_seqs)``: valid tokens, rows with at least one valid token (0-D int64 tensors;
        all-reduce them across ranks under data parallelism).
    """
    _check_shapes("mask", mask, ndim=2)
    mask = mask.bool()
    return mask.sum(), mask.any(-1).sum()


def _denominator(local: Tensor, override: Count, like: Tensor) -> Tensor:
    count = local if override is None else override
    count = torch.as_tensor(count, dtype=like.dtype, device=like.device)
    # an empty (micro-)batch divides 0 by 1: loss 0, gradient 0, no NaN
    return torch.where(count > 0, count, torch.ones_like(count))


def _token_mean(x: Tensor, mask: Tensor, num_tokens: Count, num_seqs: Count) -> Tensor:
    return x.sum() / _denominator(mask.sum(), num_tokens, x)


def _seq_mean_token_mean(x: Tensor, mask: Tensor, num_tokens: Count, num_seqs: Count) -> Tensor:
    per_row = x.sum(-1) / mask.sum(-1).clamp_min(1)  # empty rows give 0 and are not counted below
    return per_row.sum() / _denominator(mask.any(-1).sum(), num_seqs, x)


def _seq_mean_token_sum(x: Tensor, mask: Tensor, num_tokens: Count, num_seqs: Count) -> Tensor:
    return x.sum() / _denominator(mask.any(-1).sum(), num_seqs, x)


_AGGREGATORS: dict[str, Callable[[Tensor, Tensor, Count, Count], Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
}


def aggregate(
    x: Tensor, mask: Tensor, mode: str = "token-mean", *, num_tokens: Count = None, num_seqs: Count = None
) -> Tensor:
    """Reduce per-token values ``x`` to a scalar.

    * ``token-mean``: ``sum(x * mask) / N_tok``.
    * ``seq-mean-token-mean``: ``sum_i [sum_t x_it m_it / sum_t m_it] / N_seq``.
    * ``seq-mean-token-sum``: ``sum_i sum_t x_it m_it / N_seq``.

    ``N_tok`` / ``N_seq`` are the local valid-token / non-empty-row counts unless ``num_tokens`` /
    ``num_seqs`` give the whole minibatch's counts (micro-batching). Rows with no valid token are left out;
    an all-masked input gives 0.

    Args:
        x, mask: ``[B, T]`` values and bool or 0/1 mask. mode: one of :data:`AGGREGATIONS`.
        num_tokens: normaliser for ``token-mean`` (ignored by the sequence modes).
        num_seqs: normaliser for the sequence modes (ignored by ``token-mean``).

    Returns:
        0-D tensor.
    """
    _check_shapes("x", x, ndim=2, mask=mask)
    _check_choice("aggregation", mode, AGGREGATIONS)
    mask = mask.bool()
    return _AGGREGATORS[mode](torch.where(mask, x, 0.0), mask, num_tokens, num_seqs)


# ------------------------------------------------------------------------------------------ KL estimators
_KL_FROM_DELTA: dict[str, Callable[[Tensor], Tensor]] = {
    # delta = ref_logp - logp, samples drawn from the policy whose log-prob is `logp`
    "k1": lambda delta: -delta,
    "k2": lambda delta: 0.5 * delta**2,
    "k3": lambda delta: torch.exp(delta) - delta - 1.0,
}


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman's k1/k2/k3).

    With ``d = ref_logp - logp``: ``k1 = -d``, ``k2 = d^2 / 2``, ``k3 = exp(d) - d - 1`` (unbiased, >= 0).

    Args:
        logp, ref_logp: ``[B, T]`` log-probs under pi / pi_ref. estimator: one of :data:`KL_ESTIMATORS`.

    Returns:
        ``[B, T]`` per-token estimates.
    """
    _check_shapes("logp", logp, ref_logp=ref_logp)
    _check_choice("estimator", estimator, KL_ESTIMATORS)
    return _KL_FROM_DELTA[estimator](ref_logp - logp)


# ----------------------------------------------------------------------------------- clipped surrogates
def _clipped_surrogate(
    log_ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float, clip_ratio_c: float | None
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Per-element PPO loss ``max(-A r, -A clip(r, 1-eps_low, 1+eps_high))`` (+ dual clip), ratio, clip flags."""
    ratio = torch.exp(log_ratio)
    low = (ratio < 1.0 - eps_low) & (adv < 0)
    high = (ratio > 1.0 + eps_high) & (adv > 0)
    clipped = low | high  # exactly where the clipped term is the larger (active) loss
    loss = torch.where(clipped, -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high), -adv * ratio)
    flags = {"clip_frac": clipped, "clip_frac_low": low, "clip_frac_high": high}
    if clip_ratio_c is not None:
        # dual clip: for A < 0 cap the loss at -A*c so a huge ratio on a bad token cannot blow up the step
        dual = (adv < 0) & (loss > -adv * clip_ratio_c)
        loss = torch.where(dual, -adv * clip_ratio_c, loss)
        flags["clip_frac_dual"] = dual
    return loss, ratio, flags


def _policy_metrics(
    log_ratio: Tensor, mask: Tensor, ratio: Tensor, flags: dict[str, Tensor], flag_mask: Tensor
) -> dict[str, Tensor]:
    with torch.no_grad():
        metrics = {f"policy/{k}": masked_mean(v.to(ratio.dtype), flag_mask) for k, v in flags.items()}
        metrics["policy/ratio_mean"] = masked_mean(ratio.detach(), flag_mask)
        metrics["policy/approx_kl"] = masked_mean(_KL_FROM_DELTA["k3"](log_ratio.detach()), mask)
    return metrics


def _ppo_per_token(logp, old_logp, advantages, mask, clip_eps, clip_eps_high, clip_ratio_c):
    """Validated per-token PPO loss ``[B, T]``, bool mask and metrics; shared by ppo/grpo/dapo."""
    _check_shapes("logp", logp, ndim=2, old_logp=old_logp, mask=mask)
    _check_range("clip_eps", clip_eps, high=1.0)
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    _check_range("clip_eps_high", eps_high)
    if clip_ratio_c is not None:
        _check_range("clip_ratio_c", clip_ratio_c, low=1.0)
    mask = mask.bool()
    adv = _broadcast_advantages(advantages, logp)
    log_ratio = _masked_log_ratio(logp, old_logp, mask)
    per_token, ratio, flags = _clipped_surrogate(log_ratio, adv, clip_eps, eps_high, clip_ratio_c)
    return per_token, mask, _policy_metrics(log_ratio, mask, ratio, flags, mask)


# ---------------------------------------------------------------------------------------- policy losses
def ppo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    aggregation: str = "token-mean",
    *,
    clip_eps_high: float | None = None,
    clip_ratio_c: float | None = None,
    num_tokens: Count = None,
    num_seqs: Count = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate: ``aggregate(-min(r A, clip(r, 1-eps, 1+eps_high) A))``, ``r = exp(logp - old_logp)``.

    Dual clip (``clip_ratio_c = c > 1``): for ``A < 0`` the per-token loss is ``min(that, -c A)``.

    Args:
        logp, old_logp: ``[B, T]``. advantages: ``[B]`` or ``[B, T]``. mask: ``[B, T]``.
        clip_eps: lower (and default upper) clip range, in (0, 1).
        aggregation: one of :data:`AGGREGATIONS`.
        clip_eps_high: upper clip range (``None``: ``clip_eps``).
        clip_ratio_c: dual-clip constant ``c > 1`` or ``None`` (off).
        num_tokens, num_seqs: whole-minibatch normalisers (see :func:`aggregate`).

    Returns:
        ``(loss, metrics)`` with ``policy/{clip_frac, clip_frac_low, clip_frac_high, approx_kl, ratio_mean}``
        and ``policy/clip_frac_dual`` when dual clip is on.
    """
    per_token, mask, metrics = _ppo_per_token(
        logp, old_logp, advantages, mask, clip_eps, clip_eps_high, clip_ratio_c
    )
    return aggregate(per_token, mask, aggregation, num_tokens=num_tokens, num_seqs=num_seqs), metrics


def dapo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    aggregation: str = "token-mean",
    *,
    clip_ratio_c: float | None = None,
    num_tokens: Count = None,
    num_seqs: Count = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DAPO: PPO clip with the decoupled ("clip-higher") range ``[1 - clip_low, 1 + clip_high]``.

    Same shapes, options and metrics as :func:`ppo_policy_loss`.
    """
    _check_range("clip_low", clip_low, high=1.0)  # validated here so errors name DAPO's arguments
    _check_range("clip_high", clip_high)
    per_token, mask, metrics = _ppo_per_token(
        logp, old_logp, advantages, mask, clip_low, clip_high, clip_ratio_c
    )
    return aggregate(per_token, mask, aggregation, num_tokens=num_tokens, num_seqs=num_seqs), metrics


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    beta: float = 0.04,
    aggregation: str = "seq-mean-token-mean",
    *,
    clip_eps_high: float | None = None,
    clip_ratio_c: float | None = None,
    kl_estimator: str = "k3",
    num_tokens: Count = None,
    num_seqs: Count = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO: ``-aggregate(min(r A, clip(r) A) - beta * KL_t)``, ``KL_t = kl_penalty(logp, ref_logp)``.

    Args:
        ref_logp: ``[B, T]`` reference log-probs; may be ``None`` only when ``beta == 0``.
        beta: KL coefficient, >= 0.
        kl_estimator: one of :data:`KL_ESTIMATORS` (default k3, as in the GRPO paper).
        Others: as in :func:`ppo_policy_loss` (default aggregation is per-sequence token mean).

    Returns:
        ``(loss, metrics)``: the PPO metrics plus ``policy/kl_ref`` when ``ref_logp`` is given.
    """
    if beta < 0:
        raise ValueError(f"`beta` must be >= 0, got {beta}")
    if ref_logp is None and beta != 0:
        raise ValueError(f"`ref_logp` is None but beta={beta}; pass ref_logp or set beta=0")
    _check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
    per_token, mask, metrics = _ppo_per_token(
        logp, old_logp, advantages, mask, clip_eps, clip_eps_high, clip_ratio_c
    )
    if ref_logp is not None:
        _check_shapes("logp", logp, ref_logp=ref_logp)
        kl = _KL_FROM_DELTA[kl_estimator](_masked_log_ratio(ref_logp, logp, mask))
        if beta != 0:
            per_token = per_token + beta * kl
        metrics["policy/kl_ref"] = masked_mean(kl.detach(), mask)
    return aggregate(per_token, mask, aggregation, num_tokens=num_tokens, num_seqs=num_seqs), metrics


def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    *,
    num_seqs: Count = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: sequence-level ratio ``s_i = exp(sum_t m_it (logp - old_logp)_it / sum_t m_it)``;
    ``loss = -mean_i min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)`` over rows with a valid token.

    With per-sequence advantages this equals "GSPO-token" in value and gradient.

    Args:
        advantages: ``[B]``, or ``[B, T]`` constant per row (the row's masked mean over valid tokens is used).
        num_seqs: whole-minibatch count of non-empty rows (micro-batching).
        Others: as in :func:`ppo_policy_loss`.

    Returns:
        ``(loss, metrics)``: ``policy/{clip_frac, clip_frac_low, clip_frac_high, ratio_mean}`` are over
        sequences (``ratio_mean`` = mean of ``s_i``); ``policy/approx_kl`` is the token-level k3 mean.
    """
    _check_shapes("logp", logp, ndim=2, old_logp=old_logp, mask=mask)
    _check_range("clip_low", clip_low, high=1.0)
    _check_range("clip_high", clip_high)
    mask = mask.bool()
    adv = masked_mean(_broadcast_advantages(advantages, logp), mask, dim=-1)
    log_ratio = _masked_log_ratio(logp, old_logp, mask)
    seq_log_ratio = log_ratio.sum(-1) / mask.sum(-1).clamp_min(1)
    per_seq, ratio, flags = _clipped_surrogate(
        seq_log_ratio[:, None], adv[:, None], clip_low, clip_high, None
    )
    valid = mask.any(-1, keepdim=True)
    loss = aggregate(per_seq, valid, "token-mean", num_tokens=num_seqs)
    return loss, _policy_metrics(log_ratio, mask, ratio, flags, valid)


def sapo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    aggregation: str = "seq-mean-token-mean",
    *,
    num_tokens: Count = None,
    num_seqs: Count = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO soft gate: ``loss = -aggregate(f(r) A)``, ``f(r) = 4 / tau * sigmoid(tau (r - 1))``,
    ``tau = tau_pos if A > 0 else tau_neg``.

    ``d f / d log r = w r`` with gate ``w = 4 sigmoid(tau (r-1)) (1 - sigmoid(tau (r-1)))`` (1 at r = 1), so
    the gradient equals the plain policy gradient on-policy and fades smoothly off-policy. The log-ratio is
    clamped to [-20, 20] before ``exp`` so an extreme token cannot overflow (its gradient is then 0).

    Returns:
        ``(loss, metrics)`` with ``policy/{gate_weight_mean, approx_kl, ratio_mean}``.
    """
    _check_shapes("logp", logp, ndim=2, old_logp=old_logp, mask=mask)
    _check_range("tau_pos", tau_pos)
    _check_range("tau_neg", tau_neg)
    mask = mask.bool()
    adv = _broadcast_advantages(advantages, logp)
    log_ratio = _masked_log_ratio(logp, old_logp, mask).clamp(-SAPO_LOG_RATIO_CLAMP, SAPO_LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    tau = torch.where(adv > 0, ratio.new_tensor(tau_pos), ratio.new_tensor(tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = aggregate(-4.0 / tau * gate * adv, mask, aggregation, num_tokens=num_tokens, num_seqs=num_seqs)
    metrics = _policy_metrics(log_ratio, mask, ratio, {}, mask)
    metrics["policy/gate_weight_mean"] = masked_mean((4.0 * gate * (1.0 - gate)).detach(), mask)
    return loss, metrics


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    *,
    num_tokens: Count = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss: ``0.5 * token-mean(max((v - R)^2, (v_old + clip(v - v_old, -eps, eps) - R)^2))``.

    Args:
        values, old_values, returns, mask: ``[B, T]``.
        clip_eps: value clip range, > 0.
        num_tokens: whole-minibatch valid-token count (micro-batching).

    Returns:
        ``(loss, metrics)`` with ``value/{clip_frac, mean, returns_mean, error}`` (``error`` = masked MSE).
    """
    _check_shapes("values", values, ndim=2, old_values=old_values, returns=returns, mask=mask)
    _check_range("clip_eps", clip_eps)
    mask = mask.bool()
    unclipped = (values - returns) ** 2
    clipped = (old_values + (values - old_values).clamp(-clip_eps, clip_eps) - returns) ** 2
    loss = 0.5 * aggregate(torch.maximum(unclipped, clipped), mask, "token-mean", num_tokens=num_tokens)
    with torch.no_grad():
        metrics = {
            "value/clip_frac": masked_mean((clipped > unclipped).to(values.dtype), mask),
            "value/mean": masked_mean(values.detach(), mask),
            "value/returns_mean": masked_mean(returns.detach(), mask),
            "value/error": masked_mean(unclipped.detach(), mask),
        }
    return loss, metrics


# ------------------------------------------------------------------------------------------------- DPO
def _dpo_sigmoid(h: Tensor, beta: float, ls: float) -> Tensor:
    # conservative DPO (cDPO): labels flipped with probability ls
    return -(1 - ls) * F.logsigmoid(beta * h) - ls * F.logsigmoid(-beta * h)


def _dpo_robust(h: Tensor, beta: float, ls: float) -> Tensor:
    # rDPO (Chowdhury et al. 2024): unbiased under label noise ls -> note the + on the flipped term
    return (-(1 - ls) * F.logsigmoid(beta * h) + ls * F.logsigmoid(-beta * h)) / (1 - 2 * ls)


_DPO_LOSSES: dict[str, Callable[[Tensor, float, float], Tensor]] = {
    "sigmoid": _dpo_sigmoid,
    "robust": _dpo_robust,
    "ipo": lambda h, beta, ls: (h - 1 / (2 * beta)) ** 2,
    "hinge": lambda h, beta, ls: torch.relu(1 - beta * h),
}


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    *,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPO and variants on ``h = (c - rc) - (r - rr)``, averaged over the batch.

    * ``sigmoid``: ``-(1-ls) logsigmoid(beta h) - ls logsigmoid(-beta h)`` (ls = 0: DPO; else cDPO).
    * ``robust``: ``(-(1-ls) logsigmoid(beta h) + ls logsigmoid(-beta h)) / (1 - 2 ls)`` (rDPO).
    * ``ipo``: ``(h - 1 / (2 beta))^2``.  * ``hinge``: ``relu(1 - beta h)``.

    Args:
        chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps: ``[B]`` summed sequence log-probs.
        beta: > 0. loss_type: one of :data:`DPO_LOSS_TYPES`. label_smoothing: in [0, 0.5).

    Returns:
        ``(loss, metrics)`` with ``rewards/{chosen, rejected, accuracy, margin}``; rewards are
        ``beta * (logp - ref_logp)`` batch means, accuracy is the fraction with chosen > rejected (strict).
    """
    _check_shapes(
        "chosen_logps",
        chosen_logps,
        ndim=1,
        rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    _check_range("beta", beta)
    _check_choice("loss_type", loss_type, DPO_LOSS_TYPES)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"`label_smoothing` must be in [0, 0.5), got {label_smoothing}")
    chosen = chosen_logps - ref_chosen_logps
    rejected = rejected_logps - ref_rejected_logps
    loss = _DPO_LOSSES[loss_type](chosen - rejected, beta, label_smoothing).mean()
    with torch.no_grad():
        r_c, r_r = beta * chosen.detach(), beta * rejected.detach()
        metrics = {
            "rewards/chosen": r_c.mean(),
            "rewards/rejected": r_r.mean(),
            "rewards/accuracy": (r_c > r_r).to(r_c.dtype).mean(),
            "rewards/margin": (r_c - r_r).mean(),
        }
    return loss, metrics


# ---------------------------------------------------------------------------------- advantages & shaping
def _check_groups(n: int, group_size: int) -> None:
    if group_size < 2 or n % group_size != 0:
        raise ValueError(f"`group_size` must be >= 2 and divide the batch size {n}, got {group_size}")


def group_advantages(rewards: Tensor, group_size: int, eps: float = 1e-8, scale: bool = True) -> Tensor:
    """GRPO group-relative advantages: ``(r - mean_g) / (std_g + eps)`` per consecutive group of ``group_size``.

    ``std_g`` is Bessel-corrected (as ``torch.std``). ``scale=False`` gives ``r - mean_g`` (Dr. GRPO).
    A group of equal rewards gets advantage 0.

    Args:
        rewards: ``[N]``, ``N`` a multiple of ``group_size``; groups are consecutive.

    Returns:
        ``[N]`` advantages (floating point).
    """
    _check_shapes("rewards", rewards, ndim=1)
    _check_groups(rewards.shape[0], group_size)
    grouped = rewards.reshape(-1, group_size)
    grouped = grouped if grouped.is_floating_point() else grouped.float()
    centered = grouped - grouped.mean(-1, keepdim=True)
    if scale:
        centered = centered / (grouped.std(-1, keepdim=True) + eps)
    return centered.reshape(-1)


@torch.no_grad()
def gae_advantages(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over right-padded token sequences (no gradient).

    ``delta_t = r_t + gamma V_{t+1} - V_t`` (``V`` after the last valid token is 0);
    ``A_t = delta_t + gamma lam A_{t+1}``; ``returns = A + V``. Padding positions are 0 in both outputs.

    Args:
        rewards, values, mask: ``[B, T]`` (per-token rewards).
        gamma, lam: in [0, 1].

    Returns:
        ``(advantages, returns)``, each ``[B, T]``.
    """
    _check_shapes("rewards", rewards, ndim=2, values=values, mask=mask)
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"`{name}` must be in [0, 1], got {value}")
    m = mask.to(values.dtype)
    values, rewards = values * m, rewards * m
    advantages = torch.zeros_like(values)
    next_value = next_adv = values.new_zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_adv = (delta + gamma * lam * next_adv) * m[:, t]
        advantages[:, t] = next_adv
        next_value = values[:, t]
    return advantages, (advantages + values) * m


def overlong_penalty(lengths: Tensor, max_len: int, cache_len: int) -> Tensor:
    """DAPO soft overlong punishment per response length ``L`` (with ``e = max_len - cache_len``).

    ``0`` if ``L <= e``; ``(e - L) / cache_len`` if ``e < L <= max_len``; ``-1`` if ``L > max_len``.

    Args:
        lengths: ``[N]`` response lengths. max_len: > 0. cache_len: in [0, max_len] (0: only 0 or -1).

    Returns:
        ``[N]`` float penalties in [-1, 0].
    """
    if max_len <= 0:
        raise ValueError(f"`max_len` must be > 0, got {max_len}")
    if not 0 <= cache_len <= max_len:
        raise ValueError(f"`cache_len` must be in [0, max_len={max_len}], got {cache_len}")
    lengths = torch.as_tensor(lengths)
    lengths = lengths if lengths.is_floating_point() else lengths.to(torch.get_default_dtype())
    expected = max_len - cache_len
    ramp = (expected - lengths) / max(cache_len, 1)  # only used where cache_len > 0
    penalty = torch.where(lengths > expected, ramp, torch.zeros_like(lengths))
    return torch.where(lengths > max_len, -torch.ones_like(lengths), penalty)


def dapo_group_keep(correct: Tensor, group_size: int) -> Tensor:
    """DAPO dynamic sampling: keep groups that are neither all-correct nor all-wrong.

    Args:
        correct: ``[N]`` bool or 0/1, consecutive groups of ``group_size``.

    Returns:
        ``[N // group_size]`` bool, True where ``0 < #correct < group_size``.
    """
    _check_shapes("correct", correct, ndim=1)
    _check_groups(correct.shape[0], group_size)
    n_correct = correct.bool().reshape(-1, group_size).sum(-1)
    return (n_correct > 0) & (n_correct < group_size)
