"""World-size invariance: one update under DDP on 2 gloo ranks gives the single-process gradient."""

from __future__ import annotations

import json

import pytest
import torch
from rank_jobs import run_here

pytestmark = pytest.mark.distributed


@pytest.mark.ranks("ddp/update")
def test_gradient_does_not_depend_on_world_size(tmp_path, rank_jobs):
    run_here("ddp_update.py", tmp_path / "single.pt", "1", "none")
    single = torch.load(tmp_path / "single.pt")
    # rank 0 and 1 hold different token counts; 3 rows per micro-batch
    ddp = torch.load(rank_jobs.out("ddp/update") / "result.pt")
    for mode, grads in single.items():
        scale = max(g.abs().max().item() for g in grads.values())
        diff = max((grads[n] - ddp[mode][n]).abs().max().item() for n in grads)
        assert scale > 1e-2, mode
        assert diff < 1e-6, (mode, diff, scale)
    # the aggregation modes really differ, so the comparison above covers each normalisation
    a, b = single["token-mean"], single["seq-mean-token-sum"]
    assert max((a[n] - b[n]).abs().max().item() for n in a) > 1e-4


@pytest.mark.ranks("ddp/validate")
def test_every_held_out_row_is_scored_once_on_two_ranks(tmp_path, rank_jobs):
    run_here("ddp_validate.py", tmp_path / "single.json", "1")
    results = {1: json.loads((tmp_path / "single.json").read_text()),
               2: json.loads((rank_jobs.out("ddp/validate") / "result.json").read_text())}
    (single,) = results[1]["seen"]
    prompts = [p for p, _ in single]
    assert len(prompts) == 5 and len(set(prompts)) == 5
    # 2 ranks, batches of 2: rows dealt 3 + 2, so rank 1's second batch is a weight-0 placeholder (both
    # ranks run 2 validation steps); the real rows, over both ranks, are the 5 held-out rows exactly once
    rank0, rank1 = results[2]["seen"]
    real = [p for p, w in rank0 + rank1 if w > 0]
    assert sorted(real) == sorted(prompts)
    assert [w for _, w in rank0] == [1.0, 1.0, 1.0] and [w for _, w in rank1] == [1.0, 1.0, 0.0]
    for name in ("val/accuracy", "val/reward_mean"):
        value = results[1]["metrics"][name]
        assert value == pytest.approx(results[2]["metrics"][name], abs=1e-6), name
    # exact match over 5 rows: a multiple of 1/5 (a repeated row or a mean of rank means would not be)
    fifths = results[2]["metrics"]["val/accuracy"] * 5
    assert fifths == pytest.approx(round(fifths), abs=1e-5)
