"""The output layer on chosen positions: log-probs of the sampled tokens (and the entropy) from hidden states,
optionally over chunks of positions so that the fp32 ``[tokens, vocabulary]`` logits are never all held.

Used by the scoring forms that run the decoder and the head apart (:mod:`lightning_rl.models.scoring`'s
prompt-sharing form, :mod:`lightning_rl.models.packing`).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_rl.models.model_utils import filter_logits


def head_logprobs(head: nn.Module, states: Tensor, targets: Tensor, *, temperature: float, top_k: int = 0,
                  top_p: float = 1.0, with_entropy: bool = False,
                  chunk: int | None = None) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``targets`` ``[M]`` from hidden ``states`` ``[M, H]`` through ``head`` (the output layer,
    or ``nn.Identity`` when the states are already logits), tempered and
    filtered as sampled, and the entropy (``None`` unless ``with_entropy``). With ``chunk``: that many
    positions at a time, each chunk's logits recomputed in the backward instead of kept for it; the same
    values and gradients."""
    scored = partial(_chunk_logprobs, head, temperature=temperature, top_k=top_k, top_p=top_p,
                     with_entropy=with_entropy)
    if chunk is None or len(states) <= chunk:
        parts = [scored(states, targets)]
    else:
        trained = states.requires_grad or any(p.requires_grad for p in head.parameters())
        grad = torch.is_grad_enabled() and trained
        parts = [checkpoint(scored, h, t, use_reentrant=False) if grad else scored(h, t)
                 for h, t in zip(states.split(chunk), targets.split(chunk), strict=True)]
    logp = torch.cat([part[0] for part in parts])
    return logp, torch.cat([part[1] for part in parts]) if with_entropy else None


def _chunk_logprobs(head: nn.Module, states: Tensor, targets: Tensor, *, temperature: float, top_k: int,
                    top_p: float, with_entropy: bool) -> tuple[Tensor, Tensor]:
    """One chunk of :func:`head_logprobs` (the entropy an empty tensor when not asked for)."""
    logits = head(states).float() / temperature
    if top_k > 0 or top_p < 1.0:
        logits = filter_logits(logits, top_k, top_p)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp, logp.new_empty(0)
    # filtered tokens have p = 0 and log p = -inf: they count 0, not NaN
    return logp, -(logp_all.exp() * logp_all.masked_fill(torch.isinf(logp_all), 0.0)).sum(-1)


def scatter_rows(valid: Tensor, values: Tensor) -> Tensor:
    """``[N, C]`` float32 holding ``values`` at the ``valid`` positions (row-major order), 0 elsewhere."""
    return torch.zeros(valid.shape, dtype=torch.float32, device=values.device).masked_scatter(valid, values)
