"""On-policy distillation (Agarwal et al., 2024, GKD; Lu & Thinking Machines, 2025, the Tinker cookbook), on
the shared step.

The student samples its own completions; a frozen teacher scores those same tokens at the sampling
temperature (``lightning_rl.step.logprobs.TeacherLogProbs``, a stage before the advantages); each token's
advantage is the negative reverse KL ``teacher_logp - student_logp``, optionally summed over later tokens with
a discount, plus ``reward_weight`` times the task rewards' advantages
(``lightning_rl.step.estimators.Distillation``). The update is the step's policy loss (one update per
rollout: the plain policy gradient of the reverse KL). Sampling, episodes, LoRA, sharding and asynchronous
sampling are the online step's own.
"""

from __future__ import annotations

from typing import Any

from lightning_rl.algorithms.online import OnlineRL
from lightning_rl.algorithms.options import ObjectiveOptions, SamplingOptions
from lightning_rl.models.teacher import TeacherOptions, load_teacher
from lightning_rl.step.estimators import AdvantageEstimator, Distillation
from lightning_rl.step.logprobs import TeacherLogProbs

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

    def __init__(
        self, *args: Any, teacher: TeacherOptions = TeacherOptions(),
        sampling: SamplingOptions = SamplingOptions(num_generations=4),
        objective: ObjectiveOptions = DISTILL_OBJECTIVE, advantage: AdvantageEstimator | None = None,
        **kwargs: Any,
    ) -> None:
        estimator = Distillation(teacher.coef, teacher.discount, teacher.reward_weight, advantage)
        super().__init__(*args, sampling=sampling, objective=objective, advantage=estimator, **kwargs)
        self.teacher_options = teacher
        # a plain attribute, like the reference: out of the module tree, its state_dict and the optimiser
        self.__dict__["teacher"] = load_teacher(teacher, self.tokenizer, self.policy_options.model)
        self.learner.before.insert(0, TeacherLogProbs(self.teacher, sampling.temperature,
                                                      self.updater.micro_batch_size))
        self.learner.reads_behaviour = True  # the student's log-probs: the sampler's own, or a scoring pass
        self.engine.keep_logprobs()  # else the learner's behaviour pass scores the student

    def frozen_scorers(self) -> dict[str, Any]:
        return {**super().frozen_scorers(), "teacher": self.teacher}

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.teacher.share_prompts = self.policy.share_prompts
        self.teacher.to(self.device)
