"""One RL update on a fixed rollout, on 1 process or under DDP on 2 gloo ranks; rank 0 saves the gradients.

    python tests/ddp_update.py OUT.pt DEVICES MICRO_BATCH_SIZE

Every rank builds the same 16-row rollout (seeded), then takes rows ``rank::world``, so the ranks hold
different numbers of tokens. Used by tests/test_distributed.py: the gradient must not depend on the
world size.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from functools import partial

import lightning as L
import torch
import torch.distributed as dist

from lightning_rl.algorithms import GRPO
from lightning_rl.algorithms.learner_options import UpdateOptions
from lightning_rl.algorithms.options import PolicyOptions
from lightning_rl.algorithms.sampler_options import SamplingOptions
from lightning_rl.data import PromptDataModule
from lightning_rl.maths.covariance_regions import ClipCov, KLCov
from lightning_rl.maths.objective import Objective
from lightning_rl.maths.trust_regions import DPPO, Clip
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.correction import RolloutCorrection
from lightning_rl.step.logprobs import score_rollout
from lightning_rl.step.rollout import Rollout


def logprobs(module: GRPO, rollout: Rollout, scorer=None) -> torch.Tensor:
    """``[N, C]`` log-probs of the rollout's completions under ``scorer`` (default: the policy), scored as
    the step's log-prob passes score them (the rollout's temperature, the updater's micro-batches)."""
    scorer = scorer if scorer is not None else module.policy
    joiner = module.policy if scorer is module.policy or getattr(scorer, "shares_weights", False) else None
    return score_rollout(scorer, rollout, micro_batch_size=module.updater.micro_batch_size,
                         collectives=Collectives(module.trainer), joiner=joiner)


def update(module: GRPO, minibatch: Rollout) -> list[tuple[dict, float]]:
    """One optimiser step of every trained model on ``minibatch``; each micro-batch's (metrics, share)."""
    return list(module.updater.update(minibatch, module.trained_models(), module.update_hooks(),
                                      Collectives(module.trainer)))


def fixed_rollout(module: GRPO) -> Rollout:
    prompts = ["12345=", "907=", "5555123=", "31="]
    ids, mask = module.encode_prompts(prompts)
    torch.manual_seed(0)
    gen = module.policy.generate(ids, mask, num_samples=4, max_new_tokens=8)
    g = torch.Generator().manual_seed(1)
    n = len(gen.completion_ids)
    attention_mask = gen.completion_mask.clone()
    attention_mask[3] = 0  # an empty row
    # row 5 keeps its first two tokens in the context but out of the loss (as excluded tokens are): the
    # counts and normalisers read loss_mask, the forwards attention_mask
    loss_mask = attention_mask.clone()
    loss_mask[5, :2] = 0
    rollout = Rollout(gen.prompt_ids, gen.prompt_mask, gen.completion_ids, attention_mask, loss_mask,
                      gen.truncated, gen.lengths, torch.arange(4).repeat_interleave(4),
                      torch.rand(n, generator=g), torch.zeros(n, dtype=torch.bool),
                      advantages=torch.randn(n, generator=g))
    logp = logprobs(module, rollout)
    valid = attention_mask.bool()
    rollout.old_logp = torch.where(valid, logp + 0.3 * torch.randn(logp.shape, generator=g), 0.0)
    rollout.ref_logp = torch.where(valid, logp + 0.2 * torch.randn(logp.shape, generator=g), 0.0)
    # an engine that is not the trainer: truncated importance weights (some above the cap) weight the loss
    noise = 0.3 * torch.randn(logp.shape, generator=g)
    rollout.rollout_logp = torch.where(valid, rollout.old_logp + noise, 0.0)
    RolloutCorrection(cap=1.5)(rollout)
    return rollout


BASE_OBJECTIVE = {"trust_region": Clip(0.2, 0.28), "kl_coef": 0.1}  # the probe's (GRPO's otherwise)
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "skip",
         "entropy", "kl-cov", "clip-cov", "dppo", "opsm")
# issue 40's objective options: the batch-statistic selections (entropy quantile, KL-Cov, Clip-Cov) are made
# over the whole minibatch on every rank before the micro-batches; DPPO and OPSM are per token / per row
OPTION_MODES = {
    "entropy": dict(aggregation="token-mean", top_entropy_quantile=0.3),
    "kl-cov": dict(aggregation="token-mean", trust_region=KLCov(ratio=0.25, coef=0.5)),
    "clip-cov": dict(aggregation="token-mean", trust_region=ClipCov(high=0.28, ratio=0.2, lb=-0.5, ub=0.5)),
    "dppo": dict(aggregation="seq-mean-token-mean", trust_region=DPPO(low=0.1, high=0.1)),
    "opsm": dict(aggregation="seq-mean-token-mean", off_policy_mask_threshold=0.05),
}


def for_mode(module: GRPO, rollout: Rollout, mode: str) -> Rollout:
    """The rollout and objective of one probe mode: an aggregation; or ``skip``: no KL term and no signal
    on the odd rows, so the updater skips them (under the strided split all of rank 1's rows: it joins
    the gradient reduction with empty micro-batches only), and the normalisers still count them; or one of
    :data:`OPTION_MODES`, from the probe's base objective."""
    if mode in OPTION_MODES:
        module.objective = Objective(**{**BASE_OBJECTIVE, "aggregation_length": 8, **OPTION_MODES[mode]})
        return rollout
    if mode != "skip":  # seq-mean-token-sum-norm over the completion budget, as training sets it
        module.objective = dataclasses.replace(module.objective, aggregation=mode, aggregation_length=8)
        return rollout
    module.objective = dataclasses.replace(module.objective, aggregation="seq-mean-token-mean", kl_coef=0.0)
    advantages = rollout.advantages.clone()
    advantages[1::2] = 0.0
    return dataclasses.replace(rollout, advantages=advantages)


class Probe(GRPO):
    def training_step(self, batch, batch_idx):
        rollout = fixed_rollout(self)
        world, rank = self.trainer.world_size, self.global_rank
        grads = {}
        for mode in MODES:
            update(self, for_mode(self, rollout, mode).select(torch.arange(rank, len(rollout), world)))
            grads[mode] = {n: p.grad.detach().clone() for n, p in self.policy.named_parameters()}
        if rank == 0:
            torch.save(grads, sys.argv[1])


def main() -> None:
    torch.set_num_threads(1)
    out, devices, micro = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    module = Probe.configured(
        policy=PolicyOptions(model="builtin:tiny-sort", max_prompt_length=16),
        sampling=SamplingOptions(max_new_tokens=8, num_generations=4),
        update=UpdateOptions(micro_batch_size=None if micro == "none" else int(micro), max_grad_norm=None),
        objective=BASE_OBJECTIVE,
        optimizer=partial(torch.optim.SGD, lr=0.0))
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0,
                        default_root_dir=os.path.dirname(out))
    trainer.fit(module, PromptDataModule(batch_size=2))


if __name__ == "__main__":
    main()
    if dist.is_initialized():  # tear gloo down cleanly: its threads left running abort the process at exit
        dist.destroy_process_group()
