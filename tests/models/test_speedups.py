"""Every speed-up keeps the gradient: one update with and without it, in every aggregation mode."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch
from ddp_update import fixed_rollout
from helpers import datamodule, make, make_trainer, update

from lightning_rl.algorithms import GRPO
from lightning_rl.maths.trust_regions import Clip
from lightning_rl.models.scoring import shared_prompts

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


class Probe(GRPO):
    """One update per aggregation mode on the fixed 16-row rollout (4 prompts x 4 samples), in
    micro-batches of 3 (so groups straddle micro-batches), recording the policy's gradients."""

    def training_step(self, batch, batch_idx):
        rollout = fixed_rollout(self)
        self.grads = {}
        for mode in MODES:
            self.objective = dataclasses.replace(self.objective, aggregation=mode)
            update(self, rollout)
            self.grads[mode] = {n: p.grad.detach().clone() for n, p in self.policy.named_parameters()}
        self.shared = self.policy.share_prompts


def _grads(tmp_path, share: bool) -> tuple[dict, bool]:
    torch.manual_seed(0)
    module = make(Probe, sampling={"share_prompt_prefix": share},
                  update={"micro_batch_size": 3, "max_grad_norm": None},
                  objective={"kl_coef": 0.1, "trust_region": Clip(0.2, 0.28), "entropy_coef": 0.01},
                  optimizer=partial(torch.optim.SGD, lr=0.0))
    make_trainer(tmp_path, max_steps=1).fit(module, datamodule(batch_size=2))
    return module.grads, module.shared


@pytest.mark.slow
@pytest.mark.parametrize("head_on_real_tokens", [True, False])
def test_shared_prompt_prefix_keeps_the_gradient_in_every_aggregation_mode(tmp_path, monkeypatch,
                                                                          head_on_real_tokens):
    """Both fast forms: the output layer on real completion tokens only (plain-head models such as the
    embedded Llama), and the generic one (any causal LM: full logits on top of the shared prefix)."""
    if not head_on_real_tokens:
        monkeypatch.setattr("lightning_rl.models.scoring.PLAIN_HEAD_MODELS", ())
    plain, off = _grads(tmp_path, share=False)
    shared, on = _grads(tmp_path, share=True)
    assert on and not off
    for mode in MODES:
        scale = max(g.abs().max().item() for g in plain[mode].values())
        diff = max((plain[mode][n] - shared[mode][n]).abs().max().item() for n in plain[mode])
        assert scale > 1e-2 and diff < 1e-5 * max(1.0, scale), (mode, diff, scale)


def test_shared_prompts_finds_each_distinct_prompt_once():
    ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [0, 5, 6], [1, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [0, 1, 1], [0, 1, 1]])  # row 4: pad id differs
    first, inverse = shared_prompts(ids, mask)
    assert sorted(first.tolist()) == [0, 1]
    assert inverse.tolist()[0] == inverse.tolist()[2] == inverse.tolist()[3] == inverse.tolist()[4]
    assert first[inverse].tolist() == [0, 1, 0, 0, 0]
    assert shared_prompts(ids[:2], mask[:2]) is None  # nothing to share


@pytest.mark.parametrize("head_on_real_tokens", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prefix_log_probs_and_entropy_equal_the_one_pass_form(temperature, head_on_real_tokens,
                                                                    monkeypatch):
    if not head_on_real_tokens:
        monkeypatch.setattr("lightning_rl.models.scoring.PLAIN_HEAD_MODELS", ())
    module = make(GRPO)
    policy = module.policy
    policy.disable_dropout()
    ids, mask = module.encode_prompts(["12345=", "907=", "5555123=", "31="])
    torch.manual_seed(0)
    gen = policy.generate(ids, mask, num_samples=4, max_new_tokens=8)
    args = (gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask)
    out = []
    for share in (False, True):
        policy.share_prompts = share
        logp, entropy = policy.token_logprobs(*args, with_entropy=True, temperature=temperature)
        out.append((logp, entropy * gen.completion_mask))
    torch.testing.assert_close(out[0][0], out[1][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out[0][1], out[1][1], atol=1e-5, rtol=0)


def test_prefilled_generation_samples_what_plain_generation_samples():
    """The prompt prefilled once per group and repeated: the same sampled and greedy completions."""
    policy = make(GRPO).policy
    ids, mask = make(GRPO).encode_prompts(["12345=", "907=", "5555123=", "31="])
    out = {}
    for share in (False, True):
        policy.share_prompts = share
        torch.manual_seed(0)
        sampled = policy.generate(ids, mask, num_samples=8, max_new_tokens=8, temperature=1.0)
        greedy = policy.generate(ids, mask, num_samples=2, max_new_tokens=8, do_sample=False)
        out[share] = (sampled.completion_ids, sampled.completion_mask, greedy.completion_ids)
    for a, b in zip(out[False], out[True], strict=True):
        assert torch.equal(a, b)


def test_compacting_sampler_draws_from_the_models_distribution():
    """lightning_rl.models.sampling: greedy equals transformers' greedy; top-k 1 sampling is greedy; and the
    first
    sampled token's frequencies over 4000 draws match the model's tempered softmax."""
    module = make(GRPO)
    policy = module.policy
    ids, mask = module.encode_prompts(["12345=", "907="])
    runs = {}
    for compact in (False, True):
        policy.compact_sampling = compact
        runs[compact] = policy.generate(ids, mask, num_samples=3, max_new_tokens=8, do_sample=False)
    assert torch.equal(runs[False].completion_ids, runs[True].completion_ids)
    assert torch.equal(runs[False].completion_mask, runs[True].completion_mask)
    top1 = policy.generate(ids, mask, num_samples=3, max_new_tokens=8, top_k=1)
    assert torch.equal(top1.completion_ids, runs[True].completion_ids)
    torch.manual_seed(0)
    draws = policy.generate(ids[:1], mask[:1], num_samples=4000, max_new_tokens=1, temperature=0.8)
    with torch.no_grad():
        logits = policy.model(ids[:1], attention_mask=mask[:1]).logits[0, -1] / 0.8
    probs = torch.softmax(logits, -1)
    freq = torch.bincount(draws.completion_ids[:, 0], minlength=len(probs)).float() / 4000
    assert (freq - probs).abs().max() < 0.03
    assert draws.completion_mask.shape == (4000, 1)


@pytest.mark.parametrize("top_k", [0, 5])
def test_log_probs_in_chunks_equal_the_whole_head_in_value_and_gradient(top_k):
    """``update.logprob_chunk``: the output layer and softmax over 7 tokens at a time (the chunk's logits
    recomputed in the backward) give the log-probs, the entropy and the gradients of the whole head."""
    module = make(GRPO)
    policy = module.policy
    policy.disable_dropout()
    policy.share_prompts = True
    ids, mask = module.encode_prompts(["12345=", "907=", "5555123=", "31="])
    torch.manual_seed(0)
    gen = policy.generate(ids, mask, num_samples=4, max_new_tokens=8)
    args = (gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask)
    assert int(gen.completion_mask.sum()) > 3 * 7  # several chunks, the last one partial
    weights = torch.randn(gen.completion_mask.shape, generator=torch.Generator().manual_seed(1))
    out, rows = [], []
    head = policy.model.get_output_embeddings()
    hook = head.register_forward_hook(lambda mod, inputs, output: rows.append(inputs[0].shape[0]))
    for chunk in (None, 7):
        policy.logprob_chunk = chunk
        policy.zero_grad()
        logp, entropy = policy.token_logprobs(*args, with_entropy=True, temperature=0.7, top_k=top_k)
        ((logp * weights).sum() + entropy.sum()).backward()
        out.append((logp.detach(), entropy.detach(),
                    {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}))
    hook.remove()
    tokens = int(gen.completion_mask.sum())
    chunks = -(-tokens // 7)
    pieces = [7] * (chunks - 1) + [tokens - 7 * (chunks - 1)]
    # the whole head once; then each chunk in the forward, and again (in any order) in the backward
    assert rows[:1 + chunks] == [tokens, *pieces] and sorted(rows[1 + chunks:]) == sorted(pieces)
    (logp_a, ent_a, grad_a), (logp_b, ent_b, grad_b) = out
    torch.testing.assert_close(logp_a, logp_b, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent_a, ent_b, atol=1e-6, rtol=0)
    assert grad_a.keys() == grad_b.keys() and len(grad_a) > 10
    assert max(float(g.abs().max()) for g in grad_a.values()) > 1e-2  # a real gradient
    for name in grad_a:
        torch.testing.assert_close(grad_a[name], grad_b[name], atol=1e-6, rtol=1e-5, msg=name)
