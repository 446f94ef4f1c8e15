"""One LightningModule per algorithm; the YAML ``class_path`` is the registry."""

from lightning_rl.algorithms.base import PolicyModule
from lightning_rl.algorithms.dapo import DAPO
from lightning_rl.algorithms.distill import OnPolicyDistillation
from lightning_rl.algorithms.dpo import DPO
from lightning_rl.algorithms.grpo import GRPO
from lightning_rl.algorithms.gspo import GSPO
from lightning_rl.algorithms.online import OnlineRL
from lightning_rl.algorithms.ppo import PPO
from lightning_rl.algorithms.reward_model import RewardModel
from lightning_rl.algorithms.rloo import RLOO
from lightning_rl.algorithms.sapo import SAPO
from lightning_rl.algorithms.sft import SFT

__all__ = ["DAPO", "DPO", "GRPO", "GSPO", "PPO", "RLOO", "SAPO", "SFT", "OnPolicyDistillation", "OnlineRL",
           "PolicyModule", "RewardModel"]
