"""The updater: ``ppo_epochs`` passes over a rollout in ``num_minibatches`` optimiser steps each, every
minibatch accumulated over micro-batches, for a list of trained models (the policy; PPO adds its critic).

Each minibatch's losses are normalised by the counts of the whole minibatch over all ranks, and each
micro-batch's loss is multiplied by the world size (data-parallel strategies average gradients over
ranks), so the gradient does not depend on micro-batch size, accumulation or world size. Minibatches are
made of whole groups in a shuffled order, so a group's shared prompt is scored once. Under sharded
weights every rank runs as many micro-batches (empty ones join the gradient reduction with a zero loss).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_rl.maths.aggregation import normalizer_counts
from lightning_rl.maths.losses import value_loss
from lightning_rl.models.packing import packable
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.rollout import Rollout

MicroLoss = Callable[[Rollout, Tensor, Tensor], tuple[Tensor, dict[str, Tensor]]]


@dataclass
class TrainedModel:
    """One model the updater trains.

    Attributes:
        name: its metric namespace (``policy``, ``critic``): gradient norms are ``<name>/grad_norm``.
        module: the Policy / Critic (``.model`` is its FSDP2 root; it supplies empty-batch losses).
        optimizer: its (Lightning) optimiser; ``None``: the model joins the backward (its loss is a zero
            loss, so data-parallel wrappers see every parameter used) but is not stepped (PPO's policy
            while the critic warms up).
        loss: ``(micro, num_tokens, num_seqs) -> (loss, metrics)`` with the minibatch's global counts.
        summed: metric names that are micro-batch terms of a minibatch sum (reported per minibatch).
        counts_as_step: its step is the trainer's step (``global_step``); others step alongside.
        reaches: ``micro -> [N] bool``: the rows on which its loss can be non-zero (every other row adds
            exactly zero to the loss and its gradient); ``None``: every row.
        select: ``(minibatch, collectives, seed) -> minibatch``: a stage run on every rank before the
            micro-batches of each minibatch, that attaches the loss's whole-minibatch token selection
            (:func:`lightning_rl.step.selection.select_tokens`); ``None``: none.
        packed: its loss scores a micro-batch's rows packed into one sequence where they pack
            (``model.update.packing``: the policy's ``packing``); ``perf/pad_frac`` is 0 when every trained
            model does.
    """

    name: str
    module: Any
    optimizer: Any
    loss: MicroLoss
    summed: tuple[str, ...] = ()
    counts_as_step: bool = True
    reaches: Callable[[Rollout], Tensor] | None = None
    select: Callable[[Rollout, Collectives, int], Rollout] | None = None
    packed: bool = False



@dataclass
class UpdateHooks:
    """What the updater needs from Lightning, as plain callables (built by the module)."""

    backward: Callable[[Tensor], None]  # the strategy's backward (precision plugin, DeepSpeed engine)
    accumulating: Callable[[list[Any], bool], AbstractContextManager]  # (models, last) -> grad-sync context
    step: Callable[[TrainedModel], None]  # optimiser step (clipping in on_before_optimizer_step) + scheduler


class Updater:
    """Minibatches, micro-batches, global counts, empty-forward joins and stepping (see the module).

    Args:
        ppo_epochs: passes over each rollout.
        num_minibatches: optimiser steps per pass (each rank splits its rollout into this many).
        micro_batch_size: rows per forward / backward (``None``: a whole minibatch at once).
        max_grad_norm: gradient clipping by global norm (``None``: off).
        micro_batch_tokens: a token budget per forward / backward instead of a row count: rows sorted by
            length are packed while ``rows x (longest prompt + longest completion)`` fits (a longer row goes
            alone); ``micro_batch_size`` then caps the rows too. ``None``: rows by ``micro_batch_size``.
        skip_zero_rows: rows no trained model's loss reaches (``TrainedModel.reaches``: zero advantage on
            every token with no KL or entropy term, or no loss token) are neither forwarded nor
            backpropagated; the normalisers still count them, so the update is the one without skipping.
    """

    def __init__(self, ppo_epochs: int = 1, num_minibatches: int = 1, micro_batch_size: int | None = None,
                 max_grad_norm: float | None = 1.0, skip_zero_rows: bool = True,
                 micro_batch_tokens: int | None = None) -> None:
        for key, value in {"epochs": ppo_epochs, "num_minibatches": num_minibatches}.items():
            if not value > 0:
                raise ValueError(f"`model.update.{key}` must be > 0, got {value}")
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"`model.update.micro_batch_size` must be >= 1, got {micro_batch_size}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"`model.update.max_grad_norm` must be > 0 or null, got {max_grad_norm}")
        self.ppo_epochs, self.num_minibatches = ppo_epochs, num_minibatches
        self.micro_batch_size, self.max_grad_norm = micro_batch_size, max_grad_norm
        if micro_batch_tokens is not None and micro_batch_tokens < 1:
            raise ValueError(f"`model.update.micro_batch_tokens` must be >= 1 or null, "
                             f"got {micro_batch_tokens}")
        self.skip_zero_rows, self.micro_batch_tokens = skip_zero_rows, micro_batch_tokens

    @property
    def updates_per_rollout(self) -> int:
        return self.ppo_epochs * self.num_minibatches

    def split(self, rollout: Rollout, generator: torch.Generator) -> list[Rollout]:
        """``num_minibatches`` minibatches of equal row counts (some may be empty), from the rollout's
        groups in a shuffled order: a group's samples stay next to each other."""
        groups, inverse = torch.unique(rollout.group_ids.cpu(), return_inverse=True)
        place = torch.empty(len(groups), dtype=torch.long)
        place[torch.randperm(len(groups), generator=generator)] = torch.arange(len(groups))
        order = torch.argsort(place[inverse] * len(rollout) + torch.arange(len(rollout)))
        order = order.to(rollout.completion_ids.device)
        return [rollout.select(part) for part in torch.tensor_split(order, self.num_minibatches)]

    def run(self, rollout: Rollout, trained: list[TrainedModel], hooks: UpdateHooks,
            collectives: Collectives, generator: torch.Generator) -> Iterator[tuple[dict, float]]:
        """Every update of the step; yields each micro-batch's metrics and its share of the minibatch."""
        for _ in range(self.ppo_epochs):
            for minibatch in self.split(rollout, generator):
                yield from self.update(minibatch, trained, hooks, collectives, generator.initial_seed())

    def update(self, minibatch: Rollout, trained: list[TrainedModel], hooks: UpdateHooks,
               collectives: Collectives, seed: int = 0) -> Iterator[tuple[dict[str, Tensor], float]]:
        """One optimiser step of every trained model on ``minibatch``, accumulated over micro-batches; first
        each model's ``select`` stage (``seed``: the step's, for random selections)."""
        for t in trained:
            minibatch = t.select(minibatch, collectives, seed) if t.select is not None else minibatch
        counts = torch.stack(normalizer_counts(minibatch.loss_mask)).float()
        num_tokens, num_seqs = collectives.sum(counts).unbind()
        world = collectives.world_size
        kept = self.reached_rows(minibatch, trained)
        skipped = torch.tensor(1.0 - len(kept) / len(minibatch) if len(minibatch) else 0.0)
        micros = self.micro_batches(kept)
        roots = [t.module.model for t in trained]
        total = max(collectives.agreed_count(root, len(micros), backward=True) for root in roots)
        micros += [minibatch.empty()] * (total - len(micros))
        stepped = [t for t in trained if t.optimizer is not None]
        for t in stepped:
            t.optimizer.zero_grad()
        for i, micro in enumerate(micros):
            with hooks.accumulating(roots, i == len(micros) - 1):
                if len(micro) == 0:  # this rank has nothing, but must join the gradient reduction
                    hooks.backward(sum(collectives.empty_loss(t.module) for t in trained))
                    continue
                loss, metrics = 0.0, {}
                for t in trained:
                    part, part_metrics = t.loss(micro, num_tokens, num_seqs)
                    loss, metrics = loss + part, {**metrics, **part_metrics}
                hooks.backward(loss * world)  # the normalisers are already global
            share = len(micro) / len(kept)
            for name in (n for t in trained for n in t.summed if n in metrics):
                metrics[name] = metrics[name].detach() * world / share
            metrics["perf/pad_frac"] = pad_fraction(micro, trained)
            metrics["perf/skipped_rows_frac"] = skipped
            yield metrics, share
        if len(minibatch) and not len(kept):
            yield {"perf/skipped_rows_frac": skipped}, 1.0
        for t in stepped:
            hooks.step(t)

    def micro_batches(self, rows: Rollout) -> list[Rollout]:
        """``rows`` in micro-batches (by row count, or by token budget), each without shared padding."""
        if not len(rows):
            return [rows]
        device = rows.completion_ids.device
        return [rows.select(index.to(device)).trimmed() for index in self.micro_rows(rows)]

    def micro_rows(self, rows: Rollout) -> list[Tensor]:
        """The row indices of each micro-batch of ``rows`` (non-empty)."""
        if self.micro_batch_tokens is None:
            return list(torch.arange(len(rows)).split(self.micro_batch_size or len(rows)))
        return token_bins(rows.prompt_mask, rows.attention_mask, self.micro_batch_tokens,
                          self.micro_batch_size or len(rows))

    def reached_rows(self, minibatch: Rollout, trained: list[TrainedModel]) -> Rollout:
        """The rows of ``minibatch`` some trained model's loss reaches (all of them when not skipping)."""
        if not self.skip_zero_rows or not len(minibatch) or any(t.reaches is None for t in trained):
            return minibatch
        reached = torch.stack([t.reaches(minibatch) for t in trained]).any(0)
        return minibatch if bool(reached.all()) else minibatch.select(reached)


def token_bins(prompt_mask: Tensor, attention_mask: Tensor, budget: int, max_rows: int) -> list[Tensor]:
    """Row indices in bins whose padded size ``rows x (longest prompt + longest completion)`` stays within
    ``budget`` (a row alone may pass it) and whose rows number at most ``max_rows``: rows longest first,
    each bin filled in that order, so rows of like lengths share a bin."""
    prompt = prompt_mask.sum(1).cpu()
    used = attention_mask.bool().cpu()
    completion = torch.where(used.any(1), used.shape[1] - used.flip(1).int().argmax(1), 0)
    order = torch.argsort(prompt + completion, descending=True, stable=True)
    bins, current, top_p, top_c = [], [], 0, 0
    for row in order.tolist():
        p, c = max(top_p, int(prompt[row])), max(top_c, int(completion[row]))
        if current and ((len(current) + 1) * (p + c) > budget or len(current) == max_rows):
            bins.append(torch.tensor(current))
            current, p, c = [], int(prompt[row]), int(completion[row])
        current.append(row)
        top_p, top_c = p, c
    return bins + [torch.tensor(current)]


def pad_fraction(micro: Rollout, trained: list[TrainedModel]) -> Tensor:
    """The share of a training micro-batch's positions (prompt + completion) that are padding: none when
    every trained model scores it packed (``update.packing``)."""
    if all(t.packed for t in trained) and packable(micro.prompt_mask, micro.attention_mask):
        return torch.zeros(())
    total = micro.prompt_ids.numel() + micro.completion_ids.numel()
    real = micro.prompt_mask.sum() + micro.attention_mask.sum()
    return 1.0 - real.float() / max(total, 1)


def critic_loss(critic: Any, micro: Rollout, vf_coef: float, value_clip: float | None,
                num_tokens: Tensor) -> tuple[Tensor, dict[str, Any]]:
    """``vf_coef`` x the clipped value loss of a micro-batch (PPO's critic), normalised by the minibatch's
    global token count; ``value_clip`` ``None``: unclipped."""
    values = critic.values(micro.prompt_ids, micro.prompt_mask, micro.completion_ids, micro.attention_mask)
    clip = value_clip if value_clip is not None else math.inf
    vf_loss, value_metrics = value_loss(values, micro.values, micro.returns, micro.loss_mask, clip,
                                        num_tokens=num_tokens)
    metrics = {"critic/vf_loss": vf_loss, "critic/vf_clip_frac": value_metrics["value/clip_frac"],
               "critic/value_pred_mean": value_metrics["value/mean"]}
    return vf_coef * vf_loss, metrics
