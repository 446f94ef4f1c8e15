"""The trust regions whose token selection is a statistic of the whole minibatch: Clip-Cov and KL-Cov
(arXiv 2505.22617; verl ``clip_cov`` / ``kl_cov``, SkyRL ``CLIP_COV`` / ``KL_COV``), pure PyTorch.

Both pick tokens by the per-token covariance ``(A - mean A)(logp - mean logp)``
(:mod:`lightning_rl.maths.token_selection`). Their ``select`` makes that choice once per minibatch over every
rank, before the micro-batches, and passes it to each micro-batch's surrogate as ``selected``; called without
it, a surrogate chooses on the batch it is given (right only when that batch is the whole batch). The protocol
and the other regions: :mod:`lightning_rl.maths.trust_regions`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from lightning_rl.maths.checks import require
from lightning_rl.maths.token_selection import (
    Reduce,
    clip_cov_mask,
    kl_cov_mask,
    one_process,
    token_covariance,
)
from lightning_rl.maths.trust_regions import KEY, Surrogate, SurrogateInputs, TrustRegion, clipped_surrogate

Tensor = torch.Tensor


def clip_cov_surrogate(
    log_ratio: Tensor, adv: Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
    clip_cov_ratio: float = 2e-4, clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0, *, logp: Tensor,
    mask: Tensor, selected: Tensor | None = None,
) -> Surrogate:
    """Clip-Cov (arXiv 2505.22617; verl ``clip_cov``, SkyRL ``CLIP_COV``): PPO clip, with the gradient of a
    few high-covariance tokens stopped (their loss set to 0).

    The tokens: ``max(1, int(clip_cov_ratio N))`` of the ``N`` valid tokens, drawn at random among those
    PPO's clip leaves unclipped with covariance ``(A - mean A)(logp - mean logp)`` in
    ``(clip_cov_lb, clip_cov_ub)`` (:func:`~lightning_rl.maths.token_selection.clip_cov_mask`). Training
    passes them as ``selected``, chosen over the whole minibatch before the micro-batches; ``None``: drawn
    here on this batch (keys from the global RNG, like verl's ``randperm``).

    Returns:
        The :class:`Surrogate`; the clip's stats and ``cov_frac``, the share of tokens selected.
    """
    _check_fraction("clip_cov_ratio", clip_cov_ratio)
    if not clip_cov_lb < clip_cov_ub:
        raise ValueError(f"`clip_cov_lb` must be < `clip_cov_ub`, got {clip_cov_lb} and {clip_cov_ub}")
    base = clipped_surrogate(log_ratio, adv, clip_low, clip_high)
    if selected is None:
        cov = token_covariance(logp, adv, mask)
        keys = torch.rand(logp.shape, device=logp.device)
        selected = clip_cov_mask(cov, base.stats["clip_frac"], mask, clip_cov_ratio, clip_cov_lb, clip_cov_ub,
                                 keys)
    selected = selected.bool()
    return Surrogate(torch.where(selected, 0.0, base.loss), base.ratio, {**base.stats, "cov_frac": selected})


def kl_cov_surrogate(
    log_ratio: Tensor, adv: Tensor, kl_cov_ratio: float = 2e-4, kl_cov_coef: float = 1.0, *, logp: Tensor,
    mask: Tensor, selected: Tensor | None = None,
) -> Surrogate:
    """KL-Cov (arXiv 2505.22617; verl ``kl_cov``, SkyRL ``KL_COV``): the unclipped surrogate ``-A r``, plus
    ``kl_cov_coef |log r|`` on the ``max(1, int(kl_cov_ratio N))`` valid tokens of largest covariance
    ``(A - mean A)(logp - mean logp)`` (:func:`~lightning_rl.maths.token_selection.kl_cov_mask`).

    Training passes those tokens as ``selected``, chosen over the whole minibatch before the micro-batches;
    ``None``: chosen here on this batch. The penalty reaches a token whatever its advantage.

    Returns:
        The :class:`Surrogate`; ``cov_frac``, the share of tokens penalised.
    """
    _check_fraction("kl_cov_ratio", kl_cov_ratio)
    if kl_cov_coef < 0:
        raise ValueError(f"`kl_cov_coef` must be >= 0, got {kl_cov_coef}")
    if selected is None:
        selected = kl_cov_mask(token_covariance(logp, adv, mask), mask, kl_cov_ratio)
    selected = selected.bool()
    ratio = torch.exp(log_ratio)
    loss = -adv * ratio + torch.where(selected, kl_cov_coef * log_ratio.abs(), 0.0)
    return Surrogate(loss, ratio, {"cov_frac": selected})


def _check_fraction(name: str, value: float) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"`{name}` must be in (0, 1], got {value}")





@dataclass(frozen=True)
class ClipCov(TrustRegion):
    """Clip-Cov (:func:`clip_cov_surrogate`): PPO clip on ``[1 - low, 1 + high]``, the gradient of a random
    ``ratio`` share of the tokens with covariance in ``(lb, ub)`` stopped.

    Args:
        low: in (0, 1). high: > 0. ratio: in (0, 1]. lb, ub: the covariance window, ``lb < ub``.
    """

    selects_tokens: ClassVar[bool] = True
    random_keys: ClassVar[bool] = True
    low: float = 0.2
    high: float = 0.2
    ratio: float = 2e-4
    lb: float = 1.0
    ub: float = 5.0

    def __post_init__(self) -> None:
        require(KEY, low=(0 < self.low < 1, self.low, "in (0, 1)"), high=(self.high > 0, self.high, "> 0"),
                ratio=(0 < self.ratio <= 1, self.ratio, "in (0, 1]"),
                ub=(self.ub > self.lb, self.ub, f"> lb ({self.lb})"))

    def surrogate(self, x: SurrogateInputs) -> Surrogate:
        return clip_cov_surrogate(x.log_ratio, x.adv, self.low, self.high, self.ratio, self.lb, self.ub,
                                  logp=x.logp, mask=x.mask, selected=x.selected)

    def select(self, logp: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, keys: Tensor | None, *,
               total: Reduce = one_process, gather: Reduce = one_process) -> Tensor:
        cov = token_covariance(logp, adv, mask, total=total)
        clipped = clipped_surrogate(log_ratio, adv, self.low, self.high).stats["clip_frac"]
        keys = torch.rand(logp.shape, device=logp.device) if keys is None else keys
        return clip_cov_mask(cov, clipped, mask, self.ratio, self.lb, self.ub, keys, total=total,
                             gather=gather)


@dataclass(frozen=True)
class KLCov(TrustRegion):
    """KL-Cov (:func:`kl_cov_surrogate`): the unclipped surrogate plus ``coef |log r|`` on the ``ratio``
    share of tokens of largest covariance.

    Args:
        ratio: in (0, 1]. coef: >= 0.
    """

    selects_tokens: ClassVar[bool] = True
    ratio: float = 2e-4
    coef: float = 1.0

    def __post_init__(self) -> None:
        require(KEY, ratio=(0 < self.ratio <= 1, self.ratio, "in (0, 1]"),
                coef=(self.coef >= 0, self.coef, ">= 0"))

    def surrogate(self, x: SurrogateInputs) -> Surrogate:
        return kl_cov_surrogate(x.log_ratio, x.adv, self.ratio, self.coef, logp=x.logp, mask=x.mask,
                                selected=x.selected)

    def select(self, logp: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, keys: Tensor | None, *,
               total: Reduce = one_process, gather: Reduce = one_process) -> Tensor:
        cov = token_covariance(logp, adv, mask, total=total)
        return kl_cov_mask(cov, mask, self.ratio, total=total, gather=gather)
