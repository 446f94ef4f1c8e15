"""The frozen teacher of on-policy distillation: its options (``model.init_args.teacher``) and its loading.

The teacher is loaded like the policy (``builtin:`` name, local folder or hub id, its own dtype) and held
like the reference: frozen, in eval mode, whole on every rank, a plain attribute of the module (never in its
``state_dict``, checkpoints or optimisers). It scores the student's token ids, so it must read them as the
student does: a teacher whose tokenizer differs is refused before anything trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_rl.maths.checks import require
from lightning_rl.models.loading import load_policy
from lightning_rl.models.scoring import ReferencePolicy


@dataclass(frozen=True)
class TeacherOptions:
    """The teacher and how its signal becomes advantages (``lightning_rl.algorithms.OnPolicyDistillation``).

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
