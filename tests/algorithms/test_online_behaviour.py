"""Behaviour of the online RL step (lightning_rl.algorithms.online.OnlineRL) on the embedded tiny model,
checked against numbers recomputed from what the step saw: several updates per rollout (behaviour
log-probs recorded once, the ratio and clip fractions off-policy), the LR scheduler's cadence, Dr. GRPO
advantages, chat-template prompts, and the correctness function behind DAPO's dynamic sampling."""

from __future__ import annotations

import copy
import json
import logging
from functools import partial

import lightning as L
import pytest
import torch
from helpers import datamodule, make, make_trainer, read_csv_metrics, spy_policy_scoring, templated_model
from lightning.pytorch.loggers import CSVLogger

from lightning_rl.algorithms import DAPO, GRPO
from lightning_rl.callbacks.base import RLCallback
from lightning_rl.data import PromptDataModule
from lightning_rl.maths.advantages import dapo_group_keep
from lightning_rl.maths.trust_regions import Clip
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.estimators import GroupNormalized
from lightning_rl.step.logprobs import score_rollout
from lightning_rl.step.rewards import exact_match
from lightning_rl.step.rollout import Rollout

HERE = __name__  # functions below are named by import path, as in YAML


class Capture(RLCallback):
    """Keep every final rollout of a step (the object the update uses)."""

    def __init__(self):
        self.rollouts: list[Rollout] = []

    def on_rollout_end(self, trainer, pl_module, rollout):
        self.rollouts.append(rollout)


def params(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.policy.named_parameters()}


def texts(module, rows: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """Each row's tokens where ``mask`` is 1, decoded with special tokens kept."""
    return [module.tokenizer.decode(r[m.bool()].tolist(), skip_special_tokens=False)
            for r, m in zip(rows, mask, strict=True)]


def spy_generations(module) -> list[tuple[dict, Rollout]]:
    """Record every (prompt batch, scored rollout) that the sampler produces (the first round and every
    refill), before any filter."""
    seen, original = [], module.online.sampler

    def spy(batch, io, **kwargs):
        rollout, stats = original(batch, io, **kwargs)
        seen.append((batch, rollout))
        return rollout, stats

    module.rollouts.sampler = spy
    return seen


def logprobs(module, rollout, scorer=None) -> torch.Tensor:
    """``[N, C]`` log-probs of the rollout's tokens under ``scorer`` (default: the policy), as the step's
    log-prob passes score them (the rollout's temperature, the updater's micro-batches)."""
    scorer = module.policy if scorer is None else scorer
    return score_rollout(scorer, rollout, micro_batch_size=module.updater.micro_batch_size,
                         collectives=Collectives(module.trainer),
                         joiner=module.policy if scorer is module.policy else None)


# ----------------------------------------------------------------------- a. several updates per rollout
class UpdateCheck(RLCallback):
    """At each rollout keep a frozen copy of the behaviour policy; at each micro-batch's loss (wrapping
    ``module.policy_loss``: before the optimiser step) recompute the loss metrics from the live policy
    and that copy."""

    def __init__(self, module, clip):
        self.clip, self.updates, self.rollouts = clip, [], []
        original = module.policy_loss

        def policy_loss(micro, num_tokens, num_seqs):
            loss, metrics = original(micro, num_tokens, num_seqs)
            self.updates.append((len(self.rollouts) - 1, micro, self.expected(module, micro), metrics))
            return loss, metrics

        module.policy_loss = policy_loss  # trained_models() reads it at call time

    def on_rollout_end(self, trainer, pl_module, rollout):
        self.behaviour = copy.deepcopy(pl_module.policy)
        # recorded from the policy as it is now, before any update of this rollout
        self.rollouts.append((rollout, torch.equal(rollout.old_logp, logprobs(pl_module, rollout))))

    def expected(self, module, micro):
        mask = micro.loss_mask.bool()
        behaviour = logprobs(module, micro, self.behaviour)
        r = torch.exp(logprobs(module, micro) - behaviour)[mask]
        adv = micro.advantages[:, None].expand_as(mask)[mask]
        rows = mask.any(-1)
        return {"old_logp_diff": float((micro.old_logp - behaviour)[mask].abs().max()),
                # seq-mean-token-mean of -r A where r = 1: minus the mean advantage of the non-empty rows
                "on_policy_loss": -float(micro.advantages[rows].mean()),
                "policy/ratio_mean": float(r.mean()),
                "policy/approx_kl": float((r - 1 - r.log()).mean()),
                "policy/clip_frac_low": float(((r < 1 - self.clip) & (adv < 0)).float().mean()),
                "policy/clip_frac_high": float(((r > 1 + self.clip) & (adv > 0)).float().mean())}


class OptimizerSteps(L.Callback):
    """The learning rate seen by every optimiser step."""

    def __init__(self):
        self.lrs = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])


@pytest.mark.slow
def test_ppo_epochs_and_minibatches_reuse_one_behaviour_snapshot(tmp_path, monkeypatch):
    clip = 0.01
    # every row in the update (no skipping): each optimiser step sees its whole minibatch of 8
    module = make(GRPO, update={"epochs": 2, "num_minibatches": 2, "skip_zero_rows": False},
                  objective={"kl_coef": 0.0, "trust_region": Clip(clip, clip)},
                  optimizer=partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.0))
    behaviour_passes = spy_policy_scoring(monkeypatch, module)
    check, steps = UpdateCheck(module, clip), OptimizerSteps()
    trainer = make_trainer(tmp_path, max_steps=8, callbacks=[check, steps])
    trainer.fit(module, datamodule())
    # 2 rollouts x 2 epochs x 2 minibatches = 8 optimiser steps; behaviour log-probs computed once per rollout
    assert trainer.global_step == 8 and len(steps.lrs) == 8
    assert len(check.rollouts) == 2 and behaviour_passes == [16, 16]
    for rollout, recorded_before_update in check.rollouts:
        assert rollout.old_logp is not None and rollout.old_logp.shape == rollout.attention_mask.shape
        assert recorded_before_update
    assert [i for i, *_ in check.updates] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [len(micro) for _, micro, *_ in check.updates] == [8] * 8  # 16 samples split in two, twice
    for k, (_, _, want, got) in enumerate(check.updates):
        # every update compares against the snapshot taken at rollout time, never a fresher one (to float
        # rounding: prompts shared by a group are scored once per batch, and batches differ here)
        assert want["old_logp_diff"] < 1e-5, k
        for name in ("policy/ratio_mean", "policy/approx_kl", "policy/clip_frac_low",
                     "policy/clip_frac_high"):
            assert float(got[name]) == pytest.approx(want[name], abs=1e-5), (k, name)
    bites = []
    for rollout_index in (0, 1):
        (want, first), *rest = [(w, got) for i, _, w, got in check.updates if i == rollout_index]
        later = [got for _, got in rest]
        # before a rollout's first optimiser step the policy is the behaviour policy: ratio 1, no clipping
        assert float(first["policy/ratio_mean"]) == pytest.approx(1.0, abs=1e-6)
        assert float(first["policy/loss"]) == pytest.approx(want["on_policy_loss"], abs=1e-6)
        assert float(first["policy/approx_kl"]) < 1e-9
        assert float(first["policy/clip_frac_low"]) == 0 and float(first["policy/clip_frac_high"]) == 0
        # after it the ratio has moved off 1 at every later update
        assert all(float(m["policy/approx_kl"]) > 1e-4 for m in later), later
        bites.extend(float(m["policy/clip_frac_low"]) + float(m["policy/clip_frac_high"]) for m in later)
    assert max(bites) > 0.05  # and the narrow clip bites somewhere (a rollout whose groups all tie has A = 0)


@pytest.mark.slow
def test_lr_scheduler_steps_once_per_optimiser_step(tmp_path):
    lr0 = 1e-3
    module = make(GRPO, update={"epochs": 2, "num_minibatches": 2, "micro_batch_size": 4},
                  objective={"kl_coef": 0.0}, optimizer=partial(torch.optim.AdamW, lr=lr0, weight_decay=0.0),
                  lr_scheduler=partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5))
    steps, cap = OptimizerSteps(), Capture()
    trainer = make_trainer(tmp_path, max_steps=8, callbacks=[steps, cap])
    trainer.fit(module, datamodule())
    # 2 RL steps x 2 epochs x 2 minibatches (each accumulated over 2 micro-batches) = 8 optimiser steps,
    # and the scheduler halved the rate after each one: not per micro-batch, not per RL step
    assert len(cap.rollouts) == 2 and trainer.global_step == 8
    assert steps.lrs == [lr0 * 0.5**k for k in range(8)]
    assert trainer.optimizers[0].param_groups[0]["lr"] == lr0 * 0.5**8
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 8


# ---------------------------------------------------------------------------- c. advantage scaling
def length_reward(completions, **_):
    return [float(len(c)) for c in completions]


@pytest.mark.slow
@pytest.mark.parametrize("scale", [True, False])
def test_scale_advantages_inside_the_module(tmp_path, scale):
    # rewards: exact match + 0.1 x completion length, so groups have many different spreads
    module = make(GRPO, objective={"kl_coef": 0.0}, advantage=GroupNormalized(scale=scale),
                  rewards={"weights": [1.0, 0.1],
                           "functions": ["lightning_rl.step.rewards:exact_match", f"{HERE}:length_reward"]})
    cap = Capture()
    make_trainer(tmp_path, max_steps=1, callbacks=[cap]).fit(module, datamodule())
    (rollout,) = cap.rollouts
    rewards = rollout.rewards.view(4, 4)  # 4 prompts x G = 4, consecutive groups
    centred = rewards - rewards.mean(-1, keepdim=True)
    std = rewards.std(-1, keepdim=True)  # Bessel-corrected, like torch.std
    assert (std > 0).sum() >= 2 and ((std - 1).abs() > 0.1).sum() >= 2  # dividing by it makes a difference
    expected = centred / (std + 1e-8) if scale else centred  # z-scores, or Dr. GRPO's r - mean
    torch.testing.assert_close(rollout.advantages, expected.flatten(), atol=1e-6, rtol=1e-6)
    group_std = rollout.advantages.view(4, 4).std(-1)
    if scale:
        spread = std.flatten() > 0
        torch.testing.assert_close(group_std[spread], torch.ones(int(spread.sum())), atol=1e-5, rtol=0)
    else:
        torch.testing.assert_close(group_std, std.flatten(), atol=1e-6, rtol=0)


# -------------------------------------------------------------------------------- d. chat templates
def test_chat_template_renders_strings_and_messages(tmp_path):
    module = make(policy={"model": templated_model(tmp_path), "chat_template": True,
                          "max_prompt_length": 40})
    messages = [{"role": "system", "content": "sort"}, {"role": "user", "content": "321="}]
    ids, mask = module.encode_prompts(["12345=", messages])
    assert texts(module, ids, mask) == ["<bos><user>12345=<assistant>",
                                        "<bos><system>sort<user>321=<assistant>"]
    # one token per character after a single BOS (the template's, not doubled by the tokenizer's), left-padded
    assert mask.sum(-1).tolist() == [1 + 6 + 6 + 11, 1 + 8 + 4 + 6 + 4 + 11]
    assert mask[0].tolist() == [0] * 10 + [1] * 24
    assert ids[1, 0] == module.tokenizer.bos_token_id and (ids[1] == module.tokenizer.bos_token_id).sum() == 1
    # option off: a plain string is encoded as is (with the tokenizer's BOS); messages are still rendered
    module.codec.chat_template = False
    ids, mask = module.encode_prompts(["12345="])
    assert texts(module, ids, mask) == ["<bos>12345="]
    ids, mask = module.encode_prompts([messages])
    assert texts(module, ids, mask) == ["<bos><system>sort<user>321=<assistant>"]
    # decided row by row: a plain string keeps its BOS in a batch that also holds messages
    ids, mask = module.encode_prompts(["12345=", messages])
    assert texts(module, ids, mask) == ["<bos>12345=", "<bos><system>sort<user>321=<assistant>"]


def test_rollout_prompts_are_rendered_with_the_chat_template(tmp_path):
    rows = [{"prompt": [{"role": "system", "content": "sort"}, {"role": "user", "content": f"{d}="}],
             "answer": "".join(sorted(d))} for d in ("50318", "77120", "90909", "31415", "27182", "11235")]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    module = make(policy={"model": templated_model(tmp_path), "chat_template": True,
                          "max_prompt_length": 40}, objective={"kl_coef": 0.0})
    seen, cap = spy_generations(module), Capture()
    dm = PromptDataModule(path=str(path), batch_size=2)
    make_trainer(tmp_path, max_steps=1, callbacks=[cap]).fit(module, dm)
    ((batch, _),) = seen
    (rollout,) = cap.rollouts
    want = [f"<bos><system>sort<user>{p[1]['content']}<assistant>" for p in batch["prompt"] for _ in range(4)]
    assert texts(module, rollout.prompt_ids, rollout.prompt_mask) == want


def test_chat_template_without_template_names_the_key(tmp_path):
    module = make(policy={"chat_template": True})  # the embedded tokenizer has no chat template
    with pytest.raises(ValueError, match="model.policy.chat_template"):
        module.encode_prompts(["12345="])
    module.codec.chat_template = False
    with pytest.raises(ValueError, match="model.policy.chat_template"):  # messages always need a template
        module.encode_prompts([[{"role": "user", "content": "12345="}]])
    module.codec.chat_template = True
    trainer = make_trainer(tmp_path, max_steps=1)
    with pytest.raises(ValueError, match="model.policy.chat_template"):  # before any generation or step
        trainer.fit(module, datamodule())
    assert trainer.global_step == 0


def test_prompt_length_limit_counts_rendered_tokens(tmp_path):
    # "12345=" is 6 tokens, "<bos><user>12345=<assistant>" 1 + 6 + 6 + 11 = 24 > 20: fails before training
    module = make(policy={"model": templated_model(tmp_path), "chat_template": True,
                          "max_prompt_length": 20})
    trainer = make_trainer(tmp_path, max_steps=1)
    message = r"train prompt at row index 0 is 24 tokens, longer than `model.policy.max_prompt_length`=20"
    with pytest.raises(ValueError, match=message):
        trainer.fit(module, datamodule())
    assert trainer.global_step == 0


# ----------------------------------------------------------------------- e. the correctness function
def odd_length(completions, **_):
    """'Correct' where the completion has an odd number of characters: mixed within most groups."""
    return [len(c) % 2 == 1 for c in completions]


def prompt_starts_low(prompts, **_):
    """Depends on the prompt only, so every group is all-correct or all-wrong."""
    return [float(p[0] < "5") for p in prompts]


@pytest.mark.slow
def test_correctness_fn_decides_rollout_correct_and_the_groups_dapo_keeps(tmp_path):
    module = make(DAPO, rewards={"correctness_fn": f"{HERE}:odd_length", "overlong_buffer": None},
                  filters={"max_gen_batches": 3})
    seen, cap = spy_generations(module), Capture()
    make_trainer(tmp_path, max_steps=1, callbacks=[cap]).fit(module, datamodule())
    (rollout,) = cap.rollouts
    kept = []
    for batch, generated in seen:
        completions = module.decode(generated.completion_ids, generated.attention_mask)
        answers = [a for a in batch["answer"] for _ in range(4)]
        # correctness comes from correctness_fn; the reward is still the configured reward function
        assert generated.correct.tolist() == odd_length(completions)
        assert generated.rewards.tolist() == exact_match(completions, answers)
        keep = dapo_group_keep(generated.correct, 4).repeat_interleave(4)
        kept += list(zip(generated.lengths[keep].tolist(), generated.correct[keep].tolist(),
                         generated.rewards[keep].tolist(), strict=True))
    # the trained rollout is exactly the groups mixed under correctness_fn, in order, up to 4 groups
    assert len(rollout) == min(len(kept), 16) and len(rollout) > 0
    trained = zip(rollout.lengths.tolist(), rollout.correct.tolist(), rollout.rewards.tolist(), strict=True)
    assert list(trained) == kept[:16]
    assert bool(dapo_group_keep(rollout.correct, 4).all())
    # and not the groups exact_match would have kept: some kept group has one reward throughout
    assert (rollout.rewards.view(-1, 4).std(-1) == 0).any()


@pytest.mark.slow
def test_correctness_fn_uniform_per_prompt_drops_every_group(tmp_path):
    module = make(DAPO, rewards={"correctness_fn": f"{HERE}:prompt_starts_low"},
                  filters={"max_gen_batches": 2})
    cap, before = Capture(), params(module)
    trainer = make_trainer(tmp_path, max_steps=1, callbacks=[cap], logger=CSVLogger(str(tmp_path)),
                           log_every_n_steps=1)
    trainer.fit(module, datamodule())
    logged = read_csv_metrics(tmp_path)
    # with exact_match deciding, mixed groups are common (test above); here none can be mixed
    assert logged["rollout/filtered_group_frac"] == [1.0] and logged["rollout/gen_batches"] == [2.0]
    assert len(cap.rollouts[0]) == 0
    after = params(module)  # nothing to learn from: the optimiser step left the policy as it was
    assert all(torch.equal(before[n], after[n]) for n in before)


def shaped_length(completions, **_):
    """A shaped reward that never reaches 1.0: 0.1 per character, at most 0.7."""
    return [min(len(c), 7) / 10 for c in completions]


@pytest.mark.slow
def test_dapo_on_a_shaped_reward_keeps_the_groups_that_score_differently(tmp_path, caplog):
    """No correctness function and a shaped main reward: correctness (full score) is never reached, yet a
    group whose scores differ is informative. Dynamic sampling compares the function's raw score, keeps
    those groups, drops the uniform ones, and the first log line says what it compares."""
    module = make(DAPO, rewards={"functions": [f"{HERE}:shaped_length"], "overlong_buffer": None},
                  filters={"max_gen_batches": 1})
    seen, cap = spy_generations(module), Capture()
    with caplog.at_level(logging.INFO):
        make_trainer(tmp_path, max_steps=1, callbacks=[cap]).fit(module, datamodule())
    ((batch, generated),) = seen
    assert not generated.correct.any()  # nothing reaches the full score
    scores = torch.tensor(shaped_length(module.decode(generated.completion_ids, generated.attention_mask)))
    assert torch.equal(generated.outcome, scores)
    spread = scores.view(-1, 4).amax(-1) > scores.view(-1, 4).amin(-1)
    (rollout,) = cap.rollouts
    assert 0 < len(rollout) == 4 * int(spread.sum())  # every group that scored differently, and only those
    assert (rollout.rewards.view(-1, 4).std(-1) > 0).all()
    assert f"the outcome: the score of `{HERE}:shaped_length`" in caplog.text


@pytest.mark.parametrize("key", ["accuracy_fn", "correctness_fn"])
def test_val_accuracy_is_the_mean_of_the_correctness_function(tmp_path, key):
    # correctness_fn decides val/accuracy as it decides rollout.correct; without it, accuracy_fn does
    module = make(GRPO, rewards={key: f"{HERE}:prompt_starts_low"})
    dm = datamodule(max_val_rows=64, val_batch_size=16)
    (result,) = make_trainer(tmp_path, limit_val_batches=1.0).validate(module, dm, verbose=False)
    expected = sum(r["prompt"][0] < "5" for r in dm.val_rows) / len(dm.val_rows)
    assert 0.2 < expected < 0.8  # a mix: the test tells a mean from a constant
    assert result["val/accuracy"] == pytest.approx(expected, abs=1e-6)


def test_correctness_follows_the_main_reward_unless_accuracy_fn_is_set(caplog):
    """`rewards.functions: [numeric_match]` without `rewards.accuracy_fn`: validation, DAPO's filter and
    predict score correctness with numeric_match (full score), not exact_match, and the first validation
    line says so."""
    from helpers import make

    numeric = make(rewards={"functions": ["lightning_rl.step.rewards:numeric_match"]})
    columns = {"answer": ["12", "12"]}
    assert numeric.evaluator.correct(["q", "q"], ["so it is 12", "13"], columns) == [True, False]
    assert numeric.correctness_fn is numeric.accuracy_fn
    assert "numeric_match (correct at its full score" in numeric.accuracy_name
    weighted = make(rewards={"functions": ["lightning_rl.step.rewards:exact_match",
                                           "lightning_rl.step.rewards:numeric_match"], "weights": [0.5, 1.0]})
    assert weighted.accuracy_name.startswith("lightning_rl.step.rewards:numeric_match")
    explicit = make(rewards={"functions": ["lightning_rl.step.rewards:numeric_match"],
                             "accuracy_fn": "lightning_rl.step.rewards:exact_match"})
    assert explicit.evaluator.correct(["q"], ["so it is 12"], {"answer": ["12"]}) == [False]
    assert explicit.accuracy_name == "lightning_rl.step.rewards:exact_match"


@pytest.mark.slow
def test_validate_and_predict_build_no_reference_fit_does(tmp_path):
    """The KL reference (a whole copy of the policy) is built for fit only, in `setup` before a resumed
    checkpoint's weights load: validate and predict never hold one."""
    from helpers import datamodule, make, make_trainer

    module = make(objective={"kl_coef": 0.04})
    assert "reference" in module.frozen and not module.frozen.is_built("reference")
    make_trainer(tmp_path, limit_val_batches=1).validate(module, datamodule(max_val_rows=4))
    make_trainer(tmp_path).predict(module, datamodule(max_val_rows=4))
    assert not module.frozen.is_built("reference")
    make_trainer(tmp_path).fit(module, datamodule())
    assert module.frozen.is_built("reference") and not module.reference_policy().shares_weights
    assert make(objective={"kl_coef": 0.0}).reference_policy() is None


CALLS = []


def counting_match(completions, answer, **_):
    CALLS.append(len(completions))
    return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]


def test_correctness_from_the_main_reward_reuses_its_scores():
    """The rewards stage scores each function once per batch: correctness that follows the main reward reads
    its values instead of calling it again."""
    from helpers import make

    module = make(rewards={"functions": ["test_online_behaviour:counting_match"]})
    CALLS.clear()
    result = module.reward_pipeline(["q", "q"], ["12", "13"], [2, 2], {"answer": ["12", "12"]})
    assert CALLS == [2] and result.correct.tolist() == [True, False]
