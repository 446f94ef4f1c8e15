"""A difficulty curriculum for the prompt stream: prompts are drawn by their recent pass rate, so the samples
go where they teach (prime-rl's difficulty pools, ``DifficultyPoolSampler``; written here from its
description, not copied).

**Pools.** A prompt's pass rate is the fraction of its G samples that were correct the last time it was
drawn (``momentum`` > 0 smooths over visits). A prompt is *easy* when that rate is >= ``easy_threshold``,
*hard* when it is <= ``hard_threshold``, *normal* in between, *unseen* before its first outcome. Each pool has
a relative weight (normal 1); the defaults (everything right / everything wrong, 0.2) down-weight the prompts
whose groups have zero advantage under GRPO. A weight of 0 skips the pool: its prompts are drawn only when
fewer drawable prompts than a batch remain.

**The draw.** Each rank draws its ``batch_size`` prompts of step ``t`` without replacement from its shard of
the rows (row ``i`` belongs to rank ``i % world_size``), with probabilities proportional to the weights
(Efraimidis-Spirakis keys ``log(u) / w``, largest first), ``u`` uniform from a generator seeded by
``(seed, rank, t)``: the random numbers are a pure function of the step, so no generator state needs saving.

**The feedback rule.** The draw of step ``t`` uses the outcomes of steps ``<= t - 2`` exactly, never more
and never fewer, whatever the machine's speed, in the synchronous step and under asynchronous sampling at
any ``max_staleness``. Why 2: Lightning's training loop fetches step ``t``'s batch before step ``t - 1`` runs
(it prefetches one batch), so when the learner draws step ``t`` only steps ``<= t - 2`` have finished; the
worker sampling ahead draws step ``s`` after it sampled step ``s - 1``, so it has them too. Every process
that reads the stream (the learner's loader, the worker) keeps its own copy of the pass rates and records the
outcomes of the steps it sees (``CurriculumDraws.record``), so each draws exactly the same prompts (the
learner checks the worker's prompts against its own batch every step). A draw whose outcomes are missing is
an error, never a silent guess. The outcome of a step is its first round's, before any filter (DAPO's dynamic
sampling drops exactly the all-right and all-wrong groups the pools need); refill batches come from the plain
seeded refill stream, and their outcomes are not recorded.

**Checkpoints.** The DataModule keeps the pass rates of the steps trained (``CurriculumTracker``): a
checkpoint taken before step ``n`` holds the rates after steps ``<= n - 2`` and the outcomes of step
``n - 1`` apart, which is exactly what the draws of ``n`` and ``n + 1`` need, so a resumed run draws what the
uninterrupted run would. A worker that resumes after the rollouts saved ahead draws their steps again and
records their outcomes from the checkpoint before it draws a new step.

**Ranks.** Each rank keeps the pass rates of its own shard (no collective: the asynchronous worker never
joins one, and each rank draws only from its shard anyway); a checkpoint gathers every rank's. Resumed on
another world size the shards change: the rates of every row are kept, the pending outcomes folded in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset

from lightning_rl.episodes.source import Batch, PromptBatches
from lightning_rl.maths.checks import require


@dataclass(frozen=True)
class Curriculum:
    """The options of the difficulty curriculum (``data.init_args.curriculum``).

    Args:
        easy_threshold: a prompt whose pass rate is >= this is easy (1.0: all its samples were right).
        hard_threshold: a prompt whose pass rate is <= this is hard (0.0: none was right).
        easy_weight: the easy prompts' sampling weight, relative to a normal prompt's 1 (0: skip them).
        hard_weight: the hard prompts' weight (0: skip them).
        unseen_weight: the weight of a prompt with no outcome yet.
        momentum: how much of a prompt's earlier estimate a new visit keeps: ``rate = momentum * rate +
            (1 - momentum) * group pass rate`` (0: the last visit's pass rate alone, as prime-rl's pools).
    """

    easy_threshold: float = 1.0
    hard_threshold: float = 0.0
    easy_weight: float = 0.2
    hard_weight: float = 0.2
    unseen_weight: float = 1.0
    momentum: float = 0.0

    def __post_init__(self) -> None:
        weights = {k: getattr(self, k) for k in ("easy_weight", "hard_weight", "unseen_weight")}
        require("data.curriculum",
                hard_threshold=(0.0 <= self.hard_threshold < 1.0, self.hard_threshold, "in [0, 1)"),
                easy_threshold=(self.hard_threshold < self.easy_threshold <= 1.0, self.easy_threshold,
                                f"in ({self.hard_threshold} (`hard_threshold`), 1]"),
                momentum=(0.0 <= self.momentum < 1.0, self.momentum, "in [0, 1)"),
                **{k: (math.isfinite(v) and v >= 0.0, v, "a finite number >= 0") for k, v in weights.items()})

    def pools(self, rates: torch.Tensor) -> dict[str, torch.Tensor]:
        """Boolean masks of ``rates`` (NaN: unseen) in each pool: easy, hard, normal, unseen."""
        unseen = rates.isnan()
        easy, hard = rates >= self.easy_threshold, rates <= self.hard_threshold  # NaN compares False
        return {"easy": easy, "hard": hard, "normal": ~(unseen | easy | hard), "unseen": unseen}

    def weights(self, rates: torch.Tensor) -> torch.Tensor:
        """The sampling weight of each prompt, given its pass rate (NaN: unseen)."""
        pools = self.pools(rates)
        w = torch.ones_like(rates, dtype=torch.float64)
        for name, weight in (("easy", self.easy_weight), ("hard", self.hard_weight),
                             ("unseen", self.unseen_weight)):
            w[pools[name]] = weight
        return w


def weighted_draw(weights: torch.Tensor, u: torch.Tensor, k: int) -> torch.Tensor:
    """``k`` distinct indices drawn with probabilities proportional to ``weights``, without replacement, from
    the uniforms ``u`` (Efraimidis-Spirakis: the ``k`` largest keys ``log(u_i) / w_i``). Indices of weight 0
    come only after every positive one, in the order of their ``u``. Returns them largest key first."""
    logu = u.to(torch.float64).log()
    keys = torch.where(weights > 0, logu / weights.clamp_min(1e-300), logu - 1e9)
    return torch.topk(keys, k).indices


def step_generator(seed: int, rank: int, step: int) -> torch.Generator:
    """The generator of one rank's draw of one step: a pure function of the three."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + rank) * 1_000_033 + step) % 2**63)


class MissingOutcome(RuntimeError):
    """A draw needs the outcome of a step that was never recorded."""


class PassRates:
    """Pass-rate estimates of every row (NaN: unseen) after the outcomes of the steps ``< applied``, and the
    outcomes recorded for later steps, which :meth:`fold` applies in step order.

    Args:
        size: rows in the dataset.
        momentum: see :class:`Curriculum`.
    """

    def __init__(self, size: int, momentum: float = 0.0) -> None:
        self.estimates = torch.full((size,), math.nan, dtype=torch.float64)
        self.momentum, self.applied = momentum, 0
        self.pending: dict[int, tuple[list[int], list[float]]] = {}

    def record(self, step: int, rows: Sequence[int], rates: Sequence[float]) -> None:
        """The outcome of ``step``: the pass rate of each of its ``rows`` (a step recorded again: ignored)."""
        if len(rows) != len(rates):
            raise ValueError(f"step {step}: {len(rows)} rows drawn but {len(rates)} pass rates reported")
        if step >= self.applied and step not in self.pending:
            self.pending[step] = ([int(r) for r in rows], [float(r) for r in rates])

    def fold(self, until: int) -> None:
        """Apply the outcomes of the steps ``applied .. until - 1``, in order (each must be recorded)."""
        for step in range(self.applied, until):
            if step not in self.pending:
                raise MissingOutcome(step)
            rows, rates = self.pending.pop(step)
            index, new = torch.tensor(rows, dtype=torch.long), torch.tensor(rates, dtype=torch.float64)
            old = self.estimates[index]
            mixed = self.momentum * old + (1 - self.momentum) * new
            self.estimates[index] = torch.where(old.isnan(), new, mixed)
            self.applied = step + 1

    def copy(self) -> PassRates:
        other = PassRates(len(self.estimates), self.momentum)
        other.load_state_dict(self.state_dict())
        return other

    def state_dict(self) -> dict[str, Any]:
        return {"estimates": self.estimates.clone(), "applied": self.applied,
                "pending": {s: (list(r), list(p)) for s, (r, p) in self.pending.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        estimates = torch.as_tensor(state["estimates"], dtype=torch.float64)
        if estimates.shape != self.estimates.shape:
            raise ValueError(f"`data.curriculum`: the checkpoint's pass rates are of {estimates.numel()} "
                             f"rows, the training data has {self.estimates.numel()}: resume on the same data")
        self.estimates, self.applied = estimates.clone(), int(state["applied"])
        self.pending = {int(s): (list(r), list(p)) for s, (r, p) in state["pending"].items()}


class CurriculumDraws(PromptBatches):
    """One reader's iterator over a :class:`CurriculumStream`: its own pass rates, the rows of the steps it
    drew and not yet heard of; :meth:`record` gives it a step's outcome, which its later draws depend on."""

    def __init__(self, stream: CurriculumStream, rates: PassRates) -> None:  # draws: no given batches
        self.stream, self.rates, self.step = stream, rates, stream.start
        self.drawn: dict[int, list[int]] = {}

    def __next__(self) -> Batch:
        s, step = self.stream, self.step
        try:
            self.rates.fold(step - 1)  # the feedback rule: the outcomes of steps <= step - 2
        except MissingOutcome as missing:
            raise RuntimeError(
                f"`data.curriculum`: the draw of step {step} needs the pass rates of step {missing}, which "
                "were never reported: the curriculum learns from the rollouts of an online RL module "
                "(OnlineRL and its presets); remove `data.init_args.curriculum` for other modules") from None
        gen = step_generator(s.seed, s.rank, step)
        u = torch.rand(len(s.shard), generator=gen, dtype=torch.float64)
        picked = weighted_draw(s.curriculum.weights(self.rates.estimates[s.shard]), u, s.batch_size)
        rows = s.shard[picked].tolist()
        self.drawn[step], self.step = rows, step + 1
        return s.collate([s.rows[i] for i in rows])

    def record(self, step: int, pass_rates: Sequence[float]) -> list[int]:
        """The outcome of ``step`` (drawn by this reader): each prompt's pass rate, in batch order. Returns
        the rows they belong to."""
        rows = self.drawn.pop(step, None)
        if rows is None:
            if step < self.rates.applied or step in self.rates.pending:
                return []  # heard already
            raise RuntimeError(f"`data.curriculum`: an outcome of step {step}, not drawn by this stream")
        for old in [d for d in self.drawn if d < step]:  # drawn, never trained (cannot happen in order)
            del self.drawn[old]
        self.rates.record(step, rows, pass_rates)
        return rows


class CurriculumStream(IterableDataset):
    """An endless stream of one rank's prompt batches drawn by the curriculum (see the module docstring),
    from batch index ``start`` on, with the pass rates ``rates`` known then (each iterator copies them).

    Args:
        rows: the training rows.
        batch_size: prompts per batch on this rank.
        seed: the seed of the draws.
        rank, world_size: this rank, the number of ranks (rank ``r``'s shard: rows ``r, r + world, ...``).
        start: the first batch index.
        curriculum: the options.
        rates: the pass rates the stream starts from (copied by each iterator).
        collate: rows -> a batch of columns.
    """

    def __init__(self, rows: Sequence[dict[str, Any]], batch_size: int, seed: int, rank: int, world_size: int,
                 start: int, curriculum: Curriculum, rates: PassRates,
                 collate: Callable[[list[dict[str, Any]]], Batch]) -> None:
        self.rows, self.batch_size, self.seed, self.rank, self.start = rows, batch_size, seed, rank, start
        self.curriculum, self.rates, self.collate = curriculum, rates, collate
        self.shard = torch.arange(rank, len(rows), world_size)
        if len(self.shard) < batch_size:
            raise ValueError(f"`data.curriculum`: rank {rank}'s shard has {len(self.shard)} rows (every "
                             f"{world_size}th of {len(rows)}), fewer than `batch_size`={batch_size}")
        self.active: CurriculumDraws | None = None

    def __iter__(self) -> CurriculumDraws:
        self.active = CurriculumDraws(self, self.rates.copy())
        return self.active


class CurriculumTracker:
    """The DataModule's side of the curriculum: the pass rates of the steps trained (what a checkpoint holds),
    the training loader's stream (which the learner's outcomes reach), the pool statistics.

    Args:
        curriculum: the options.
        size: rows in the training data.
        seed: the seed of the draws.
    """

    def __init__(self, curriculum: Curriculum, size: int, seed: int) -> None:
        self.curriculum, self.seed = curriculum, seed
        self.trained = PassRates(size, curriculum.momentum)
        self.loader: CurriculumStream | None = None  # the training loader's stream, in the learner

    def stream(self, rows: Sequence[dict[str, Any]], batch_size: int, rank: int, world_size: int, start: int,
               collate: Callable[[list[dict[str, Any]]], Batch]) -> CurriculumStream:
        """A stream from batch ``start`` (the next step to train) with the pass rates known then."""
        return CurriculumStream(rows, batch_size, self.seed, rank, world_size, start, self.curriculum,
                                self.trained.copy(), collate)

    def record(self, step: int, pass_rates: Sequence[float], rank: int, world_size: int) -> dict[str, float]:
        """The outcome of trained step ``step`` (its prompts' pass rates, in batch order), for the training
        loader's stream and the checkpointed rates. Returns the ``curriculum/*`` statistics: the pools the
        step's prompts were drawn from (as its draw saw them), and this rank's shard in each pool (fractions
        and counts) and its mean pass rate after the steps before ``step``."""
        draws = self.loader.active if self.loader is not None else None
        if draws is None:
            raise RuntimeError("`data.curriculum`: an outcome was reported before the training stream drew")
        rows = draws.record(step, pass_rates)
        if not rows:  # heard already: nothing new
            return {}
        self.trained.fold(step - 1)  # as the draw of `step` saw them
        drawn = self.curriculum.pools(self.trained.estimates[torch.tensor(rows, dtype=torch.long)])
        stats = {f"curriculum/batch_{name}_frac": float(drawn[name].double().mean())
                 for name in ("easy", "hard", "unseen")}
        self.trained.fold(step)  # the steps before this one: what a checkpoint after it holds folded
        shard = self.trained.estimates[rank::world_size]
        pools = self.curriculum.pools(shard)
        seen = ~pools["unseen"]
        stats.update({f"curriculum/{name}_frac": float(mask.double().mean()) for name, mask in pools.items()})
        stats.update({f"curriculum/{name}": float(pools[name].sum()) for name in ("easy", "hard")})
        stats["curriculum/seen"] = float(seen.sum())
        stats["curriculum/mean_pass_rate"] = float(shard[seen].mean()) if bool(seen.any()) else 0.0
        self.trained.record(step, rows, pass_rates)
        return stats

    def state_dict(self, next_step: int) -> dict[str, Any]:
        """The rates a checkpoint before step ``next_step`` holds: after steps ``<= next_step - 2``, and the
        outcome of ``next_step - 1`` apart."""
        self.trained.fold(next_step - 1)
        return self.trained.state_dict()

    def load_state_dict(self, by_rank: list[dict[str, Any]], rank: int, world_size: int,
                        next_step: int) -> None:
        """Each rank's rates from a checkpoint (``by_rank``, one state per rank of the saving run). On the
        same world size each rank takes its own; on another, every row's rate is taken from the rank whose
        shard held it, the pending outcomes folded in, and the draws continue from there."""
        if len(by_rank) == world_size:
            self.trained.load_state_dict(by_rank[rank])
            return
        merged = self.trained.estimates.clone()
        for old_rank, state in enumerate(by_rank):
            rates = PassRates(len(merged), self.curriculum.momentum)
            rates.load_state_dict(state)
            rates.fold(max(rates.pending, default=rates.applied - 1) + 1)
            merged[old_rank::len(by_rank)] = rates.estimates[old_rank::len(by_rank)]
        self.trained.load_state_dict({"estimates": merged, "applied": next_step, "pending": {}})
