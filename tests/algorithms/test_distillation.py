"""On-policy distillation (``OnPolicyDistillation``): the step written out by hand from the published pieces,
the teacher frozen and out of checkpoints and optimisers, refused with another tokenizer, and the paths the
online step offers (LoRA, episodes on two ranks, a bf16 engine, a worker sampling ahead) on the tiny model."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from helpers import Recorder, datamodule, logprobs, make, make_trainer

from lightning_rl.algorithms import OnPolicyDistillation
from lightning_rl.algorithms.distill import TeacherOptions
from lightning_rl.episodes.source import round_seed
from lightning_rl.maths.advantages import distillation_advantages
from lightning_rl.maths.aggregation import normalizer_counts
from lightning_rl.maths.losses import policy_loss
from lightning_rl.maths.rollout_weights import rollout_is_weights
from lightning_rl.models.builtin import TEACHER_MODEL, build_char_tokenizer, tiny_llama_config
from lightning_rl.models.generation import SamplingParams, hf_generate
from lightning_rl.models.loading import load_policy
from lightning_rl.step.engine import CopyEngine, seeded

G, NEW_TOKENS, STEPS, TEMPERATURE = 4, 8, 2, 0.7


def distill(sampling=None, **groups):
    return make(OnPolicyDistillation, sampling={"temperature": TEMPERATURE} | (sampling or {}), **groups)


def written_out(steps: int):
    """``steps`` distillation steps by hand: seeded sampling at the temperature, which also gives the
    student's log-probs of the sampled tokens; the teacher's at that temperature; ``A_t = teacher - student``;
    PPO-clip (one update: the ratio is 1) with ``token-mean``, each token weighed by the truncated importance
    weight from the sampler's log-probs to the trainer's (1 up to float rounding); clipping at 1, AdamW lr
    1e-3. Each step's (completion ids, teacher log-probs, advantages) and the final weights."""
    holder = distill()
    policy, teacher = holder.policy, load_policy(TEACHER_MODEL)
    policy.share_prompts = teacher.share_prompts = True
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-3, weight_decay=0.0)
    data = datamodule()
    data.setup("fit")
    batches, seen = data.train_batches(0), []
    for step in range(steps):
        ids, mask = holder.encode_prompts(next(batches)["prompt"])
        with seeded(round_seed(0, step, 0, 0), ids.device):
            gen = hf_generate(policy, ids, mask, num_samples=G, compact=True, return_logprobs=True,
                              sampling=SamplingParams(NEW_TOKENS, TEMPERATURE, 1.0, 0, True))
        args = (gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask)
        with torch.no_grad():
            teacher_logp, _ = teacher.token_logprobs(*args, temperature=TEMPERATURE)
        policy.model.train()
        logp, _ = policy.token_logprobs(*args, temperature=TEMPERATURE, with_entropy=True)
        mask = gen.completion_mask.float()
        advantages = distillation_advantages(teacher_logp, gen.rollout_logp, mask)
        weights = rollout_is_weights(logp.detach(), gen.rollout_logp, mask)
        num_tokens, _ = (c.float() for c in normalizer_counts(mask))
        loss, _ = policy_loss(logp, logp.detach(), None, advantages, mask, aggregation="token-mean",
                              num_tokens=num_tokens, token_weights=weights)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
        optimizer.step()
        seen.append((gen.completion_ids, teacher_logp, advantages))
    return seen, {k: v.detach().clone() for k, v in policy.model.named_parameters()}


@pytest.mark.slow
def test_the_step_is_distillation_written_out(tmp_path):
    module, rollouts = distill(), Recorder()
    make_trainer(tmp_path, max_steps=STEPS, callbacks=[rollouts]).fit(module, datamodule())
    by_hand, weights = written_out(STEPS)
    for rollout, stats, (ids, teacher_logp, advantages) in zip(rollouts.rollouts, rollouts.stats, by_hand,
                                                               strict=True):
        mask = rollout.loss_mask.bool()
        assert torch.equal(rollout.completion_ids, ids)
        scored = rollout.frozen_logp["teacher"]
        torch.testing.assert_close(scored[mask], teacher_logp[mask], atol=1e-5, rtol=0)
        torch.testing.assert_close(rollout.advantages[mask], advantages[mask], atol=1e-5, rtol=0)
        # the student's log-probs are the sampler's own (no separate behaviour pass)
        assert rollout.old_logp is None and rollout.rollout_logp is not None
        gap = (rollout.rollout_logp - scored)[mask].mean()
        assert stats["distill/reverse_kl"] == pytest.approx(float(gap), abs=1e-6)
    assert rollouts.stats[0]["distill/reverse_kl"] > 0.05  # the warm start is far from its teacher
    trained = dict(module.policy.model.named_parameters())
    start = distill().policy.model.state_dict()
    assert max(float((trained[k] - start[k]).abs().max()) for k in weights) > 1e-3
    for name, value in weights.items():  # to float rounding (measured: 1.8e-6 at most after 2 steps; the
        # teacher's log-probs differ by ~2e-6 between the module's scoring and the loop's)
        torch.testing.assert_close(trained[name].detach(), value, rtol=0, atol=5e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_the_teacher_is_frozen_and_out_of_checkpoints_and_optimisers(tmp_path):
    module = distill(teacher=TeacherOptions(dtype="bfloat16"))
    before = {k: v.clone() for k, v in module.teacher.model.state_dict().items()}
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.fit(module, datamodule())
    assert next(module.teacher.parameters()).dtype == torch.bfloat16  # its dtype is its own
    assert not any(p.requires_grad for p in module.teacher.parameters()) and not module.teacher.model.training
    after = module.teacher.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any("teacher" in k for k in module.state_dict())
    optimised = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert not optimised & {id(p) for p in module.teacher.parameters()}
    trainer.save_checkpoint(tmp_path / "opd.ckpt")
    saved = torch.load(tmp_path / "opd.ckpt", weights_only=False)["state_dict"]
    assert saved.keys() == module.state_dict().keys()


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(tmp_path):
    from lightning_rl.models.policy import Policy

    tokenizer = build_char_tokenizer("0123456789=+-")
    Policy.from_config(tiny_llama_config(tokenizer), tokenizer).save_pretrained(str(tmp_path / "other"))
    with pytest.raises(ValueError) as err:
        distill(teacher={"model": str(tmp_path / "other")})
    message = str(err.value)
    assert "\n" not in message and str(tmp_path / "other") in message and "builtin:tiny-sort" in message
    assert "model.teacher.model" in message and "model.policy.model" in message


@pytest.mark.parametrize("kw,key", [({"coef": 0.0}, "model.teacher.coef"),
                                    ({"discount": 2.0}, "model.teacher.discount"),
                                    ({"reward_weight": -1.0}, "model.teacher.reward_weight")])
def test_teacher_options_are_validated(kw, key):
    with pytest.raises(ValueError, match=key):
        TeacherOptions(**kw)


def _fit(tmp_path, steps=2, **groups):
    module, rollouts = distill(**groups), Recorder()
    make_trainer(tmp_path, max_steps=steps, callbacks=[rollouts]).fit(module, datamodule(batch_size=2))
    return module, rollouts


@pytest.mark.slow
def test_distillation_with_lora_trains_the_adapters_only(tmp_path):
    lora = {"class_path": "peft.LoraConfig",
            "init_args": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}}
    module, rollouts = _fit(tmp_path, policy={"peft": lora},
                            optimizer=partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.0))
    adapters = [n for n, p in module.policy.model.named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in n for n in adapters)
    assert all(torch.isfinite(r.advantages).all() for r in rollouts.rollouts)
    assert all("teacher" not in k for k in module.state_dict())


@pytest.mark.slow
def test_a_bf16_engine_distils_from_the_recomputed_behaviour_logprobs(tmp_path):
    """The student's log-probs are the trainer's behaviour log-probs when they are scored (a bf16 engine:
    recomputed, the engine's own differ)."""
    _, copy = _fit(tmp_path / "copy", engine=CopyEngine("bfloat16"))
    for rollout in copy.rollouts:
        mask = rollout.loss_mask.bool()
        assert not torch.equal(rollout.old_logp[mask], rollout.rollout_logp[mask])
        teacher = rollout.frozen_logp["teacher"]
        expected = distillation_advantages(teacher, rollout.old_logp, rollout.loss_mask)
        torch.testing.assert_close(rollout.advantages[mask], expected[mask])


@pytest.mark.slow
@pytest.mark.parametrize("worker", ["thread", "process"])
def test_a_worker_sampling_ahead_scores_the_teacher_and_its_logprobs_are_the_students(tmp_path, worker):
    """A worker one step ahead scores the teacher where it samples (the learner does not), and the student's
    log-probs are the worker's own: the policy, one version old, that drew the tokens."""
    module, ahead = _fit(tmp_path, steps=3, sampling={"max_staleness": 1, "worker": worker})
    assert [int(r.versions.max()) for r in ahead.rollouts] == [0, 0, 1]
    assert all(s["perf/sampler_teacher_time"] > 0 and s["perf/teacher_time"] < s["perf/sampler_teacher_time"]
               for s in ahead.stats)
    for rollout in ahead.rollouts:
        torch.testing.assert_close(rollout.frozen_logp["teacher"], logprobs(module, rollout, module.teacher) *
                                   rollout.loss_mask, atol=1e-5, rtol=0)
        assert rollout.old_logp is None and rollout.rollout_logp is not None
        teacher = rollout.frozen_logp["teacher"]
        expected = distillation_advantages(teacher, rollout.rollout_logp, rollout.loss_mask)
        mask = rollout.loss_mask.bool()
        torch.testing.assert_close(rollout.advantages[mask], expected[mask])


@pytest.mark.distributed
@pytest.mark.ranks("ddp/distill", "fsdp2/distill")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_distillation_on_two_ranks_with_uneven_episodes(rank_jobs, strategy):
    """Two steps of distillation on episodes whose turn counts differ by rank (tests/episodes_fit.py): the
    teacher is whole on each rank (its forwards are no collectives), observation tokens get no advantage,
    each model token ``teacher - student``, and the logged reverse KL is the mean over both ranks' tokens."""
    result = torch.load(rank_jobs.out(f"{strategy}/distill") / "result.pt")
    assert result["global_step"] == 2 and not result["teacher_collective"]
    rank0, rank1 = result["distill"]
    assert len(rank0) == len(rank1) == 2 and sum(s["observations"] for s in rank1) > 0
    for step, (a, b) in enumerate(zip(rank0, rank1, strict=True)):
        for mine in (a, b):
            assert mine["advantage_error"] < 1e-5 and mine["observation_advantage"] == 0.0
        expected = (a["gap_sum"] + b["gap_sum"]) / (a["count"] + b["count"])
        assert result["logged"][step] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert a["gap_sum"] / a["count"] != pytest.approx(b["gap_sum"] / b["count"])  # the ranks' means differ


def spread_reward(completions, **_):
    """A task reward that tells apart any two different completions of a group."""
    return [float(sum(ord(ch) * (i + 1) for i, ch in enumerate(c)) % 7) for c in completions]


def test_opd_plus_rl_adds_the_weighted_task_advantages(tmp_path):
    """``teacher.reward_weight`` 0.5: each model token's advantage is ``teacher - student`` plus half the
    group z-score of the task rewards."""
    from lightning_rl.maths.advantages import group_advantages

    module, rollouts = _fit(tmp_path, steps=1, teacher={"reward_weight": 0.5}, sampling={"temperature": 1.0},
                            rewards={"functions": ["test_distillation:spread_reward"]})
    (rollout,) = rollouts.rollouts
    mask = rollout.loss_mask.bool()
    task = group_advantages(rollout.rewards, G)[:, None].expand_as(mask)
    teacher = rollout.frozen_logp["teacher"]
    expected = distillation_advantages(teacher, rollout.rollout_logp, rollout.loss_mask)
    torch.testing.assert_close(rollout.advantages[mask], (expected + 0.5 * task)[mask])
    assert task[mask].abs().max() > 0  # some group had mixed rewards: the task term is really there
