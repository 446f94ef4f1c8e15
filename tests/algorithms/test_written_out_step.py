"""The synchronous step (``model.sampling.max_staleness: 0``, the default) is GRPO as one would write it out
by hand from the published pieces: seeded sampling, the reward function, group-normalised advantages,
``grpo_loss`` with the reference's log-probs, clipping by global norm, AdamW. Three steps of the module and
three of the loop below sample the same tokens and score the same rewards, bit for bit, and end at the same
weights: bit for bit after the first step, to float rounding after three (measured: 4.5e-8 at most, from
the order of a few sums; the weights move by more than 1e-3). Whatever the sampler / learner split, the
stages and the Lightning loop add nothing to the maths."""

from __future__ import annotations

import pytest
import torch
from helpers import datamodule, make, make_trainer

from lightning_rl.algorithms import GRPO
from lightning_rl.callbacks.base import RLCallback
from lightning_rl.episodes.source import round_seed
from lightning_rl.maths.advantages import group_advantages
from lightning_rl.maths.aggregation import normalizer_counts
from lightning_rl.maths.policy_presets import grpo_loss
from lightning_rl.models.generation import SamplingParams, hf_generate
from lightning_rl.step.engine import seeded
from lightning_rl.step.rewards import exact_match

G, NEW_TOKENS, STEPS = 4, 8, 3


class Rollouts(RLCallback):
    def __init__(self) -> None:
        self.seen = []

    def on_rollout_end(self, trainer, pl_module, rollout):
        self.seen.append(rollout)


def written_out(steps: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]:
    """``steps`` GRPO steps on the test defaults (tests/helpers.py ``make``: G 4, 8 new tokens, AdamW lr
    1e-3; the preset's clip 0.2, KL k3 0.04, ``seq-mean-token-mean``, max_grad_norm 1): each step's
    (completion ids, rewards) and the final weights."""
    holder = make(GRPO)  # the policy as the module loads it, and its prompt encoding
    policy, reference = holder.policy, holder.policy.reference()
    policy.share_prompts = reference.share_prompts = True  # each prompt's prefix scored once (the default)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-3, weight_decay=0.0)
    data = datamodule()
    data.setup("fit")
    batches, seen = data.train_batches(0), []
    for step in range(steps):
        batch = next(batches)
        ids, mask = holder.encode_prompts(batch["prompt"])
        with seeded(round_seed(0, step, 0, 0), ids.device):
            gen = hf_generate(policy, ids, mask, num_samples=G, compact=True,
                              sampling=SamplingParams(NEW_TOKENS, 1.0, 1.0, 0, True))
        shown = gen.completion_ids.masked_fill(gen.completion_mask == 0, policy.pad_token_id)
        texts = holder.tokenizer.batch_decode(shown, skip_special_tokens=True)
        answers = [a for a in batch["answer"] for _ in range(G)]
        rewards = torch.tensor(exact_match(texts, answers))
        advantages = group_advantages(rewards, G)
        args = (gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask)
        with torch.no_grad():
            ref_logp, _ = reference.token_logprobs(*args)
        policy.model.train()
        logp, _ = policy.token_logprobs(*args, with_entropy=True)  # the entropy is logged
        mask = gen.completion_mask.float()
        num_tokens, num_seqs = (c.float() for c in normalizer_counts(mask))
        loss, _ = grpo_loss(logp, logp.detach(), ref_logp, advantages, mask, num_tokens=num_tokens,
                            num_seqs=num_seqs)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
        optimizer.step()
        seen.append((gen.completion_ids, rewards))
    return seen, {k: v.detach().clone() for k, v in policy.model.named_parameters()}


@pytest.mark.slow
def test_the_synchronous_step_is_grpo_written_out(tmp_path):
    module = make(GRPO)
    assert module.rollouts.max_staleness == 0
    rollouts = Rollouts()
    make_trainer(tmp_path, max_steps=STEPS, callbacks=[rollouts]).fit(module, datamodule())
    by_hand, weights = written_out(STEPS)
    assert len(rollouts.seen) == STEPS
    for rollout, (completion_ids, rewards) in zip(rollouts.seen, by_hand, strict=True):
        assert rollout.versions is None  # sampled by the step's own weights
        assert torch.equal(rollout.completion_ids, completion_ids)
        assert torch.equal(rollout.rewards, rewards)
    assert any(float(r.rewards.std()) > 0 for r in rollouts.seen)  # some step had a gradient
    trained = dict(module.policy.model.named_parameters())
    start = make(GRPO).policy.model.state_dict()
    assert max(float((trained[k] - start[k]).abs().max()) for k in weights) > 1e-3
    for name, value in weights.items():
        torch.testing.assert_close(trained[name].detach(), value, rtol=0, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
