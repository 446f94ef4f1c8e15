"""The online RL step inside Lightning: scoring under top-k / top-p sampling, gradient clipping through the
precision plugin, bf16-mixed on CPU, and gradient checkpointing through the ``Policy`` method."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from helpers import datamodule, make, make_trainer, read_csv_metrics
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_rl.algorithms import GRPO
from lightning_rl.callbacks.base import RLCallback

PROMPTS = ["50318=", "91234=", "77201=", "46650="]


def perturb(model: torch.nn.Module, scale: float = 0.05) -> None:
    """Move the policy away from the reference (which stays the model as loaded)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))


def sampled(module: GRPO, top_k: int, top_p: float):
    ids, mask = module.encode_prompts(PROMPTS)
    torch.manual_seed(0)
    return module.policy.generate(ids, mask, num_samples=4, max_new_tokens=8, temperature=1.0,
                                  top_k=top_k, top_p=top_p)


# ------------------------------------------------------------------------ top-k / top-p never gives NaN
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_moved_policy_with_top_k_top_p_gives_finite_loss_kl_and_gradient(ratio_level):
    module = make(GRPO, sampling={"top_k": 5, "top_p": 0.9},
                  objective={"kl_coef": 0.04, "ratio_level": ratio_level})
    module.reference_policy()  # the policy as loaded (fit builds it in `setup`), before it moves
    perturb(module.policy.model)
    gen = sampled(module, top_k=5, top_p=0.9)
    args = (gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask)
    valid = gen.completion_mask.bool()
    # The trap this guards against: scored under its *own* filter, the reference rejects tokens the moved
    # policy sampled (-inf log-prob, infinite k3).
    filtered_ref, _ = module.reference_policy().token_logprobs(*args, temperature=1.0, top_k=5, top_p=0.9)
    assert torch.isinf(filtered_ref[valid]).sum() > 0
    # What training does: every log-prob on the tempered, unfiltered distribution.
    ref = module.reference_policy().token_logprobs(*args, temperature=module.sampling.temperature)[0]
    old = module.policy.token_logprobs(*args, temperature=module.sampling.temperature)[0].detach()
    logp, _ = module.policy.token_logprobs(*args, temperature=module.sampling.temperature)
    adv = torch.linspace(-1.5, 1.5, len(valid))
    loss, metrics = module.objective(logp, old + 0.1 * torch.randn_like(old), ref, adv, valid)
    loss.backward()
    assert math.isfinite(loss.item()) and math.isfinite(metrics["policy/kl_ref"].item())
    assert metrics["policy/kl_ref"].item() > 1e-3  # the policy did move
    grads = [p.grad for p in module.policy.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0


@pytest.mark.slow
def test_grpo_run_with_top_k_top_p_logs_finite_loss_and_kl_every_step(tmp_path):
    module = make(GRPO, sampling={"top_k": 5, "top_p": 0.9}, objective={"kl_coef": 0.04},
                  optimizer=partial(torch.optim.AdamW, lr=3e-3))
    trainer = make_trainer(tmp_path, max_steps=8, logger=CSVLogger(str(tmp_path)), log_every_n_steps=1)
    trainer.fit(module, datamodule())
    logged = read_csv_metrics(tmp_path)
    for name in ("policy/loss", "policy/kl_ref", "policy/approx_kl", "policy/entropy"):
        assert len(logged[name]) == 8 and all(math.isfinite(v) for v in logged[name]), (name, logged[name])
    assert logged["policy/kl_ref"][-1] > 0  # the policy moved away from the reference, and KL says so
    assert logged["rollout/excluded_tokens"] == [0.0] * 8


def test_nonfinite_behaviour_logprobs_are_excluded_and_counted():
    from lightning_rl.step.rollout import Rollout, exclude_nonfinite

    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    rollout = Rollout(prompt_ids=torch.ones(2, 1, dtype=torch.long),
                      prompt_mask=torch.ones(2, 1, dtype=torch.long),
                      completion_ids=torch.ones(2, 3, dtype=torch.long), attention_mask=mask, loss_mask=mask,
                      truncated=torch.zeros(2, dtype=torch.bool), lengths=mask.sum(-1),
                      group_ids=torch.zeros(2, dtype=torch.long), rewards=torch.zeros(2),
                      correct=torch.zeros(2, dtype=torch.bool), advantages=torch.zeros(2),
                      old_logp=torch.tensor([[-1.0, -math.inf, -math.inf], [-1.0, -1.0, -1.0]]),
                      ref_logp=torch.tensor([[-1.0, -1.0, 0.0], [math.nan, -1.0, -1.0]]))
    clean, excluded = exclude_nonfinite(rollout)
    assert excluded == 2.0  # (0, 1) old -inf and (1, 0) ref NaN; (0, 2) is padding and does not count
    assert clean.loss_mask.tolist() == [[1, 0, 0], [0, 1, 1]]
    assert torch.equal(clean.attention_mask, mask)  # out of the loss, still in the context
    assert torch.isfinite(clean.old_logp).all() and torch.isfinite(clean.ref_logp).all()
    assert exclude_nonfinite(clean) == (clean, 0.0)


# ------------------------------------------------------------------------------ clipping, precision
class NormProbe(RLCallback):
    """The logged pre-clip norm of each step (one optimiser step per step here)."""

    def __init__(self):
        self.norms: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, *_):
        if "policy/grad_norm" in trainer.callback_metrics:
            self.norms.append(float(trainer.callback_metrics["policy/grad_norm"]))


@pytest.mark.slow
@pytest.mark.parametrize("max_grad_norm", [1e-3, None])
def test_max_grad_norm_bounds_the_update(tmp_path, max_grad_norm):
    # Plain SGD with lr 1: the parameter change is exactly the (clipped) gradient.
    module = make(GRPO, objective={"kl_coef": 0.0}, update={"max_grad_norm": max_grad_norm},
                  optimizer=partial(torch.optim.SGD, lr=1.0))
    before = [p.detach().clone() for p in module.policy.parameters()]
    probe = NormProbe()
    make_trainer(tmp_path, max_steps=1, callbacks=[probe]).fit(module, datamodule())
    step = math.sqrt(sum(float((p.detach() - b).pow(2).sum())
                         for p, b in zip(module.policy.parameters(), before, strict=True)))
    if max_grad_norm is None:
        assert probe.norms == [] and step > 1e-2  # unclipped: the raw gradient
    else:
        assert probe.norms[0] > 10 * max_grad_norm  # the raw gradient was much larger...
        assert step == pytest.approx(max_grad_norm, rel=1e-4)  # ...and the update is cut to the bound


@pytest.mark.slow
def test_clipping_sees_unscaled_gradients_under_16_mixed(tmp_path):
    # 16-mixed scales the loss by 2**16 before backward. Clipping before the precision plugin unscales
    # would cut the scaled gradient to 1e-3 and the step would then be 1e-3 / 65536; clipped in
    # on_before_optimizer_step, after unscaling, the SGD (lr 1) step is exactly the bound.
    module = make(GRPO, objective={"kl_coef": 0.0}, update={"max_grad_norm": 1e-3},
                  optimizer=partial(torch.optim.SGD, lr=1.0))
    before = [p.detach().clone() for p in module.policy.parameters()]
    probe = NormProbe()
    # Lightning gives CPU 16-mixed no scaler: pass one, as CUDA would have (initial scale 2**16)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    make_trainer(tmp_path, max_steps=1, plugins=[plugin], callbacks=[probe]).fit(module, datamodule())
    assert plugin.scaler.get_scale() == 2.0**16  # the step was taken with a scaled loss, not skipped
    params = zip(module.policy.parameters(), before, strict=True)
    step = math.sqrt(sum(float((p.detach() - b).pow(2).sum()) for p, b in params))
    assert 1e-2 < probe.norms[0] < 1e3  # the logged norm is of the unscaled gradient, not ~65536 times it
    assert step == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.slow
def test_grpo_runs_in_bf16_mixed_on_cpu(tmp_path):
    module = make(GRPO, objective={"kl_coef": 0.04})
    before = [p.detach().clone() for p in module.policy.parameters()]
    probe = NormProbe()
    trainer = make_trainer(tmp_path, max_steps=2, precision="bf16-mixed", callbacks=[probe],
                           logger=CSVLogger(str(tmp_path)), log_every_n_steps=1)
    trainer.fit(module, datamodule())
    logged = read_csv_metrics(tmp_path)
    assert (all(math.isfinite(v) for v in logged["policy/loss"] + logged["policy/kl_ref"])
            and len(logged["policy/loss"]) == 2)
    assert all(p.dtype == torch.float32 for p in module.policy.parameters())  # mixed: fp32 weights
    assert len(probe.norms) == 2 and all(0 < n < math.inf for n in probe.norms)
    assert any(not torch.equal(p, b) for p, b in zip(module.policy.parameters(), before, strict=True))


@pytest.mark.slow
def test_gradient_checkpointing_gives_the_same_update(tmp_path):
    def one_step(checkpointing: bool) -> list[torch.Tensor]:
        # prompts are shared only without checkpointing (float rounding would differ): off in both
        module = make(GRPO, objective={"kl_coef": 0.04}, policy={"gradient_checkpointing": checkpointing},
                      update={"max_grad_norm": None}, sampling={"share_prompt_prefix": False},
                      optimizer=partial(torch.optim.SGD, lr=1.0))
        model = module.policy.model
        on = getattr(model, "is_activation_checkpointing", None)
        assert (model.is_gradient_checkpointing if on is None else on) == checkpointing
        before = [p.detach().clone() for p in module.policy.parameters()]
        make_trainer(tmp_path, max_steps=1).fit(module, datamodule())
        return [p.detach() - b for p, b in zip(module.policy.parameters(), before, strict=True)]

    plain, checkpointed = one_step(False), one_step(True)
    assert sum(float(d.abs().sum()) for d in plain) > 1e-3
    for a, b in zip(plain, checkpointed, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
