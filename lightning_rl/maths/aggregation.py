"""Reductions of per-token values: masked means and the aggregation modes (pure PyTorch).

``x`` and ``mask`` are ``[B, T]``; ``mask`` is bool or 0/1, 1 on the tokens that count. Part of the
contract :mod:`lightning_rl.losses`. A new aggregation is a function in :data:`AGGREGATORS` plus its name in
:data:`Aggregation` (the config key's type).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import torch

from lightning_rl.maths.checks import check_choice, check_shapes

Tensor = torch.Tensor
Count = float | Tensor | None
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Masked mean ``sum(x * mask, dim) / max(sum(mask, dim), 1)``: 0 (not NaN) where nothing is selected.

    Args:
        x: values, any shape; ``mask``: same shape, bool or 0/1; ``dim``: reduce only this dim (None: all).
    """
    check_shapes("x", x, mask=mask)
    mask = mask.bool()
    return torch.where(mask, x, 0.0).sum(dim) / mask.sum(dim).clamp_min(1)


# ------------------------------------------------------------------------------------------- aggregation
def normalizer_counts(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Counts to pass as ``num_tokens`` / ``num_seqs`` when splitting this minibatch into micro-batches.

    Args:
        mask: ``[B, T]`` bool or 0/1.

    Returns:
        ``(num_tokens, num_seqs)``: valid tokens, rows with at least one valid token (0-D int64 tensors;
        all-reduce them across ranks under data parallelism).
    """
    check_shapes("mask", mask, ndim=2)
    mask = mask.bool()
    return mask.sum(), mask.any(-1).sum()


def _denominator(local: Tensor, override: Count, like: Tensor) -> Tensor:
    count = torch.as_tensor(local if override is None else override, dtype=like.dtype, device=like.device)
    # an empty (micro-)batch divides 0 by 1: loss 0, gradient 0, no NaN
    return torch.where(count > 0, count, torch.ones_like(count))


def _token_mean(
    x: Tensor, mask: Tensor, num_tokens: Count, num_seqs: Count, length: int | None = None
) -> Tensor:
    return x.sum() / _denominator(mask.sum(), num_tokens, x)


def _seq_mean_token_mean(
    x: Tensor, mask: Tensor, num_tokens: Count, num_seqs: Count, length: int | None = None
) -> Tensor:
    per_row = x.sum(-1) / mask.sum(-1).clamp_min(1)  # empty rows give 0 and are not counted below
    return per_row.sum() / _denominator(mask.any(-1).sum(), num_seqs, x)


def _seq_mean_token_sum(
    x: Tensor, mask: Tensor, num_tokens: Count, num_seqs: Count, length: int | None = None
) -> Tensor:
    return x.sum() / _denominator(mask.any(-1).sum(), num_seqs, x)


def _seq_mean_token_sum_norm(
    x: Tensor, mask: Tensor, num_tokens: Count, num_seqs: Count, length: int | None = None
) -> Tensor:
    # a constant normaliser: every token weighs 1 / (N_seq L) whatever its row's length (Dr. GRPO)
    norm = max(mask.shape[-1], 1) if length is None else length
    return _seq_mean_token_sum(x, mask, num_tokens, num_seqs) / norm


# (x, mask, num_tokens, num_seqs, norm_length) -> 0-D; x is already 0 where mask is False
AGGREGATORS: dict[str, Callable[[Tensor, Tensor, Count, Count, int | None], Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def aggregate(
    x: Tensor, mask: Tensor, mode: str = "token-mean", *, num_tokens: Count = None, num_seqs: Count = None,
    norm_length: int | None = None,
) -> Tensor:
    """Reduce per-token values ``x`` to a scalar.

    * ``token-mean``: ``sum(x * mask) / N_tok``.
    * ``seq-mean-token-mean``: ``sum_i [sum_t x_it m_it / sum_t m_it] / N_seq``.
    * ``seq-mean-token-sum``: ``sum_i sum_t x_it m_it / N_seq``.
    * ``seq-mean-token-sum-norm``: ``sum_i sum_t x_it m_it / (N_seq * L)``, ``L = norm_length`` (Dr. GRPO's
      constant normaliser: no per-row length bias; in training ``L`` is the completion budget).

    ``N_tok`` / ``N_seq`` are the local valid-token / non-empty-row counts unless ``num_tokens`` /
    ``num_seqs`` give the whole minibatch's counts (micro-batching). Rows with no valid token are left out;
    an all-masked input gives 0.

    ``seq-mean-token-sum-norm`` equals TRL's ``loss_type="dr_grpo"``,
    ``(loss * mask).sum() / (B * max_completion_length)``, when every row has a valid token (TRL counts all
    ``B`` rows, this counts non-empty ones). verl's mode of the same name, ``sum(seq_losses) /
    loss_scale_factor`` per micro-batch (then scaled by ``1 / gradient_accumulation``), does not divide by
    the number of rows: on one micro-batch of ``B`` rows it is this value times ``B``, so verl's step size
    grows with its micro-batch size, and this one does not.

    Args:
        x, mask: ``[B, T]`` values and bool or 0/1 mask. mode: one of :data:`AGGREGATIONS`.
        num_tokens: normaliser for ``token-mean`` (ignored by the sequence modes).
        num_seqs: normaliser for the sequence modes (ignored by ``token-mean``).
        norm_length: ``L`` of ``seq-mean-token-sum-norm``, >= 1 (ignored by the others); ``None``: ``T``
            (verl's default), which changes with the padding of each (micro-)batch: pass a fixed length
            when micro-batching.

    Returns:
        0-D tensor.
    """
    check_shapes("x", x, ndim=2, mask=mask)
    check_choice("aggregation", mode, AGGREGATIONS)
    if norm_length is not None and not norm_length >= 1:
        raise ValueError(f"`norm_length` must be >= 1 or None, got {norm_length}")
    mask = mask.bool()
    return AGGREGATORS[mode](torch.where(mask, x, 0.0), mask, num_tokens, num_seqs, norm_length)
