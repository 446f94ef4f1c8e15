"""DAPO (Yu et al., 2025): clip-higher, dynamic sampling, token-level loss, overlong reward shaping."""

from __future__ import annotations

from typing import Any, Literal

from lightning_rl.algorithms.online import OnlineRL
from lightning_rl.maths.aggregation import Aggregation


class DAPO(OnlineRL):
    """DAPO preset: all four parts on. Only the defaults differ from :class:`OnlineRL`.

    Args:
        clip_low: the ratio's clip range starts at ``1 - clip_low``.
        clip_high: clip-higher: the range ends at ``1 + clip_high``, above ``1 + clip_low`` so that
            unlikely tokens can gain probability (entropy does not collapse).
        aggregation: ``token-mean`` over the whole minibatch, so long answers weigh per token.
        kl_coef: no KL term to a reference (0.0), as in the paper.
        dynamic_sampling: on: only groups with mixed correctness are trained on, refilled from new prompts
            (``lightning_rl.step.filters.DynamicSampling``, up to ``max_gen_batches`` rounds).
        overlong_buffer: soft overlong punishment over the last this-many tokens of ``max_new_tokens``.
            On by default here: ``auto`` is a fifth of the module's ``max_new_tokens``, at least 1 (the
            paper's 4096 of 20480); ``None`` or 0 turns it off. A completion of L tokens (EOS included)
            loses nothing up to ``max_new_tokens - overlong_buffer`` tokens, then up to
            ``overlong_penalty_factor`` at ``max_new_tokens``; ``rollout/overlong_penalty_mean`` logs it.
            Truncated completions can also be left out of the loss with ``mask_truncated``.
        **kwargs: see :class:`~lightning_rl.algorithms.online.OnlineRL`.
    """

    def __init__(
        self,
        *args: Any,
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        aggregation: Aggregation = "token-mean",
        kl_coef: float = 0.0,
        dynamic_sampling: bool = True,
        overlong_buffer: int | Literal["auto"] | None = "auto",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, clip_low=clip_low, clip_high=clip_high, aggregation=aggregation,
                         kl_coef=kl_coef, dynamic_sampling=dynamic_sampling,
                         overlong_buffer=overlong_buffer, **kwargs)
