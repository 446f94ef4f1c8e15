"""The ratio-level axis of :func:`lightning_rl.maths.losses.policy_loss` (pure PyTorch): what one importance
ratio stands for, a token or a whole sequence (GSPO), and so which advantage it takes and what its
metrics average over. Part of the contract :mod:`lightning_rl.losses`.

Shapes: ``logp`` / ``old_logp`` float ``[B, T]``, ``mask`` ``[B, T]`` (bool or 0/1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import torch

from lightning_rl.maths.aggregation import masked_mean

Tensor = torch.Tensor
RatioLevel = Literal["token", "sequence"]


def token_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """``log r_t = logp_t - old_logp_t`` on valid tokens, 0 on padding (so ``exp`` never sees garbage)."""
    return torch.where(mask.bool(), logp - old_logp, 0.0)


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO-token ratio ``log s_it = sg[log s_i] + logp_t - sg[logp_t]``, ``log s_i`` the row's mean
    log-ratio.

    Its value is the sequence ratio on every valid token of the row; its gradient is ``s_i grad logp_t``,
    so with ``seq-mean-token-mean`` it equals GSPO's sequence objective in value and gradient.
    """
    mask = mask.bool()
    log_ratio = token_log_ratio(logp, old_logp, mask)
    seq = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1)
    return torch.where(mask, seq.detach() + logp - logp.detach(), 0.0)


def _row_mean_advantages(adv: Tensor, mask: Tensor) -> Tensor:
    # one ratio per sequence takes one advantage per sequence: the row mean over valid tokens
    return masked_mean(adv, mask, dim=-1).unsqueeze(-1).expand_as(adv)


class _RatioLevel(NamedTuple):
    log_ratio: Callable[[Tensor, Tensor, Tensor], Tensor]  # (logp, old_logp, mask) -> [B, T]
    advantages: Callable[[Tensor, Tensor], Tensor]  # (advantages [B, T], mask) -> [B, T]
    metric_mode: str  # what one ratio stands for: metrics are means over it


RATIO_LEVELS: dict[str, _RatioLevel] = {
    "token": _RatioLevel(token_log_ratio, lambda adv, mask: adv, "token-mean"),
    "sequence": _RatioLevel(sequence_log_ratio, _row_mean_advantages, "seq-mean-token-mean"),
}
