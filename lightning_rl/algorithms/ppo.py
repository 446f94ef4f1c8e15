"""PPO with a learned critic (Schulman et al., 2017; Ouyang et al., 2022, InstructGPT), on the shared step.

The step is :class:`~lightning_rl.algorithms.online.OnlineRL`'s; PPO adds a second trained model. Values
come from the critic, the KL to the reference is a per-token penalty in the reward by default
(``KLInReward``, fixed or adaptive), advantages are GAE's (``lightning_rl.step.estimators.GAE``, whitened over
all ranks), and the updater steps the policy (PPO-Clip, optional entropy bonus) and the critic (clipped
value loss) with their own optimisers, learning rates and schedulers. One trainer step is one update;
during ``critic_warmup`` only the critic learns.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from lightning_rl.algorithms.online import OnlineRL
from lightning_rl.maths.advantages import KLEstimator
from lightning_rl.maths.aggregation import Aggregation
from lightning_rl.maths.losses import value_loss
from lightning_rl.models.critic import load_critic
from lightning_rl.models.scoring import enable_gradient_checkpointing
from lightning_rl.models.sharding import zero_loss
from lightning_rl.step.estimators import GAE, AdvantageEstimator
from lightning_rl.step.rollout import Rollout
from lightning_rl.step.update import TrainedModel


class PPO(OnlineRL):
    """PPO with a critic (value model) and GAE; any reward functions and / or a reward model.

    Args:
        num_generations: completions per prompt (1 is enough: the critic is the baseline).
        critic_model: where the critic starts: ``None`` copies the policy's weights (fresh scalar head); else
            a folder or hub id that ``AutoModelForTokenClassification`` loads with one label (a causal LM, a
            reward model from ``configs/reward_model.yaml``, a saved critic) with the policy's vocabulary.
        critic_optimizer, critic_lr_scheduler: the critic's optimiser and scheduler factories.
        vf_coef: weight of the value loss.
        value_clip: clip range around the rollout-time values (``None``: off).
        gamma, lam, whiten_advantages: GAE's discount and lambda, and global whitening (``advantage`` unset).
        kl_in_reward, kl_coef, kl_estimator, kl_target, kl_horizon: the KL to the reference, by default a
            per-token ``k1`` penalty in the reward; ``kl_in_reward: false`` uses the in-loss term.
        critic_warmup: rollouts at the start during which only the critic learns.
        aggregation, clip_low, clip_high: the policy objective (PPO-Clip, ``token-mean`` as verl).
        **kwargs: see :class:`~lightning_rl.algorithms.online.OnlineRL`.
    """

    def __init__(
        self, *args: Any, num_generations: int = 1, critic_model: str | None = None,
        critic_optimizer: OptimizerCallable = torch.optim.AdamW,
        critic_lr_scheduler: LRSchedulerCallable | None = None, vf_coef: float = 0.5,
        value_clip: float | None = 0.2, gamma: float = 1.0, lam: float = 0.95, whiten_advantages: bool = True,
        advantage: AdvantageEstimator | None = None, kl_in_reward: bool = True, kl_coef: float = 0.05,
        kl_estimator: KLEstimator = "k1", critic_warmup: int = 0, aggregation: Aggregation = "token-mean",
        clip_low: float = 0.2, clip_high: float = 0.2, **kwargs: Any,
    ) -> None:
        advantage = advantage if advantage is not None else GAE(gamma, lam, whiten_advantages)
        super().__init__(*args, num_generations=num_generations, advantage=advantage,
                         kl_in_reward=kl_in_reward,
                         kl_coef=kl_coef, kl_estimator=kl_estimator, aggregation=aggregation,
                         clip_low=clip_low, clip_high=clip_high, **kwargs)
        checks = {"vf_coef": vf_coef > 0, "kl_coef": kl_coef >= 0, "critic_warmup": critic_warmup >= 0,
                  "value_clip": value_clip is None or value_clip > 0}
        for key, ok in checks.items():
            if not ok:
                raise ValueError(f"`model.{key}` is out of range, got {locals()[key]}")
        remote = kwargs.get("trust_remote_code", False)
        self.critic = load_critic(critic_model, self.policy, trust_remote_code=remote)
        if kwargs.get("gradient_checkpointing"):
            enable_gradient_checkpointing(self.critic.model)
        self.critic_optimizer_factory, self.critic_scheduler_factory = critic_optimizer, critic_lr_scheduler
        self.vf_coef, self.value_clip, self.critic_warmup = vf_coef, value_clip, critic_warmup

    @property
    def warming_up(self) -> bool:
        return self.trainer.fit_loop.total_batch_idx < self.critic_warmup

    def trained_models(self) -> list[TrainedModel]:
        """The policy (joining the backward without stepping while the critic warms up), then the critic,
        whose step goes through the strategy beside the policy's (so one trainer step stays one update)."""
        policy_opt, critic_opt = self.optimizers()
        policy = TrainedModel("policy", self.policy, policy_opt, self.policy_loss, ("policy/loss",))
        if self.warming_up:
            policy.optimizer, policy.loss, policy.summed = None, self.frozen_policy_loss, ()
        critic = TrainedModel("critic", self.critic, critic_opt, self.critic_loss, ("critic/vf_loss",),
                              counts_as_step=self.warming_up)
        return [policy, critic]

    def frozen_policy_loss(self, micro: Rollout, num_tokens: torch.Tensor, num_seqs: torch.Tensor) -> tuple:
        """A zero loss whose backward still joins the gradient reduction (DDP sees every parameter used)."""
        return zero_loss(self.policy, self.trainer), {}

    def critic_loss(self, micro: Rollout, num_tokens: torch.Tensor, num_seqs: torch.Tensor) -> tuple:
        """``vf_coef`` x the clipped value loss, normalised by the minibatch's global token count."""
        values = self.critic.values(micro.prompt_ids, micro.prompt_mask, micro.completion_ids,
                                    micro.attention_mask)
        clip = self.value_clip if self.value_clip is not None else math.inf
        vf_loss, value_metrics = value_loss(values, micro.values, micro.returns, micro.loss_mask, clip,
                                            num_tokens=num_tokens)
        metrics = {"critic/vf_loss": vf_loss, "critic/vf_clip_frac": value_metrics["value/clip_frac"],
                   "critic/value_pred_mean": value_metrics["value/mean"]}
        return self.vf_coef * vf_loss, metrics
