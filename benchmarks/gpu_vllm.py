"""GRPO sampled by vLLM against the HF engine, synchronous and one version ahead, on one GPU (the device
machine): seconds per step, generated tokens per second, the weight push, peak memory.

    python benchmarks/gpu_vllm.py                                     # CUDA, a 0.5B-class model, 20 steps
    python benchmarks/gpu_vllm.py --device cpu --size tiny --steps 4  # a check that it runs, on this CPU

The model is Llama-shaped with random weights and the embedded character tokenizer (no hub there): hidden
1024, 24 layers, 16 heads, MLP 4096 (``--size 0.5b``: 0.4B parameters, the 0.5B class); the embedded task's
prompts, ``--max-new-tokens`` (128) per completion, 8 prompts x 8 samples per step; fp32 weights with
``bf16-mixed`` training on CUDA. Variants: ``hf`` / ``hf-async`` (the bf16 ``CopyEngine``, ``max_staleness``
0 / 1) and ``vllm`` / ``vllm-async`` (``VLLMEngine`` colocated, bf16 on CUDA, ``gpu_memory_utilization``
0.3; a thread worker samples ahead on a GPU). One line per variant: median ``perf/step_time`` after the first
3 steps, median ``perf/tokens_per_sec``, median ``perf/weight_sync_time``, peak memory (this process's
``max_memory_allocated``, and the device's used memory at the end, which counts vLLM's engine process).
Where vLLM is not installed it says so in one line and runs the HF variants.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_async import build_model, mount_subpackages, timed_fit  # noqa: E402

mount_subpackages()
from lightning_rl.step.engine import CopyEngine  # noqa: E402


def engine_for(variant: str, device: str):
    if not variant.startswith("vllm"):
        return CopyEngine("bfloat16" if device == "cuda" else "float32")
    from lightning_rl.step.vllm_engine import VLLMEngine

    if device == "cuda":
        return VLLMEngine(dtype="bfloat16", gpu_memory_utilization=0.3, enforce_eager=False)
    return VLLMEngine(dtype="float32", kv_cache_gib=1.0)


def run(variant: str, model: Path, args: argparse.Namespace, out: Path) -> str:
    lag = 1 if variant.endswith("async") else 0
    med, wall = timed_fit(variant, model, engine_for(variant, args.device), lag, args, out)
    peak = used = float("nan")
    if args.device == "cuda":
        free, total = torch.cuda.mem_get_info()
        peak, used = torch.cuda.max_memory_allocated() / 2**30, (total - free) / 2**30
    push_ms = med("perf/weight_sync_time") * 1000
    return (f"{variant:10s} | {med('perf/step_time'):.3f} s/step | "
            f"{med('perf/tokens_per_sec'):.0f} tokens/s | push {push_ms:.0f} ms | "
            f"wait {med('perf/rollout_wait_time'):.3f} s | peak {peak:.1f} GiB "
            f"(device used {used:.1f} GiB) | wall {wall:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", default="0.5b", choices=["tiny", "0.5b"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--variants", nargs="+", default=["hf", "hf-async", "vllm", "vllm-async"])
    args = parser.parse_args()
    name = torch.cuda.get_device_name() if args.device == "cuda" else torch.backends.cpu.get_cpu_capability()
    print(f"{name}, torch {torch.__version__}, {args.size} model, {args.steps} steps", flush=True)
    variants = args.variants
    try:
        import vllm

        print(f"vllm {vllm.__version__}", flush=True)
    except ImportError as err:
        print(f"vLLM is not installed here ({err}): the vllm variants are left out", flush=True)
        variants = [v for v in variants if not v.startswith("vllm")]
    with tempfile.TemporaryDirectory() as tmp:
        size = "0.4b" if args.size == "0.5b" else args.size
        model = build_model(size, Path(tmp) / "model")
        for variant in variants:
            print(run(variant, model, args, Path(tmp)), flush=True)


if __name__ == "__main__":
    main()
