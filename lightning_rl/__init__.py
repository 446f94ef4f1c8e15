"""lightning-rl: RL post-training for causal language models on PyTorch Lightning."""

__version__ = "0.1.0"
