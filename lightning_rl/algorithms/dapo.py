"""DAPO (Yu et al., 2025): clip-higher, dynamic sampling, token-level loss, overlong reward shaping."""

from __future__ import annotations

from typing import Any

from lightning_rl.algorithms.learner_options import FilterOptions, ObjectiveOptions
from lightning_rl.algorithms.online import OnlineRL
from lightning_rl.algorithms.sampler_options import RewardOptions
from lightning_rl.maths.trust_regions import Clip


class DAPO(OnlineRL):
    """DAPO preset: all four parts on. Only the defaults of three groups differ from :class:`OnlineRL`.

    Args:
        objective: clip-higher (``trust_region: Clip`` with ``high`` 0.28 above ``low`` 0.2, so that
            unlikely tokens can gain probability and entropy does not collapse), ``token-mean`` over the
            whole minibatch (long answers weigh per token), no KL term, as in the paper.
        filters: dynamic sampling on: only groups with mixed correctness are trained on, refilled from new
            prompts (``lightning_rl.step.filters.DynamicSampling``, up to ``max_gen_batches`` rounds);
            ``mask_truncated`` (overlong filtering) stays off: the shaping below handles long answers.
        rewards: soft overlong punishment on: ``overlong_buffer: auto`` is a fifth of ``max_new_tokens``, at
            least 1 (the paper's 4096 of 20480). A completion of L tokens (EOS included) loses nothing up to
            ``max_new_tokens - overlong_buffer`` tokens, then up to ``overlong_penalty_factor`` at
            ``max_new_tokens``; ``rollout/overlong_penalty_mean`` logs it.
        **kwargs: see :class:`~lightning_rl.algorithms.online.OnlineRL`.
    """

    def __init__(
        self, *args: Any,
        objective: ObjectiveOptions = ObjectiveOptions(trust_region=Clip(high=0.28),
                                                       aggregation="token-mean"),
        filters: FilterOptions = FilterOptions(dynamic_sampling=True),
        rewards: RewardOptions = RewardOptions(overlong_buffer="auto"), **kwargs: Any,
    ) -> None:
        super().__init__(*args, objective=objective, filters=filters, rewards=rewards, **kwargs)
