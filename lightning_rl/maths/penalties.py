"""KL estimators, the adaptive KL controller and reward shaping penalties (pure PyTorch).

The per-token KL to a reference policy (:func:`kl_penalty`: Schulman's k1/k2/k3), which the policy losses of
:mod:`lightning_rl.maths.losses` add to the loss and :func:`~lightning_rl.maths.advantages.token_rewards`
puts into the reward; the coefficient's controllers when it is in the reward (:class:`FixedKL`,
:class:`AdaptiveKL`: Ziegler et al.'s :func:`adaptive_kl_coef`); and DAPO's
overlong punishment of a response length (:func:`overlong_penalty`). Part of the contract
:mod:`lightning_rl.losses`.

Shapes: ``[N]`` per sample, ``[B, T]`` per token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from lightning_rl.maths.checks import check_choice, check_shapes, require

Tensor = torch.Tensor
KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)

# delta = ref_logp - logp, on tokens sampled from the policy whose log-prob is `logp`
_KL_FROM_DELTA: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": lambda delta: -delta,
    "k2": lambda delta: 0.5 * delta**2,
    "k3": lambda delta: torch.exp(delta) - delta - 1.0,
}


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman's k1/k2/k3).

    With ``d = ref_logp - logp``: ``k1 = -d``, ``k2 = d^2 / 2``, ``k3 = exp(d) - d - 1`` (unbiased, >= 0).
    The same k3 with ``d = -log r`` is the ``approx_kl`` of an importance ratio ``r``.

    Args:
        logp, ref_logp: ``[B, T]`` log-probs under pi / pi_ref. estimator: one of :data:`KL_ESTIMATORS`.

    Returns:
        ``[B, T]`` per-token estimates.
    """
    check_shapes("logp", logp, ref_logp=ref_logp)
    check_choice("estimator", estimator, KL_ESTIMATORS)
    return _KL_FROM_DELTA[estimator](ref_logp - logp)


def adaptive_kl_coef(coef: float, kl: float, target: float, n_steps: int, horizon: int) -> float:
    """Ziegler et al. (2019)'s proportional controller, as in TRL / verl: the KL coefficient after a batch
    of ``n_steps`` samples whose mean KL (summed over tokens) was ``kl``.

    ``coef * (1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon)``.
    """
    if not target > 0 or not horizon > 0:
        raise ValueError(f"`kl_target` and `kl_horizon` must be > 0, got {target} and {horizon}")
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * n_steps / horizon)


class KLController:
    """How the coefficient of the KL in the reward moves after each rollout
    (``model.init_args.objective.kl_in_reward``: a ``class_path``, the class name is enough, and its
    ``init_args``; ``null``: the KL is a loss term instead)."""

    def next_value(self, coef: float, kl: float, n_steps: int) -> float:
        """The coefficient after a rollout of ``n_steps`` samples whose mean per-sample KL was ``kl``."""
        raise NotImplementedError


@dataclass(frozen=True)
class FixedKL(KLController):
    """The KL in the reward at the fixed ``objective.kl_coef`` (InstructGPT's, verl's ``kl_ctrl.type:
    fixed``)."""

    def next_value(self, coef: float, kl: float, n_steps: int) -> float:
        return coef


@dataclass(frozen=True)
class AdaptiveKL(KLController):
    """The KL in the reward with Ziegler et al.'s proportional controller (:func:`adaptive_kl_coef`; verl's
    ``kl_ctrl.type: adaptive``, TRL's): ``objective.kl_coef`` is its starting value.

    Args:
        target: the mean per-sequence KL aimed at, > 0. horizon: the controller's horizon in samples, >= 1.
    """

    target: float
    horizon: int = 10000

    def __post_init__(self) -> None:
        require("model.objective.kl_in_reward", target=(self.target > 0, self.target, "> 0"),
                horizon=(self.horizon >= 1, self.horizon, ">= 1"))

    def next_value(self, coef: float, kl: float, n_steps: int) -> float:
        return adaptive_kl_coef(coef, kl, self.target, n_steps, self.horizon)


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
