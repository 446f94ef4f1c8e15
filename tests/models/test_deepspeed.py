"""DeepSpeed ZeRO-2 / ZeRO-3 through Lightning's ``DeepSpeedStrategy`` on 2 gloo CPU ranks.

The stock strategy refuses non-CUDA devices; ``tests/deepspeed_cpu.py`` lifts only that check, so the
engine, its ZeRO partitioning, gradient reduction, accumulation boundary, clipping and optimizer step
are DeepSpeed's own. Each 2-rank run is a job of tests/rank_jobs.py, under a hard timeout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rank_jobs import run_here

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def single_process(tmp_path_factory) -> dict:
    """One process's updates for each row split (in this process), computed once for the module."""
    out = tmp_path_factory.mktemp("single")
    for split in ("strided", "rank0"):
        run_here("deepspeed_update.py", out / f"{split}.pt", "1", "0", "3", split)
    return {split: torch.load(out / f"{split}.pt") for split in ("strided", "rank0")}


@pytest.mark.ranks("zero2/update-strided", "zero3/update-strided", "zero3/update-rank0")
@pytest.mark.parametrize(("stage", "split"), [(2, "strided"), (3, "strided"), (3, "rank0")])
def test_zero_updates_equal_single_process_updates(rank_jobs, single_process, stage, split):
    """4 SGD steps (lr 1, one per aggregation mode) clipped to 0.05 by the engine: after each, the weights
    equal one process's. strided: the ranks hold different token counts in 3 micro-batches each (the
    engine's accumulation boundary on the last); rank0: rank 1 holds nothing and joins with a zero loss.
    Without the per-micro-batch engine bookkeeping, ZeRO-3 kept only the last micro-batch (diff 7e-3)."""
    single = single_process[split]
    zero = torch.load(rank_jobs.out(f"zero{stage}/update-{split}") / "result.pt")
    assert zero["zero3"] == (stage == 3) and not single["zero3"]
    start = None
    for before, a, b in zip([None, *single["weights"]], single["weights"], zero["weights"], strict=False):
        assert set(a) == set(b)
        assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
        if before is not None:
            start = max((a[k] - before[k]).abs().max().item() for k in a)
            assert start > 1e-3  # each update moved the weights
    # the engine's pre-clip norm, logged as policy/grad_norm, equals one process's (and exceeded the clip)
    for (_, x), (_, y) in zip(single["norms"], zero["norms"], strict=True):
        assert x == pytest.approx(y, rel=1e-5) and x > 0.05


def _reloads_exactly(folder: Path, trained: dict) -> None:
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert set(reloaded) == set(trained)
    assert max((reloaded[k] - trained[k]).abs().max().item() for k in trained) == 0.0


@pytest.mark.ranks("zero3/dapo")
def test_zero3_dapo_fit_partitions_agrees_on_every_collective_and_exports(rank_jobs):
    """Rank 0 keeps every group, rank 1 only some: the ranks' rollouts, refills and micro-batch counts
    differ, yet every ZeRO-3 gather and reduction is matched (a mismatch hangs, killed by the timeout);
    validation runs on uneven ranks (3 held-out rows, batches of 1); the export gathers the partitions."""
    from transformers import AutoModelForCausalLM

    out = rank_jobs.out("zero3/dapo")
    result = torch.load(out / "result.pt")
    assert result["global_step"] == 3
    assert {"val/accuracy", "rollout/gen_batches", "policy/grad_norm"} <= set(result["metrics"])
    whole = sum(p.nbytes for p in AutoModelForCausalLM.from_pretrained(out / "policy").parameters())
    assert all(r["sharded"] and r["policy_local_bytes"] * 2 == whole for r in result["ranks"])
    r0, r1 = (r["steps"] for r in result["ranks"])
    assert [s["kept"] for s in r0] == [8, 8, 8]
    assert any(s["kept"] < 8 for s in r1)
    for a, b in zip(r0, r1, strict=True):
        assert a["refills_consumed"] == b["refills_consumed"] and a["logged"] == b["logged"]
    _reloads_exactly(out / "policy", result["weights"])


@pytest.mark.ranks("zero3/resume")
def test_zero3_grpo_resumes_exactly_from_a_deepspeed_checkpoint(rank_jobs):
    """4 steps vs 2 + a DeepSpeed checkpoint folder + 2: the same metrics, weights and per-rank RNG. The
    resumed run finds the folder, copied alone into its own checkpoint folder, as `--ckpt_path last` does."""
    out = rank_jobs.out("zero3/resume")
    (ckpt,) = (out / "full" / "ckpt").glob("*step=2.ckpt")
    assert ckpt.is_dir() and (ckpt / "checkpoint").is_dir()
    assert (out / "resumed" / "ckpt" / ckpt.name).is_dir()  # the copy the resumed run found
    full, resumed = (torch.load(out / run / "result.pt") for run in ("full", "resumed"))
    assert full["global_step"] == resumed["global_step"] == 4
    for rank in (0, 1):
        tail = [s for s in full["ranks"][rank]["steps"] if s["step"] > 2]
        again = resumed["ranks"][rank]["steps"]
        assert [s["step"] for s in tail] == [s["step"] for s in again] == [3, 4]
        for a, b in zip(tail, again, strict=True):
            assert a["rng"] == b["rng"], rank
            exact = [{k: v for k, v in s["logged"].items() if not k.startswith("perf/") and k != "step"}
                     for s in (a, b)]
            assert len(exact[0]) > 15 and exact[0] == exact[1]
    assert all(torch.equal(full["weights"][k], resumed["weights"][k]) for k in full["weights"])
