"""Rollout engines on the same sampling work: transformers' ``generate``, lightning-rl's compacting sampler
(``lightning_rl.models.sampling``), and transformers' continuous batching (``generate_batch``, paged
attention).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/engines.py [--rounds 3] [--dtype float32|bfloat16]

Work: the embedded tiny model (workload A's shape: 16 prompts x 8 samples, 8 new tokens) and a random-init
Llama of workload B's shape (hidden 256, 4 layers, 16,384-token vocabulary; 8 prompts of ~190 tokens x 4
samples, up to 64 new tokens, stopping at EOS). Prints seconds per batch (median of rounds) and tokens / s.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

from lightning_rl.models.generation import SamplingParams, hf_generate
from lightning_rl.models.loading import load_policy
from lightning_rl.models.policy import Policy


def shapes(dtype: torch.dtype) -> dict[str, tuple[Policy, torch.Tensor, torch.Tensor, int, int]]:
    tiny = load_policy("builtin:tiny-sort", None, False)
    tiny.model.to(dtype)
    ids, mask = tiny.encode_prompts(["53421="] * 16)
    out = {"A (tiny, 16x8, 8 tokens)": (tiny, ids, mask, 8, 8)}
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16384, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
                         eos_token_id=tiny.eos_token_id, pad_token_id=tiny.pad_token_id)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    big = Policy(model, tiny.tokenizer)
    ids = torch.randint(5, 16384, (8, 190))
    out["B-shaped (7.6M, 8x4, 64 tokens)"] = (big, ids, torch.ones_like(ids), 4, 64)
    return out


def timed(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def continuous(policy: Policy, ids: torch.Tensor, mask: torch.Tensor, group: int, new: int) -> int:
    rows = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True) for _ in range(group)]
    config = GenerationConfig(max_new_tokens=new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              eos_token_id=policy.eos_token_id, pad_token_id=policy.pad_token_id)
    out = policy.model.generate_batch(inputs=rows, generation_config=config, progress_bar=False, warmup=False)
    return sum(len(o.generated_tokens) for o in out.values())


def measure(name: str, policy: Policy, ids: torch.Tensor, mask: torch.Tensor, group: int, new: int,
            rounds: int) -> None:
    """One row per engine for one shape: seconds per batch and sampled tokens per second."""
    policy.model.eval()
    sampling = SamplingParams(max_new_tokens=new)

    def sampled(compact: bool) -> int:
        gen = hf_generate(policy, ids, mask, num_samples=group, sampling=sampling, compact=compact)
        return int(gen.lengths.sum())

    engines = {"transformers generate": lambda: sampled(False), "compacting sampler": lambda: sampled(True),
               "continuous batching (generate_batch)": lambda: continuous(policy, ids, mask, group, new)}
    for engine, fn in engines.items():
        try:
            tokens = fn()
            seconds = timed(fn, rounds)
            print(f"| {name} | {engine} | {seconds:.3f} | {tokens / seconds:.0f} |", flush=True)
        except Exception as err:  # noqa: BLE001 - report an engine that does not run here
            print(f"| {name} | {engine} | failed: {type(err).__name__}: {str(err)[:80]} | |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"| work ({args.dtype}) | engine | s / batch | new tokens / s |")
    print("|---|---|---|---|")
    for name, (policy, ids, mask, group, new) in shapes(getattr(torch, args.dtype)).items():
        measure(name, policy, ids, mask, group, new, args.rounds)


if __name__ == "__main__":
    main()
