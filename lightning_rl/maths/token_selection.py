"""Which tokens carry the policy gradient: batch-statistic selections and the off-policy sequence mask
(pure PyTorch).

* High-entropy tokens ("Beyond the 80/20 rule", arXiv 2506.01939; TRL ``top_entropy_quantile``): only the
  tokens whose entropy is at least the batch's ``1 - rho`` quantile keep their surrogate.
* Covariance selections (arXiv 2505.22617; verl ``clip_cov`` / ``kl_cov``, SkyRL ``CLIP_COV`` / ``KL_COV``):
  the per-token covariance ``(A - mean A)(logp - mean logp)`` over the batch picks the tokens whose
  gradient is stopped (Clip-Cov) or KL-penalised (KL-Cov).
* OPSM (DeepSeek-V3.2 eq. 9; TRL ``off_policy_mask_threshold``, slime ``--use-opsm``): a per-row mask, no
  batch statistic.

A batch statistic must be the whole minibatch's over every rank, or the update changes with the micro-batch
size and the world size. So each selection takes ``total`` (a sum over ranks) and ``gather`` (the
concatenation over ranks of a fixed-length 1-D tensor); both default to one process, where the batch given is
the whole batch. Every rank must make the same calls whatever its data: the lengths passed to ``gather`` are
global counts, so they agree. Shapes: ``[B, T]`` per-token values, ``mask`` bool or 0/1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

Tensor = torch.Tensor
Reduce = Callable[[Tensor], Tensor]
_HASH_MASK = 0x7FFFFFFF  # 31-bit integer hashing: every product stays below 2**62 in int64


def one_process(value: Tensor) -> Tensor:
    """``total`` and ``gather`` on one process: the value itself."""
    return value


def _values(x: Tensor) -> Tensor:
    """Detached, in float32 at least (bf16 values would tie where float32 ones differ)."""
    return x.detach().to(torch.promote_types(x.dtype, torch.float32))


class TokenSelection(NamedTuple):
    """A minibatch's selections, ``[B, T]`` bool each or ``None`` when off.

    Attributes:
        high_entropy: the tokens whose surrogate counts (``top_entropy_quantile``).
        selected: the trust region's covariance selection (``ClipCov``: gradient stopped; ``KLCov``:
            KL-penalised).
    """

    high_entropy: Tensor | None = None
    selected: Tensor | None = None


# ------------------------------------------------------------------------------------------ order statistics
def kth_largest(values: Tensor, k: int, gather: Reduce = one_process) -> Tensor:
    """The ``k``-th largest of ``values`` (1-D, this rank's) over all ranks, ``k >= 1`` and at most their
    number: each rank's ``k`` largest (padded with ``-inf``) are gathered, so ``gather`` sees ``k`` values
    from every rank whatever its count."""
    top = torch.topk(values, min(k, values.numel())).values if values.numel() else values
    padded = torch.cat([top, top.new_full((k - top.numel(),), -math.inf)])
    return torch.topk(gather(padded), k).values[-1]


def quantile_count(n: int, quantile: float) -> int:
    """How many of ``n`` distinct values reach TRL's threshold ``torch.quantile(values, 1 - quantile)``.

    With linear interpolation the threshold lies in ``(v_j, v_(j+1)]`` for ``j = floor((n - 1) p)``,
    ``p = 1 - quantile`` (or equals ``v_j`` when the position is whole), so the values at or above it are
    those from rank ``ceil((n - 1) p)`` up: ``n - ceil((n - 1) p)``; 1 at ``quantile`` 0, ``n`` at 1.
    """
    if n <= 0:
        return 0
    position = (n - 1) * (1.0 - quantile)
    return n - math.ceil(position - 1e-9 * max(position, 1.0))  # a whole position is not rounded up


def high_entropy_mask(entropy: Tensor, mask: Tensor, quantile: float, *, total: Reduce = one_process,
                      gather: Reduce = one_process) -> Tensor:
    """``[B, T]`` bool: the valid tokens whose entropy is at least the ``1 - quantile`` quantile of all valid
    tokens' entropies (over ranks); ties at the threshold are all kept, as TRL's ``>=``.

    Args:
        entropy, mask: ``[B, T]``. quantile: ``rho`` in [0, 1]: the top share kept (1: every token; 0: the
            highest one).
    """
    mask = mask.bool()
    n = int(total(mask.sum().reshape(1).double()).item())
    k = quantile_count(n, quantile)
    if k == 0:
        return torch.zeros_like(mask)
    threshold = kth_largest(_values(entropy)[mask], k, gather)
    return mask & (_values(entropy) >= threshold)


# ------------------------------------------------------------------------------------------------ covariance
def token_covariance(logp: Tensor, adv: Tensor, mask: Tensor, *, total: Reduce = one_process) -> Tensor:
    """``[B, T]``: ``(A_t - mean A)(logp_t - mean logp)``, both means over every valid token of the batch (all
    ranks), 0 on invalid tokens; detached (it only selects)."""
    mask = mask.bool()
    logp, adv = _values(logp), _values(adv)
    sums = torch.stack([torch.where(mask, adv, 0.0).sum(), torch.where(mask, logp, 0.0).sum(),
                        mask.sum().float()])
    adv_sum, logp_sum, n = total(sums).unbind()
    n = n.clamp_min(1.0)
    return torch.where(mask, (adv - adv_sum / n) * (logp - logp_sum / n), 0.0)


def kl_cov_mask(cov: Tensor, mask: Tensor, ratio: float, *, total: Reduce = one_process,
                gather: Reduce = one_process) -> Tensor:
    """KL-Cov's tokens: the ``max(1, int(ratio N))`` valid tokens of largest covariance among all ``N``
    valid tokens (over ranks), as verl's ``topk``; ties at the threshold are all taken."""
    mask = mask.bool()
    n = int(total(mask.sum().reshape(1).double()).item())
    if n == 0:
        return torch.zeros_like(mask)
    threshold = kth_largest(_values(cov)[mask], max(1, int(ratio * n)), gather)
    return mask & (_values(cov) >= threshold)


def clip_cov_mask(cov: Tensor, clipped: Tensor, mask: Tensor, ratio: float, low: float, high: float,
                  keys: Tensor, *, total: Reduce = one_process, gather: Reduce = one_process) -> Tensor:
    """Clip-Cov's tokens: among the valid tokens that PPO's clip leaves unclipped and whose covariance is in
    ``(low, high)``, ``max(1, int(ratio N))`` chosen at random (``N`` the valid tokens over ranks): those of
    smallest ``keys`` (``[B, T]`` in [0, 1), e.g. :func:`token_keys`). verl draws a ``randperm`` of the
    candidates per micro-batch; keys fixed per token make the choice the same whatever micro-batch or rank
    holds the token."""
    mask = mask.bool()
    candidates = mask & ~clipped.bool() & (cov > low) & (cov < high)
    n = int(total(mask.sum().reshape(1).double()).item())
    found = int(total(candidates.sum().reshape(1).double()).item())
    k = min(max(1, int(ratio * n)), found)
    if k == 0:
        return torch.zeros_like(mask)
    threshold = kth_largest(-_values(keys)[candidates], k, gather)
    return candidates & (-_values(keys) >= threshold)


def token_keys(prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor,
               seed: int = 0) -> Tensor:
    """``[B, C]`` pseudo-random keys in [0, 1) fixed by each token's row content (prompt and completion ids,
    whatever the padding), its position and ``seed``: the same token draws the same key in any batch.
    Identical rows share their keys."""
    # ids + 1 on real tokens, 0 on padding; columns weighted by position: prompts counted from their right
    # end (left padding), completions from the left; every product below 2**51, every sum below 2**45
    prompt = (prompt_ids.long() % 1_000_003 + 1) * prompt_mask.bool()
    completion = (completion_ids.long() % 1_000_003 + 1) * completion_mask.bool()
    p_pos = torch.arange(prompt.shape[1] - 1, -1, -1, device=prompt.device)
    c_pos = torch.arange(completion.shape[1], device=prompt.device)
    row = ((prompt * _mix(p_pos + 7_919)) & _HASH_MASK).sum(1) \
        + ((completion * _mix(c_pos + 104_729)) & _HASH_MASK).sum(1)
    tokens = _mix(_mix(row[:, None]) ^ _mix(c_pos[None, :] + (seed & 0xFFFF) * 65_536))
    return tokens.double() / float(_HASH_MASK + 1)


def _mix(x: Tensor) -> Tensor:
    """A 31-bit integer hash (xorshift-multiply rounds), elementwise on int64 in [0, 2**31)."""
    x = x & _HASH_MASK
    for mult in (0x2C1B3C6D, 0x297A2D39):
        x = x ^ (x >> 15)
        x = (x * mult) & _HASH_MASK
    return x ^ (x >> 15)


# ------------------------------------------------------------------------------------------------------ OPSM
def off_policy_sequence_mask(logp: Tensor, sampler_logp: Tensor, adv: Tensor, mask: Tensor,
                             threshold: float) -> Tensor:
    """OPSM: ``[B, T]`` bool, False where a token's advantage is negative and its row's mean divergence from
    the sampling policy, ``mean_t (log mu_t - log pi_t)`` over the row's valid tokens (the k1 estimate of
    ``KL(mu || pi)``, current log-probs detached), exceeds ``threshold``; True elsewhere (TRL keeps
    ``A >= 0`` or ``KL <= delta``; slime masks ``A < 0`` and ``KL > delta``: the same set).

    Args:
        logp: current log-probs. sampler_logp: the log-probs of the policy that sampled the tokens.
        adv: ``[B, T]`` advantages. mask: ``[B, T]``. threshold: ``delta`` >= 0.
    """
    mask = mask.bool()
    diff = torch.where(mask, sampler_logp.detach() - logp.detach(), 0.0)
    seq_kl = diff.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1)
    return ~((adv < 0) & (seq_kl > threshold))
