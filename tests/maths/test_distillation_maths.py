"""On-policy distillation's maths: per-token advantages from the reverse KL to the teacher (hand-worked), and
the estimator that mixes them with the task rewards' advantages."""

from __future__ import annotations

import pytest
import torch

import lightning_rl.losses as L
from lightning_rl.algorithms.distill import Distillation
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.estimators import LeaveOneOut
from lightning_rl.step.rollout import Rollout

T = torch.tensor
TEACHER = T([[-1.0, -0.5, -2.0, 0.0], [-0.2, -3.0, -1.0, -1.0]])
STUDENT = T([[-1.5, -0.5, -1.0, 0.0], [-0.2, -1.0, -2.0, -1.0]])
# row 0: three sampled tokens then padding; row 1: token 1 is an environment's observation (context, no loss)
MASK = T([[1, 1, 1, 0], [1, 0, 1, 1]])


@pytest.mark.parametrize("coef,discount,expected", [
    # r = coef * (teacher - student) on valid tokens: row 0 [.5, 0, -1], row 1 [0, -, 1, 0]
    (1.0, 0.0, [[0.5, 0.0, -1.0, 0.0], [0.0, 0.0, 1.0, 0.0]]),
    (2.0, 0.0, [[1.0, 0.0, -2.0, 0.0], [0.0, 0.0, 2.0, 0.0]]),
    # discount .5, row 0: A2 = -1; A1 = 0 + .5 * -1 = -.5; A0 = .5 + .5 * -.5 = .25
    #              row 1: A3 = 0; A2 = 1 + .5 * 0 = 1; the observation is skipped: A0 = 0 + .5 * 1 = .5
    (1.0, 0.5, [[0.25, -0.5, -1.0, 0.0], [0.5, 0.0, 1.0, 0.0]]),
    # discount 1: the rest of the sequence's reverse-KL term: row 0 [-.5, -1, -1], row 1 [1, -, 1, 0]
    (1.0, 1.0, [[-0.5, -1.0, -1.0, 0.0], [1.0, 0.0, 1.0, 0.0]]),
])
def test_distillation_advantages_by_hand(coef, discount, expected):
    out = L.distillation_advantages(TEACHER, STUDENT, MASK, coef=coef, discount=discount)
    torch.testing.assert_close(out, T(expected))
    assert not out.requires_grad


def test_distillation_advantages_ignore_garbage_outside_the_mask():
    teacher = TEACHER.clone()
    teacher[0, 3], teacher[1, 1] = float("-inf"), float("nan")  # padding and an observation token
    out = L.distillation_advantages(teacher, STUDENT, MASK, discount=0.5)
    torch.testing.assert_close(out, T([[0.25, -0.5, -1.0, 0.0], [0.5, 0.0, 1.0, 0.0]]))


@pytest.mark.parametrize("kw,match", [({"coef": 0.0}, "coef"), ({"discount": 1.5}, "discount"),
                                      ({"discount": -0.1}, "discount")])
def test_distillation_advantages_refuse_bad_options(kw, match):
    with pytest.raises(ValueError, match=match):
        L.distillation_advantages(TEACHER, STUDENT, MASK, **kw)


def _rollout(rewards, **fields) -> Rollout:
    n, c = MASK.shape
    return Rollout(torch.ones(n, 2, dtype=torch.long), torch.ones(n, 2, dtype=torch.long),
                   torch.ones(n, c, dtype=torch.long), MASK.clone(), MASK.clone(),
                   torch.zeros(n, dtype=torch.bool), MASK.sum(-1), torch.tensor([0, 0]), T(rewards),
                   torch.zeros(n, dtype=torch.bool), **fields)


def test_the_estimator_reads_the_behaviour_logprobs_and_logs_the_reverse_kl():
    rollout = _rollout([0.0, 0.0], frozen_logp={"teacher": TEACHER}, old_logp=STUDENT)
    adv, stats = Distillation().estimate(rollout, Collectives.local())
    torch.testing.assert_close(adv["advantages"], T([[0.5, 0.0, -1.0, 0.0], [0.0, 0.0, 1.0, 0.0]]))
    # mean of student - teacher over the 6 valid tokens: (-.5 + 0 + 1 + 0 - 1 + 0) / 6 = -1/12
    assert stats["distill/reverse_kl"] == pytest.approx(-1 / 12)


def test_without_behaviour_logprobs_the_engines_are_the_students():
    """A worker sampling ahead: the step has no ``old_logp``; the tokens came from the engine's policy."""
    rollout = _rollout([0.0, 0.0], frozen_logp={"teacher": TEACHER}, rollout_logp=STUDENT)
    adv, _ = Distillation().estimate(rollout, Collectives.local())
    torch.testing.assert_close(adv["advantages"], T([[0.5, 0.0, -1.0, 0.0], [0.0, 0.0, 1.0, 0.0]]))
    with pytest.raises(ValueError, match="teacher"):
        Distillation().estimate(_rollout([0.0, 0.0], old_logp=STUDENT), Collectives.local())


def test_task_rewards_are_mixed_in_with_their_weight():
    """OPD + RL: the task estimator's per-sequence advantages, times ``reward_weight``, on each valid token.
    RLOO of rewards [1, 0] in one group of 2: [1 - 0, 0 - 1] = [1, -1]; weight .5 adds [.5, -.5]."""
    estimator = Distillation(coef=1.0, discount=0.0, reward_weight=0.5, task=LeaveOneOut())
    adv, _ = estimator.estimate(_rollout([1.0, 0.0], frozen_logp={"teacher": TEACHER}, old_logp=STUDENT),
                                Collectives.local())
    torch.testing.assert_close(adv["advantages"], T([[1.0, 0.5, -0.5, 0.0], [-0.5, 0.0, 0.5, -0.5]]))
    assert estimator.min_group_size == 2 and Distillation().min_group_size == 1  # no groups without rewards


class NaNTeacher:
    """Scores every token 0.5 nats below the student, except one NaN (a teacher that overflowed)."""

    shares_weights = False

    def token_logprobs(self, prompt_ids, prompt_mask, completion_ids, completion_mask, *, temperature):
        logp = (STUDENT - 0.5) * completion_mask
        logp[0, 1] = float("nan")
        return logp, None


def test_a_non_finite_teacher_logprob_leaves_the_loss_and_is_counted():
    from lightning_rl.models.frozen import FrozenModels
    from lightning_rl.step.logprobs import FrozenLogProbs

    frozen = FrozenModels()
    frozen.add("teacher", NaNTeacher())
    stage = FrozenLogProbs(frozen, "teacher", policy=None,
                           micro_batch_size=None, time_key="perf/teacher_time",
                           excluded_key="distill/teacher_excluded_tokens")
    rollout, stats = stage(_rollout([0.0, 0.0], old_logp=STUDENT), Collectives.local())
    assert stats["distill/teacher_excluded_tokens"] == 1.0
    assert rollout.loss_mask.tolist() == [[1, 0, 1, 0], [1, 0, 1, 1]]  # token (0, 1) out of the loss
    assert rollout.attention_mask.tolist() == MASK.tolist()  # still in the context
    assert torch.isfinite(rollout.frozen_logp["teacher"]).all()
    adv, _ = Distillation().estimate(rollout, Collectives.local())
    assert torch.isfinite(adv["advantages"]).all() and adv["advantages"][0, 1] == 0
