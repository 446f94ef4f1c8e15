"""World-size invariance: one update under DDP on 2 gloo ranks gives the single-process gradient."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("ddp_update.py")


def _run(out: Path, devices: int, micro: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # hard timeout: a hung gloo rank ignores SIGTERM, so run in its own session and kill the group
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(out), str(devices), micro], cwd=out.parent,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        pytest.fail("DDP run hung")
    assert proc.returncode == 0, log.decode()[-3000:]
    return torch.load(out)


def test_gradient_does_not_depend_on_world_size(tmp_path):
    single = _run(tmp_path / "single.pt", 1, "none")
    # rank 0 and 1 hold different token counts; 3 rows per micro-batch
    ddp = _run(tmp_path / "ddp.pt", 2, "3")
    for mode, grads in single.items():
        scale = max(g.abs().max().item() for g in grads.values())
        diff = max((grads[n] - ddp[mode][n]).abs().max().item() for n in grads)
        assert scale > 1e-2, mode
        assert diff < 1e-6, (mode, diff, scale)
    # the three aggregation modes really differ, so the comparison above covers three normalisations
    a, b = single["token-mean"], single["seq-mean-token-sum"]
    assert max((a[n] - b[n]).abs().max().item() for n in a) > 1e-4
