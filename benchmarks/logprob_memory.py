"""Peak memory and time of one scoring forward + backward with the log-probs taken in chunks
(``model.update.logprob_chunk``) against the whole output layer at once.

    .venv/bin/python benchmarks/logprob_memory.py [--rows 16] [--prompt 32] [--completion 64] [--layers 2]
                                                  [--chunks none 512 128] [--device cpu]

A random-weight Llama of SmolLM2-135M's widths (hidden 576, vocabulary 49,152; ``--layers`` deep) scores
``rows`` completions with entropy (as the policy loss does) and backpropagates. Each variant runs in a
fresh process: on CPU the figure is the process's peak RSS (``ru_maxrss``) above its RSS after the model
is built and warmed up once; on CUDA ``torch.cuda.max_memory_allocated``. Prints one line per variant and
the machine (``get_cpu_capability``, ``nproc``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import time


def run_variant(args: argparse.Namespace, chunk: int | None) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_rl.models.scoring import TokenScorer

    class Scorer(TokenScorer):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def _scoring(self):  # noqa: ANN202 - the policy's scoring, without a tokenizer
            return self.model, contextlib.nullcontext()

    torch.manual_seed(0)
    device = torch.device(args.device)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=args.layers, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    policy = Scorer(LlamaForCausalLM(config).to(device))
    policy.share_prompts, policy.logprob_chunk = True, chunk
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 49152, (args.rows // 4, args.prompt), generator=g).repeat_interleave(4, 0)
    completion = torch.randint(0, 49152, (args.rows, args.completion), generator=g)
    masks = torch.ones_like(prompt), torch.ones_like(completion)
    batch = [t.to(device) for t in (prompt, masks[0], completion, masks[1])]

    def step() -> float:
        start = time.perf_counter()
        policy.zero_grad(set_to_none=True)
        logp, entropy = policy.token_logprobs(*batch, with_entropy=True)
        (logp.sum() + 0.01 * entropy.sum()).backward()
        return time.perf_counter() - start

    step()  # warm-up: allocator pools and the gradients' own memory
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = current_rss_mb()
    seconds = min(step() for _ in range(3))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    return {"chunk": chunk, "peak_above_warm_mb": round(peak, 1), "seconds": round(seconds, 3)}


def current_rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--completion", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--chunks", nargs="+", default=["none", "512", "128"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant is not None:
        print(json.dumps(run_variant(args, None if args.variant == "none" else int(args.variant))))
        return
    import torch

    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, nproc {os.cpu_count()}, "
          f"torch threads {torch.get_num_threads()}, {args.rows} rows x ({args.prompt} + {args.completion}) "
          f"tokens, vocabulary 49152, {args.layers} layers, {args.device}")
    for chunk in args.chunks:
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--variant", chunk], check=True,
                             capture_output=True, text=True).stdout.strip().splitlines()[-1]
        r = json.loads(out)
        print(f"logprob_chunk {str(r['chunk']):>5}: peak +{r['peak_above_warm_mb']:8.1f} MB above warm, "
              f"{r['seconds']:.3f} s forward + backward")


if __name__ == "__main__":
    main()
