"""Tests for lightning_rl.step.judge: the LLM judge against a fake OpenAI-compatible server on loopback that
answers well, answers garbage, answers slowly, fails then recovers, or is not there at all; its retries,
cache, error counting (``rewards.on_error``) and metrics, through RewardScorer as the rewards stage runs
it; and configs/examples/judge.yaml through the real CLI."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lightning_rl.step.judge import LLMJudge, parse_group_scores, parse_score
from lightning_rl.step.judge_client import JudgeError
from lightning_rl.step.reward_scorer import RewardError, RewardScorer

RUBRIC = "Task: {prompt}\nResponse: {completion}\nReference: {answer}\nScore 0-10."


class FakeJudge:
    """A loopback chat-completions server; ``answer(text) -> str`` decides each reply's content, ``delay``
    seconds before it; ``fail_first`` requests answer HTTP 503. ``requests`` holds every request body."""

    def __init__(self, answer=lambda text: "Score: 10", delay: float = 0.0, fail_first: int = 0) -> None:
        self.answer, self.delay, self.fail_first, self.requests = answer, delay, fail_first, []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append((self.path, body))
                time.sleep(fake.delay)
                if len(fake.requests) <= fake.fail_first:
                    self.send_response(503)
                    self.end_headers()
                    return
                content = fake.answer(body["messages"][-1]["content"])
                data = json.dumps({"id": "x", "object": "chat.completion", "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": content},
                     "finish_reason": "stop"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        ThreadingHTTPServer.request_queue_size = 64  # the default backlog of 5 drops concurrent connects
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, args=(0.01,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake():
    servers = []

    def start(**kwargs) -> FakeJudge:
        servers.append(FakeJudge(**kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def free_port() -> int:
    """A loopback port nothing listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def grade_sort(text: str) -> str:
    """A rubric checker: 10 where the response is the reference, 5 for the right digits in another order."""
    response = text.split("Response: ")[1].split("\n")[0].strip()
    reference = text.split("Reference: ")[1].split("\n")[0].strip()
    score = 10 if response == reference else 5 if sorted(response) == sorted(reference) else 0
    return f"The response is graded.\nScore: {score}"


def judge(url: str, **kwargs) -> LLMJudge:
    return LLMJudge(**{"base_url": url, "model": "fake", "rubric": RUBRIC, "retries": 0, "timeout": 5.0,
                       **kwargs})


def score(fn: LLMJudge, completions: list[str], on_error: str = "zero", **kwargs):
    scorer = RewardScorer([fn], on_error=on_error, **kwargs)
    n = len(completions)
    return scorer.score(["31=", "31="] * (n // 2), completions, answer=["13"] * n)


def test_answers_parsed_cached_and_deduplicated(fake):
    server = fake(answer=grade_sort)
    fn = judge(server.url)
    scores = score(fn, ["13", "31", "7", "13"])
    assert scores.totals == [1.0, 0.5, 0.0, 1.0] and not scores.failed
    # one request per distinct (prompt, completion): "13" twice was asked once, and to the right route
    assert len(server.requests) == 3 and {p for p, _ in server.requests} == {"/v1/chat/completions"}
    assert server.requests[0][1]["model"] == "fake"
    assert scores.metrics["rollout/judge_requests"] == 3 and scores.metrics["rollout/judge_cache_hits"] == 1
    assert scores.metrics["perf/judge_latency_mean"] > 0
    again = score(fn, ["13", "31", "7", "13"])  # all from the cache: no request
    assert again.totals == scores.totals and len(server.requests) == 3
    assert again.metrics["rollout/judge_cache_hits"] == 4 and again.metrics["rollout/judge_requests"] == 0


def test_garbage_answers_are_counted_errors_never_crashes(fake):
    server = fake(answer=lambda text: "I think it's fine!" if "7" not in text else "Score: 4")
    scores = score(judge(server.url), ["13", "7"])
    assert scores.totals == [0.0, 0.4] and scores.failed == {0}
    assert "no score in the judge's answer" in str(scores.errors[0]) and "judge" in str(scores.errors[0])
    with pytest.raises(RewardError, match="reward function `judge` failed on sample 0.*no score"):
        score(judge(server.url), ["13", "7"], on_error="raise")
    # garbage is not cached: a later call asks again
    before = len(server.requests)
    score(judge(server.url), ["13"] * 2)
    assert len(server.requests) == before + 1


def test_slow_answers_time_out_and_are_retried(fake):
    server = fake(answer=grade_sort, delay=0.5)
    fn = judge(server.url, timeout=0.1, retries=1, backoff=0.0)
    start = time.perf_counter()
    scores = score(fn, ["13", "31"])
    assert time.perf_counter() - start < 1.5
    assert scores.failed == {0, 1} and "no answer within 0.1 s (after 2 attempts)" in str(scores.errors[0])
    metrics = fn.pop_metrics()  # popped by the scorer already: nothing left
    assert metrics["rollout/judge_requests"] == 0
    assert scores.metrics["rollout/judge_requests"] == 4 and scores.metrics["rollout/judge_retries"] == 2


def test_refused_connection_is_retried_then_counted():
    fn = judge(f"http://127.0.0.1:{free_port()}/v1", retries=2, backoff=0.01)
    scores = score(fn, ["13", "31"])
    assert scores.failed == {0, 1} and "after 3 attempts" in str(scores.errors[0])
    assert "ConnectionRefusedError" in str(scores.errors[0])
    assert scores.metrics["rollout/judge_retries"] == 4


def test_server_errors_are_retried_until_an_answer(fake):
    server = fake(answer=grade_sort, fail_first=2)
    scores = score(judge(server.url, retries=2, backoff=0.0, concurrency=1), ["13"] * 2)
    assert scores.totals == [1.0, 1.0] and len(server.requests) == 3
    assert scores.metrics["rollout/judge_retries"] == 2


def test_group_judge_ranks_a_group_in_one_request(fake):
    def rank(text: str) -> str:  # scores responses by their position in the reply, "2" garbled in group 2
        return "1: 9\n2: 3" if "Task: 31=" in text else "Response 1: 10\nnothing else"

    server = fake(answer=rank)
    fn = judge(server.url, group=True, rubric="Task: {prompt}\n{completions}\n({count})")
    scorer = RewardScorer([fn], on_error="zero")
    scores = scorer.score(["31=", "31=", "52=", "52="], ["13", "31", "25", "52"], group_size=2,
                          answer=["13", "13", "25", "25"])
    assert scores.totals[:2] == [0.9, 0.3] and scores.failed == {2, 3}
    assert len(server.requests) == 2
    assert "Response 1: 13" in server.requests[0][1]["messages"][0]["content"] or \
        "Response 1: 13" in server.requests[1][1]["messages"][0]["content"]
    assert "scores no response [2] of 2" in str(scores.errors[0])


def test_parser_reads_common_forms_and_refuses_the_rest():
    assert parse_score("Reasoning...\nScore: 7", 10) == 0.7
    assert parse_score("**Score:** 10", 10) == 1.0
    assert parse_score(" 3 ", 10) == 0.3
    for text in ["", "great", "Score: 12", "Score: -1", "{\"score\": null}"]:
        with pytest.raises(JudgeError):
            parse_score(text, 10)
    assert parse_group_scores("1. 4\n2) 6\n#3: 10", 3, 10) == [0.4, 0.6, 1.0]
    with pytest.raises(JudgeError, match="scores no response"):
        parse_group_scores("1: 4", 3, 10)


def test_bad_configuration_names_the_key():
    with pytest.raises(ValueError, match="init_args.timeout"):
        judge("http://x/v1", timeout=0)
    with pytest.raises(ValueError, match=r"must contain `\{completion\}`"):
        LLMJudge("http://x/v1", "m", rubric="Task: {prompt}")
    fn = judge("http://127.0.0.1:9/v1", rubric="{prompt} {completion} {difficulty}")
    scores = RewardScorer([fn], on_error="zero").score(["1="], ["1"])
    assert "names ['difficulty'], which are not data columns" in str(scores.errors[0])


# ---- configs/examples/judge.yaml through the real CLI --------------------------------------------------
def judge_args(url: str, tmp_path, *extra: str) -> list[str]:
    from helpers import CONFIGS

    return ["--config", str(CONFIGS / "examples" / "judge.yaml"), "--trainer.logger.init_args.save_dir",
            str(tmp_path), "--trainer.enable_progress_bar", "false", *extra,
            "--model.init_args.rewards.functions", json.dumps([{
                "class_path": "lightning_rl.step.judge.LLMJudge",
                "init_args": {"base_url": url, "model": "scripted", "rubric": RUBRIC, "retries": 0}}])]


@pytest.mark.slow
def test_example_yaml_parses_through_the_cli(tmp_path):
    from helpers import CONFIGS

    from lightning_rl.cli.main import LightningRLCLI

    cli = LightningRLCLI(args=["--config", str(CONFIGS / "examples" / "judge.yaml"),
                               "--trainer.logger.init_args.save_dir", str(tmp_path)], run=False)
    (fn,) = cli.model.reward_pipeline.scorer.fns
    assert isinstance(fn, LLMJudge) and fn.base_url == "http://127.0.0.1:8000/v1" and fn.max_score == 10
    assert {"prompt", "answer", "completion"} <= fn.fields and fn.concurrency == 32
    assert cli.model.reward_pipeline.scorer.names == ["judge"]


@pytest.mark.slow
@pytest.mark.parametrize("overlay", [None, "async.yaml"])
def test_a_fit_whose_only_reward_is_the_judge_logs_its_metrics_and_errors(fake, tmp_path, overlay):
    from helpers import CONFIGS, run_cli, scalars

    # the scripted judge grades the sort task, but every answer to a prompt holding a "7" is garbage;
    # with configs/async.yaml the judge runs in the sampler's worker, one version ahead
    server = fake(answer=lambda text: "hmm" if "7" in text.split("Task: ")[1][:6] else grade_sort(text))
    extra = ["--config", str(CONFIGS / overlay)] if overlay else []
    run_cli("fit", *judge_args(server.url, tmp_path, *extra, "--trainer.max_steps", "2",
                               "--trainer.val_check_interval", "2", "--data.init_args.batch_size", "4",
                               "--model.init_args.sampling.num_generations", "4",
                               "--model.init_args.rewards.max_error_frac", "1.0"))
    logged = scalars(tmp_path)
    assert len(logged["rollout/judge_requests"]) == 2 and logged["rollout/judge_requests"][0][1] > 0
    assert "rollout/judge_cache_hits" in logged and logged["perf/judge_latency_mean"][0][1] > 0
    assert sum(v for _, v in logged["rollout/reward_errors"]) > 0  # the garbage answers, counted
    assert "val/accuracy" in logged


@pytest.mark.slow
def test_a_rubric_naming_a_missing_column_fails_before_training(tmp_path):
    from helpers import CONFIGS, run_cli

    from lightning_rl.errors import InputError

    functions = json.dumps([{"class_path": "lightning_rl.step.judge.LLMJudge", "init_args": {
        "base_url": "http://127.0.0.1:9/v1", "model": "m", "rubric": "{prompt} {completion} {difficulty}"}}])
    with pytest.raises(InputError, match=r"`model.init_args.rewards.functions`.*needs the data column "
                                         r"`difficulty`"):
        run_cli("fit", "--config", CONFIGS / "examples" / "judge.yaml", "--trainer.max_steps", "1",
                "--trainer.logger.init_args.save_dir", tmp_path,
                "--model.init_args.rewards.functions", functions)
