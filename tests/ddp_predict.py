"""``trainer.predict`` of the embedded model on a prompt file, on 1 process or on 2 gloo ranks.

    python tests/ddp_predict.py PROMPTS.jsonl OUT_DIR DEVICES

Writes ``OUT_DIR/greedy.jsonl`` (one greedy completion per prompt) and ``OUT_DIR/sampled.jsonl`` (two
samples per prompt), with their summaries. Used by tests/algorithms/test_predict.py: with an odd number of
prompts (3 + 2 over two ranks, batches of 2: the short rank runs a placeholder batch), every prompt must be
written once per sample, and the greedy file must equal the single-process one.
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
import torch.distributed as dist

from lightning_rl.algorithms import GRPO
from lightning_rl.algorithms.options import PolicyOptions
from lightning_rl.algorithms.sampler_options import SamplingOptions
from lightning_rl.callbacks import WritePredictions
from lightning_rl.data import PromptDataModule


def main() -> None:
    torch.set_num_threads(1)
    prompts, out, devices = sys.argv[1], sys.argv[2], int(sys.argv[3])
    module = GRPO(policy=PolicyOptions(model="builtin:tiny-sort", max_prompt_length=16),
                  sampling=SamplingOptions(max_new_tokens=8, num_generations=2))
    for name, n in (("greedy", 1), ("sampled", 2)):
        writer = WritePredictions(output=os.path.join(out, f"{name}.jsonl"), num_generations=n)
        trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[writer], default_root_dir=out)
        data = PromptDataModule(predict_path=prompts, val_batch_size=2)
        trainer.predict(module, data, return_predictions=False)


if __name__ == "__main__":
    main()
    if dist.is_initialized():  # tear gloo down cleanly: its threads left running abort the process at exit
        dist.destroy_process_group()
