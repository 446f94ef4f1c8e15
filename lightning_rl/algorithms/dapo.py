"""DAPO (Yu et al., 2025): clip-higher, dynamic sampling, token-level loss, overlong reward shaping."""

from __future__ import annotations

from typing import Any, Literal

from lightning_rl.algorithms.online import OnlineRL
from lightning_rl.losses import Aggregation


class DAPO(OnlineRL):
    """DAPO preset: all four parts on.

    * clip-higher: ``[1 - 0.2, 1 + 0.28]``;
    * dynamic sampling: only groups with mixed correctness, refilled from new prompts
      (``DAPOGroupFilter``, up to ``max_gen_batches`` rounds);
    * ``token-mean`` aggregation over the whole minibatch;
    * soft overlong punishment over the last ``overlong_buffer`` tokens of ``max_new_tokens``
      (``auto``: a fifth of the real ``max_new_tokens``, like the paper's 4096 of 20480; ``None`` or 0: off).
      Truncated completions can also be left out of the loss with ``mask_truncated``.
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
