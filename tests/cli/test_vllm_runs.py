"""vLLM through the real CLI: configs/vllm.yaml over every shipped online config (and DPO's greedy
validation), a killed run resumed exactly, predictions, sampling ahead (a forked worker with its own engine,
a thread one two versions back, resumed exactly) and episodes whose earlier turns come from the prefix cache.
The engines in this process come from the session's pool (tests/vllm_pool.py)."""

from __future__ import annotations

import json

import pytest
from helpers import CONFIGS, run_cli, scalars

from lightning_rl.step.vllm_engine import VLLMEngine

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("vllm_pool", "one_thread")]

QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.log_every_n_steps", "1",
         "--trainer.num_sanity_val_steps", "0"]
SMALL = ["--data.init_args.batch_size", "4", "--data.init_args.max_val_rows", "8"]


def fit(tmp_path, *configs: str, steps: int = 2, extra: tuple[str, ...] = ()):
    args = [a for c in configs for a in ("--config", CONFIGS / f"{c}.yaml")]
    return run_cli("fit", *args, "--config", CONFIGS / "vllm.yaml", *QUIET, *SMALL, "--trainer.max_steps",
                   str(steps), "--trainer.val_check_interval", "1", "--trainer.limit_val_batches", "1",
                   "--trainer.logger.init_args.save_dir", tmp_path, *extra)


ONLINE = ["grpo", "gspo", "dapo", "sapo", "rloo", "reinforce_pp", "ppo", "distill", "grpo_tools", "grpo_lora"]


@pytest.mark.parametrize("name", ONLINE)
def test_vllm_overlay_runs_every_online_config(tmp_path, name):
    """Rollouts (DAPO's refills, PPO's values, the distillation teacher, tool episodes, LoRA's merged
    adapters) sampled by vLLM; the trainer's and vLLM's log-probs agree (fp32), the weights were pushed every
    step, and the engine stopped with the run."""
    cli = fit(tmp_path, name)
    assert isinstance(cli.model.engine, VLLMEngine) and cli.model.engine.backend is None
    logged = scalars(tmp_path)
    gap = [v for _, v in logged["rollout/logp_diff_mean"]]
    assert gap and max(abs(v) for v in gap) < 1e-4, gap
    assert len(logged["perf/weight_sync_time"]) == len(gap)
    assert all(v > 0 for _, v in logged["perf/weight_sync_time"])
    losses = [v for k, series in logged.items() if k.endswith("loss") for _, v in series]
    assert losses and all(v == v for v in losses)
    assert "val/accuracy" in logged


def test_dpo_validates_with_vllm(tmp_path):
    cli = fit(tmp_path, "dpo")
    assert isinstance(cli.model.engine, VLLMEngine)
    assert "val/accuracy" in scalars(tmp_path)


RESUME = ["--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
          "--trainer.callbacks.dirpath={ckpt}", "--trainer.callbacks.every_n_train_steps=2",
          "--trainer.callbacks.save_top_k=-1", "--trainer.callbacks.save_last=true"]


def run_with_checkpoints(tmp_path, name: str, ckpt, steps: int, *configs: str, resume: bool = False,
                         extra: tuple[str, ...] = ()) -> dict:
    args = [a.format(ckpt=ckpt) for a in RESUME] + list(extra) + (["--ckpt_path", "last"] if resume else [])
    fit(tmp_path / name, *configs, steps=steps, extra=tuple(args))
    return scalars(tmp_path / name)


def assert_same_after(full: dict, resumed: dict, step: int, keys: list[str]) -> None:
    for key in keys:
        tail_full = [(s, v) for s, v in full[key] if s > step]
        tail_resumed = [(s, v) for s, v in resumed[key] if s > step]
        assert tail_full and [s for s, _ in tail_full] == [s for s, _ in tail_resumed], key
        expected = pytest.approx([v for _, v in tail_resumed], rel=1e-6, abs=1e-7)
        assert [v for _, v in tail_full] == expected, key


KEYS = ["policy/loss", "rollout/reward_mean", "rollout/response_length_mean", "policy/grad_norm",
        "rollout/mismatch_k3"]


def test_a_killed_vllm_run_resumes_exactly(tmp_path):
    """Same seeds, same weights pushed: the resumed run samples the same tokens as the uninterrupted one."""
    full = run_with_checkpoints(tmp_path, "full", tmp_path / "ckpt_full", 4, "grpo")
    run_with_checkpoints(tmp_path, "killed", tmp_path / "ckpt", 2, "grpo")
    resumed = run_with_checkpoints(tmp_path, "resumed", tmp_path / "ckpt", 4, "grpo", resume=True)
    assert_same_after(full, resumed, 2, KEYS)


def test_predict_with_vllm_answers_as_the_hf_engine(tmp_path):
    """Greedy predictions of the embedded model: vLLM's completions are transformers' (fp32)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n"
                               for p, a in [("44935=", "34459"), ("80684=", "04688"), ("32205=", "02235")]))
    rows = {}
    for name, overlay in (("vllm", ["--config", CONFIGS / "vllm.yaml"]), ("hf", [])):
        run_cli("predict", "--config", CONFIGS / "grpo.yaml", *overlay, "--data.init_args.predict_path",
                prompts, "--trainer.logger.init_args.save_dir", tmp_path / name,
                "--trainer.enable_progress_bar", "false")
        path = tmp_path / name / "lightning-rl" / "version_0" / "predictions.jsonl"
        rows[name] = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows["vllm"]) == 3
    assert [r["completion"] for r in rows["vllm"]] == [r["completion"] for r in rows["hf"]]


ASYNC = ("async",)  # the forked worker (the CPU default) runs in tests/vllm_stops.py
THREAD_K2 = ("--model.init_args.sampling.worker", "thread", "--model.init_args.sampling.max_staleness", "2",
             "--trainer.limit_val_batches", "0")


def test_a_thread_worker_samples_two_versions_back(tmp_path):
    """`worker: thread` (the GPU default): its own engine, started by the learner's thread; staleness 2, and
    the gap to the learner's weights measured and corrected."""
    cli = fit(tmp_path, "grpo", *ASYNC, steps=5, extra=THREAD_K2)
    assert cli.model.rollouts.process is None  # the worker stopped with the run
    logged = scalars(tmp_path)
    assert [v for _, v in logged["rollout/staleness_max"]] == [0.0, 1.0, 2.0, 2.0, 2.0]
    k3 = [v for _, v in logged["rollout/mismatch_k3"]]
    assert k3[0] < 1e-6 and max(k3[2:]) > 1e-6  # version 0 is the learner's own; later ones lag


def test_episodes_sample_the_same_tokens_with_and_without_earlier_turns_cached(tmp_path, monkeypatch):
    """Multi-turn tool episodes, token in / token out: every turn's context is the earlier turns' ids, which
    vLLM serves from its prefix cache within a weight version. The same run with the cache emptied before
    every turn (nothing served from it) samples the same tokens."""
    seen: dict[str, list] = {"cached": [], "emptied": []}
    original = VLLMEngine.generate

    def recording(self, prompt_ids, prompt_mask, **kw):
        if self.label == "emptied":
            self.backend.reset_prefix_cache()
        gen = original(self, prompt_ids, prompt_mask, **kw)
        seen[self.label].append((prompt_ids[prompt_mask.bool()].tolist(), gen.completion_ids.tolist()))
        return gen

    monkeypatch.setattr(VLLMEngine, "generate", recording)
    for label in seen:
        monkeypatch.setattr(VLLMEngine, "label", label, raising=False)
        fit(tmp_path / label, "grpo_tools", steps=2, extra=("--trainer.limit_val_batches", "0"))
    assert len(seen["cached"]) == 2 * 2  # two turns per step (configs/grpo_tools.yaml)
    first, second = seen["cached"][:2]  # the second turn's contexts hold the first turn's tokens
    assert min(len(c) for c in second[0]) > max(len(c) for c in first[0]) if isinstance(second[0][0], list) \
        else len(second[0]) > len(first[0])
    assert seen["cached"] == seen["emptied"]
