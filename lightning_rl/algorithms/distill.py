"""On-policy distillation (Agarwal et al., 2024, GKD; Lu & Thinking Machines, 2025, the Tinker cookbook), on
the shared step: the preset, its teacher's options and loading, and its advantage estimator, all here.

The student samples its own completions; a frozen teacher scores those same tokens at the temperature they
were sampled at (``Rollout.temperature``; ``lightning_rl.step.logprobs.FrozenLogProbs``, this preset's
stage, which puts them in ``Rollout.frozen_logp["teacher"]``); each token's advantage is the negative
reverse KL ``teacher_logp - student_logp``, optionally summed over later tokens with a discount, plus
``reward_weight`` times the task rewards' advantages (:class:`Distillation`). The update is the step's policy
loss (one update per rollout: the plain policy gradient of the reverse KL). Sampling, episodes, LoRA,
sharding and asynchronous sampling (the worker scores every frozen model it is given) are the online step's
own.

The teacher is loaded like the policy (``builtin:`` name, local folder or hub id, its own dtype) and held
like the reference: frozen, in eval mode, whole on every rank, in the module's ``FrozenModels`` (never in
its ``state_dict``, checkpoints or optimisers). It scores the student's token ids, so it must read them as
the student does: a teacher whose tokenizer differs is refused before anything trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lightning_rl.algorithms.learner_options import ObjectiveOptions
from lightning_rl.algorithms.online import OnlineRL
from lightning_rl.algorithms.sampler_options import SamplingOptions
from lightning_rl.maths.advantages import distillation_advantages
from lightning_rl.maths.checks import require
from lightning_rl.models.loading import load_policy
from lightning_rl.models.scoring import ReferencePolicy
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.estimators import AdvantageEstimator, Estimate, GroupNormalized
from lightning_rl.step.learner import Stage
from lightning_rl.step.logprobs import FrozenLogProbs
from lightning_rl.step.rollout import Rollout

TEACHER = "teacher"  # its name among the module's frozen models and in `Rollout.frozen_logp`
DISTILL_OBJECTIVE = ObjectiveOptions(aggregation="token-mean")


@dataclass(frozen=True)
class TeacherOptions:
    """The teacher and how its signal becomes advantages (:class:`OnPolicyDistillation`).

    Args:
        model: hub id, local ``save_pretrained`` folder, or ``builtin:tiny-sort-teacher`` (the embedded model
            after ``configs/grpo.yaml``). Its tokenizer must be the student's.
        dtype: the teacher's weights dtype (``float32``, ``bfloat16``, ``float16``, ``auto``); ``None``:
            float32.
        trust_remote_code: allow the teacher's model code from the hub.
        coef: weight of the per-token reverse-KL term ``teacher_logp - student_logp`` in the advantages.
        discount: each token's advantage also sums the later tokens' terms, discounted by this per token
            (0: each token its own term, the Tinker cookbook's default; 1: the rest of the sequence).
        reward_weight: weight of the task rewards' advantages (the ``advantage`` estimator, group z-score by
            default) added to the distillation term: 0 is pure distillation, > 0 OPD + RL in one config.
    """

    model: str = "builtin:tiny-sort-teacher"
    dtype: str | None = None
    trust_remote_code: bool = False
    coef: float = 1.0
    discount: float = 0.0
    reward_weight: float = 0.0

    def __post_init__(self) -> None:
        require("model.teacher", coef=(self.coef > 0, self.coef, "> 0"),
                discount=(0 <= self.discount <= 1, self.discount, "in [0, 1]"),
                reward_weight=(self.reward_weight >= 0, self.reward_weight, ">= 0"))


def load_teacher(options: TeacherOptions, student_tokenizer: Any, student_name: str) -> ReferencePolicy:
    """The frozen teacher of ``options``, refused in one line when its tokenizer is not the student's
    (``student_name``: the policy's ``model.policy.model``, for the message)."""
    loaded = load_policy(options.model, options.dtype, options.trust_remote_code, key="model.teacher.model")
    difference = tokenizer_difference(loaded.tokenizer, student_tokenizer)
    if difference is not None:
        raise ValueError(f"`model.teacher.model` ({options.model}) and `model.policy.model` ({student_name}) "
                         f"have different tokenizers ({difference}): the teacher scores the student's token "
                         "ids, so distill from a teacher of the same tokenizer")
    return ReferencePolicy(loaded.model, shares_weights=False)


def tokenizer_difference(teacher: Any, student: Any) -> str | None:
    """How two tokenizers' vocabularies differ, or ``None`` when they map every token to the same id."""
    mine, theirs = teacher.get_vocab(), student.get_vocab()
    if mine == theirs:
        return None
    differing = sum(mine.get(token) != index for token, index in theirs.items())
    differing += len(set(mine) - set(theirs))
    return f"{len(mine)} and {len(theirs)} tokens, {differing} of them missing or with other ids"


class Distillation(AdvantageEstimator):
    """On-policy distillation's advantages: per token, the negative reverse KL to the teacher on the
    student's own samples (``distillation_advantages``), plus ``reward_weight`` times the task estimator's
    advantages (OPD + RL).

    The teacher's log-probs are ``rollout.frozen_logp["teacher"]``; the student's are the behaviour log-probs
    (``old_logp``), or the engine's (``rollout_logp``) when the step has none (a worker sampling ahead: the
    policy that drew the tokens). Logs ``distill/reverse_kl``: the mean per-token ``student_logp -
    teacher_logp`` over every rank's valid tokens (one all-reduce, on every rank), the sampled estimate of
    KL(student || teacher) per token.

    Args:
        coef, discount: the reverse-KL term's weight and its discount over later tokens.
        reward_weight: the task advantages' weight (0: none, and G may be 1).
        task: the task rewards' estimator (group z-score by default).
    """

    def __init__(self, coef: float = 1.0, discount: float = 0.0, reward_weight: float = 0.0,
                 task: AdvantageEstimator | None = None) -> None:
        self.coef, self.discount, self.reward_weight = coef, discount, reward_weight
        self.task = task if task is not None else GroupNormalized()
        self.min_group_size = self.task.min_group_size if reward_weight > 0 else 1

    def estimate(self, rollout: Rollout, collectives: Collectives) -> Estimate:
        mask, teacher = rollout.loss_mask, rollout.frozen_scores(TEACHER)
        student = rollout.old_logp if rollout.old_logp is not None else rollout.rollout_logp
        if teacher is None or (student is None and len(rollout)):
            raise ValueError("distillation needs the teacher's and the student's log-probs of the rollout "
                             "(`frozen_logp['teacher']`; `old_logp` or the engine's `rollout_logp`)")
        if student is None:  # no rows on this rank
            student = teacher
        advantages = distillation_advantages(teacher, student, mask, self.coef, self.discount)
        gap = torch.where(mask.bool(), student.float() - teacher.float(), 0.0)
        sums = collectives.sum(torch.stack([gap.sum().double(), mask.sum().double()]))
        stats = {"distill/reverse_kl": float(sums[0] / sums[1].clamp_min(1))}
        if self.reward_weight > 0:
            fields, task_stats = self.task.estimate(rollout, collectives)
            task = fields["advantages"]
            task = task[:, None] if task.dim() == 1 else task
            advantages = advantages + self.reward_weight * task.float() * mask
            stats.update(task_stats)
        return {"advantages": advantages}, stats


class OnPolicyDistillation(OnlineRL):
    """On-policy distillation from a frozen ``teacher``; with ``teacher.reward_weight`` > 0, OPD + RL.

    Args:
        teacher: the teacher model, its dtype, and the distillation term's weight, discount and the task
            rewards' weight (:class:`TeacherOptions`).
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
        self.frozen.add(TEACHER, load_teacher(teacher, self.tokenizer, self.policy_options.model))

    @property
    def teacher(self) -> Any:
        return self.frozen.get(TEACHER)

    def preset_stages(self) -> list[Stage]:
        """The teacher's log-probs of the sampled tokens (a non-finite one leaves the loss, counted as
        ``distill/teacher_excluded_tokens``)."""
        return [FrozenLogProbs(self.frozen, TEACHER, policy=self.policy,
                               micro_batch_size=self.updater.micro_batch_size, time_key="perf/teacher_time",
                               excluded_key="distill/teacher_excluded_tokens")]
