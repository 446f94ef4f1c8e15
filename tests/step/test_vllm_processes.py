"""Real vLLM processes that fail or are stopped: a model vLLM cannot serve; and, through tests/vllm_stops.py,
Ctrl-C or SIGTERM to a run's whole process group, the process that started the engine killed outright, a
vLLM server that dies in the middle of a run. Each ends in one clear line, keeps what was saved, and leaves
no vLLM process behind (they are counted)."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

@pytest.mark.usefixtures("vllm_pool")
def test_a_model_vllm_cannot_serve_is_named():
    from helpers import make
    from transformers import AutoModelForCausalLM, OpenAIGPTConfig

    from lightning_rl.models.policy import Policy
    from lightning_rl.step.vllm_engine import VLLMEngine

    config = OpenAIGPTConfig(vocab_size=100, n_positions=64, n_embd=32, n_layer=1, n_head=2)
    policy = Policy(AutoModelForCausalLM.from_config(config), make().tokenizer)
    engine = VLLMEngine(kv_cache_gib=1.0)
    engine.attach(policy)
    with pytest.raises(RuntimeError, match=r"vLLM could not serve `model.policy.model") as err:
        engine.sync_weights(policy, version=0)
    assert "not supported" in str(err.value) and "\n" not in str(err.value)
    engine.close()


@pytest.fixture(scope="module")
def stops(rank_jobs) -> dict:
    """tests/vllm_stops.py's runs (a solo job of the launch, run beside the single-process tests)."""
    return json.loads((rank_jobs.out("vllm/stops") / "result.json").read_text())


STOPPED = pytest.mark.ranks("vllm/stops")


@pytest.mark.distributed
@STOPPED
@pytest.mark.parametrize("name,code", [("sigint", 130), ("sigterm", 143)])
def test_a_signal_to_the_whole_group_saves_the_checkpoint_then_stops_the_engines(stops, name, code):
    """Ctrl-C (or a scheduler's SIGTERM) reaches the trainer, its forked worker and the worker's vLLM
    processes at once: vLLM holds, the step in flight finishes, the checkpoint is saved, then everything
    stops; the worker had sampled one version ahead."""
    run = stops[name]
    assert run["code"] == code, run["stderr"]
    assert "checkpoint saved to" in run["stderr"] and "interrupted-step=3.ckpt" in run["last"]
    assert any(c.endswith("interrupted-step=3.ckpt") for c in run["checkpoints"])
    assert run["staleness"][:2] == [0.0, 1.0]  # steps 0 and 1 logged before the signal's step
    assert run["left"] == []


@pytest.mark.distributed
@STOPPED
def test_the_process_that_started_the_engine_killed_outright_takes_it_along(stops):
    """The forked worker (which started vLLM) is SIGKILLed: the run ends naming the worker's exit code and
    no vLLM process of the worker or of the trainer is left."""
    run = stops["kill-worker"]
    assert run["code"] == 1, run["stderr"]
    assert "the sampler worker exited (code -9)" in run["last"]
    assert run["left"] == []


@pytest.mark.distributed
@STOPPED
def test_a_server_that_dies_mid_run_is_named_and_the_last_checkpoint_is_intact(stops):
    """`mode: server` (configs/vllm_server.yaml), a server started by the run: its death at step 2 ends the
    run with the server's exit code as the last line; the checkpoints up to step 2 are whole, and nothing the
    server started is left."""
    run = stops["server-death"]
    assert run["code"] == 1, run["stderr"]
    assert "the vLLM server exited with code -9" in run["stderr"]
    assert "the vLLM server exited with code -9" in run["last"]
    assert run["checkpoints"] == ["ckpt/epoch=0-step=1.ckpt", "ckpt/epoch=0-step=2.ckpt"]
    assert run["left"] == []
