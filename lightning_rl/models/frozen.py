"""The frozen models a module scores with but never trains (the reference of a KL term, a distillation
teacher), held in :class:`FrozenModels`, a plain object outside the module tree: never in ``state_dict``,
checkpoints or optimisers, never sharded (their forwards are local; one that shares the trained weights, a
LoRA reference, joins the trained model's forward count instead). Each is declared by name with how to build
it and built on first use, so ``validate`` and ``predict`` hold no copy they do not score with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

REFERENCE = "reference"  # the KL term's: its log-probs are the rollout's `ref_logp`, the others' by name


class FrozenModels:
    """Frozen scorers by name (:data:`REFERENCE`, a preset's own such as distillation's ``teacher``): each a
    :class:`~lightning_rl.models.scoring.ReferencePolicy`, built by its ``build`` on first use."""

    def __init__(self, built: dict[str, Any] | None = None) -> None:
        """``built``: models already built, by name (a worker sampling ahead is handed them so)."""
        self._build: dict[str, Callable[[], Any]] = {}
        self._built: dict[str, Any] = {}
        for name, model in (built or {}).items():
            self.add(name, model)

    def declare(self, name: str, build: Callable[[], Any]) -> None:
        """``name`` is built by ``build()`` the first time it is asked for."""
        self._build[name] = build
        self._built.pop(name, None)

    def add(self, name: str, model: Any) -> None:
        """``name`` is ``model``, already built (a teacher loaded and checked with the module)."""
        self._build[name] = lambda: model
        self._built[name] = model

    def __contains__(self, name: str) -> bool:
        return name in self._build

    def is_built(self, name: str) -> bool:
        """Whether ``name`` has been built (validate and predict never build the reference)."""
        return name in self._built

    def get(self, name: str) -> Any:
        """The model declared as ``name``, built now if it was not yet; ``None`` when none is declared."""
        if name not in self._build:
            return None
        if name not in self._built:
            self._built[name] = self._build[name]()
        return self._built[name]

    def all(self) -> dict[str, Any]:
        """Every declared model, by name, built."""
        return {name: self.get(name) for name in self._build}

    def to(self, device: Any) -> None:
        """Move the models built so far to ``device``."""
        for model in self._built.values():
            model.to(device)

    def score_like(self, policy: Any, share_prompts: bool, device: Any) -> None:
        """Build every declared model and score with it as ``policy`` does (prompt sharing, log-prob chunk,
        packing), on ``device``."""
        for frozen in self.all().values():
            frozen.share_prompts, frozen.logprob_chunk = share_prompts, policy.logprob_chunk
            frozen.packing = policy.packing
            frozen.to(device)
