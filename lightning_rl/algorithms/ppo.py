"""PPO with a learned critic (Schulman et al., 2017; Ouyang et al., 2022, InstructGPT), on the shared step.

prompt batch -> completions (one per prompt is enough) -> sequence scores (reward functions and / or a
reward model) -> reference and behaviour log-probs -> per-token rewards (the score on the last completion
token, minus ``kl_coef`` x KL to the reference on every token when ``kl_in_reward``) -> the critic's values
-> GAE advantages and returns -> advantages whitened over the whole global batch (all ranks) -> ``ppo_epochs``
x ``num_minibatches`` updates of the policy (PPO-Clip, optional entropy bonus) and the critic (clipped value
loss), each with its own optimiser, learning rate and scheduler.

One trainer step is one update: the policy's optimiser step counts as the trainer's, and the critic's goes
through the strategy alongside it (precision plugin and clipping included). During ``critic_warmup`` only
the critic learns and its step is the trainer's.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from lightning_rl.adapters import trainable_parameters
from lightning_rl.algorithms.online import OnlineRL
from lightning_rl.critic import Critic, load_critic
from lightning_rl.losses import (
    Aggregation,
    KLEstimator,
    adaptive_kl_coef,
    explained_variance,
    gae_advantages,
    kl_penalty,
    masked_moments,
    moments_mean_var,
    token_rewards,
    value_loss,
    whiten,
)
from lightning_rl.rollout import Rollout
from lightning_rl.sharding import agreed_count, shard_policy_model, strategy_is, zero_loss


class PPO(OnlineRL):
    """PPO with a critic (value model) and GAE; any reward functions and / or a reward model.

    Args:
        num_generations: completions per prompt (1 is enough: the critic is the baseline).
        critic_model: where the critic starts: ``None`` copies the policy's weights (fresh scalar head); else
            a folder or hub id that ``AutoModelForTokenClassification`` loads with one label (a causal LM, a
            reward model from ``configs/reward_model.yaml``, a saved critic); its vocabulary must be the
            policy's.
        critic_optimizer, critic_lr_scheduler: the critic's optimiser and scheduler factories (YAML
            ``class_path`` + ``init_args``), independent of the policy's ``optimizer`` / ``lr_scheduler``.
        vf_coef: weight of the value loss (scales the critic's gradient; matters with clipping).
        value_clip: value clip range around the rollout-time values; ``None``: unclipped.
        gamma, lam: GAE discount and lambda, in [0, 1].
        kl_in_reward: the KL to the reference as a per-token penalty in the reward (InstructGPT / verl); off:
            the in-loss KL term of the other algorithms, with the same ``kl_coef`` / ``kl_estimator``.
        kl_coef: the KL weight (the controller's starting value when ``kl_target`` is set); 0: no reference.
        kl_estimator: per-token KL estimate (``k1`` = log-ratio, InstructGPT's, by default here).
        kl_target, kl_horizon: adaptive KL controller (Ziegler et al.): after each rollout the coefficient
            moves towards the value that keeps the mean per-sequence KL at ``kl_target``; ``None``: fixed.
        whiten_advantages: normalise advantages to mean 0, std 1 over all valid tokens of all ranks.
        critic_warmup: rollouts at the start during which only the critic learns.
        aggregation, clip_low, clip_high: the policy objective (PPO-Clip, ``token-mean`` as verl).
        **kwargs: see :class:`~lightning_rl.algorithms.online.OnlineRL` (``entropy_coef``: entropy bonus).
    """

    min_generations = 1
    summed_metrics = ("policy/loss", "critic/vf_loss")

    def __init__(
        self,
        *args: Any,
        num_generations: int = 1,
        critic_model: str | None = None,
        critic_optimizer: OptimizerCallable = torch.optim.AdamW,
        critic_lr_scheduler: LRSchedulerCallable | None = None,
        vf_coef: float = 0.5,
        value_clip: float | None = 0.2,
        gamma: float = 1.0,
        lam: float = 0.95,
        kl_in_reward: bool = True,
        kl_coef: float = 0.05,
        kl_estimator: KLEstimator = "k1",
        kl_target: float | None = None,
        kl_horizon: int = 10000,
        whiten_advantages: bool = True,
        critic_warmup: int = 0,
        aggregation: Aggregation = "token-mean",
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, num_generations=num_generations, aggregation=aggregation, clip_low=clip_low,
                         clip_high=clip_high, kl_coef=0.0 if kl_in_reward else kl_coef,
                         kl_estimator=kl_estimator, **kwargs)
        for key, value in {"gamma": gamma, "lam": lam}.items():
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"`model.{key}` must be in [0, 1], got {value}")
        checks = {"vf_coef": vf_coef > 0, "kl_coef": kl_coef >= 0, "kl_horizon": kl_horizon > 0,
                  "critic_warmup": critic_warmup >= 0, "value_clip": value_clip is None or value_clip > 0,
                  "kl_target": kl_target is None or kl_target > 0}
        for key, ok in checks.items():
            if not ok:
                raise ValueError(f"`model.{key}` is out of range, got {locals()[key]}")
        if kl_target is not None and not (kl_in_reward and kl_coef > 0):
            raise ValueError("`model.kl_target` (adaptive KL) needs `model.kl_in_reward: true` and "
                             "`model.kl_coef` > 0")
        remote = kwargs.get("trust_remote_code", False)
        self.critic: Critic = load_critic(critic_model, self.policy, trust_remote_code=remote)
        if kwargs.get("gradient_checkpointing"):
            self.critic.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        self.critic_optimizer_factory, self.critic_scheduler_factory = critic_optimizer, critic_lr_scheduler
        self.vf_coef, self.value_clip = vf_coef, value_clip
        self.gamma, self.lam = gamma, lam
        self.kl_in_reward, self.kl_value = kl_in_reward, kl_coef
        self.kl_target, self.kl_horizon = kl_target, kl_horizon
        self.kl_estimator = kl_estimator
        self.whiten_advantages, self.critic_warmup = whiten_advantages, critic_warmup
        if self._reference is None and kl_in_reward and kl_coef > 0:
            self.__dict__["_reference"] = self.policy.reference()

    # ---- setup ----------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if strategy_is(self.trainer.strategy, ("DeepSpeedStrategy",)):
            raise ValueError("PPO trains two models with two optimisers and Lightning's DeepSpeed strategy "
                             "takes one: use DDP or FSDP2 (configs/strategy/fsdp2.yaml)")
        super().setup(stage)

    def configure_model(self) -> None:
        """FSDP2: the critic is sharded like the policy (each decoder layer, then the root)."""
        super().configure_model()
        if self.device_mesh is not None:
            shard_policy_model(self.critic.model, self.device_mesh, cpu_offload=self.fsdp_cpu_offload,
                               param_dtype=self.fsdp_param_dtype, reduce_dtype=self.fsdp_reduce_dtype)

    def configure_optimizers(self) -> Any:
        policy_opt = self.optimizer_factory(trainable_parameters(self.policy))  # the adapters under PEFT
        critic_opt = self.critic_optimizer_factory(self.critic.parameters())
        pairs = ((self.scheduler_factory, policy_opt), (self.critic_scheduler_factory, critic_opt))
        schedulers = [{"scheduler": make(opt), "interval": "step"} for make, opt in pairs if make is not None]
        return [policy_opt, critic_opt], schedulers

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.critic.train()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["kl_coef_value"] = self.kl_value  # the adaptive controller's state

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.kl_value = checkpoint.get("kl_coef_value", self.kl_value)

    def extra_exports(self) -> dict[str, Any]:
        """Written by ``ExportPolicy`` next to the policy folder: ``critic/``."""
        return {"critic": self.critic}

    # ---- advantages -----------------------------------------------------------------------------
    @property
    def warming_up(self) -> bool:
        return self.trainer.fit_loop.total_batch_idx < self.critic_warmup

    @torch.no_grad()
    def critic_values(self, rollout: Rollout) -> torch.Tensor:
        """The critic's values of the rollout, micro-batched (as many forwards on every rank if sharded)."""
        size = self.micro_batch_size or max(len(rollout), 1)
        out = [self.critic.values(p.prompt_ids, p.prompt_mask, p.completion_ids, p.completion_mask)
               for p in rollout.minibatches(size)]
        for _ in range(agreed_count(self.trainer, self.critic.model, len(out)) - len(out)):
            zero_loss(self.critic, self.trainer)
        if not out:
            return rollout.completion_mask.new_zeros(rollout.completion_mask.shape).float()
        return torch.cat(out, 0)

    def prepare_update(self, rollout: Rollout) -> tuple[Rollout, dict[str, float]]:
        """Values, per-token rewards, GAE advantages (whitened globally) and returns; step statistics.

        Every rank makes the same one all-reduce of the statistics, whatever its number of rows.
        """
        mask = rollout.completion_mask
        values = self.critic_values(rollout)
        kl = None
        if self.kl_in_reward and rollout.ref_logp is not None:
            behaviour = rollout.old_logp if rollout.old_logp is not None else self.logprobs(rollout)
            kl = kl_penalty(behaviour, rollout.ref_logp, self.kl_estimator) * mask
        rewards = token_rewards(rollout.rewards, mask, kl, self.kl_value)
        advantages, returns = gae_advantages(rewards, values, mask, self.gamma, self.lam)
        seq_kl = kl.sum(1) if kl is not None else mask.new_zeros(len(rollout)).float()
        local = torch.cat([masked_moments(advantages, mask), masked_moments(values, mask),
                           masked_moments(returns, mask), masked_moments(returns - values, mask),
                           torch.stack([seq_kl.double().sum(), torch.tensor(float(len(rollout))).double()])])
        total = self.trainer.strategy.reduce(local.to(self.device), reduce_op="sum")
        adv_m, val_m, ret_m, res_m, kl_sums = total[0:3], total[3:6], total[6:9], total[9:12], total[12:]
        if self.whiten_advantages:
            advantages = whiten(advantages, mask, adv_m)
        adv_mean, adv_var = moments_mean_var(adv_m)
        mean_kl = float(kl_sums[0] / kl_sums[1].clamp_min(1))
        stats = {"critic/value_mean": float(moments_mean_var(val_m)[0]),
                 "critic/returns_mean": float(moments_mean_var(ret_m)[0]),
                 "critic/explained_variance": float(explained_variance(res_m, ret_m)),
                 "rollout/advantages_mean": float(adv_mean), "rollout/advantages_std": float(adv_var.sqrt()),
                 "policy/kl_in_reward": mean_kl, "policy/kl_coef": self.kl_value}
        if self.kl_target is not None:  # after this rollout's rewards used the current value
            self.kl_value = adaptive_kl_coef(self.kl_value, mean_kl, self.kl_target, int(kl_sums[1]),
                                             self.kl_horizon)
        return replace(rollout, advantages=advantages.float(), values=values, returns=returns), stats

    # ---- update ---------------------------------------------------------------------------------
    def stepped_optimizers(self) -> list[Any]:
        policy_opt, critic_opt = self.optimizers()
        return [critic_opt] if self.warming_up else [policy_opt, critic_opt]

    def sharded_roots(self) -> list[Any]:
        return [self.policy.model, self.critic.model]

    def empty_loss(self) -> torch.Tensor:
        return zero_loss(self.policy, self.trainer) + zero_loss(self.critic, self.trainer)

    def grad_norm_name(self, optimizer: Any) -> str:
        critic = {id(p) for p in self.critic.parameters()}
        params = (p for group in optimizer.param_groups for p in group["params"])
        return "critic/grad_norm" if any(id(p) in critic for p in params) else "policy/grad_norm"

    def micro_loss(
        self, micro: Rollout, num_tokens: torch.Tensor, num_seqs: torch.Tensor
    ) -> tuple[torch.Tensor, dict]:
        """Policy loss (skipped while the critic warms up: a zero loss joins the gradient reduction) plus
        ``vf_coef`` x the clipped value loss, both normalised by the minibatch's global token count."""
        if self.warming_up:
            loss, metrics = zero_loss(self.policy, self.trainer), {}
        else:
            loss, metrics = super().micro_loss(micro, num_tokens, num_seqs)
        values = self.critic.values(micro.prompt_ids, micro.prompt_mask, micro.completion_ids,
                                    micro.completion_mask)
        clip = self.value_clip if self.value_clip is not None else math.inf
        vf_loss, value_metrics = value_loss(values, micro.values, micro.returns, micro.completion_mask, clip,
                                            num_tokens=num_tokens)
        metrics.update({"critic/vf_loss": vf_loss, "critic/vf_clip_frac": value_metrics["value/clip_frac"],
                        "critic/value_pred_mean": value_metrics["value/mean"]})
        return loss + self.vf_coef * vf_loss, metrics
