"""A frozen-model stage needs no library change: a preset written here declares a second frozen model
(``critic_lm``) and its ``FrozenLogProbs`` stage, and the step puts its log-probs on the rollout
(``frozen_logp["critic_lm"]``), keeps them through select and cat, leaves its non-finite tokens out of the
loss, logs the stage's own metric group, and a worker sampling ahead scores it where it samples."""

from __future__ import annotations

import threading

import torch
from helpers import Recorder, datamodule, logprobs, make, make_trainer

from lightning_rl.algorithms import GRPO
from lightning_rl.models.builtin import TEACHER_MODEL
from lightning_rl.models.loading import load_policy
from lightning_rl.models.scoring import ReferencePolicy
from lightning_rl.step.learner import Stage
from lightning_rl.step.logprobs import FrozenLogProbs
from lightning_rl.step.rollout import Rollout

NAME = "critic_lm"


class FirstTokenNaN(ReferencePolicy):
    """A frozen language model whose log-prob of every row's first completion token is NaN (an overflow),
    recording the thread of each call."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model, shares_weights=False)
        self.__dict__["threads"] = []

    def token_logprobs(self, *args, **kwargs):
        self.__dict__["threads"].append(threading.get_ident())
        logp, entropy = super().token_logprobs(*args, **kwargs)
        return logp.index_fill(1, torch.tensor([0], device=logp.device), float("nan")), entropy


class ScoredByCriticLM(GRPO):
    """GRPO with a second frozen model scored beside the policy: all a preset writes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.frozen.add(NAME, FirstTokenNaN(load_policy(TEACHER_MODEL).model))

    def preset_stages(self) -> list[Stage]:
        return [FrozenLogProbs(self.frozen, NAME, policy=self.policy,
                               micro_batch_size=self.updater.micro_batch_size, time_key="perf/critic_lm_time",
                               excluded_key="critic_lm/excluded_tokens")]


def fit(tmp_path, steps: int, **sampling):
    module, recorder = make(ScoredByCriticLM, sampling=sampling), Recorder()
    trainer = make_trainer(tmp_path, max_steps=steps, callbacks=[recorder])
    trainer.fit(module, datamodule(batch_size=2))
    return module, recorder, trainer


def check_scores(module, rollout: Rollout) -> None:
    """The rollout holds the model's log-probs of its tokens (as the step scores them), each row's first token
    out of the loss (its NaN replaced by 0) but still in the context; the reference's stay in ``ref_logp``."""
    scores, mask = rollout.frozen_logp[NAME], rollout.loss_mask.bool()
    expected = logprobs(module, rollout, module.frozen.get(NAME))
    torch.testing.assert_close(scores[mask], expected[mask], atol=1e-5, rtol=0)
    assert torch.isfinite(scores).all() and not torch.equal(rollout.ref_logp, scores)  # GRPO's own, apart
    assert not mask[:, 0].any() and rollout.attention_mask[:, 0].bool().all()


def test_a_presets_second_frozen_model_is_scored_kept_and_checked(tmp_path):
    module, recorder, trainer = fit(tmp_path, steps=2)
    for rollout, stats in zip(recorder.rollouts, recorder.stats, strict=True):
        check_scores(module, rollout)
        assert stats["critic_lm/excluded_tokens"] == len(rollout) and stats["rollout/excluded_tokens"] == 0
    assert "critic_lm/excluded_tokens" in trainer.logged_metrics  # the stage's own group, no table entry
    first, second = recorder.rollouts
    picked = first.select(torch.tensor([3, 0]))
    assert torch.equal(picked.frozen_logp[NAME], first.frozen_logp[NAME][[3, 0]])
    joined = Rollout.cat([first, second])
    width = first.frozen_logp[NAME].shape[1]
    assert torch.equal(joined.frozen_logp[NAME][: len(first), :width], first.frozen_logp[NAME])
    assert torch.equal(joined.loss_mask[: len(first), :width], first.loss_mask)


def test_a_worker_sampling_ahead_scores_the_presets_frozen_model(tmp_path):
    """One step ahead, in a thread: every call of the model is the worker's, and the learner's common
    exclusion (before the preset's stage) already finds the NaNs the worker scored."""
    module, recorder, _ = fit(tmp_path, steps=3, max_staleness=1, worker="thread")
    main = threading.get_ident()
    calls = list(module.frozen.get(NAME).threads)
    assert calls and main not in calls
    assert [int(r.versions.max()) for r in recorder.rollouts] == [0, 0, 1]
    for rollout, stats in zip(recorder.rollouts, recorder.stats, strict=True):
        check_scores(module, rollout)
        assert stats["perf/sampler_critic_lm_time"] > 0
        assert stats["rollout/excluded_tokens"] == len(rollout) and stats["critic_lm/excluded_tokens"] == 0
