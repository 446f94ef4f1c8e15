"""One LightningModule per algorithm; the YAML ``class_path`` is the registry."""

from lightning_rl.algorithms.common import PolicyModule
from lightning_rl.algorithms.sft import SFT

__all__ = ["SFT", "PolicyModule"]
