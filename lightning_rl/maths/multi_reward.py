"""Several reward functions combined into one advantage (pure PyTorch): GDPO's decoupled normalisation
(Liu et al., 2026, "Group reward-Decoupled Normalization Policy Optimization"), where each function's scores
are normalised within the group before the weighted sum, so that reward combinations GRPO's sum-then-normalise
maps to one advantage stay apart.

The three sources agree on the group step (Bessel std per function and group, weighted sum) and on a batch
step after it; they differ in ``eps`` (TRL 1e-4, verl and NeMo-RL 1e-6, NeMo-RL dividing only where the std is
positive) and in the batch step (TRL, NeMo-RL: a z-score over the batch's sequences; verl: whitening over
tokens). Here: TRL's, with NeMo-RL's guard (a constant function adds 0 whatever ``eps``), over every rank's
sequences. Shapes: ``[N, K]`` scores of ``K`` functions, consecutive groups of ``group_size`` share a prompt.
"""

from __future__ import annotations

import torch

from lightning_rl.maths.advantages import masked_moments, moments_mean_var
from lightning_rl.maths.checks import check_shapes

Tensor = torch.Tensor


def gdpo_group_sum(scores: Tensor, group_size: int, weights: Tensor | None = None,
                   eps: float = 1e-4) -> Tensor:
    """GDPO's decoupled normalisation (Liu et al., 2026; TRL ``normalize_then_sum``, verl ``gdpo``, NeMo-RL
    ``GDPOAdvantageEstimator``): ``sum_k w_k (r_k - mean_g(r_k)) / (std_g(r_k) + eps)``, each reward
    function's scores z-scored within the group (Bessel std, as all three sources), then weighted and summed.
    A function that is constant in a group adds 0 there (also at ``eps`` 0), so distinct combinations stay
    distinct.

    Args:
        scores: ``[N, K]`` each of ``K`` reward functions' raw score, consecutive groups of ``group_size``.
        weights: ``[K]`` (``None``: 1 each). eps: TRL's 1e-4 (verl and NeMo-RL 1e-6).

    Returns:
        ``[N]`` float, before the batch normalisation of :func:`gdpo_advantages`.
    """
    check_shapes("scores", scores, ndim=2)
    if group_size < 2 or scores.shape[0] % group_size:
        raise ValueError(f"`group_size` must be >= 2 and divide the batch size {scores.shape[0]}, "
                         f"got {group_size}")
    grouped = scores.double().reshape(-1, group_size, scores.shape[1])
    std = grouped.std(1, keepdim=True)
    z = torch.where(std > 0, (grouped - grouped.mean(1, keepdim=True)) / (std + eps), 0.0)  # 0 / 0 -> 0
    w = torch.ones(scores.shape[1], dtype=torch.float64) if weights is None else torch.as_tensor(weights)
    return (z * w.to(z)).sum(-1).reshape(-1).float()


def gdpo_advantages(scores: Tensor, group_size: int, weights: Tensor | None = None, eps: float = 1e-4,
                    moments: Tensor | None = None) -> Tensor:
    """GDPO advantages: :func:`gdpo_group_sum`, then ``(x - mean) / (std + eps)`` over the batch's sequences
    (Bessel std; TRL's and NeMo-RL's batch step: one value per sequence, over every rank's rows; verl whitens
    over tokens instead, weighing long rows more).

    Args:
        moments: ``[sum, sum of squares, count]`` of the group sums over the global batch (summed over ranks);
            ``None``: this batch's own.

    Returns:
        ``[N]`` float advantages.
    """
    return batch_normalized(gdpo_group_sum(scores, group_size, weights, eps), eps, moments)


def batch_normalized(x: Tensor, eps: float = 1e-4, moments: Tensor | None = None) -> Tensor:
    """``[N]`` ``(x - mean) / (std + eps)``, Bessel std over the batch (``moments``: the global batch's)."""
    mean, var = moments_mean_var(sequence_moments(x) if moments is None else moments)
    return ((x.double() - mean) / (var.sqrt() + eps)).float()


def sequence_moments(x: Tensor) -> Tensor:
    """``[sum, sum of squares, count]`` of the ``[N]`` values ``x`` (float64, to be summed over ranks)."""
    return masked_moments(x[:, None], torch.ones_like(x[:, None], dtype=torch.bool))
