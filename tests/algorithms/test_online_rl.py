"""Tests for the shared online RL step (lightning_rl.algorithms.online.OnlineRL) and its stages, on the
embedded tiny model: micro-batch gradient invariance, behaviour log-probs (on-policy / recomputed once),
end-to-end runs of every algorithm with their metrics, bad input caught before any step, and truncation.
DAPO's dynamic-sampling filter on its own is tested in test_stages.py."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import datamodule, make, make_trainer, read_csv_metrics, sample_round, spy_policy_scoring
from lightning.pytorch.loggers import CSVLogger

from lightning_rl.algorithms import DAPO, GRPO, GSPO, SAPO, OnlineRL
from lightning_rl.callbacks.base import RLCallback
from lightning_rl.data import PromptDataModule
from lightning_rl.maths.advantages import dapo_group_keep
from lightning_rl.maths.aggregation import normalizer_counts
from lightning_rl.maths.penalties import overlong_penalty
from lightning_rl.maths.trust_regions import Clip
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.logprobs import resolve_behaviour, score_rollout
from lightning_rl.step.reward_scorer import RewardError
from lightning_rl.step.rollout import Rollout

HERE = __name__  # reward functions below are named by import path, as in YAML
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


# --------------------------------------------------------------------------------------------- helpers
class Probe(L.Callback):
    """Run ``fn(trainer, module)`` inside a started fit (optimisers, callbacks and data attached), then stop
    before the first training step."""

    def __init__(self, fn):
        self.fn, self.result = fn, None

    def on_train_start(self, trainer, pl_module):
        self.result = self.fn(trainer, pl_module)
        trainer.should_stop = True


def probe(module, fn, tmp_path, dm=None, callbacks=()):
    p = Probe(fn)
    make_trainer(tmp_path, callbacks=[p, *callbacks]).fit(module, dm or datamodule())
    return p.result


def first_batch(trainer):
    return next(iter(trainer.datamodule.train_dataloader()))


def grads(module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.policy.named_parameters() if p.grad is not None}


def max_diff(a, b) -> float:
    assert a.keys() == b.keys() and len(a) > 10
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def norm(g) -> float:
    return math.sqrt(sum(float(v.pow(2).sum()) for v in g.values()))


def params(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.policy.named_parameters()}


class Capture(RLCallback):
    """Keep every final rollout of a step (the object the update uses)."""

    def __init__(self):
        self.rollouts: list[Rollout] = []

    def on_rollout_end(self, trainer, pl_module, rollout):
        self.rollouts.append(rollout)


def sample(module, batch) -> Rollout:
    """The step's sampling stage on ``batch``: G samples per prompt, scored (no advantages yet)."""
    rollout, _ = sample_round(module, batch, Collectives(module.trainer))
    return rollout


def logprobs(module, rollout, scorer=None) -> torch.Tensor:
    """``[N, C]`` log-probs of the rollout's tokens under ``scorer`` (default: the policy), as the step's
    log-prob passes score them (the rollout's temperature, the updater's micro-batches)."""
    scorer = module.policy if scorer is None else scorer
    joiner = module.policy if scorer is module.policy or getattr(scorer, "shares_weights", False) else None
    return score_rollout(scorer, rollout, micro_batch_size=module.updater.micro_batch_size,
                         collectives=Collectives(module.trainer), joiner=joiner)


def update(module, rollout) -> None:
    """One optimiser step of the module's updater on ``rollout`` (one minibatch, its micro-batches)."""
    for _ in module.updater.update(rollout, module.trained_models(), module.update_hooks(),
                                   Collectives(module.trainer)):
        pass


def behaviour_passes(module):
    """The step's reference and behaviour log-prob stages as the module declares them now (its first two
    learner stages), run one after the other."""
    reference, behaviour = module.online.learner_stages(module.preset_stages())[:2]

    def run(rollout, collectives):
        rollout, _ = reference(rollout, collectives)
        return behaviour(rollout, collectives)

    return run


# reward functions named by path -------------------------------------------------------------------------
def raising_reward(completions, **_):
    raise ZeroDivisionError("bad reward code")


def nan_reward(completions, **_):
    return [math.nan if i == 2 else 0.0 for i in range(len(completions))]


def aligned_or_nan(prompts, completions, answer, **_):
    """1 for every sample except NaN at every 4th; raises if the answer column is misaligned with prompts."""
    for p, a in zip(prompts, answer, strict=True):
        if a != "".join(sorted(p.rstrip("="))):
            raise AssertionError("dataset columns not aligned with prompts")
    return [math.nan if i % 4 == 0 else 1.0 for i in range(len(completions))]


CALLS = {"n": 0}


def counting_reward(completions, **_):
    CALLS["n"] += 1
    return [0.0] * len(completions)


# ----------------------------------------------------------------------------- a. gradient invariance
def prepare_rollout(module, trainer, seed=0) -> Rollout:
    """A real rollout made harder: rows of different lengths, two fully masked rows, off-policy old
    log-probs (the clip bites on both sides), advantages of both signs, a perturbed reference."""
    rollout = sample(module, first_batch(trainer))
    g = torch.Generator().manual_seed(seed)
    mask = rollout.attention_mask.clone()
    mask[3] = 0
    mask[9] = 0
    mask[5, 2:] = 0
    mask[12, 4:] = 0
    rollout.attention_mask, rollout.loss_mask = mask, mask.clone()  # out of the context and of the loss
    logp = logprobs(module, rollout)
    noise = torch.randn(logp.shape, generator=g) * 0.3
    rollout.old_logp = torch.where(mask.bool(), logp + noise, 0.0)
    rollout.ref_logp = torch.where(mask.bool(), logp + torch.randn(logp.shape, generator=g) * 0.2, 0.0)
    rollout.advantages = torch.randn(len(rollout), generator=g)
    return rollout


def update_grads(module, rollout, micro_batch_size, aggregation) -> dict[str, torch.Tensor]:
    module.updater.micro_batch_size = micro_batch_size
    # the completion budget, as training sets it (`None` would be each micro-batch's own width)
    module.objective = dataclasses.replace(module.objective, aggregation=aggregation, aggregation_length=8)
    before = params(module)
    update(module, rollout)
    assert max_diff(before, params(module)) == 0  # SGD with lr 0: the step leaves the policy unchanged
    return grads(module)


@pytest.mark.slow
def test_gradient_does_not_depend_on_micro_batch_size(tmp_path):
    module = make(OnlineRL, objective={"trust_region": Clip(0.2, 0.28), "kl_coef": 0.1},
                  update={"max_grad_norm": None}, optimizer=partial(torch.optim.SGD, lr=0.0))

    def experiment(trainer, module):
        rollout = prepare_rollout(module, trainer)
        mask = rollout.loss_mask.bool()
        lengths = mask.sum(-1)
        assert len(rollout) == 16 and len(set(lengths.tolist())) >= 3 and (lengths == 0).sum() == 2
        r = torch.exp(logprobs(module, rollout) - rollout.old_logp)[mask]
        adv = rollout.advantages[:, None].expand_as(mask)[mask]
        assert ((r > 1.28) & (adv > 0)).any() and ((r < 0.8) & (adv < 0)).any()  # clipped on both sides
        out = {}
        for mode in AGGS:
            whole = update_grads(module, rollout, None, mode)
            for micro in (1, 3):  # 3 does not divide 16: the last micro-batch has one row
                out[(mode, micro)] = (max_diff(update_grads(module, rollout, micro, mode), whole),
                                      norm(whole))
        # control: normalising each micro-batch by its own counts changes the gradient
        original = module.policy_loss

        def local_counts(micro, num_tokens, num_seqs):
            return original(micro, *normalizer_counts(micro.loss_mask))

        module.policy_loss = local_counts  # trained_models() reads it at call time
        for mode in AGGS:
            out[(mode, "local")] = max_diff(update_grads(module, rollout, 1, mode),
                                            update_grads(module, rollout, None, mode))
        del module.policy_loss  # the class's method again
        return out

    out = probe(module, experiment, tmp_path)
    for mode in AGGS:
        for micro in (1, 3):
            diff, scale = out[(mode, micro)]
            assert scale > 1e-2, mode  # a real gradient
            # float rounding only: a micro-batch's rows share their prompts' forward only within it
            assert diff < 1e-5, (mode, micro, diff)
        assert out[(mode, "local")] > 1e-3, mode


@pytest.mark.slow
def test_micro_batches_on_a_single_device_match_the_whole_batch_step(tmp_path):
    """Through ``fit``: micro-batches of 2 rows, skipping the rows without signal (a group whose rewards are
    all equal), make the whole-batch step without skipping (same rollout, same SGD update)."""
    runs = {}
    for micro in (None, 2):
        module = make(GRPO, objective={"kl_coef": 0.0},
                      update={"micro_batch_size": micro, "max_grad_norm": None,
                              "skip_zero_rows": bool(micro)},
                      optimizer=partial(torch.optim.SGD, lr=1.0))
        before, sizes, original = params(module), [], module.policy_loss

        def counting(m, num_tokens, num_seqs, original=original, sizes=sizes):
            sizes.append(len(m))
            return original(m, num_tokens, num_seqs)

        module.policy_loss = counting
        cap = Capture()
        trainer = make_trainer(tmp_path / str(micro), max_steps=1, callbacks=[cap])
        trainer.fit(module, datamodule())
        assert trainer.global_step == 1
        step = {n: v - before[n] for n, v in params(module).items()}
        runs[micro] = (sizes, cap.rollouts[0], step)
    (whole_sizes, whole_rollout, whole_step), (micro_sizes, micro_rollout, micro_step) = runs[None], runs[2]
    assert torch.equal(whole_rollout.completion_ids, micro_rollout.completion_ids)
    reached = int((micro_rollout.advantages != 0).sum())
    assert whole_sizes == [16] and set(micro_sizes) == {2} and sum(micro_sizes) == reached < 16
    assert norm(whole_step) > 1e-2  # a real step (lr 1: the step is minus the gradient)
    assert max_diff(whole_step, micro_step) < 1e-6


# ------------------------------------------------------------------------------ b. behaviour log-probs
@pytest.mark.slow
def test_single_update_skips_the_old_policy_forward_pass(tmp_path, monkeypatch):
    module = make(GRPO, objective={"kl_coef": 0.0})
    cap = Capture()
    policy_logprob_calls = spy_policy_scoring(monkeypatch, module)
    trainer = make_trainer(tmp_path, max_steps=2, callbacks=[cap])
    trainer.fit(module, datamodule())
    assert trainer.global_step == 2 and len(cap.rollouts) == 2
    per_rollout = module.updater.updates_per_rollout
    assert resolve_behaviour(module.online.behaviour, per_rollout, module.engine) == "on_policy"  # `auto`
    assert policy_logprob_calls == []  # no behaviour forward pass at all
    assert all(r.old_logp is None for r in cap.rollouts)


@pytest.mark.slow
def test_single_update_gradient_equals_recorded_old_logprobs(tmp_path, monkeypatch):
    module = make(GRPO, update={"max_grad_norm": None}, optimizer=partial(torch.optim.SGD, lr=0.0))
    policy_calls = spy_policy_scoring(monkeypatch, module)

    def experiment(trainer, module):
        collectives = Collectives(trainer)
        rollout = sample(module, first_batch(trainer))
        rollout.advantages = torch.randn(len(rollout), generator=torch.Generator().manual_seed(1))
        rollout, _ = behaviour_passes(module)(rollout, collectives)
        torch.testing.assert_close(rollout.ref_logp, logprobs(module, rollout, module.reference_policy()),
                                   atol=0, rtol=0)
        assert rollout.old_logp is None and policy_calls == []  # on-policy: no behaviour forward
        update(module, rollout)
        skipped = grads(module)
        rollout.old_logp = logprobs(module, rollout)  # recorded explicitly: the behaviour policy's
        update(module, rollout)
        recorded = grads(module)
        # with 2 updates per rollout the passes record exactly these log-probs, with one forward pass
        module.updater.num_minibatches = 2
        rollout.old_logp = None
        rollout, _ = behaviour_passes(module)(rollout, collectives)
        assert policy_calls == [len(rollout)]
        torch.testing.assert_close(rollout.old_logp, logprobs(module, rollout), atol=0, rtol=0)
        module.updater.num_minibatches = 1
        return skipped, recorded

    skipped, recorded = probe(module, experiment, tmp_path)
    assert norm(skipped) > 1e-2
    assert max_diff(skipped, recorded) < 1e-6


class OldLogpCheck(RLCallback):
    """At each update of a step (at its loss, before the optimiser step) compare the rollout's old
    log-probs with the policy's current ones: equal before the first step, different after it."""

    def __init__(self, module):
        self.rollout, self.checks = None, []
        original = module.policy_loss

        def policy_loss(micro, num_tokens, num_seqs):
            current = logprobs(module, self.rollout)
            self.checks.append((self.seen, float((current - self.rollout.old_logp).abs().max())))
            self.seen += 1
            return original(micro, num_tokens, num_seqs)

        module.policy_loss = policy_loss

    def on_rollout_end(self, trainer, pl_module, rollout):
        self.rollout, self.seen = rollout, 0


@pytest.mark.slow
def test_two_minibatches_record_old_logprobs_once_per_step(tmp_path, monkeypatch):
    # every row in the update (no skipping), so that each optimiser step sees its whole minibatch
    module = make(GRPO, update={"num_minibatches": 2, "skip_zero_rows": False}, objective={"kl_coef": 0.0})
    policy_logprob_calls = spy_policy_scoring(monkeypatch, module)
    cap, check = Capture(), OldLogpCheck(module)
    # 2 RL steps x 2 optimiser steps
    trainer = make_trainer(tmp_path, max_steps=4, callbacks=[cap, check])
    trainer.fit(module, datamodule())
    assert trainer.global_step == 4 and len(cap.rollouts) == 2
    assert policy_logprob_calls == [16, 16]  # one behaviour pass per rollout, over all of it
    for r in cap.rollouts:
        assert r.old_logp is not None and r.old_logp.shape == r.attention_mask.shape
    first = [d for i, d in check.checks if i == 0]
    second = [d for i, d in check.checks if i == 1]
    assert len(first) == 2 and len(second) == 2 and len(check.checks) == 4
    assert max(first) < 1e-6  # recorded from the behaviour policy, before any step
    assert min(second) > 1e-6  # the second minibatch is off-policy: the recorded values were kept


# ------------------------------------------------------------------------------------- c. end to end
COMMON = ["rollout/reward_mean", "rollout/reward_std", "rollout/response_length_mean",
          "rollout/truncated_frac", "rollout/zero_std_group_frac", "policy/loss", "policy/approx_kl",
          "policy/entropy", "policy/ratio_mean", "policy/grad_norm", "val/accuracy", "val/reward_mean",
          "perf/step_time", "perf/generation_time", "perf/tokens_per_sec"]
CLIP = ["policy/clip_frac_low", "policy/clip_frac_high"]


@pytest.mark.parametrize(("cls", "kw", "max_steps", "rl_steps", "extra", "absent"), [
    (GRPO, {}, 3, 3, ["policy/kl_ref", *CLIP], ["policy/gate_weight_mean"]),
    (GSPO, {"update": {"num_minibatches": 2}}, 4, 2, CLIP, ["policy/kl_ref", "policy/gate_weight_mean"]),
    (DAPO, {}, 3, 3, [*CLIP, "rollout/filtered_group_frac", "rollout/gen_batches"],
     ["policy/kl_ref", "policy/gate_weight_mean"]),
    (SAPO, {}, 3, 3, ["policy/gate_weight_mean"], ["policy/kl_ref", *CLIP]),  # a soft gate: nothing clips
], ids=["GRPO", "GSPO", "DAPO", "SAPO"])
@pytest.mark.slow
def test_end_to_end(tmp_path, cls, kw, max_steps, rl_steps, extra, absent):
    module = make(cls, **kw)
    before = params(module)
    cap, generated, original = Capture(), [], module.online.sampler

    def spy(batch, io, **kwargs):  # every generation round (refills too), with its RL step
        rollout, stats = original(batch, io, **kwargs)
        generated.append((module.trainer.fit_loop.total_batch_idx, rollout))
        return rollout, stats

    module.rollouts.sampler = spy
    trainer = make_trainer(tmp_path, max_steps=max_steps, callbacks=[cap], logger=CSVLogger(str(tmp_path)),
                           limit_val_batches=1, val_check_interval=rl_steps, check_val_every_n_epoch=None,
                           log_every_n_steps=1)
    trainer.fit(module, datamodule())
    assert trainer.global_step == max_steps and len(cap.rollouts) == rl_steps
    assert max_diff(before, params(module)) > 0  # AdamW without weight decay: only a gradient moves it

    logged = read_csv_metrics(tmp_path)
    for name in COMMON + extra:
        assert name in logged, (name, sorted(logged))
        assert all(math.isfinite(v) for v in logged[name]), name
    for name in absent:
        assert name not in logged, name
    for name in ("policy/loss", "rollout/reward_mean", "perf/step_time"):
        assert len(logged[name]) == rl_steps, name  # once per RL step
    # validation ran once, after the last step, on the 16 held-out prompts: recompute it with the final policy
    val = module.trainer.datamodule.val_rows
    greedy, _ = module.completer.greedy([r["prompt"] for r in val])
    accuracy = sum(g.strip() == r["answer"] for g, r in zip(greedy, val, strict=True)) / len(val)
    assert logged["val/accuracy"] == [pytest.approx(accuracy, abs=1e-6)]
    assert logged["val/reward_mean"] == [pytest.approx(accuracy, abs=1e-6)]  # the reward is exact match too
    assert all(v > 0 for v in logged["perf/tokens_per_sec"] + logged["perf/generation_time"])
    assert all(v > 0 for v in logged["policy/entropy"])
    # the logged rollout statistics are those of the rollouts trained on
    for k, r in enumerate(cap.rollouts):
        groups = r.rewards.view(-1, 4)
        want = {"rollout/reward_mean": r.rewards.mean(), "rollout/reward_std": r.rewards.std(),
                "rollout/response_length_mean": r.lengths.float().mean(),
                "rollout/truncated_frac": r.truncated.float().mean(),
                "rollout/zero_std_group_frac": (groups.std(-1) == 0).float().mean()}
        for name, value in want.items():
            assert logged[name][k] == pytest.approx(float(value), abs=1e-6), (name, k)
        # a gradient exactly when some advantage is non-zero (or a KL term pulls, after the first step)
        if (r.advantages != 0).any():
            assert logged["policy/grad_norm"][k] > 1e-4, k
        elif module.reference_policy() is None:
            assert logged["policy/grad_norm"][k] == 0, k
    if cls is GRPO:  # one update per rollout: the ratio is exactly 1, nothing clips, KL(old || new) is 0
        assert logged["policy/ratio_mean"] == [1.0] * 3 and logged["policy/approx_kl"] == [0.0] * 3
        assert logged["policy/clip_frac_low"] == [0.0] * 3 and logged["policy/clip_frac_high"] == [0.0] * 3
        assert logged["policy/kl_ref"][0] == pytest.approx(0.0, abs=1e-7)  # step 0: policy == reference
        assert max(logged["policy/kl_ref"]) > 0
        # step 0: r = 1 and KL 0, so the loss is -mean_i A_i; z-scored advantages sum to 0 in every group
        assert logged["policy/loss"][0] == pytest.approx(0.0, abs=1e-6)
        # the reference is the starting policy, frozen, and not part of the checkpointed state
        ref = dict(module.reference_policy().named_parameters())
        assert ref.keys() == before.keys() and all(torch.equal(ref[n], v) for n, v in before.items())
        assert all(k.startswith("policy.") for k in module.state_dict())  # no reference, no frozen model
    else:
        assert module.reference_policy() is None and "reference" not in module.frozen  # no KL term: none
    if cls is GSPO:  # the second minibatch of each rollout is off-policy: the step's mean KL is above 0
        assert all(v > 1e-6 for v in logged["policy/approx_kl"]), logged["policy/approx_kl"]
    if cls is DAPO:
        for k, r in enumerate(cap.rollouts):  # only groups of mixed correctness, at most the target count
            assert len(r) <= 16 and len(r) % 4 == 0
            assert bool(dapo_group_keep(r.correct, 4).all())
            # the filter's statistics, recounted from every generation round of the step
            rounds = [g for step, g in generated if step == k]
            mixed = sum(int(dapo_group_keep(g.correct, 4).sum()) for g in rounds)
            assert logged["rollout/gen_batches"][k] == len(rounds) and 1 <= len(rounds) <= 3
            dropped = 1 - mixed / (4 * len(rounds))
            assert logged["rollout/filtered_group_frac"][k] == pytest.approx(dropped, abs=1e-6)
            assert len(r) == 4 * min(mixed, 4)
    if cls is SAPO:  # on-policy the gate weight is 4 sigmoid(0) (1 - sigmoid(0)) = 1 exactly
        assert logged["policy/gate_weight_mean"] == [pytest.approx(1.0, abs=1e-6)] * 3


# ------------------------------------------------------------------------------ e. bad input, early
def fit_expecting(module, tmp_path, exc, match, dm=None):
    before = params(module)
    trainer = make_trainer(tmp_path, max_steps=2)
    with pytest.raises(exc, match=match):
        trainer.fit(module, dm or datamodule())
    assert trainer.global_step == 0  # no optimiser step happened
    assert max_diff(before, params(module)) == 0
    return trainer


@pytest.mark.slow
def test_raising_reward_names_the_function(tmp_path):
    module = make(rewards={"functions": [f"{HERE}:raising_reward"]})
    fit_expecting(module, tmp_path, RewardError,
                  rf"`{HERE}:raising_reward` raised ZeroDivisionError: bad reward code")


def test_nan_reward_names_function_and_sample(tmp_path):
    module = make(rewards={"functions": ["lightning_rl.step.rewards:exact_match", f"{HERE}:nan_reward"]})
    fit_expecting(module, tmp_path, RewardError, rf"`{HERE}:nan_reward` returned nan for sample 2")


@pytest.mark.slow
def test_reward_errors_zero_mode_scores_zero_and_counts(tmp_path):
    module = make(rewards={"functions": [f"{HERE}:aligned_or_nan"], "on_error": "zero"})
    cap = Capture()
    trainer = make_trainer(tmp_path, max_steps=2, callbacks=[cap], logger=CSVLogger(str(tmp_path)),
                           log_every_n_steps=1)
    trainer.fit(module, datamodule())
    # 16 samples per step, NaN at rows 0, 4, 8, 12 -> 4 errors scored 0, 12 scored 1
    expected = torch.tensor([0.0, 1.0, 1.0, 1.0] * 4)
    for r in cap.rollouts:
        assert torch.equal(r.rewards, expected)
    logged = read_csv_metrics(tmp_path)
    assert logged["rollout/reward_errors"] == [4.0, 4.0]
    assert logged["rollout/reward_mean"] == [0.75, 0.75]
    # Bessel std of twelve 1s and four 0s: sqrt((4 * .75^2 + 12 * .25^2) / 15) = sqrt(0.2)
    assert logged["rollout/reward_std"] == pytest.approx([math.sqrt(0.2)] * 2, rel=1e-6)
    assert logged["rollout/zero_std_group_frac"] == [0.0, 0.0]


def write_jsonl(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "answer": "".join(sorted(p.rstrip("=")))}) + "\n"
                            for p in prompts))
    return path


def test_long_prompt_fails_in_on_fit_start_naming_the_row(tmp_path):
    CALLS["n"] = 0
    prompts = ["12345=", "54321=", "1234567890123456789=", "11111="]
    dm = PromptDataModule(path=str(write_jsonl(tmp_path / "p.jsonl", prompts)), batch_size=2)
    module = make(rewards={"functions": [f"{HERE}:counting_reward"]})
    steps = []
    module.training_step = lambda *a, **k: steps.append(1)
    fit_expecting(module, tmp_path, ValueError, r"train prompt at line 3 of .*p\.jsonl is 20 tokens, "
                                                r"longer than `model.policy.max_prompt_length`=16", dm=dm)
    assert steps == [] and CALLS["n"] == 0  # before any training step or generation


def test_long_prompt_is_found_past_the_first_thousand_rows(tmp_path):
    # the check works in chunks of 1024 prompts: a long one in the second chunk must be found too
    prompts = ["12345="] * 1500
    prompts[1400] = "1234567890123456789="
    dm = PromptDataModule(path=str(write_jsonl(tmp_path / "p.jsonl", prompts)), batch_size=2)
    message = r"train prompt at line 1401 of .*p\.jsonl is 20 tokens"
    fit_expecting(make(), tmp_path, ValueError, message, dm=dm)


def bos_model(tmp_path) -> Path:
    """The embedded model whose tokenizer adds <bos> to every encoding (as Llama / Gemma tokenizers do)."""
    from lightning_rl.models.builtin import EMBEDDED_MODEL

    folder = tmp_path / "bos_model"
    shutil.copytree(EMBEDDED_MODEL, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<bos>": {"id": "<bos>", "ids": [1], "tokens": ["<bos>"]}},
    }
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


def test_bos_model_fixture_adds_bos(tmp_path):
    module = make(policy={"model": str(bos_model(tmp_path)), "max_prompt_length": 6})
    assert module.tokenizer("12345=")["input_ids"] == [module.tokenizer.bos_token_id] + module.tokenizer(
        "12345=", add_special_tokens=False)["input_ids"]
    ids, _ = module.encode_prompts(["1234="])  # 5 characters + BOS = 6 tokens: fits
    assert ids.shape == (1, 6)


def test_prompt_too_long_only_with_bos_fails_before_training(tmp_path):
    # sort prompts are 6 characters; with <bos> they are 7 tokens > max_prompt_length 6: the promised
    # early error (naming `model.policy.max_prompt_length`) must come in on_fit_start, not from the first step
    module = make(policy={"model": str(bos_model(tmp_path)), "max_prompt_length": 6})
    fit_expecting(module, tmp_path, ValueError, "model.policy.max_prompt_length")


@pytest.mark.parametrize(("cls", "kw", "key"), [
    (GRPO, {"sampling": {"num_generations": 1}}, "model.sampling.num_generations"),
    (GRPO, {"rewards": {"functions": ["lightning_rl.step.rewards:exact_match"], "weights": [1.0, 2.0]}},
     "model.rewards.weights"),
    (DAPO, {"rewards": {"overlong_buffer": 9}}, "model.rewards.overlong_buffer"),
    (GRPO, {"update": {"micro_batch_size": 0}}, "model.update.micro_batch_size"),
    (GRPO, {"update": {"epochs": 0}}, "model.update.epochs"),
    (GRPO, {"update": {"num_minibatches": 0}}, "model.update.num_minibatches"),
    (GRPO, {"rewards": {"on_error": "ignore"}}, "model.rewards.on_error"),
    (GRPO, {"objective": {"aggregation": "sum"}}, "model.objective.aggregation"),
    (SAPO, {"objective": {"kl_clamp": 0.0}}, "model.objective.kl_clamp"),
    (GRPO, {"policy": {"model": "builtin:nope"}}, "model.policy.model"),
])
def test_config_errors_name_the_key(cls, kw, key):
    with pytest.raises(ValueError, match=key):
        make(cls, **kw)


def overlong_buffer(module):
    """The overlong shaping's buffer as the reward pipeline applies it (``None``: no shaping)."""
    overlong = module.reward_pipeline.overlong
    return None if overlong is None else overlong[1]


def test_dapo_overlong_buffer_defaults():
    assert overlong_buffer(make(DAPO, sampling={"max_new_tokens": 10})) == 2  # a fifth of max_new_tokens
    assert overlong_buffer(make(DAPO, sampling={"max_new_tokens": 4})) == 1
    assert overlong_buffer(make(DAPO, rewards={"overlong_buffer": 0})) is None  # 0 turns it off
    assert overlong_buffer(make(DAPO, rewards={"overlong_buffer": 8})) == 8
    # the shaping is over the module's real max_new_tokens, with the configured factor
    shaped = make(DAPO, rewards={"overlong_buffer": 8, "overlong_penalty_factor": 0.5})
    assert shaped.reward_pipeline.overlong == (8, 8, 0.5)
    # resolved inside OnlineRL from the module's real max_new_tokens, for any preset
    auto = make(GRPO, rewards={"overlong_buffer": "auto"}, sampling={"max_new_tokens": 20})
    assert overlong_buffer(auto) == 4
    assert overlong_buffer(make(GRPO)) is None  # off unless asked for
    with pytest.raises(ValueError, match="model.rewards.overlong_buffer"):
        make(DAPO, sampling={"max_new_tokens": 8}, rewards={"overlong_buffer": 9})


# ---------------------------------------------------------------------------- f. truncation, overlong
@pytest.mark.slow
def test_mask_truncated_zeroes_truncated_rows(tmp_path):
    module = make(GRPO, sampling={"max_new_tokens": 2}, filters={"mask_truncated": True},
                  objective={"kl_coef": 0.0}, update={"max_grad_norm": None},
                  optimizer=partial(torch.optim.SGD, lr=0.0))

    def experiment(trainer, module):
        batch = first_batch(trainer)
        rollout = sample(module, batch)
        module.online.sampler.mask_truncated = False
        plain = sample(module, batch)
        module.online.sampler.mask_truncated = True
        rollout.advantages = torch.randn(len(rollout), generator=torch.Generator().manual_seed(0))
        update(module, rollout)
        return rollout, plain, grads(module)

    rollout, plain, g = probe(module, experiment, tmp_path)
    # sort answers need 6 tokens: with a budget of 2 every completion is truncated
    assert rollout.truncated.all()
    assert rollout.loss_mask.sum() == 0
    assert rollout.attention_mask.sum(-1).tolist() == [2] * 16  # out of the loss, still in the context
    assert rollout.lengths.tolist() == [2] * 16  # the sampled length, whatever the loss mask says
    assert plain.loss_mask.sum(-1).tolist() == [2] * 16  # without the option they count
    # nothing counts in the loss: a zero, finite gradient
    assert all(torch.isfinite(v).all() and (v == 0).all() for v in g.values())


def test_dapo_overlong_penalty_shapes_rewards_not_correctness(tmp_path):
    module = make(DAPO, sampling={"max_new_tokens": 8},
                  rewards={"overlong_buffer": 4, "overlong_penalty_factor": 0.5},
                  filters={"dynamic_sampling": False})

    def experiment(trainer, module):
        batch = first_batch(trainer)
        rollout = sample(module, batch)
        texts = module.decode(rollout.completion_ids, rollout.attention_mask)
        answers = [a for a in batch["answer"] for _ in range(4)]
        return rollout, texts, answers

    rollout, texts, answers = probe(module, experiment, tmp_path)
    exact = torch.tensor([float(t.strip() == a) for t, a in zip(texts, answers, strict=True)])
    lengths = rollout.lengths.float()
    # by hand: expected length 8 - 4 = 4; L <= 4 -> 0, 4 < L <= 8 -> (4 - L) / 4, L > 8 -> -1
    penalty = torch.tensor([0.0 if n <= 4 else (4 - n) / 4 if n <= 8 else -1.0 for n in lengths.tolist()])
    torch.testing.assert_close(penalty, overlong_penalty(rollout.lengths, 8, 4).float())
    assert (penalty < 0).any()
    torch.testing.assert_close(rollout.rewards, exact + 0.5 * penalty)
    assert rollout.correct.tolist() == exact.bool().tolist()  # correctness is not shaped
