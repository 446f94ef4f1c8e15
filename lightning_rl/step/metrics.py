"""The RL step's metrics: weighted means (maxima for ``*_max``) over the step and ranks, logged once per step.

Stages return their numbers; the module feeds them here with a weight (samples for rollout statistics,
the micro-batch's share for loss terms) and logs everything at the end of the step. Collectives are
symmetric by construction: a rank whose rollout is empty updates no ``rollout/*`` or ``policy/*`` metric,
yet must join every all-reduce the other ranks make, so the key set is every name *any* rank has updated
so far in the run (exchanged once per step and kept in a registry that only grows). Every rank computes
every registered metric in sorted order; a rank without data contributes weight 0. When no rank had data
(NaN after the reduction) the name is not logged that step: the decision follows the reduced value, so
every rank makes it alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torchmetrics import MaxMetric, MeanMetric

# the step's statistics that are counts for its own sums, not metrics: never logged
NOT_LOGGED = ("perf/generated_tokens",)


def is_step_metric(name: str) -> bool:
    """Whether the step statistic ``name`` is logged: a ``group/name`` metric (the step's ``perf/``,
    ``rollout/``, ``policy/``, ``critic/``, a preset stage's own group, a DataModule's ``curriculum/``), not
    one of the counts the step keeps for its own sums (:data:`NOT_LOGGED`) or a name without a group."""
    group, _, metric = name.partition("/")
    return bool(group) and bool(metric) and name not in NOT_LOGGED


class StepMetrics:
    """Weighted means of the step's metrics (``torchmetrics.MeanMetric``, synced over ranks)."""

    def __init__(self) -> None:
        self.metrics: dict[str, MeanMetric] = {}
        self.updated: set[str] = set()  # names this rank updated during the current step

    def _metric(self, device: torch.device, name: str) -> MeanMetric | MaxMetric:
        """The metric of ``name``: a maximum for names ending in ``_max``, else a weighted mean."""
        if name not in self.metrics:
            kind = MaxMetric() if name.endswith("_max") else MeanMetric(nan_strategy="ignore")
            self.metrics[name] = kind.to(device)
        return self.metrics[name]

    def add(self, device: torch.device, values: Mapping[str, Any], weight: float = 1.0) -> None:
        """Add each value with ``weight``."""
        for name, value in values.items():
            value = torch.as_tensor(value, dtype=torch.float32, device=device)
            metric = self._metric(device, name)
            if isinstance(metric, MaxMetric):
                if weight > 0:
                    metric.update(value)
            else:
                metric.update(value, torch.as_tensor(weight, dtype=torch.float32, device=device))
            self.updated.add(name)

    def add_stats(self, device: torch.device, stats: Mapping[str, float]) -> None:
        """The step's statistics (one value each) whose names are logged."""
        self.add(device, {k: v for k, v in stats.items() if is_step_metric(k)})

    def log(self, device: torch.device, log: Callable[[str, torch.Tensor], None]) -> dict[str, float]:
        """Reduce every known metric over ranks, ``log`` each, reset; returns what was logged."""
        for name in agreed_names(self.updated):
            self._metric(device, name)
        self.updated = set()
        out = {}
        for name in sorted(self.metrics):  # every rank: the same names, in the same order
            metric = self.metrics[name]
            is_max = isinstance(metric, MaxMetric)
            if not metric.update_called:  # joins the all-reduce without changing the mean or the maximum
                zero = torch.zeros((), dtype=torch.float32, device=device)
                if is_max:
                    metric.update(zero - torch.inf)
                else:
                    metric.update(zero, zero)
            value = metric.compute()
            metric.reset()
            if torch.isnan(value) or (is_max and value == -torch.inf):  # no rank had data
                continue
            log(name, value)
            out[name] = float(value)
        return out


class StepClock:
    """One step's wall-clock times, from its start: the weight sync's, the update's and the whole step's, and
    the generated tokens per second over the step, as the step's ``perf/`` statistics."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.sync_time = self.update_start = 0.0

    def synced(self) -> None:
        """The weights reached the engine (or the worker sampling ahead): the sync's time is taken."""
        self.sync_time = time.perf_counter() - self.start

    def updating(self) -> None:
        """The update starts now."""
        self.update_start = time.perf_counter()

    def stats(self, generated_tokens: float) -> dict[str, float]:
        """The ``perf/`` times at the step's end, and ``generated_tokens`` per second of the step."""
        step_time = time.perf_counter() - self.start
        return {"perf/step_time": step_time, "perf/weight_sync_time": self.sync_time,
                "perf/update_time": time.perf_counter() - self.update_start,
                "perf/tokens_per_sec": generated_tokens / step_time}


def agreed_names(names: set[str]) -> set[str]:
    """The union of ``names`` over all ranks (one ``all_gather_object``; ``names`` alone on one process)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return set(names)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(names))
    return set().union(*gathered)
