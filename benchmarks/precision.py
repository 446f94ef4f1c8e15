"""The rollout engine's precision: what each ``CopyEngine`` dtype costs in sampling time and in mismatch with
the fp32 trainer, on the machine it runs on.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/precision.py [--rounds 5] [--threads 1] [--device cpu]
    # the same machine held to AVX2 kernels (no bf16 units used): torch's and oneDNN's dispatch limits
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS=1 \
        .venv/bin/python benchmarks/precision.py
    # AVX-512 without its bf16 instructions (oneDNN held below AVX512_CORE_BF16)
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI OMP_NUM_THREADS=1 .venv/bin/python benchmarks/precision.py

Prints the machine first (CPU model, ``torch.backends.cpu.get_cpu_capability()``, the CPU flags that decide
whether bf16 / fp16 run on hardware units, ``nproc``, ``os.cpu_count()``, torch threads), then two tables:

* matmul throughput per dtype (``128 x 512 @ 512 x 512``, median of repeats): whether the dtype has hardware
  support here (AMX / AVX512-BF16 / AVX512-FP16) or is emulated.
* per engine dtype (float32, bfloat16, float16), on the embedded tiny model (``builtin:tiny-sort``) and the
  same 16 prompts x 8 samples x 8 new tokens (workload A's shape, ``configs/grpo.yaml``'s sampling): seconds
  per rollout of sampling (median over rounds, each round a new seed), and the mismatch of the engine's
  log-probs of its sampled tokens (``rollout_logp``, what the correction weighs) against the fp32 trainer's
  log-probs of the same tokens (``rollout/logp_diff_mean``: mean |diff|; ``rollout/mismatch_k3``: mean k3),
  computed by ``lightning_rl.maths.rollout_weights.rollout_mismatch_stats`` over every round's tokens.

The engine copies the trained (fp32) weights, cast, exactly as training does after each optimiser step.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time

import torch

from lightning_rl.maths.rollout_weights import rollout_is_weights, rollout_mismatch_stats
from lightning_rl.models.generation import SamplingParams
from lightning_rl.models.loading import load_policy
from lightning_rl.step.engine import CopyEngine

DTYPES = ("float32", "bfloat16", "float16")
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "amx_tile", "f16c")


def machine(device: torch.device) -> list[str]:
    """What the figures depend on: the CPU, its bf16 / fp16 units, the cores and the threads."""
    model, flags = platform.processor() or "?", set()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("?", platform.processor()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    lines = [f"cpu: {model}", f"torch {torch.__version__}, "
             f"torch.backends.cpu.get_cpu_capability(): {torch.backends.cpu.get_cpu_capability()}",
             "cpu flags: " + " ".join(f"{flag}={'yes' if flag in flags else 'no'}" for flag in FLAGS),
             f"nproc (cores this process may use): {len(os.sched_getaffinity(0))}, os.cpu_count(): "
             f"{os.cpu_count()}, torch.get_num_threads(): {torch.get_num_threads()}"]
    limits = {name: os.environ[name] for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
              if name in os.environ}
    if limits:  # kernels held below the hardware (e.g. to measure an AVX2 machine on an AVX-512 one)
        lines.append("dispatch limited by " + ", ".join(f"{k}={v}" for k, v in limits.items()))
    if device.type == "cuda":
        lines.append(f"gpu: {torch.cuda.get_device_name(device)}")
    return lines


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_gflops(dtype: torch.dtype, device: torch.device, repeats: int = 20) -> float:
    """GFLOP/s of ``128 x 512 @ 512 x 512`` in ``dtype`` (median of ``repeats``, after one warm-up)."""
    a = torch.randn(128, 512, device=device).to(dtype)
    b = torch.randn(512, 512, device=device).to(dtype)
    times = []
    for i in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        if i:
            times.append(time.perf_counter() - start)
    return 2 * 128 * 512 * 512 / statistics.median(times) / 1e9


def prompts(n: int) -> list[str]:
    """``n`` sort-task prompts (4-6 digits then ``=``), the same on every run."""
    rng = random.Random(0)
    return ["".join(rng.choice("0123456789") for _ in range(rng.randint(4, 6))) + "=" for _ in range(n)]


def measure(dtype: str, trainer, ids: torch.Tensor, mask: torch.Tensor, rounds: int,
            device: torch.device) -> dict[str, float]:
    """Seconds per rollout (median) and the mismatch against the fp32 trainer over all rounds' tokens."""
    engine = CopyEngine(dtype)
    engine.attach(trainer)  # builds the copy and syncs the trained weights into it, cast
    sampling = SamplingParams(max_new_tokens=8)
    engine.generate(ids, mask, num_samples=8, sampling=sampling, seed=1000)  # warm-up
    times, engine_logp, trainer_logp, masks = [], [], [], []
    for round_ in range(rounds):
        synchronize(device)
        start = time.perf_counter()
        gen = engine.generate(ids, mask, num_samples=8, sampling=sampling, seed=round_)
        synchronize(device)
        times.append(time.perf_counter() - start)
        with torch.no_grad():
            logp, _ = trainer.token_logprobs(gen.prompt_ids, gen.prompt_mask, gen.completion_ids,
                                             gen.completion_mask, temperature=1.0)
        width = gen.completion_ids.shape[1]
        for store, value in ((engine_logp, gen.rollout_logp), (trainer_logp, logp),
                             (masks, gen.completion_mask)):
            store.append(torch.nn.functional.pad(value.float().cpu(), (0, 8 - width)))
    old, rollout, valid = torch.cat(trainer_logp), torch.cat(engine_logp), torch.cat(masks).bool()
    weights = rollout_is_weights(old, rollout, valid)
    stats = rollout_mismatch_stats(old, rollout, valid, weights, 2.0)
    tokens = int(valid.sum()) / rounds
    seconds = statistics.median(times)
    return {"seconds": seconds, "tokens_per_s": tokens / seconds,
            "logp_diff_mean": float(stats["rollout/logp_diff_mean"]),
            "mismatch_k3": float(stats["rollout/mismatch_k3"])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    for line in machine(device):
        print(line)
    print("\n| dtype | matmul 128x512 @ 512x512, GFLOP/s |\n|---|---|")
    for dtype in DTYPES:
        print(f"| {dtype} | {matmul_gflops(getattr(torch, dtype), device):.1f} |", flush=True)
    trainer = load_policy("builtin:tiny-sort")
    trainer.model.to(device)
    trainer.disable_dropout()
    ids, mask = trainer.encode_prompts(prompts(16))
    ids, mask = ids.to(device), mask.to(device)
    print(f"\n| engine dtype | s / rollout (16 x 8 samples, 8 tokens; median of {args.rounds}) "
          "| new tokens / s | mean abs logp diff vs fp32 trainer | mean k3 |\n|---|---|---|---|---|")
    for dtype in DTYPES:
        r = measure(dtype, trainer, ids, mask, args.rounds, device)
        print(f"| {dtype} | {r['seconds']:.3f} | {r['tokens_per_s']:.0f} | {r['logp_diff_mean']:.2e} | "
              f"{r['mismatch_k3']:.2e} |", flush=True)


if __name__ == "__main__":
    main()
