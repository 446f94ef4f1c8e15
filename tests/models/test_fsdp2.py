"""FSDP2 (``ModelParallelStrategy`` + ``fully_shard``) on 2 gloo ranks: gradient, fit, validation, export.

Each multi-process run is a job of tests/rank_jobs.py (one launch for the session, every job under a hard
timeout: a hung gloo rank ignores SIGTERM, and a hang, a rank skipping a collective, must fail the test,
not stall the suite).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rank_jobs import run_here

from lightning_rl.models.sharding import FSDPOptions, decoder_layers, needs_synced_generation, refuse_fsdp1

distributed = pytest.mark.distributed


@distributed
@pytest.mark.ranks("fsdp2/update-strided", "fsdp2/update-rank0")
@pytest.mark.parametrize("split", ["strided", "rank0"])
def test_fsdp2_update_equals_single_process_gradient(tmp_path, rank_jobs, split):
    """strided: ranks hold different token counts, 3 micro-batches each (gradient sync off for the first
    two); rank0: rank 1 has no rows at all and its empty micro-batch still joins the reduce-scatter."""
    run_here("fsdp2_update.py", tmp_path / "single.pt", "1", "none", split)
    single = torch.load(tmp_path / "single.pt")
    fsdp = torch.load(rank_jobs.out(f"fsdp2/update-{split}") / "result.pt")
    assert fsdp["sharded"] and not single["sharded"]
    for mode, grads in single["grads"].items():
        assert set(grads) == set(fsdp["grads"][mode])
        scale = max(g.abs().max().item() for g in grads.values())
        diff = max((grads[n] - fsdp["grads"][mode][n]).abs().max().item() for n in grads)
        assert scale > 1e-3, mode
        assert diff < 1e-5, (mode, diff, scale)
        # clipped to max_grad_norm = 0.05 from a larger norm: clipping ran on the sharded gradients
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        assert total.item() == pytest.approx(0.05, rel=1e-3)
    # the logged norm is a plain tensor on rank 0, equal to the single-process one, and above the clip
    assert [kind for kind, _ in fsdp["norms"]] == ["Tensor"] * len(single["grads"])  # one per mode
    for (_, a), (_, b) in zip(single["norms"], fsdp["norms"], strict=True):
        assert a == pytest.approx(b, rel=1e-5) and a > 0.05


@distributed
@pytest.mark.ranks("fsdp2/grpo")
def test_fsdp2_grpo_fit_validates_unevenly_and_exports(rank_jobs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = rank_jobs.out("fsdp2/grpo")
    result = torch.load(out / "result.pt")
    assert result["global_step"] == 3
    assert {"val/accuracy", "policy/grad_norm", "policy/kl_ref"} <= set(result["metrics"])
    ranks = result["ranks"]
    assert all(r["sharded"] and not r["reference_sharded"] for r in ranks)
    # each rank holds half the policy's weights and a whole frozen reference
    assert ranks[0]["policy_local_bytes"] * 2 == ranks[0]["reference_bytes"]
    reloaded = AutoModelForCausalLM.from_pretrained(out / "policy").state_dict()
    trained = result["weights"]
    assert set(reloaded) == set(trained)
    assert max((reloaded[k] - trained[k]).abs().max().item() for k in trained) == 0.0
    assert AutoTokenizer.from_pretrained(out / "policy").decode([5]) != ""


def _reloads_exactly(folder: Path, trained: dict) -> None:
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert set(reloaded) == set(trained)
    assert max((reloaded[k] - trained[k]).abs().max().item() for k in trained) == 0.0


@distributed
@pytest.mark.ranks("fsdp2/dapo")
def test_fsdp2_dapo_fit_with_dynamic_sampling_validates_unevenly_and_exports(rank_jobs):
    """Rank 0 keeps every group, rank 1 only some: the ranks' rollouts and micro-batch counts differ, yet
    generation rounds, micro-batches and forwards are agreed (a disagreement hangs, killed by the timeout)."""
    out = rank_jobs.out("fsdp2/dapo")
    result = torch.load(out / "result.pt")
    assert result["global_step"] == 3
    assert {"val/accuracy", "rollout/gen_batches", "rollout/filtered_group_frac"} <= set(result["metrics"])
    r0, r1 = (r["steps"] for r in result["ranks"])
    assert all(r["sharded"] for r in result["ranks"])
    assert [s["kept"] for s in r0] == [8, 8, 8]  # 2 micro-batches of 4 every step
    assert any(s["kept"] < 8 for s in r1)  # rank 1 trained on fewer samples at least once
    assert any(s["logged"]["rollout/gen_batches"] > 1 for s in r0)  # rank 0 generated extra rounds too
    for a, b in zip(r0, r1, strict=True):
        assert a["refills_consumed"] == b["refills_consumed"]  # the same rounds on both ranks
        assert a["logged"] == b["logged"]  # the same (reduced) metrics, the same key set
    _reloads_exactly(out / "policy", result["weights"])


@distributed
@pytest.mark.ranks("fsdp2/dapo-kl")
def test_fsdp2_uneven_scoring_passes_agree_before_any_forward(rank_jobs):
    """DAPO with LoRA, a KL reference running the sharded weights with adapters off, and 2 minibatches
    (behaviour log-probs): the ranks score different numbers of rows in every pass (rank 1 keeps 4 where
    rank 0 keeps 8), so each pass agrees its forward count over ranks before its first forward (agreeing
    after them let one rank's all-reduce meet another's weight gather: a hang, here killed by the timeout)."""
    result = torch.load(rank_jobs.out("fsdp2/dapo-kl") / "result.pt")
    assert result["global_step"] == 4 and "policy/kl_ref" in result["metrics"]
    r0, r1 = (r["steps"] for r in result["ranks"])
    assert any(a["kept"] != b["kept"] for a, b in zip(r0, r1, strict=True))
    assert all(a["logged"] == b["logged"] for a, b in zip(r0, r1, strict=True))


@distributed
@pytest.mark.ranks("fsdp2/dpo")
def test_fsdp2_dpo_fit_validates_and_exports(rank_jobs):
    out = rank_jobs.out("fsdp2/dpo")
    result = torch.load(out / "result.pt")
    assert result["global_step"] == 3
    assert {"train/loss", "val/loss", "val/accuracy", "val/rewards/accuracy"} <= set(result["metrics"])
    ranks = result["ranks"]
    assert all(r["sharded"] and not r["reference_sharded"] for r in ranks)
    assert ranks[0]["policy_local_bytes"] * 2 == ranks[0]["reference_bytes"]  # a whole reference per rank
    losses = [s["logged"]["train/loss"] for s in ranks[0]["steps"]]
    assert len(set(losses)) > 1  # the policy moved away from the reference
    _reloads_exactly(out / "policy", result["weights"])


@distributed
@pytest.mark.ranks("fsdp2/resume")
def test_fsdp2_grpo_resumes_exactly_from_a_sharded_checkpoint(rank_jobs):
    """4 steps in one go vs 2 steps, a distributed checkpoint (a folder of shards), and 2 more: the same
    metrics, weights and, on each rank, its own RNG state (ranks are seeded differently). The resumed run
    finds the folder, copied alone into its own checkpoint folder, as `--ckpt_path last` does."""
    out = rank_jobs.out("fsdp2/resume")
    (ckpt,) = (out / "full" / "ckpt").glob("*step=2.ckpt")
    assert ckpt.is_dir() and len(list(ckpt.glob("*.distcp"))) == 2
    assert (out / "resumed" / "ckpt" / ckpt.name).is_dir()  # the copy the resumed run found
    full, resumed = (torch.load(out / run / "result.pt") for run in ("full", "resumed"))
    assert full["global_step"] == resumed["global_step"] == 4
    rng = []
    for rank in (0, 1):
        tail = [s for s in full["ranks"][rank]["steps"] if s["step"] > 2]
        again = resumed["ranks"][rank]["steps"]
        assert [s["step"] for s in tail] == [s["step"] for s in again] == [3, 4]
        for a, b in zip(tail, again, strict=True):
            assert a["rng"] == b["rng"], rank
            exact = [{k: v for k, v in s["logged"].items() if not k.startswith("perf/") and k != "step"}
                     for s in (a, b)]
            assert len(exact[0]) > 15 and exact[0] == exact[1]
        rng.append(tail[0]["rng"])
    assert rng[0] != rng[1]  # the ranks' RNG states differ, so each restored its own
    assert set(full["weights"]) == set(resumed["weights"])
    assert all(torch.equal(full["weights"][k], resumed["weights"][k]) for k in full["weights"])


def test_fsdp1_strategy_is_refused_naming_the_overlay():
    from lightning.pytorch.strategies import FSDPStrategy

    with pytest.raises(ValueError, match="configs/strategy/fsdp2.yaml"):
        refuse_fsdp1(FSDPStrategy())


def test_fsdp_dtypes_are_validated_naming_the_key():
    from lightning_rl.algorithms import GRPO
    from lightning_rl.algorithms.options import PolicyOptions

    with pytest.raises(ValueError, match=r"`model.policy.fsdp.param_dtype` must be one of .* got 'fp8'"):
        GRPO(policy=PolicyOptions(fsdp=FSDPOptions(param_dtype="fp8")))
    with pytest.raises(ValueError, match="`model.policy.fsdp.reduce_dtype` must be"):
        FSDPOptions(reduce_dtype="half")


def test_decoder_layers_and_synced_generation_rule():
    from lightning_rl.models.loading import load_policy

    model = load_policy("builtin:tiny-sort", None, False).model
    layers = decoder_layers(model)
    assert layers and all(type(m).__name__ == "LlamaDecoderLayer" for m in layers)
    assert len(layers) == model.config.num_hidden_layers
    named = type("ModelParallelStrategy", (), {})
    assert needs_synced_generation(SimpleNamespace(strategy=named()))
    assert not needs_synced_generation(SimpleNamespace(strategy=object()), model)
    assert not needs_synced_generation(None)
