"""The sampler's half of the online step: :class:`RolloutSource` turns one prompt batch into the scored,
filtered rollout the learner trains on (the sampler's rounds, then the filters with their refills).

Each round is seeded by ``(seed, step, round, rank)``, so a resumed run samples exactly what the
uninterrupted one did. It reaches the policy only through :class:`~lightning_rl.episodes.sampler.PolicyIO`
and the prompt stream only through a ``refill`` callable, so it never holds the LightningModule or the
DataModule.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from lightning_rl.episodes.sampler import PolicyIO, Sampler
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.filters import RolloutFilter
from lightning_rl.step.rollout import Rollout, merge_stats

Batch = dict[str, list]


class PromptBatches(Iterator[Batch]):
    """One rank's training prompt batches, in step order, as a sampler running ahead reads them (a
    DataModule's ``train_batches(start)``), with :meth:`record`, which hears the outcome of each step drawn.

    This one yields the batches of ``batches`` and ignores the outcomes (its draws depend on none); a stream
    whose draws do (a curriculum's, ``lightning_rl.data.curriculum.CurriculumDraws``) overrides both.
    """

    def __init__(self, batches: Iterable[Batch]) -> None:
        self.batches = iter(batches)

    @classmethod
    def of(cls, batches: Iterable[Batch]) -> PromptBatches:
        """``batches`` as a stream with :meth:`record`: itself when it is one, else wrapped (a user
        DataModule's ``train_batches`` may return any iterable of batches)."""
        return batches if isinstance(batches, PromptBatches) else cls(batches)

    def __next__(self) -> Batch:
        return next(self.batches)

    def record(self, step: int, pass_rates: Sequence[float]) -> list[int]:
        """The pass rate of each prompt of drawn step ``step`` (batch order). Returns the training rows they
        were recorded for: none here."""
        return []


class RefillStream:
    """The refill batches (dynamic sampling) a sampler running ahead draws: ``refills(position)``'s, opened
    on the first draw; ``position`` counts the draws (what a checkpoint records after each rollout)."""

    def __init__(self, refills: Callable[[int], Iterator[Batch]] | None, position: int) -> None:
        self.refills, self.position = refills, position
        self.batches: Iterator[Batch] | None = None

    def __call__(self) -> Batch:
        if self.batches is None:
            assert self.refills is not None, "no refill stream to draw from"
            self.batches = self.refills(self.position)
        self.position += 1
        return next(self.batches)


def pass_rates(rollout: Rollout) -> list[float]:
    """The fraction of correct samples of each prompt of ``rollout`` (its groups, in order)."""
    _, group, counts = torch.unique_consecutive(rollout.group_ids.cpu(), return_inverse=True,
                                                return_counts=True)
    correct = torch.zeros(len(counts), dtype=torch.float64)
    return (correct.index_add_(0, group, rollout.correct.double().cpu()) / counts).tolist()


def round_seed(seed: int, step: int, round_index: int, rank: int) -> int:
    """The sampling seed of one generation round of one step on one rank."""
    return hash((seed, step, round_index, rank)) % 2**31


class RolloutSource:
    """Samples, scores and filters one prompt batch (see the module docstring).

    Args:
        sampler: the sampler (engine or episodes, then the rewards pipeline).
        filters: the rollout filters, in order (dynamic sampling refills through ``refill``).
        seed: the run's sampling seed (``model.sampling.seed``).
    """

    max_staleness = 0  # sampled by the weights of the step that trains on it

    def __init__(self, sampler: Sampler, filters: Sequence[RolloutFilter], seed: int) -> None:
        self.sampler, self.filters, self.seed = sampler, list(filters), seed

    # the interface it shares with `async_source.AsyncRollouts`, which runs it ahead in a worker
    def start(self, **_: Any) -> None:
        """Nothing to start: the step samples in this process."""

    def publish(self, step: int, model: torch.nn.Module) -> None:
        """Nothing to publish: the step samples with the trained weights."""

    def state_dict(self, next_step: int) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass

    def __call__(self, batch: Batch, io: PolicyIO, *, step: int, rank: int, collectives: Collectives,
                 refill: Callable[[], Batch] | None, device: torch.device,
                 report: Callable[[list[float]], None] | None = None) -> tuple[Rollout, dict[str, float]]:
        """The rollout of ``batch`` at trainer step ``step`` and its statistics; ``refill()`` draws a fresh
        prompt batch for the filters (``None``: the DataModule has no refill stream); ``report`` receives the
        pass rate of each prompt of ``batch`` before any filter (a curriculum's feedback)."""
        rounds = itertools.count()

        def sample(prompts: Batch, decide: bool) -> tuple[Rollout, dict[str, float]]:
            seed = round_seed(self.seed, step, next(rounds), rank)
            return self.sampler(prompts, io, seed=seed, collectives=collectives, decide=decide, device=device)

        def refill_round() -> tuple[Rollout, dict[str, float]]:
            if refill is None:
                raise RuntimeError("dynamic sampling needs a DataModule with `refill_batch()` "
                                   "(PromptDataModule)")
            rollout, stats = sample(refill(), decide=False)  # the reward-failure limit: first round only
            return rollout, {k: v for k, v in stats.items()  # means: the first round's stand for the step
                             if not (k.endswith("_mean") or k == "rollout/env_time")}

        rollout, stats = sample(batch, decide=True)
        if report is not None:
            report(pass_rates(rollout))
        for rollout_filter in self.filters:
            rollout, extra = rollout_filter(rollout, refill_round, collectives)
            stats = merge_stats(stats, extra)
        return rollout, stats
