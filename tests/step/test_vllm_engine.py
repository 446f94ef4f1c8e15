"""VLLMEngine in this process (``mode: colocate``): token in, token out, the log-probs of the distribution it
sampled from, seeds, EOS and the token budget, greedy as HFEngine, weights kept in step with the trained
module (LoRA merged), and a fit that logs the gap and the push time. The engines come from the session's
pool (tests/vllm_pool.py): starting one takes ~20 s."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import datamodule, make, make_trainer

from lightning_rl.models.generation import SamplingParams
from lightning_rl.step.engine import HFEngine
from lightning_rl.step.vllm_engine import VLLMEngine

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("vllm_pool", "one_thread")]

PROMPTS = ["50318=", "9071=", "123456=", "8=", "77401=", "2=", "66=", "901="]


def engine_for(module, **options) -> VLLMEngine:
    """An engine with configs/vllm.yaml's options (the pool's engine for the CLI tests too)."""
    engine = VLLMEngine(**({"kv_cache_gib": 1.0} | options))
    engine.attach(module.policy)
    return engine


class Spy:
    """Records what the engine's backend is asked (prompts, pushes, cache resets)."""

    def __init__(self, engine: VLLMEngine) -> None:
        engine.start()
        self.backend, self.calls = engine.backend, []
        for name in ("generate", "load_weights", "reset_prefix_cache"):
            original = getattr(self.backend, name)
            setattr(self.backend, name, self.wrap(name, original))

    def wrap(self, name, original):
        def call(*args, **kwargs):
            self.calls.append((name, args))
            return original(*args, **kwargs)
        return call

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


def trainer_logprobs(module, gen, temperature: float) -> torch.Tensor:
    logp, _ = module.policy.token_logprobs(gen.prompt_ids, gen.prompt_mask, gen.completion_ids,
                                           gen.completion_mask, temperature=temperature)
    return logp * gen.completion_mask


def test_token_ids_in_sampled_ids_and_the_samplers_logprobs_out():
    module = make()
    engine = engine_for(module)
    spy = Spy(engine)
    ids, mask = module.encode_prompts(PROMPTS)
    assert (mask == 0).any(), "the prompts must be left-padded for this test"
    gen = engine.generate(ids, mask, num_samples=4, sampling=SamplingParams(8, temperature=0.7), seed=11)
    (name, (prompts, params, n, seeds)), = [c for c in spy.calls if c[0] == "generate"]
    # each prompt row without its padding, as ids; one seed per prompt, 4 samples each (seed, seed+1, ...)
    assert prompts == [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
    assert n == 4 and seeds == [11 + 4 * i for i in range(len(PROMPTS))]
    assert params["stop_token_ids"] == [module.policy.eos_token_id] and params["max_tokens"] == 8
    assert gen.completion_ids.shape[0] == 4 * len(PROMPTS) and gen.completion_ids.shape[1] <= 8
    eos = module.policy.eos_token_id
    for row, m, trunc in zip(gen.completion_ids, gen.completion_mask, gen.truncated, strict=True):
        length = int(m.sum())
        assert bool(trunc) == (eos not in row[:length].tolist())
        if not trunc:
            assert row[length - 1] == eos and eos not in row[:length - 1].tolist()
        assert (row[length:] == module.policy.pad_token_id).all()
    # the log-probs of the tempered distribution vLLM sampled from equal the trainer's (fp32, same weights)
    expected = trainer_logprobs(module, gen, 0.7)
    assert gen.rollout_logp.shape == expected.shape
    assert (gen.rollout_logp - expected).abs().max() < 1e-5
    assert (gen.rollout_logp[gen.completion_mask == 0] == 0).all()
    assert (gen.rollout_logp[gen.completion_mask == 1] < 0).any()
    # a seed reproduces the draw; another seed draws other tokens
    again = engine.generate(ids, mask, num_samples=4, sampling=SamplingParams(8, temperature=0.7), seed=11)
    other = engine.generate(ids, mask, num_samples=4, sampling=SamplingParams(8, temperature=0.7), seed=12)
    assert torch.equal(again.completion_ids, gen.completion_ids)
    assert not torch.equal(other.completion_ids, gen.completion_ids)
    engine.close()


def test_greedy_and_the_token_budget_behave_as_with_the_hf_engine():
    module = make()
    engine, hf = engine_for(module), HFEngine()
    hf.attach(module.policy)
    ids, mask = module.encode_prompts(PROMPTS)
    for budget in (8, 3):
        greedy = SamplingParams(budget, do_sample=False)
        ours = engine.generate(ids, mask, sampling=greedy)
        theirs = hf.generate(ids, mask, sampling=greedy)
        assert torch.equal(ours.completion_ids, theirs.completion_ids)
        assert torch.equal(ours.completion_mask, theirs.completion_mask)
        assert torch.equal(ours.truncated, theirs.truncated)
        assert ours.rollout_logp is None  # greedy: nothing to correct
    assert ours.truncated.any()  # 3 tokens cut some answers short
    engine.close()


def test_top_k_and_top_p_logprobs_are_those_of_the_filtered_distribution():
    module = make()
    engine = engine_for(module)
    ids, mask = module.encode_prompts(PROMPTS)
    # top-k 1 at temperature 1 is greedy: every sampled token had probability 1 after filtering
    gen = engine.generate(ids, mask, num_samples=2, sampling=SamplingParams(8, top_k=1), seed=3)
    greedy = engine.generate(ids, mask, sampling=SamplingParams(8, do_sample=False))
    assert torch.equal(gen.completion_ids[::2], greedy.completion_ids)
    assert gen.rollout_logp.abs().max() < 1e-6
    # top-p 0.8 at temperature 1.3: log of the token's probability renormalised over the nucleus
    nucleus_sampling = SamplingParams(8, temperature=1.3, top_p=0.8)
    gen = engine.generate(ids, mask, num_samples=4, sampling=nucleus_sampling, seed=5)
    with torch.no_grad():
        ctx = torch.cat([gen.prompt_ids, gen.completion_ids], 1)
        att = torch.cat([gen.prompt_mask, gen.completion_mask], 1)
        pos = (att.cumsum(1) - 1).clamp(min=0)
        logits = module.policy.model(ctx, attention_mask=att, position_ids=pos).logits
    P = gen.prompt_ids.shape[1]
    probs = torch.softmax(logits[:, P - 1:-1].float() / 1.3, -1)
    sorted_p, order = probs.sort(-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # the mass of the tokens ranked above each one
    kept = torch.zeros_like(probs).scatter(-1, order, (before < 0.8).float())
    nucleus = probs * kept
    renormalised = nucleus / nucleus.sum(-1, keepdim=True)
    expected = renormalised.gather(-1, gen.completion_ids[..., None])[..., 0].log()
    valid = gen.completion_mask.bool()
    assert (gen.rollout_logp[valid] - expected[valid]).abs().max() < 1e-4
    engine.close()


def test_weights_follow_the_trained_module_once_per_version():
    module = make()
    engine = engine_for(module)
    spy = Spy(engine)
    ids, mask = module.encode_prompts(PROMPTS[:4])
    engine.sync_weights(module.policy, version=0)
    with torch.no_grad():  # an "optimiser step": every weight moves
        for p in module.policy.model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    engine.sync_weights(module.policy, version=0)  # the same version: nothing is sent
    assert spy.names() == ["load_weights", "reset_prefix_cache"]
    stale = engine.generate(ids, mask, num_samples=2, sampling=SamplingParams(6), seed=1)
    assert (stale.rollout_logp - trainer_logprobs(module, stale, 1.0)).abs().max() > 1e-3
    engine.sync_weights(module.policy, version=1)
    assert spy.names()[-2:] == ["load_weights", "reset_prefix_cache"]  # the cache goes with the weights
    fresh = engine.generate(ids, mask, num_samples=2, sampling=SamplingParams(6), seed=1)
    assert (fresh.rollout_logp - trainer_logprobs(module, fresh, 1.0)).abs().max() < 1e-5
    assert engine.version == 1 and engine.sync_time > 0
    engine.close()


def test_lora_adapters_are_merged_into_the_weights_vllm_samples_with():
    pytest.importorskip("peft")
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    module = make(policy={"peft": {"class_path": "peft.LoraConfig", "init_args": lora}})
    with torch.no_grad():  # LoRA starts as the identity (B = 0): give the adapters a value
        for name, p in module.policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    engine = engine_for(module)
    spy = Spy(engine)
    ids, mask = module.encode_prompts(PROMPTS[:4])
    engine.sync_weights(module.policy, version=0)
    gen = engine.generate(ids, mask, num_samples=2, sampling=SamplingParams(6), seed=2)
    assert (gen.rollout_logp - trainer_logprobs(module, gen, 1.0)).abs().max() < 1e-5
    with module.policy.model.disable_adapter():  # the adapters really change the distribution
        assert (gen.rollout_logp - trainer_logprobs(module, gen, 1.0)).abs().max() > 1e-2
    # the next version sends only the layers the adapters change
    from safetensors import safe_open

    engine.sync_weights(module.policy, version=1)
    path = [args[0] for name, args in spy.calls if name == "load_weights"][-1]
    with safe_open(path, framework="pt") as f:
        assert sorted(f.keys()) == sorted(f"model.layers.{i}.self_attn.{p}.weight"
                                          for i in range(2) for p in ("q_proj", "v_proj"))
    engine.close()


def test_a_grpo_fit_samples_with_vllm_and_logs_its_gap_and_push_time(tmp_path):
    from helpers import read_csv_metrics
    from lightning.pytorch.loggers import CSVLogger

    module = make(engine=VLLMEngine(kv_cache_gib=1.0))
    before = {n: p.detach().clone() for n, p in module.policy.model.named_parameters()}
    trainer = make_trainer(tmp_path, max_steps=3, logger=CSVLogger(tmp_path), limit_val_batches=1,
                           val_check_interval=3, log_every_n_steps=1)
    trainer.fit(module, datamodule=datamodule())
    metrics = read_csv_metrics(tmp_path)
    assert len(metrics["rollout/mismatch_k3"]) == 3 and max(metrics["rollout/mismatch_k3"]) < 1e-5
    assert len(metrics["perf/weight_sync_time"]) == 3 and min(metrics["perf/weight_sync_time"]) > 0
    assert "val/accuracy" in metrics
    moved = [n for n, p in module.policy.model.named_parameters() if not torch.equal(p, before[n])]
    assert moved
    assert module.engine.backend is None  # stopped with the run


@pytest.mark.distributed
@pytest.mark.ranks("fsdp2/vllm", "ddp/vllm-server")
@pytest.mark.parametrize("kind", ["fsdp2/vllm", "ddp/vllm-server"])
def test_two_ranks_sample_with_the_weights_of_every_step(rank_jobs, kind):
    """tests/vllm_fit.py: under FSDP2 each rank's engine gets the gathered weights every step; under DDP two
    ranks share one server that rank 0 alone loads, and neither samples before the load. Either way each
    rank's vLLM log-probs are its recomputed ones (so the engine held that step's weights), the ranks sample
    their own prompts, and the engines stop with the run."""
    ranks = json.loads((rank_jobs.out(kind) / "result.json").read_text())
    assert len(ranks) == 2
    for rank in ranks:
        assert [s["version"] for s in rank["steps"]] == [0, 1, 2]
        assert max(s["gap"] for s in rank["steps"]) < 1e-5, rank["steps"]
        assert rank["closed"]
    assert ranks[0]["steps"][0]["first"] != ranks[1]["steps"][0]["first"] or \
        ranks[0]["steps"][1]["first"] != ranks[1]["steps"][1]["first"]
    expected_loads = [3, 3] if kind == "fsdp2/vllm" else [3, 0]
    assert [r["loads"] for r in ranks] == expected_loads
