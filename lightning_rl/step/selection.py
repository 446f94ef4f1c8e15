"""The token-selection stage of the updater: the objective's whole-minibatch selections (the 80/20 entropy
mask, Clip-Cov, KL-Cov), made once per minibatch on every rank before its micro-batches, and the minibatch
record that carries them (:class:`SelectedRows`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from lightning_rl.maths.token_selection import TokenSelection, token_keys
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.rollout import Rollout


@dataclass
class SelectedRows(Rollout):
    """A minibatch (and then its micro-batches) with the objective's token selection, ``[N, C]`` bool each
    (:class:`lightning_rl.maths.token_selection.TokenSelection`), cut with its rows and columns."""

    high_entropy: Tensor | None = None
    selected: Tensor | None = None

    @property
    def selection(self) -> TokenSelection:
        return TokenSelection(self.high_entropy, self.selected)


def select_tokens(policy: Any, minibatch: Rollout, objective: Any,
                  micro_rows: Callable[[Rollout], list[Tensor]], collectives: Collectives,
                  seed: int) -> Rollout:
    """The minibatch with ``objective``'s token selection (:class:`SelectedRows`), or as it is when the
    objective makes none (:attr:`~lightning_rl.maths.objective.Objective.selects_tokens`).

    The selections of the 80/20 entropy mask, Clip-Cov and KL-Cov are statistics of a batch (a quantile, a
    covariance, a top share) of the current policy's values. Made per micro-batch, as TRL and verl make them,
    they change with the micro-batch size and the world size; here they are made once per minibatch, over
    every rank (sums and a gather of each rank's top values, made by every rank whatever its rows), before its
    first micro-batch: from the trained policy's log-probs and entropies of the whole minibatch, scored in one
    forward without backward. The weights do not change until the minibatch's optimiser step, so these are
    the values each micro-batch's own forward computes again (up to rounding): the sources' definitions,
    applied to the whole minibatch. The extra forward is the price of exactness: the entropies are in no
    earlier record, and the first micro-batch's backward cannot wait for the later micro-batches' forwards
    without holding every activation at once. Clip-Cov's random draw uses keys fixed by each token's content
    and ``seed`` (:func:`~lightning_rl.maths.token_selection.token_keys`), so it too is the same whatever
    micro-batch or rank holds a token.
    """
    if not objective.selects_tokens:
        return minibatch
    logp, entropy = score_with_entropy(policy, minibatch, micro_rows, collectives)
    keys = None
    if objective.trust_region.random_keys:
        keys = token_keys(minibatch.prompt_ids, minibatch.prompt_mask, minibatch.completion_ids,
                          minibatch.attention_mask, seed)
    selection = objective.select(logp, minibatch.old_logp, minibatch.advantages, minibatch.loss_mask, entropy,
                                 keys=keys, total=collectives.sum,
                                 gather=lambda values: gather_over_ranks(collectives, values))
    rows = {f.name: getattr(minibatch, f.name) for f in fields(Rollout)}
    return SelectedRows(**rows, high_entropy=selection.high_entropy, selected=selection.selected)


@torch.no_grad()
def score_with_entropy(policy: Any, rows: Rollout, micro_rows: Callable[[Rollout], list[Tensor]],
                       collectives: Collectives) -> tuple[Tensor, Tensor]:
    """``[N, C]`` float32 log-probs and entropies of ``rows``' completion tokens under ``policy``, at the
    temperature they were sampled at (``rows.temperature``), in the micro-batches ``micro_rows`` gives (the
    updater's); as many forwards on every rank when they are collectives (sharded weights)."""
    logp = torch.zeros(rows.attention_mask.shape, device=rows.attention_mask.device)
    entropy = torch.zeros_like(logp)
    parts = micro_rows(rows) if len(rows) else []
    total = collectives.agreed_count(policy.model, len(parts))  # before any forward: a collective too
    for index in parts:
        index = index.to(logp.device)
        micro = rows.select(index).trimmed()
        part, part_entropy = policy.token_logprobs(micro.prompt_ids, micro.prompt_mask, micro.completion_ids,
                                                   micro.attention_mask, with_entropy=True,
                                                   temperature=micro.temperature)
        logp[index, :part.shape[1]], entropy[index, :part.shape[1]] = part.float(), part_entropy.float()
    for _ in range(total - len(parts)):
        collectives.empty_loss(policy)
    return logp, entropy


def gather_over_ranks(collectives: Collectives, values: Tensor) -> Tensor:
    """The concatenation over ranks of a 1-D tensor of the same length on every rank (an all-reduce of a
    ``[world, L]`` tensor holding each rank's values in its own row)."""
    if collectives.world_size == 1:
        return values
    slots = values.new_zeros(collectives.world_size, values.numel())
    slots[collectives.rank] = values
    return collectives.sum(slots).reshape(-1)
