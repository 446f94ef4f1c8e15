"""The lower-precision rollout engine (``CopyEngine``) and the off-policy correction of its mismatch."""

from __future__ import annotations

import dataclasses
import json
import math
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers import CONFIGS, datamodule, logprobs, make, make_trainer, run_cli, scalars, update

from lightning_rl.algorithms import GRPO
from lightning_rl.callbacks import RLCallback
from lightning_rl.models.loading import load_policy
from lightning_rl.step.correction import RolloutCorrection
from lightning_rl.step.engine import CopyEngine
from lightning_rl.step.rollout import Rollout

HERE = Path(__file__).resolve().parents[1]  # tests/


class Record(RLCallback):
    def __init__(self) -> None:
        self.rollouts, self.stats, self.engine_diff = [], [], []

    def on_rollout_end(self, trainer, pl_module, rollout):
        self.rollouts.append(rollout)
        engine = dict(pl_module.engine.copy.model.named_parameters())
        self.engine_diff.append(max(
            (engine[n].float() - p.detach().to(engine[n].dtype).float()).abs().max().item()
            for n, p in pl_module.policy.model.named_parameters()))

    def on_step_end(self, trainer, pl_module, stats):
        self.stats.append(dict(stats))


def _fit(tmp_path, engine, steps=2, **kw):
    torch.manual_seed(0)
    module = make(GRPO, engine=engine, objective={"kl_coef": 0.0}, **kw)
    record = Record()
    make_trainer(tmp_path, max_steps=steps, callbacks=[record]).fit(module, datamodule(batch_size=2))
    return module, record


def test_fp32_copy_gives_the_trainers_logprobs_and_unit_weights(tmp_path):
    """No mismatch, no correction: the engine's log-probs equal the recomputed behaviour log-probs and every
    weight is 1."""
    module, record = _fit(tmp_path, CopyEngine("float32"))
    for rollout, stats in zip(record.rollouts, record.stats, strict=True):
        mask = rollout.loss_mask.bool()
        torch.testing.assert_close(rollout.rollout_logp[mask], rollout.old_logp[mask], atol=1e-5, rtol=0)
        # 1 up to float rounding (the sampler decodes incrementally, the trainer scores in one pass)
        torch.testing.assert_close(rollout.is_weights[mask], torch.ones_like(rollout.is_weights[mask]),
                                   atol=2e-5, rtol=0)
        assert stats["rollout/mismatch_k3"] < 1e-9 and stats["rollout/is_clipped_frac"] == 0.0
    assert record.engine_diff == [0.0, 0.0]  # synced before each rollout


@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=pytest.mark.slow), "float16"])
def test_a_half_precision_engine_is_synced_every_step_and_its_gap_is_measured(tmp_path, dtype):
    module, record = _fit(tmp_path, CopyEngine(dtype), steps=3,
                          optimizer=partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.0))
    assert next(module.engine.copy.model.parameters()).dtype == getattr(torch, dtype)
    assert record.engine_diff == [0.0, 0.0, 0.0]  # the cast trained weights, exactly, after each sync
    for rollout, stats in zip(record.rollouts, record.stats, strict=True):
        assert rollout.old_logp is not rollout.rollout_logp  # recomputed by the trainer
        assert 0 < stats["rollout/logp_diff_mean"] < 0.1 and stats["rollout/mismatch_k3"] >= 0
        assert "perf/weight_sync_time" in stats
    # the fp32 master weights moved; the engine follows them, it does not replace them
    assert next(module.policy.model.parameters()).dtype == torch.float32


def test_an_fp16_copy_scores_closer_to_the_fp32_trainer_than_a_bf16_copy():
    """The same weights (the policy's, cast by ``sync_weights``) score the same sampled tokens: float16
    keeps 10 mantissa bits, bfloat16 7, so the fp16 copy's log-probs are several times closer to the fp32
    trainer's (Qi et al. 2025, "Defeating the Training-Inference Mismatch via FP16"). No sampling in the
    comparison: deterministic."""
    policy = load_policy("builtin:tiny-sort")
    policy.disable_dropout()
    ids, mask = policy.encode_prompts(["12345=", "907=", "5555123=", "31="])
    torch.manual_seed(0)
    gen = policy.generate(ids, mask, num_samples=4, max_new_tokens=8)
    tokens = (gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask)
    valid = gen.completion_mask.bool()
    with torch.no_grad():
        trainer, _ = policy.token_logprobs(*tokens)
        gap = {}
        for dtype in ("bfloat16", "float16"):
            engine = CopyEngine(dtype)
            engine.attach(policy)
            engine_logp, _ = engine.copy.token_logprobs(*tokens)
            gap[dtype] = (engine_logp - trainer)[valid].abs().mean().item()
    assert valid.sum() > 20 and 0 < gap["float16"] < 0.5 * gap["bfloat16"], gap


class StaleEngine(CopyEngine):
    """Syncs only on the first call: from the second step on it samples with weights one update old."""

    def sync_weights(self, policy, version=None):
        if getattr(self, "synced_once", False):
            return
        super().sync_weights(policy, version)
        self.synced_once = self.copy is not None


def test_a_stale_engine_is_corrected(tmp_path):
    module, record = _fit(tmp_path, StaleEngine("float32"), steps=2,
                          optimizer=partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.0))
    fresh, stale = record.rollouts
    mask = stale.loss_mask.bool()
    torch.testing.assert_close(fresh.is_weights[fresh.loss_mask.bool()],
                               torch.ones(int(fresh.loss_mask.sum())), atol=2e-5, rtol=0)
    weights = stale.is_weights[mask]
    assert (weights != 1).float().mean() > 0.5 and weights.max() <= 2.0  # truncated at the cap
    assert record.stats[1]["rollout/mismatch_k3"] > 1e-4
    assert all(math.isfinite(s["perf/step_time"]) for s in record.stats)
    assert all(torch.isfinite(p).all() for p in module.policy.parameters())


# the corrections the gradient equalities below run with: TIS, a sequence MIS, a two-sided token mask
# (OpenRLHF's ICEPOP) and a geometric sequence mask (verl's geometric level); the engine's noise (0.3 per
# token) makes each bound bite
CORRECTIONS = {
    "token-truncate": dict(level="token", mode="truncate", cap=1.5),
    "sequence-mask": dict(level="sequence", mode="mask", cap=1.5),
    "token-mask-two-sided": dict(level="token", mode="mask", cap=1.5, low=0.8),
    "geometric-mask": dict(level="geometric", mode="mask", cap=1.1, low=0.9),
}


def _check_the_bounds_bite(rollout: Rollout, stats: dict, options: dict) -> None:
    """The correction changed weights (so the equalities can fail): clipped, and masked in mask mode, the
    lower bound on some token of the two-sided mask, some whole rows (not all) at geometric level."""
    assert stats["rollout/is_clipped_frac"] > 0
    if options["mode"] == "mask":
        assert stats["rollout/is_masked_frac"] > 0
    if options["level"] == "token" and options.get("low"):  # dropped below the lower bound
        raw = torch.exp(rollout.old_logp - rollout.rollout_logp)
        assert ((rollout.is_weights == 0) & (raw < options["low"]) & rollout.loss_mask.bool()).any()
    if options["level"] == "geometric":
        assert 0 < stats["rollout/seq_masked_frac"] < 1


@pytest.mark.slow
@pytest.mark.parametrize("options", CORRECTIONS.values(), ids=CORRECTIONS.keys())
def test_gradient_with_the_correction_does_not_depend_on_micro_batch_size(tmp_path, options):
    grads = {}
    for micro in (None, 3):
        module = make(GRPO, objective={"kl_coef": 0.0},
                      update={"micro_batch_size": micro, "max_grad_norm": None},
                      logprobs={"correction": RolloutCorrection(**options)},
                      optimizer=partial(torch.optim.SGD, lr=0.0))
        make_trainer(tmp_path, max_steps=0).fit(module, datamodule(batch_size=2))
        module.policy.disable_dropout()
        ids, mask = module.encode_prompts(["12345=", "907=", "5555123="])
        torch.manual_seed(0)
        gen = module.policy.generate(ids, mask, num_samples=4, max_new_tokens=8)

        g = torch.Generator().manual_seed(1)
        rollout = Rollout.from_generation(gen, torch.arange(3).repeat_interleave(4),
                                          torch.rand(12, generator=g), torch.zeros(12, dtype=torch.bool),
                                          temperature=1.0)
        rollout.advantages = torch.randn(12, generator=g)
        rollout.old_logp = logprobs(module, rollout)
        rollout.rollout_logp = rollout.old_logp + 0.3 * torch.randn(rollout.old_logp.shape, generator=g) \
            * rollout.attention_mask
        rollout, stats = module.online.correction(rollout)
        assert rollout.is_weights is not None
        _check_the_bounds_bite(rollout, stats, options)
        update(module, rollout)
        grads[micro] = torch.cat([p.grad.flatten() for p in module.policy.parameters()])
    assert grads[None].abs().max() > 1e-3
    torch.testing.assert_close(grads[None], grads[3], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("options", CORRECTIONS.values(), ids=CORRECTIONS.keys())
def test_the_correction_in_the_loss_equals_a_behaviour_pass_and_the_stage(tmp_path, options):
    """One update per rollout from an engine that returns its log-probs: taking the current log-probs as the
    behaviour's and weighing the gap in the loss (``on_policy``, what a worker sampling ahead uses) gives
    the gradient of a separate behaviour pass followed by the correction stage, without the pass."""
    module = make(GRPO, objective={"kl_coef": 0.0}, update={"max_grad_norm": None},
                  logprobs={"correction": RolloutCorrection(**options)},
                  optimizer=partial(torch.optim.SGD, lr=0.0))
    make_trainer(tmp_path, max_steps=0).fit(module, datamodule(batch_size=2))
    module.policy.disable_dropout()
    ids, mask = module.encode_prompts(["12345=", "907=", "5555123="])
    torch.manual_seed(0)
    gen = module.policy.generate(ids, mask, num_samples=4, max_new_tokens=8)
    g = torch.Generator().manual_seed(1)
    rollout = Rollout.from_generation(gen, torch.arange(3).repeat_interleave(4), torch.rand(12, generator=g),
                                      torch.zeros(12, dtype=torch.bool), temperature=1.0)
    rollout.advantages = torch.randn(12, generator=g)
    current = logprobs(module, rollout)
    rollout.rollout_logp = current + 0.3 * torch.randn(current.shape, generator=g) * rollout.attention_mask
    grads = {}
    for way in ("pass", "loss"):
        staged = dataclasses.replace(rollout, old_logp=current if way == "pass" else None)
        staged, stats = module.online.correction(staged)
        assert (staged.is_weights is not None) == (way == "pass")
        if way == "pass":
            _check_the_bounds_bite(staged, stats, options)
        module.policy.zero_grad()
        update(module, staged)
        grads[way] = torch.cat([p.grad.flatten() for p in module.policy.parameters()])
    assert grads["pass"].abs().max() > 1e-3
    torch.testing.assert_close(grads["loss"], grads["pass"], atol=1e-6, rtol=1e-5)


def test_correction_options_are_validated():
    for kwargs, key in [(dict(cap=0.5), "cap"), (dict(low=1.2), "low"), (dict(low=-0.1), "low"),
                        (dict(level="group"), "level"), (dict(mode="clip"), "mode")]:
        with pytest.raises(ValueError, match=f"`model.logprobs.correction.{key}` must be"):
            RolloutCorrection(**kwargs)
    assert RolloutCorrection("geometric", "mask", 1.01, 0.99).low == 0.99
    with pytest.raises(ValueError, match="engine.init_args.dtype"):
        CopyEngine("int8")


@pytest.mark.distributed
@pytest.mark.ranks("ddp/engine", "fsdp2/engine")
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_engine_weights_follow_the_trained_weights_on_two_ranks(rank_jobs, kind):
    steps = json.loads((rank_jobs.out(f"{kind}/engine") / "result.json").read_text())  # tests/engine_sync.py
    dtype = {"ddp": "torch.bfloat16", "fsdp2": "torch.float16"}[kind]  # tests/rank_jobs.py: both dtypes
    assert len(steps) == 3 and all(s["dtype"] == dtype and s["count"] > 10 for s in steps)
    assert [s["diff"] for s in steps] == [0.0, 0.0, 0.0]
    assert all(s["stats"]["rollout/mismatch_k3"] >= 0 for s in steps)


# the online step with and without filters and a critic, and an offline module (its engine serves only
# greedy validation); RLOO, GSPO, SAPO and SFT take the same paths
OVERLAY_RUNS = ["grpo", "dapo", "ppo", "dpo"]


@pytest.mark.slow
@pytest.mark.parametrize("name", OVERLAY_RUNS)
def test_bf16_overlay_runs_every_algorithm_through_the_cli(tmp_path, name):
    """configs/precision/bf16.yaml composes with any algorithm config: bf16 engine, bf16-mixed training,
    the correction; two steps through the real CLI log finite losses (and, online, the mismatch)."""
    overlay = CONFIGS / "precision" / "bf16.yaml"
    cli = run_cli("fit", "--config", CONFIGS / f"{name}.yaml", "--config", overlay,
                  "--trainer.max_steps", "2", "--trainer.val_check_interval", "1",
                  "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0",
                  "--trainer.log_every_n_steps", "1",
                  "--trainer.logger.init_args.save_dir", tmp_path, "--trainer.enable_progress_bar", "false")
    assert cli.trainer.precision == "bf16-mixed" and isinstance(cli.model.engine, CopyEngine)
    assert next(cli.model.engine.copy.model.parameters()).dtype == torch.bfloat16
    assert next(cli.model.policy.model.parameters()).dtype == torch.float32  # fp32 master weights
    logged = scalars(tmp_path)
    losses = [v for k, series in logged.items() if k.endswith("loss") for _, v in series]
    assert losses and all(math.isfinite(v) for v in losses)
    if name not in ("dpo", "sft"):
        mismatch = [v for _, v in logged["rollout/mismatch_k3"]]
        assert mismatch and all(v >= 0 for v in mismatch)  # one per rollout (DAPO: 2 steps each)
