"""The seams of the RL step: a fake engine drives ``training_step``; context and loss masks are separate;
callbacks only observe; validation samples through the module's engine."""

from __future__ import annotations

import itertools
from functools import partial

import pytest
import torch
from helpers import Recorder, datamodule, logprobs, make, make_trainer, update

from lightning_rl.algorithms import GRPO
from lightning_rl.callbacks import LogSamples
from lightning_rl.maths.losses import policy_loss
from lightning_rl.models.generation import SamplingParams, make_generation
from lightning_rl.step.engine import RolloutEngine
from lightning_rl.step.rollout import Rollout, exclude_nonfinite


class FakeEngine(RolloutEngine):
    """Canned completions (cycled over the rows) and, with ``logp``, that log-prob on every sampled token."""

    def __init__(self, completions: list[str], logp: float | None = None) -> None:
        self.completions, self.logp = completions, logp
        self.returns_logprobs = logp is not None
        self.is_trained_module = logp is None
        self.calls: list[tuple[int, SamplingParams]] = []

    def attach(self, policy, *, synced=False, compact=False):
        self.policy = policy

    def generate(self, prompt_ids, prompt_mask, *, num_samples=1, sampling, seed=None):
        self.calls.append((num_samples, sampling))
        ids = prompt_ids.repeat_interleave(num_samples, 0)
        mask = prompt_mask.repeat_interleave(num_samples, 0)
        tok = self.policy.tokenizer
        texts = list(itertools.islice(itertools.cycle(self.completions), len(ids)))
        rows = [tok(t, add_special_tokens=False)["input_ids"][: sampling.max_new_tokens - 1]
                + [tok.eos_token_id] for t in texts]
        out = torch.full((len(rows), max(map(len, rows))), tok.pad_token_id, dtype=torch.long)
        for i, row in enumerate(rows):
            out[i, : len(row)] = torch.tensor(row)
        gen = make_generation(ids, mask, out.to(ids.device), tok.eos_token_id, tok.pad_token_id)
        if self.logp is not None:
            gen.rollout_logp = torch.full(out.shape, self.logp) * gen.completion_mask
        return gen


def test_fake_engine_drives_the_step_without_generation(tmp_path):
    """Rewards come from the canned texts (half right, half wrong per group), advantages are the group
    z-scores of those rewards, and the policy moves."""
    engine = FakeEngine(["12345", "wrong"])
    module = make(GRPO, engine=engine, objective={"kl_coef": 0.0})
    record = Recorder()
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    # a fixed prompt whose answer is 12345 for every row
    dm = datamodule(batch_size=2)
    dm.setup("fit")
    dm.train_rows = [{"prompt": "53421=", "answer": "12345"}] * 64
    make_trainer(tmp_path, max_steps=1, callbacks=[record]).fit(module, dm)
    (rollout,) = record.rollouts
    assert engine.calls and engine.calls[0][0] == 4
    assert rollout.rewards.tolist() == [1.0, 0.0, 1.0, 0.0] * 2
    # group z-score by hand: mean 0.5, Bessel std sqrt(1/3) -> +-0.866
    torch.testing.assert_close(rollout.advantages, torch.tensor([0.8660254, -0.8660254] * 4), atol=1e-5,
                               rtol=0)
    assert rollout.old_logp is None  # on-policy: one update from the trained module
    moved = max((p - before[n]).abs().max().item() for n, p in module.policy.named_parameters())
    assert moved > 0


def test_behaviour_from_engine_uses_the_engines_logprobs(tmp_path):
    engine = FakeEngine(["12345", "54321"], logp=-1.5)
    module = make(GRPO, engine=engine, objective={"kl_coef": 0.0},
                  logprobs={"behaviour": "from_engine"})
    record = Recorder()
    make_trainer(tmp_path, max_steps=1, callbacks=[record]).fit(module, datamodule(batch_size=2))
    (rollout,) = record.rollouts
    assert torch.equal(rollout.old_logp, rollout.rollout_logp)
    assert torch.equal(rollout.old_logp, -1.5 * rollout.attention_mask.float())


def test_from_engine_is_refused_for_an_engine_without_logprobs():
    with pytest.raises(ValueError, match="logprobs.behaviour: from_engine"):
        make(GRPO, logprobs={"behaviour": "from_engine"})
    with pytest.raises(ValueError, match="on_policy"):
        make(GRPO, logprobs={"behaviour": "on_policy"}, update={"num_minibatches": 2})


def _rollout(module) -> Rollout:
    ids, mask = module.encode_prompts(["12345=", "907="])
    torch.manual_seed(0)
    gen = module.policy.generate(ids, mask, num_samples=2, max_new_tokens=8)
    n = len(gen.completion_ids)
    g = torch.Generator().manual_seed(1)
    rollout = Rollout.from_generation(gen, torch.arange(2).repeat_interleave(2), torch.rand(n, generator=g),
                                      torch.zeros(n, dtype=torch.bool), temperature=1.0)
    rollout.advantages = torch.randn(n, generator=g)
    return rollout


def test_excluding_a_middle_token_keeps_the_other_tokens_context_and_update(tmp_path):
    """A token whose behaviour log-prob is not finite leaves the loss, not the context: every token's
    log-prob is unchanged, and the update equals the loss over the remaining tokens with full context."""
    module = make(GRPO, objective={"kl_coef": 0.0}, update={"max_grad_norm": None},
                  optimizer=partial(torch.optim.SGD, lr=0.0))
    make_trainer(tmp_path, max_steps=0).fit(module, datamodule(batch_size=2))  # attach a trainer
    module.policy.disable_dropout()
    rollout = _rollout(module)
    row = int(torch.argmax(rollout.lengths))
    assert rollout.lengths[row] >= 3
    full = logprobs(module, rollout)
    rollout.old_logp = full + 0.1 * rollout.attention_mask
    rollout.old_logp[row, 1] = float("-inf")
    clean, excluded = exclude_nonfinite(rollout)
    assert excluded == 1.0
    assert torch.equal(clean.attention_mask, rollout.attention_mask)
    assert clean.loss_mask[row, 1] == 0 and clean.loss_mask.sum() == rollout.attention_mask.sum() - 1
    torch.testing.assert_close(logprobs(module, clean), full, atol=0, rtol=0)

    update(module, clean)
    got = {n: p.grad.clone() for n, p in module.policy.named_parameters()}
    module.policy.zero_grad()
    logp, _ = module.policy.token_logprobs(clean.prompt_ids, clean.prompt_mask, clean.completion_ids,
                                           rollout.attention_mask, temperature=1.0)
    loss, _ = policy_loss(logp, clean.old_logp, None, clean.advantages, clean.loss_mask,
                          aggregation=module.objective.aggregation)
    loss.backward()
    for n, p in module.policy.named_parameters():
        torch.testing.assert_close(got[n], p.grad, atol=1e-6, rtol=1e-5)


def _logged(tmp_path, callbacks) -> dict[str, float]:
    torch.manual_seed(0)
    module = make(GRPO, objective={"kl_coef": 0.04}, update={"num_minibatches": 2})
    trainer = make_trainer(tmp_path, max_steps=4, callbacks=callbacks)
    trainer.fit(module, datamodule(batch_size=2))
    weights = torch.cat([p.detach().flatten() for p in module.policy.parameters()])
    return {k: float(v) for k, v in trainer.callback_metrics.items()}, weights


@pytest.mark.slow
def test_removing_observing_callbacks_changes_no_number(tmp_path):
    plain, w_plain = _logged(tmp_path / "a", [])
    observed, w_observed = _logged(tmp_path / "b", [Recorder(), LogSamples(log_samples_every_n_steps=1)])
    timing = [k for k in plain if k.startswith("perf/") and "time" in k or k.endswith("tokens_per_sec")]
    assert set(plain) == set(observed) and "policy/loss" in plain and "rollout/reward_mean" in plain
    for k in set(plain) - set(timing):
        assert plain[k] == observed[k], k
    assert torch.equal(w_plain, w_observed)


def test_validation_samples_greedily_through_the_engine(tmp_path):
    engine = FakeEngine(["12345"])
    module = make(GRPO, engine=engine)
    trainer = make_trainer(tmp_path, max_steps=0, limit_val_batches=1)
    trainer.validate(module, datamodule(batch_size=2, val_batch_size=4))
    assert engine.calls and engine.calls[-1][1].greedy and engine.calls[-1][0] == 1
