"""PPO with a learned critic (Schulman et al., 2017; Ouyang et al., 2022, InstructGPT), on the shared step.

The step is :class:`~lightning_rl.algorithms.online.OnlineRL`'s; PPO adds a companion, the critic, trained
beside the policy with its own optimiser, and the stage that scores its values before the advantages. The
KL to the reference is a per-token penalty in the reward by default (``KLInReward``, fixed or adaptive),
advantages are GAE's (``lightning_rl.step.estimators.GAE``, whitened over all ranks), and the updater steps
the policy (PPO-Clip, optional entropy bonus) and the critic (clipped value loss). One trainer step is one
update; during ``critic.warmup`` only the critic learns.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from lightning_rl.algorithms.learner_options import ObjectiveOptions
from lightning_rl.algorithms.online import OnlineRL
from lightning_rl.algorithms.optimiser_steps import Companion
from lightning_rl.algorithms.presets import PPO_MOVED_KEYS
from lightning_rl.algorithms.sampler_options import SamplingOptions
from lightning_rl.maths.penalties import FixedKL
from lightning_rl.models.critic import CriticOptions, load_critic
from lightning_rl.models.model_utils import enable_gradient_checkpointing
from lightning_rl.models.sharding import zero_loss
from lightning_rl.step.estimators import GAE, AdvantageEstimator
from lightning_rl.step.learner import Stage
from lightning_rl.step.logprobs import CriticValues
from lightning_rl.step.rollout import Rollout
from lightning_rl.step.update import TrainedModel, critic_loss

PPO_OBJECTIVE = ObjectiveOptions(aggregation="token-mean", kl_coef=0.05, kl_estimator="k1",
                                 kl_in_reward=FixedKL())


class PPO(OnlineRL):
    """PPO with a critic (value model) and GAE; any reward functions and / or a reward model.

    Args:
        critic: the value model, its optimiser and its loss (``CriticOptions``).
        sampling: one completion per prompt by default (the critic is the baseline).
        objective: PPO-Clip with ``token-mean`` (as verl) and the KL to the reference as a per-token ``k1``
            penalty in the reward at a fixed coefficient (``kl_in_reward: FixedKL``; ``AdaptiveKL`` with
            a ``target``; ``null`` puts it in the loss).
        advantage: ``None``: GAE (``gamma`` 1.0, ``lam`` 0.95, whitened); set
            ``lightning_rl.step.estimators.GAE`` with other ``init_args`` to change them.
        **kwargs: see :class:`~lightning_rl.algorithms.online.OnlineRL`.
    """

    moved_keys: ClassVar[dict[str, str]] = PPO_MOVED_KEYS

    def __init__(
        self, *args: Any, critic: CriticOptions = CriticOptions(),
        sampling: SamplingOptions = SamplingOptions(num_generations=1),
        objective: ObjectiveOptions = PPO_OBJECTIVE, advantage: AdvantageEstimator | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, sampling=sampling, objective=objective,
                         advantage=advantage if advantage is not None else GAE(), **kwargs)
        held, self.critic_options = self.policy_options, critic
        self.critic = load_critic(critic.model, self.policy, trust_remote_code=held.trust_remote_code)
        if held.gradient_checkpointing:
            enable_gradient_checkpointing(self.critic.model)

    def companions(self) -> dict[str, Companion]:
        o = self.critic_options
        return {"critic": Companion(self.critic, o.optimizer, o.lr_scheduler)}

    def preset_stages(self) -> list[Stage]:
        """The critic's values of the rollout's tokens, which GAE reads."""
        return [CriticValues(self.critic, self.updater.micro_batch_size)]

    def trained_models(self) -> list[TrainedModel]:
        """The policy (joining the backward without stepping while the critic warms up), then the critic,
        whose step goes through the strategy beside the policy's (so one trainer step stays one update)."""
        warm = self.trainer.fit_loop.total_batch_idx < self.critic_options.warmup  # rollouts, not updates
        policy_opt, critic_opt = self.optimizers()
        policy = TrainedModel("policy", self.policy, policy_opt, self.policy_loss, ("policy/loss",),
                              select=self.select_tokens, packed=self.policy.packing)
        if warm:
            policy.optimizer, policy.loss, policy.summed = None, self.frozen_policy_loss, ()
            policy.select = None  # its loss is a zero loss: no selection to make
        critic = TrainedModel("critic", self.critic, critic_opt, self.critic_loss, ("critic/vf_loss",),
                              counts_as_step=warm)
        return [policy, critic]

    def frozen_policy_loss(self, micro: Rollout, num_tokens: torch.Tensor, num_seqs: torch.Tensor) -> tuple:
        """A zero loss whose backward still joins the gradient reduction (DDP sees every parameter used)."""
        return zero_loss(self.policy, self.trainer), {}

    def critic_loss(self, micro: Rollout, num_tokens: torch.Tensor, num_seqs: torch.Tensor) -> tuple:
        o = self.critic_options
        return critic_loss(self.critic, micro, o.vf_coef, o.value_clip, num_tokens)
