"""The rollout records the temperature its completions were sampled at (``Rollout.temperature``), the record
keeps it through every reshaping, checkpoint and process boundary, and every learner-side log-prob pass
scores at it: the reference and behaviour passes, the token selection's pass and the policy loss hold no
copy of the sampling temperature of their own."""

from __future__ import annotations

import pickle
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from helpers import make

from lightning_rl.algorithms import GRPO
from lightning_rl.episodes.async_source import as_state, from_state
from lightning_rl.episodes.async_worker import Sampled, rollout_to
from lightning_rl.episodes.sampler import PolicyIO, Sampler
from lightning_rl.maths.aggregation import masked_mean
from lightning_rl.models.generation import Generation, SamplingParams
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.logprobs import BehaviourLogProbs, FrozenLogProbs
from lightning_rl.step.policy_loss import micro_batch_policy_loss
from lightning_rl.step.rollout import Rollout
from lightning_rl.step.selection import score_with_entropy


def fake_rollout(rows: int = 4, width: int = 3, temperature: float = 0.7) -> Rollout:
    """``rows`` rows in groups of 2, the last completion column padding (``trimmed`` cuts it)."""
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[:, -1] = 0
    return Rollout(torch.ones(rows, 2, dtype=torch.long), torch.ones(rows, 2, dtype=torch.long),
                   torch.ones(rows, width, dtype=torch.long), mask, mask.clone(),
                   torch.zeros(rows, dtype=torch.bool), mask.sum(1), torch.arange(rows) // 2,
                   torch.rand(rows), torch.zeros(rows, dtype=torch.bool), old_logp=torch.zeros(rows, width),
                   temperature=temperature)


def test_a_rollout_keeps_its_temperature_through_select_trim_cat_and_pickle():
    rollout = fake_rollout()
    trimmed, joined = rollout.trimmed(), Rollout.cat([rollout, fake_rollout(2, width=5)])
    assert trimmed.completion_ids.shape == (4, 2) and joined.completion_ids.shape == (6, 5)  # reshaped
    kept = [rollout.select(torch.tensor([0, 2])), rollout.select(torch.tensor([True, False, True, False])),
            trimmed, joined, rollout.empty(), *rollout.minibatches(3, torch.Generator().manual_seed(0)),
            pickle.loads(pickle.dumps(rollout)), rollout_to(rollout, "cpu")]
    assert [r.temperature for r in kept] == [0.7] * len(kept)
    # a checkpoint of rollouts sampled ahead (plain types and tensors), and the worker's pickled message
    restored = from_state(as_state(Sampled(3, 2, ["p"] * 2, rollout, {}, 0)), 1.0)
    assert restored.rollout.temperature == 0.7  # the record's own, not the run's
    # a checkpoint from before rollouts carried their temperature: drawn at the run's sampling temperature
    old = as_state(Sampled(3, 2, ["p"] * 2, rollout, {}, 0))
    del old["rollout"]["temperature"]
    assert from_state(old, 0.7).rollout.temperature == 0.7
    message = pickle.loads(pickle.dumps(Sampled(3, 2, ["p"] * 2, rollout, {}, 0)))
    assert message.rollout.temperature == 0.7


def test_concatenating_rollouts_sampled_at_different_temperatures_names_both():
    with pytest.raises(ValueError, match=r"different temperatures \[0\.7, 1\.0\]"):
        Rollout.cat([fake_rollout(temperature=0.7), fake_rollout(temperature=1.0)])
    with pytest.raises(ValueError, match=r"\[0\.5, 0\.7\]"):  # whichever part differs
        Rollout.cat([fake_rollout(), fake_rollout(), fake_rollout(temperature=0.5)])


def test_the_sampler_records_the_temperature_the_engine_sampled_at():
    """The sampler builds the record from the sampling parameters it called the engine with."""
    called = []

    def generate(ids, mask, *, num_samples, sampling, seed):
        called.append(sampling)
        n = len(ids) * num_samples
        ones = torch.ones(n, 2, dtype=torch.long)
        return Generation(ones, ones, ones, ones, torch.zeros(n, dtype=torch.bool))

    io = PolicyIO(encode=lambda prompts: (torch.ones(len(prompts), 1, dtype=torch.long),) * 2,
                  generate=generate, decode=lambda ids, mask: ["x"] * len(ids))

    def rewards(prompts, texts, lengths, columns, **_):
        n = len(prompts)
        return SimpleNamespace(rewards=torch.zeros(n), correct=torch.zeros(n, dtype=torch.bool), stats={},
                               outcome=None, decoupled=None)

    sampling = SamplingParams(max_new_tokens=2, temperature=0.7)
    sampler = Sampler(2, sampling, rewards, episodes=None, mask_truncated=False)
    rollout, _ = sampler({"prompt": ["a", "b"]}, io, seed=0, collectives=Collectives.local(), decide=True,
                         device=torch.device("cpu"))
    assert called == [sampling] and rollout.temperature == 0.7 and len(rollout) == 4


@pytest.fixture(scope="module")
def scored():
    """A tiny GRPO module with a reference, and a rollout its policy sampled at temperature 0.7."""
    module = make(GRPO, sampling={"temperature": 0.7}, objective={"kl_coef": 0.04})
    module.policy.disable_dropout()
    ids, mask = module.encode_prompts(["12345=", "907="])
    torch.manual_seed(0)
    gen = module.policy.generate(ids, mask, num_samples=2, max_new_tokens=8, temperature=0.7)
    rollout = Rollout.from_generation(gen, torch.arange(2).repeat_interleave(2), torch.rand(4),
                                      torch.zeros(4, dtype=torch.bool), temperature=0.7)
    return module, rollout


def direct(scorer, rollout, temperature, with_entropy=False):
    """The scorer called as the passes were before the record carried the temperature: with it passed in."""
    with torch.no_grad():
        return scorer.token_logprobs(rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                     rollout.attention_mask, temperature=temperature,
                                     with_entropy=with_entropy)


def test_the_reference_and_behaviour_passes_score_at_the_rollouts_temperature(scored):
    module, rollout = scored
    reference = module.reference_policy()
    frozen = FrozenLogProbs(module.frozen, "reference", policy=module.policy, micro_batch_size=3,
                            time_key="perf/reference_time")
    behaviour = BehaviourLogProbs("recompute", engine=module.engine, policy=module.policy,
                                  updates_per_rollout=2, micro_batch_size=None)
    for temperature in (0.7, 1.0):  # the record's temperature, whatever the module was configured with
        at = replace(rollout, temperature=temperature)
        ref = frozen(at, Collectives.local())[0].ref_logp
        old = behaviour(at, Collectives.local())[0].old_logp
        torch.testing.assert_close(ref, direct(reference, at, temperature)[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(old, direct(module.policy, at, temperature)[0], atol=0, rtol=0)
    gap = direct(module.policy, rollout, 0.7)[0] - direct(module.policy, rollout, 1.0)[0]
    assert gap[rollout.attention_mask.bool()].abs().max() > 1e-2  # the two temperatures score apart


def test_the_selection_pass_and_the_policy_loss_score_at_the_rollouts_temperature(scored):
    module, rollout = scored
    logp, entropy = direct(module.policy, rollout, 0.7, with_entropy=True)
    got, got_entropy = score_with_entropy(module.policy, rollout, module.updater.micro_rows,
                                          Collectives.local())
    torch.testing.assert_close(got, logp, atol=0, rtol=0)
    torch.testing.assert_close(got_entropy, entropy, atol=0, rtol=0)
    advantages = torch.randn(4, generator=torch.Generator().manual_seed(1))
    micro = replace(rollout, old_logp=logp, ref_logp=logp, advantages=advantages)
    counts = torch.tensor(float(micro.loss_mask.sum())), torch.tensor(4.0)
    _, metrics = micro_batch_policy_loss(module.policy, micro, module.objective, 0.0, *counts)
    mask = micro.loss_mask.bool()
    torch.testing.assert_close(metrics["policy/entropy"], masked_mean(entropy, mask))
    _, hotter = direct(module.policy, rollout, 1.0, with_entropy=True)
    assert abs(float(metrics["policy/entropy"]) - float(masked_mean(hotter, mask))) > 1e-3
