"""GRPO whose only reward is an LLM judge: `configs/examples/judge.yaml` against a scripted judge (loopback).

    OMP_NUM_THREADS=1 LRL_NUM_THREADS=1 python benchmarks/judge_reward.py [--steps N] [--group] [--garbage F]

No LLM that runs on this CPU can grade the sort task, so the judge here is a rubric checker behind a real
OpenAI-compatible HTTP endpoint (`http.server` on 127.0.0.1, `POST /v1/chat/completions`): it reads the task,
the reference and the response out of the rubric the trainer sends, applies the example's rubric (10: the
reference exactly; 4: the task's digits in another order; 0: otherwise) and answers in free text ending in
`Score: n`. A fraction `--garbage` of prompts (chosen by a hash of the request, so the same ones every time)
gets an answer without a score: counted in `rollout/reward_errors` (`on_error: zero`), never cached. `--group`
switches the judge to one request per group of G completions, answered `i: score` lines (RULER-style).

Everything else is the real path: `lightning-rl validate` and `lightning-rl fit` in subprocesses, the judge
called through `LLMJudge` (async, concurrent, cached, retried, timed out), held-out `val/accuracy` by exact
match. Prints the start and end held-out accuracy, the reward errors, requests, cache hits, latency and wall
time, read back from TensorBoard.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "configs" / "examples" / "judge.yaml"
GROUP_RUBRIC = ("Rubric: 10 if a response equals the reference answer exactly; 4 if it has exactly the "
                "task's digits but not in ascending order; 0 otherwise.\nTask: {prompt}\n"
                "Reference answer: {answer}\n"
                "{completions}\nReply with one line per response: <response number>: <score>")


def grade(task: str, reference: str, response: str) -> int:
    """The example's rubric."""
    digits = task.strip().rstrip("=")
    if response.strip() == reference.strip():
        return 10
    return 4 if sorted(response.strip()) == sorted(digits) else 0


def answer(text: str, garbage: float) -> str:
    """What the scripted judge says to one request (a rubric in, free text with the score(s) out)."""
    if int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) / 16**8 < garbage:
        return "I am not sure how to grade this one."
    task = re.search(r"Task: (.*)", text).group(1)
    reference = re.search(r"Reference answer: (.*)", text).group(1)
    responses = re.findall(r"Response (\d+): (.*)", text)
    if responses:  # group mode
        return "\n".join(f"{i}: {grade(task, reference, r)}" for i, r in responses)
    response = re.search(r"Response: (.*)", text).group(1)
    return f"The response was compared with the rubric.\nScore: {grade(task, reference, response)}"


def serve(garbage: float) -> tuple[ThreadingHTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            content = answer(body["messages"][-1]["content"], garbage)
            data = json.dumps({"object": "chat.completion", "model": body["model"], "choices": [
                {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data.encode())

        def log_message(self, *args) -> None:
            pass

    ThreadingHTTPServer.request_queue_size = 256  # the default backlog of 5 drops concurrent connects (1 s)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1"


def config(url: str, steps: int, group: bool, out: Path) -> Path:
    """The example with the judge pointed at ``url`` (and switched to group mode)."""
    cfg = yaml.safe_load(EXAMPLE.read_text())
    cfg["trainer"]["max_steps"] = steps
    judge = cfg["model"]["init_args"]["rewards"]["functions"][0]["init_args"]
    judge.update(base_url=url, model="scripted-rubric-checker")
    if group:
        judge.update(group=True, rubric=GROUP_RUBRIC, max_tokens=64)
    path = out / "judge.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def scalars(log_dir: Path) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for events in sorted(glob.glob(f"{log_dir}/**/events.out.tfevents.*", recursive=True)):
        acc = EventAccumulator(events, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend(e.value for e in acc.Scalars(tag))
    return out


def cli(subcommand: str, cfg: Path, out: Path) -> float:
    cmd = [sys.executable, "-m", "lightning_rl.cli.main", subcommand, "--config", str(cfg),
           "--trainer.logger.init_args.save_dir", str(out), "--trainer.enable_progress_bar", "false"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--group", action="store_true", help="one judge request per group (RULER-style)")
    parser.add_argument("--garbage", type=float, default=0.02, help="fraction of answers without a score")
    args = parser.parse_args()
    server, url = serve(args.garbage)
    out = Path(tempfile.mkdtemp(prefix="bench-judge-"))
    cfg = config(url, args.steps, args.group, out)
    cli("validate", cfg, out / "start")
    seconds = cli("fit", cfg, out / "fit")
    server.shutdown()
    start, end = scalars(out / "start"), scalars(out / "fit")
    result = {
        "judge": "group" if args.group else "per sample", "steps": args.steps, "garbage": args.garbage,
        "val_accuracy_start": start["val/accuracy"][0], "val_accuracy_end": end["val/accuracy"][-1],
        "val_accuracy_curve": end["val/accuracy"], "reward_errors": sum(end["rollout/reward_errors"]),
        "judge_requests": sum(end["rollout/judge_requests"]),
        "judge_cache_hits": sum(end["rollout/judge_cache_hits"]),
        "judge_latency_mean_s": sum(end["perf/judge_latency_mean"]) / len(end["perf/judge_latency_mean"]),
        "reward_time_median_s": sorted(end["perf/reward_time"])[len(end["perf/reward_time"]) // 2],
        "step_time_median_s": sorted(end["perf/step_time"])[len(end["perf/step_time"]) // 2],
        "fit_seconds": seconds, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
