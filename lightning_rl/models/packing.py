"""Packed scoring (``model.update.packing``): a micro-batch's rows run as one sequence without padding,
positions restarting at each row, and attention that never crosses rows.

The rows' real tokens (prompt, then completion) are laid end to end in a ``[1, T]`` sequence with each
row's positions ``0 .. L-1`` and no attention mask: transformers then keeps rows apart from the position
restarts (``masking_utils.find_packed_sequence_indices``: a block-diagonal causal mask for eager / SDPA /
flex attention, variable-length kernels for FlashAttention). A token keeps its position and its context,
so its log-prob is the padded form's, to float rounding. A model whose attention does not read the
restarts would let rows see each other: before training (every rank at once), the policy's log-probs of two
rows are checked against the padded form's, and packing is refused, naming the model and the option, where
they differ.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_rl.models.heads import head_logprobs, scatter_rows
from lightning_rl.models.model_utils import base_model

TOLERANCE = 1e-4  # log-prob difference that is a crossed row, not float rounding


def packable(prompt_mask: Tensor, completion_mask: Tensor) -> bool:
    """Rows can be packed exactly: a non-empty left-padded prompt and a completion without holes (the
    token after a hole is predicted from the hole's position in the padded form)."""
    left_padded = not bool((prompt_mask[:, 1:] < prompt_mask[:, :-1]).any())
    no_holes = not bool((completion_mask[:, 1:] > completion_mask[:, :-1]).any())
    return left_padded and no_holes and bool((prompt_mask.sum(1) > 0).all())


def pack(prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
         completion_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(ids, positions, predictors)``: the real tokens of every row end to end ``[1, T]``, each row's
    positions from 0 ``[1, T]``, and for each real completion token (row-major order) the packed index of
    the position that predicts it (the token before it, of the same row)."""
    real = torch.cat([prompt_mask, completion_mask], dim=1).bool()
    ids = torch.cat([prompt_ids, completion_ids], dim=1)[real]
    positions = (real.long().cumsum(1) - 1)[real]
    completion = torch.cat([torch.zeros_like(prompt_mask), completion_mask], dim=1).bool()[real]
    predictors = torch.nonzero(completion).squeeze(1) - 1
    return ids[None], positions[None], predictors


def packed_logprobs(model: nn.Module, split: tuple[nn.Module, nn.Linear] | None, prompt_ids: Tensor,
                    prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor, *,
                    temperature: float, top_k: int = 0, top_p: float = 1.0, with_entropy: bool = False,
                    chunk: int | None = None) -> tuple[Tensor, Tensor | None]:
    """``TokenScorer.token_logprobs`` on the packed rows: one forward over ``[1, T]`` real tokens; the
    output layer on the completion's predicting positions only where ``split`` gives it apart."""
    ids, positions, predictors = pack(prompt_ids, prompt_mask, completion_ids, completion_mask)
    valid = completion_mask.bool()
    if split is not None:
        decoder, head = split
        states = decoder(ids, position_ids=positions, use_cache=False).last_hidden_state[0, predictors]
    else:
        head = nn.Identity()  # the model's own output layer: its logits are the states
        states = model(ids, position_ids=positions, use_cache=False).logits[0, predictors]
    logp, entropy = head_logprobs(head, states, completion_ids[valid], temperature=temperature, top_k=top_k,
                                  top_p=top_p, with_entropy=with_entropy, chunk=chunk)
    return scatter_rows(valid, logp), None if entropy is None else scatter_rows(valid, entropy)


def probe_rows(model: nn.Module) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Two rows of different lengths (a left-padded prompt, a right-padded completion) of token ids the
    model's vocabulary holds, on its device: what :func:`refuse_crossing` scores both ways."""
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 32)
    device = next(model.parameters()).device
    ids = torch.arange(1, 13, device=device).remainder(vocab - 1) + 1
    prompt_ids = torch.stack([ids[:3], torch.cat([ids[:1] * 0, ids[3:5]])])
    prompt_mask = torch.tensor([[1, 1, 1], [0, 1, 1]], device=device)
    completion_ids = torch.stack([ids[5:9], torch.cat([ids[9:12], ids[:1] * 0])])
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], device=device)
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def refuse_crossing(model: nn.Module, padded: Tensor, packed: Tensor) -> None:
    """Refuse packing in one line, naming the model class, its attention and the option, when the packed
    log-probs of :func:`probe_rows` are not the padded form's."""
    diff = float((padded - packed).abs().max())
    attention = getattr(getattr(model, "config", None), "_attn_implementation", "?")
    if diff > TOLERANCE:
        raise ValueError(
            f"`model.update.packing: true`: {type(base_model(model)).__name__} with attention "
            f"`{attention}` lets packed rows attend "
            f"to each other (its log-probs differ from the padded form's by {diff:.3g}); set "
            "`model.update.packing: false`")
