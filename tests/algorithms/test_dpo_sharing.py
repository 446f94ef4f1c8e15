"""DPO at the RL step's efficiency: each pair's prompt scored once (same log-probs and gradient), completions
scored up to their first EOS only, exact ties at step 0, val/* at the printed step, perf/* timings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers import CONFIGS, run_cli, scalars
from test_dpo import PAIRS, as_batch, logps_by_hand, make_dpo, perturb

import lightning_rl.models.sharding as sharding
from lightning_rl.algorithms import DPO
from lightning_rl.algorithms.options import PolicyOptions
from lightning_rl.data.preference import BUILTIN_TRAIN, BUILTIN_VAL
from lightning_rl.step.engine import CopyEngine

# ChatML-like: every turn ends with EOS and a newline, as SmolLM2's / Qwen's `<|im_end|>\n`.
EOS_NEWLINE_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
# Shared prompts of different lengths (left padding) and completions of different lengths (right padding).
LONG_PAIRS = [
    {"prompt": "9081726354=", "chosen": "0123456789", "rejected": "012345678"},
    *PAIRS,
    {"prompt": "21=", "chosen": "21", "rejected": "1"},  # PAIRS[1]'s prompt: shared across pairs too
]


pytestmark = pytest.mark.usefixtures("seeded_one_thread")


def decoder_inputs(model: torch.nn.Module) -> tuple[list[torch.Size], object]:
    """The input shape of every forward through the decoder (the prefix pass shows how many prompts ran)."""
    seen: list[torch.Size] = []

    def record(_: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        seen.append((args[0] if args else kwargs["input_ids"]).shape)

    return seen, model.get_decoder().register_forward_pre_hook(record, with_kwargs=True)


# ---- 1. prompt-prefix sharing ------------------------------------------------------------------------
def scored(dpo, batch, share: bool):
    """Per-sequence policy and reference log-probs, the loss and its gradient, sharing on or off."""
    dpo.share_prompt_prefix = share
    dpo.configure_prefix_sharing()
    assert dpo.policy.share_prompts is share and dpo.reference.share_prompts is share
    enc = dpo.encode(batch)
    dpo.policy.zero_grad(set_to_none=True)
    policy = dpo.policy.token_logprobs(enc.prompt_ids, enc.prompt_mask, enc.completion_ids,
                                       enc.completion_mask)[0].sum(-1).detach()
    reference = dpo.reference_logps(batch, enc)
    loss, _ = dpo.pair_loss(batch, enc)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in dpo.policy.named_parameters()}
    return policy, reference, loss.detach(), grads


@pytest.mark.parametrize("rpo_alpha", [None, 1.0])
def test_prefix_sharing_keeps_logps_and_gradient(rpo_alpha):
    dpo = make_dpo(rpo_alpha=rpo_alpha)
    assert dpo.share_prompt_prefix  # on by default
    perturb(dpo.policy.model)  # policy != reference, so that a swap of the two would show
    dpo.policy.train()
    batch = as_batch(LONG_PAIRS)
    off, on = scored(dpo, batch, False), scored(dpo, batch, True)
    torch.testing.assert_close(on[0], off[0], rtol=0, atol=1e-5)  # policy, per sequence
    torch.testing.assert_close(on[1], off[1], rtol=0, atol=1e-5)  # frozen reference, per sequence
    assert (on[0] - on[1]).abs().max() > 1e-2
    torch.testing.assert_close(on[2], off[2], rtol=0, atol=1e-6)
    assert on[3].keys() == off[3].keys()
    for name, grad in off[3].items():
        torch.testing.assert_close(on[3][name], grad, rtol=1e-4, atol=1e-5, msg=name)
    assert max(g.abs().max() for g in off[3].values()) > 1e-2


def test_each_distinct_prompt_runs_once_per_step():
    dpo = make_dpo()
    batch = as_batch(LONG_PAIRS)  # 5 pairs, 4 distinct prompts, 10 sequences
    enc = dpo.encode(batch)
    for scorer in (dpo.policy, dpo.reference):
        seen, handle = decoder_inputs(scorer.model)
        try:
            scorer.token_logprobs(enc.prompt_ids, enc.prompt_mask, enc.completion_ids, enc.completion_mask)
        finally:
            handle.remove()
        prompt_width, completion_width = enc.prompt_ids.shape[1], enc.completion_ids.shape[1]
        assert seen == [torch.Size([4, prompt_width]), torch.Size([10, completion_width])]


def test_prefix_sharing_is_off_where_the_online_step_turns_it_off(monkeypatch):
    assert not make_dpo(share_prompt_prefix=False).policy.share_prompts
    # the cache is off under gradient checkpointing
    checkpointed = make_dpo(policy={"gradient_checkpointing": True})
    assert not checkpointed.policy.share_prompts and not checkpointed.reference.share_prompts
    dpo = make_dpo()
    assert dpo.policy.share_prompts and dpo.reference.share_prompts
    monkeypatch.setattr(sharding, "collective_forward", lambda model: True)  # FSDP2 / ZeRO-3
    dpo.configure_prefix_sharing()
    assert not dpo.policy.share_prompts and not dpo.reference.share_prompts


# ---- 2. completions scored up to and including their first EOS ---------------------------------------
def test_completion_is_scored_up_to_its_first_eos_only():
    dpo = DPO(policy=PolicyOptions(model="builtin:tiny-sort", chat_template=True, max_prompt_length=32),
              max_completion_length=10)
    tok = dpo.tokenizer
    tok.chat_template = EOS_NEWLINE_TEMPLATE
    batch = as_batch(PAIRS)
    enc = dpo.encode(batch)
    eos = tok.eos_token_id
    for row in range(2 * len(PAIRS)):
        scored_ids = enc.completion_ids[row][enc.completion_mask[row].bool()].tolist()
        assert scored_ids[-1] == eos and eos not in scored_ids[:-1]  # the template's "\n" is not scored
    rendered = tok.decode(enc.prompt_ids[0][enc.prompt_mask[0].bool()])
    assert rendered == f"<user>{PAIRS[0]['prompt']}<eos>\n<assistant>"
    # the summed log-probs are those of completion + EOS after the rendered prompt, nothing after EOS
    perturb(dpo.policy.model)
    dpo.policy.eval()
    with torch.no_grad():
        seq = dpo.policy.token_logprobs(enc.prompt_ids, enc.prompt_mask, enc.completion_ids,
                                        enc.completion_mask)[0].sum(-1)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p["prompt"]}], tokenize=False,
                                       add_generation_prompt=True) for p in PAIRS]
    expected = torch.stack([logps_by_hand(dpo.policy.model, tok, prompt, p[side]).sum()
                            for side in ("chosen", "rejected")
                            for prompt, p in zip(prompts, PAIRS, strict=True)])
    torch.testing.assert_close(seq, expected, rtol=0, atol=1e-5)


# ---- 3-5. step 0 through the real CLI: exact ties, val/* at the printed step, perf/* ------------------
def small_data(tmp_path: Path) -> list[str]:
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text("\n".join(BUILTIN_TRAIN.read_text().splitlines()[:48]) + "\n")
    val.write_text("\n".join(BUILTIN_VAL.read_text().splitlines()[:32]) + "\n")
    return [f"--data.init_args.path={train}", f"--data.init_args.val_path={val}"]


@pytest.mark.slow
def test_cli_step0_ties_val_steps_and_perf(tmp_path, caplog, capfd):
    """bf16-mixed with a precomputed reference: the cache used to be scored outside autocast, so every
    margin at step 0 was float noise (held-out preference accuracy 0.48 instead of 0)."""
    run_cli("fit", "--config", CONFIGS / "dpo.yaml", "--config", CONFIGS / "precision" / "bf16.yaml",
            *small_data(tmp_path), "--model.init_args.precompute_ref_logps=true",
            "--data.init_args.batch_size=8", "--trainer.max_steps=2", "--trainer.val_check_interval=2",
            "--trainer.num_sanity_val_steps=1", "--trainer.log_every_n_steps=1",
            "--trainer.enable_checkpointing=false", f"--trainer.logger.init_args.save_dir={tmp_path}")
    logged = {tag: dict(points) for tag, points in scalars(tmp_path).items()}
    # 3. the policy is the reference at step 0: every margin is exactly 0, a tie, so accuracy is exactly 0
    assert logged["val/rewards/accuracy"][0] == 0.0 and logged["val/rewards/margin"][0] == 0.0
    assert logged["rewards/accuracy"][0] == 0.0 and logged["rewards/margin"][0] == 0.0
    # 4. validation after 2 optimiser steps is logged at step 2, the step printed beside it
    assert sorted(logged["val/rewards/accuracy"]) == [0, 2]
    assert sorted(logged["val/loss"]) == [0, 2] and logged["val/rewards/accuracy"][2] > 0.5
    out = capfd.readouterr()
    printed = re.findall(r"step (\d+): val/accuracy = ", caplog.text + out.out + out.err)
    assert sorted(set(printed)) == ["0", "2"]
    # 5. timings once per step
    for name in ("perf/step_time", "perf/forward_time", "perf/reference_time", "perf/backward_time",
                 "perf/tokens_per_sec"):
        assert sorted(logged[name]) == [0, 1], name
    for step in (0, 1):
        step_time = logged["perf/step_time"][step]
        assert 0 < logged["perf/forward_time"][step] < step_time
        assert 0 < logged["perf/backward_time"][step] < step_time
        assert logged["perf/tokens_per_sec"][step] > 0


def test_validation_samples_with_the_current_weights_of_a_copy_engine():
    dpo = make_dpo(engine=CopyEngine(dtype="float32"))
    dpo.completer.attach()
    perturb(dpo.policy.model)
    dpo.on_validation_start()  # no trainer needed without precompute_ref_logps
    copy = dict(dpo.engine.copy.model.named_parameters())
    for name, p in dpo.policy.model.named_parameters():
        assert torch.equal(copy[name], p), name
