"""On-policy distillation (Agarwal et al., 2024, GKD; Lu & Thinking Machines, 2025, the Tinker cookbook), on
the shared step.

The student samples its own completions; a frozen teacher scores those same tokens at the temperature they
were sampled at (``Rollout.temperature``; ``lightning_rl.step.logprobs.FrozenLogProbs``, this preset's
stage); each token's advantage is the negative reverse KL ``teacher_logp - student_logp``, optionally summed
over later tokens with a discount, plus ``reward_weight`` times the task rewards' advantages
(``lightning_rl.step.estimators.Distillation``). The update is the step's policy loss (one update per
rollout: the plain policy gradient of the reverse KL). Sampling, episodes, LoRA, sharding and asynchronous
sampling are the online step's own.
"""

from __future__ import annotations

from typing import Any, ClassVar

from lightning_rl.algorithms.online import OnlineRL
from lightning_rl.algorithms.options import ObjectiveOptions, SamplingOptions
from lightning_rl.models.teacher import TeacherOptions, load_teacher
from lightning_rl.step.estimators import AdvantageEstimator, Distillation
from lightning_rl.step.learner import Stage
from lightning_rl.step.logprobs import FrozenLogProbs

DISTILL_OBJECTIVE = ObjectiveOptions(aggregation="token-mean")


class OnPolicyDistillation(OnlineRL):
    """On-policy distillation from a frozen ``teacher``; with ``teacher.reward_weight`` > 0, OPD + RL.

    Args:
        teacher: the teacher model, its dtype, and the distillation term's weight, discount and the task
            rewards' weight (:class:`~lightning_rl.models.teacher.TeacherOptions`).
        sampling: 4 samples per prompt by default (no group is needed without task rewards).
        objective: ``token-mean`` aggregation, no KL to a reference (the teacher is the anchor).
        advantage: the task rewards' estimator, used when ``teacher.reward_weight`` > 0 (``None``: group
            z-score).
        **kwargs: see :class:`~lightning_rl.algorithms.online.OnlineRL`.
    """

    reads_behaviour: ClassVar[bool] = True  # the advantages read the student's log-probs

    def __init__(
        self, *args: Any, teacher: TeacherOptions = TeacherOptions(),
        sampling: SamplingOptions = SamplingOptions(num_generations=4),
        objective: ObjectiveOptions = DISTILL_OBJECTIVE, advantage: AdvantageEstimator | None = None,
        **kwargs: Any,
    ) -> None:
        estimator = Distillation(teacher.coef, teacher.discount, teacher.reward_weight, advantage)
        super().__init__(*args, sampling=sampling, objective=objective, advantage=estimator, **kwargs)
        self.teacher_options = teacher
        self.frozen.add("teacher", load_teacher(teacher, self.tokenizer, self.policy_options.model))

    @property
    def teacher(self) -> Any:
        return self.frozen.get("teacher")

    def preset_stages(self) -> list[Stage]:
        """The teacher's log-probs of the sampled tokens (a non-finite one leaves the loss, counted as
        ``distill/teacher_excluded_tokens``)."""
        return [FrozenLogProbs(self.frozen, "teacher", policy=self.policy,
                               micro_batch_size=self.updater.micro_batch_size, time_key="perf/teacher_time",
                               excluded_key="distill/teacher_excluded_tokens")]
