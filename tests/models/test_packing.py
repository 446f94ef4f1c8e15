"""Packed scoring (``model.update.packing``): rows end to end without padding, the same log-probs, entropy
and gradients as the padded form; refused where the attention lets rows meet."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers import make

from lightning_rl.algorithms import GRPO, OnlineRL
from lightning_rl.maths.trust_regions import Clip
from lightning_rl.models.packing import pack, packable

sys.path.insert(0, str(Path(__file__).parents[1] / "algorithms"))
from test_online_rl import AGGS, max_diff, norm, prepare_rollout, probe  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "step"))
from test_skip_rows import skipping_grads  # noqa: E402


def test_pack_lays_real_tokens_end_to_end_with_positions_restarting():
    prompt_ids, prompt_mask = torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
    completion_ids = torch.tensor([[1, 2, 0], [3, 0, 0]])
    completion_mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    ids, positions, predictors = pack(prompt_ids, prompt_mask, completion_ids, completion_mask)
    assert ids.tolist() == [[5, 6, 1, 2, 7, 8, 9, 3]]
    assert positions.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert predictors.tolist() == [1, 2, 6]  # token 1 from 6, token 2 from 1, token 3 from 9
    assert packable(prompt_mask, completion_mask)
    assert not packable(prompt_mask, torch.tensor([[1, 0, 1], [1, 0, 0]]))  # a hole: scored padded
    assert not packable(torch.tensor([[1, 0, 1], [1, 1, 1]]), completion_mask)  # not left-padded


def rollout_args(module):
    ids, mask = module.encode_prompts(["12345=", "907=", "5555123=", "31="])
    torch.manual_seed(0)
    gen = module.policy.generate(ids, mask, num_samples=4, max_new_tokens=8)
    return gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask


@pytest.mark.parametrize(("head_apart", "chunk"), [(True, None), (True, 5), (False, None)])
def test_packed_log_probs_entropy_and_gradients_equal_the_padded_form(monkeypatch, head_apart, chunk):
    if not head_apart:  # the generic form: the model's own logits at every packed position
        monkeypatch.setattr("lightning_rl.models.scoring.PLAIN_HEAD_MODELS", ())
    module = make(GRPO)
    policy = module.policy
    policy.disable_dropout()
    args = rollout_args(module)
    assert len(set(args[1].sum(1).tolist())) > 1 and len(set(args[3].sum(1).tolist())) > 1  # real padding
    weights = torch.randn(args[3].shape, generator=torch.Generator().manual_seed(1))
    out = []
    for packing in (False, True):
        policy.packing, policy.logprob_chunk = packing, chunk
        policy.zero_grad()
        logp, entropy = policy.token_logprobs(*args, with_entropy=True, temperature=0.7)
        entropy = entropy * args[3]  # the padded form's entropy at padding is no token's
        ((logp * weights).sum() + entropy.sum()).backward()
        out.append((logp.detach(), entropy.detach(),
                    {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}))
    (a_logp, a_ent, a_grad), (b_logp, b_ent, b_grad) = out
    torch.testing.assert_close(a_logp, b_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(a_ent, b_ent, atol=1e-5, rtol=0)
    assert a_grad.keys() == b_grad.keys() and max(float(g.abs().max()) for g in a_grad.values()) > 1e-2
    for name in a_grad:
        torch.testing.assert_close(a_grad[name], b_grad[name], atol=1e-5, rtol=1e-4, msg=name)


def test_packing_is_checked_and_refused_where_attention_ignores_the_position_restarts(monkeypatch):
    module = make(GRPO)
    module.policy.check_packing()  # the embedded Llama keeps packed rows apart
    # an attention that does not read the restarts: every packed token sees the rows before it
    monkeypatch.setattr("transformers.masking_utils.find_packed_sequence_indices", lambda position_ids: None)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM .* lets packed rows attend to each other .*"
                                         r"`model\.update\.packing: false`"):
        module.policy.check_packing()


@pytest.mark.slow
def test_packed_updates_make_the_padded_gradient_in_every_aggregation(tmp_path):
    module = make(OnlineRL, objective={"trust_region": Clip(0.2, 0.28), "kl_coef": 0.1},
                  update={"max_grad_norm": None}, optimizer=partial(torch.optim.SGD, lr=0.0))

    def experiment(trainer, module):
        rollout = prepare_rollout(module, trainer)  # rows of different lengths, two without tokens
        out = {}
        for mode in AGGS:
            module.policy.packing = False
            padded, _, _ = skipping_grads(module, rollout, True, 3, mode)
            module.policy.packing = True
            packed, _, metrics = skipping_grads(module, rollout, True, 3, mode)
            pads = [float(m["perf/pad_frac"]) for m, _ in metrics]
            out[mode] = (max_diff(padded, packed), norm(padded), pads)
        return out

    for mode, (diff, scale, pads) in probe(module, experiment, tmp_path).items():
        assert scale > 1e-2 and diff < 1e-6, (mode, diff)
        assert pads == [0.0] * len(pads) and len(pads) > 1  # nothing forwarded is padding
