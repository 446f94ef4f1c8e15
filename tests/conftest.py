"""Test setup: one torch thread (several times faster for tiny models on a 2-core machine)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/helpers.py


@pytest.fixture
def seeded_one_thread():
    """One torch thread and torch's global seed 0 for the test (files opt in with ``pytestmark``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    """One torch thread for the test, restored after it (a CLI run in-process may change it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
