"""Argument checks shared by the pure maths modules: each raises a ``ValueError`` naming the argument."""

from __future__ import annotations

from typing import Any

import torch


def check_shapes(
    ref_name: str, ref: torch.Tensor, ndim: int | None = None, **others: torch.Tensor | None
) -> None:
    """Require ``ref`` to be ``ndim``-D (when given) and every tensor of ``others`` to have its shape."""
    if ndim is not None and ref.dim() != ndim:
        raise ValueError(f"`{ref_name}` must be {ndim}-D, got shape {tuple(ref.shape)}")
    for name, t in others.items():
        if t is not None and t.shape != ref.shape:
            raise ValueError(f"`{name}` has shape {tuple(t.shape)} but `{ref_name}` has {tuple(ref.shape)}")


def check_range(name: str, value: float, low: float = 0.0, high: float | None = None) -> None:
    """Require ``low < value`` (and ``value < high`` when given)."""
    if not value > low or (high is not None and not value < high):
        bound = f"in ({low}, {high})" if high is not None else f"> {low}"
        raise ValueError(f"`{name}` must be {bound}, got {value}")


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """Require ``value`` to be one of ``choices``."""
    if value not in choices:
        raise ValueError(f"unknown `{name}` {value!r}; expected one of {choices}")


def require(prefix: str, **checks: tuple[bool, Any, str]) -> None:
    """Raise ``ValueError`` for the first failing check ``key=(ok, value, expected)``, naming the key as
    ``<prefix>.<key>`` (a YAML path such as ``model.sampling``), the valid range and the value:
    ```model.sampling.temperature` must be > 0, got 0.0``."""
    for key, (ok, value, expected) in checks.items():
        if not ok:
            raise ValueError(f"`{prefix}.{key}` must be {expected}, got {value!r}")
