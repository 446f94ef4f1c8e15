"""A tiny GRPO fit through the real CLI on 2 gloo ranks (DDP or FSDP2), for the signal and resume tests.

    python tests/signals_fit.py OUT_DIR STRATEGY MAX_STEPS [CLI overrides...]

Runs ``lightning-rl fit --config configs/grpo.yaml --config configs/strategy/<STRATEGY>.yaml
--trainer.devices 2`` (STRATEGY: ``ddp`` | ``fsdp2``) cut to MAX_STEPS steps of 2 prompts x 2 samples per
rank, without validation, logging to ``OUT_DIR``. Every reward call sleeps 0.2 s, so a signal lands in the
middle of a step. ``SIGNAL=NAME:CALL[:twice]`` in the environment: at its CALL-th reward call (the rollout
of step CALL), rank ``SIGNAL_RANK`` (default 1) sends signal NAME to the whole process group (every rank),
as a cluster scheduler or a terminal's Ctrl-C does (``twice``: again 0.5 s later), and writes when it sent
it to ``OUT_DIR/signal-sent``. ``FAIL=RANK:CALL``: the reward raises on that rank only, at that call.
Extra arguments are CLI overrides (``--ckpt_path last``).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SHORT = ["--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
         "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
         "--data.init_args.batch_size", "2", "--model.init_args.sampling.num_generations", "2",
         "--model.init_args.rewards.functions", "[signals_fit:slow_reward]",
         "--model.init_args.rewards.correctness_fn", "signals_fit:correct", "--trainer.devices", "2"]
_calls = 0


def correct(completions, answer, **_):
    """Exact match (so that ``slow_reward`` is called once a step)."""
    return [c.strip() == str(a).strip() for c, a in zip(completions, answer, strict=True)]


def slow_reward(completions, answer, **_):
    """Exact match, 0.2 s a call; one rank sends ``SIGNAL`` to every rank at the call it names."""
    global _calls
    _calls += 1
    time.sleep(0.2)
    failing, _, at = os.environ.get("FAIL", "").partition(":")
    if failing and dist.get_rank() == int(failing) and _calls == int(at):
        raise ValueError(f"the reward service is down on rank {failing}")
    name, _, rest = os.environ.get("SIGNAL", "").partition(":")
    call, _, twice = rest.partition(":")
    if name and dist.get_rank() == int(os.environ.get("SIGNAL_RANK", "1")) and _calls == int(call):
        for _ in range(2 if twice else 1):
            Path(os.environ["SIGNAL_OUT"], "signal-sent").write_text(repr(time.time()))
            os.killpg(os.getpgrp(), signal.Signals[name])
            time.sleep(0.5)
    return [float(c) for c in correct(completions, answer)]


def main() -> None:
    torch.set_num_threads(1)
    out, strategy, steps, overrides = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
    from lightning_rl.cli.main import main as cli

    os.environ["SIGNAL_OUT"] = str(out)  # rank 0 starts the other ranks with this environment

    overlay = CONFIGS / "strategy" / f"{strategy}.yaml"
    cli(["fit", "--config", str(CONFIGS / "grpo.yaml"), "--config", str(overlay), *SHORT,
         "--trainer.max_steps", steps, "--trainer.logger.init_args.save_dir", str(out), *overrides])


if __name__ == "__main__":
    main()
    if dist.is_initialized():  # tear gloo down cleanly: its threads left running abort the process at exit
        dist.destroy_process_group()
