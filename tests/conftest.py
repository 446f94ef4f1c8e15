"""Test setup: one torch thread (several times faster for tiny models on a 2-core machine)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/helpers.py
