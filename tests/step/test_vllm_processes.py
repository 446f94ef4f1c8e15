"""Real vLLM processes that fail or are stopped: a model vLLM cannot serve, a vLLM server that dies in the
middle of a run, Ctrl-C to the whole process group, and a trainer killed outright. Each ends in one clear
line, keeps what was saved, and leaves no vLLM process behind (they are counted)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from helpers import CONFIGS, ROOT, run_cli

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TESTS = Path(__file__).resolve().parents[1]


def processes_where(test) -> list[int]:
    """Pids of the processes (not this one) for which ``test(pid, environ, stat)`` holds."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if test(int(entry.name), environ, stat):
            found.append(int(entry.name))
    return found


def engines_of(owner: int) -> list[int]:
    """vLLM processes started under ``owner`` (``LIGHTNING_RL_VLLM_OWNER``, inherited by vLLM's own)."""
    mark = f"LIGHTNING_RL_VLLM_OWNER={owner}".encode()
    return processes_where(lambda pid, environ, stat: mark in environ)


def in_group(pgid: int) -> list[int]:
    return processes_where(lambda pid, environ, stat: int(stat.rsplit(")", 1)[1].split()[2]) == pgid)


def wait_until_gone(find, seconds: float = 30.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := find()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.mark.usefixtures("vllm_pool")
def test_a_model_vllm_cannot_serve_is_named():
    from helpers import make
    from transformers import AutoModelForCausalLM, OpenAIGPTConfig

    from lightning_rl.models.policy import Policy
    from lightning_rl.step.vllm_engine import VLLMEngine

    config = OpenAIGPTConfig(vocab_size=100, n_positions=64, n_embd=32, n_layer=1, n_head=2)
    policy = Policy(AutoModelForCausalLM.from_config(config), make().tokenizer)
    engine = VLLMEngine(kv_cache_gib=1.0)
    engine.attach(policy)
    with pytest.raises(RuntimeError, match=r"vLLM could not serve `model.policy.model") as err:
        engine.sync_weights(policy, version=0)
    assert "not supported" in str(err.value) and "\n" not in str(err.value)
    engine.close()


class KillServerAt(L.Callback):
    """At optimiser step ``step``, SIGKILL the vLLM server's own process (its engine is left to the run);
    the server's session is recorded in ``groups``."""

    groups: list[int] = []

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if pl_module.engine.backend is None:  # started by the step's first weight push
            return
        process = pl_module.engine.backend.process
        KillServerAt.groups.append(process.pid)
        if trainer.global_step == self.step:
            process.kill()
            process.wait()


def test_a_server_that_dies_mid_run_is_named_and_the_last_checkpoint_is_intact(tmp_path):
    """`mode: server` (configs/vllm_server.yaml): a server per run, started here; its death at step 2 stops
    the run with the server's exit code, the checkpoint of step 2 loads, and nothing it started is left."""
    ckpt = tmp_path / "ckpt"
    overlay = tmp_path / "steps.yaml"
    overlay.write_text(yaml.safe_dump({"trainer": {"callbacks": [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": str(ckpt), "every_n_train_steps": 1, "save_top_k": -1}},
        {"class_path": "test_vllm_processes.KillServerAt", "init_args": {"step": 2}}]}}))
    with pytest.raises(RuntimeError, match=r"the vLLM server exited with code -9") as err:
        run_cli("fit", "--config", CONFIGS / "grpo.yaml", "--config", CONFIGS / "vllm_server.yaml",
                "--config", overlay, "--trainer.max_steps", "6", "--trainer.limit_val_batches", "0",
                "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
                "--data.init_args.batch_size", "4", "--trainer.logger.init_args.save_dir", tmp_path)
    assert "the last lines of its log" in str(err.value)
    saved = sorted(ckpt.glob("*.ckpt"))
    assert [p.name for p in saved] == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]
    state = torch.load(saved[-1], map_location="cpu", weights_only=False)
    assert state["global_step"] == 2 and state["state_dict"]
    # the server's session (its engine core and worker) is gone with the run
    (group,) = set(KillServerAt.groups)
    assert not wait_until_gone(lambda: in_group(group))


SIGINT_RUN = """
import os, signal, sys
import lightning as L

class GroupSignalAt(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 2:
            os.killpg(0, signal.SIGINT)  # Ctrl-C: every process of the terminal's group

if __name__ == "__main__":  # vLLM's engine core is a spawned process: it imports this file again
    from lightning_rl.cli.main import main
    main(sys.argv[1:])
"""

KILL_RUN = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from helpers import make
from lightning_rl.step.vllm_engine import VLLMEngine
if __name__ == "__main__":
    module = make()
    engine = VLLMEngine(kv_cache_gib=1.0)
    engine.attach(module.policy)
    engine.sync_weights(module.policy, version=0)
    print("engine up", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> dict:
    """Two runs in sessions of their own, started at once: GRPO + configs/vllm.yaml through `lightning-rl
    fit`, Ctrl-C to its whole process group at step 2; and an engine whose process is SIGKILLed."""
    folder = tmp_path_factory.mktemp("stopped")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LRL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(folder), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    (folder / "group_signal.py").write_text(SIGINT_RUN)
    overlay = folder / "signal.yaml"
    callbacks = [{"class_path": "group_signal.GroupSignalAt"}]
    overlay.write_text(yaml.safe_dump({"trainer": {"callbacks": callbacks}}))
    fit = subprocess.Popen(
        [sys.executable, str(folder / "group_signal.py"), "fit", "--config", str(CONFIGS / "grpo.yaml"),
         "--config", str(CONFIGS / "vllm.yaml"), "--config", str(overlay), "--trainer.max_steps", "10",
         "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
         "--data.init_args.batch_size", "4", "--trainer.logger.init_args.save_dir", str(folder / "runs")],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    kill = subprocess.Popen([sys.executable, "-c", KILL_RUN, str(TESTS)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    out = {}
    for name, proc in (("sigint", fit), ("sigkill", kill)):
        stdout, stderr = proc.communicate(timeout=300)
        out[name] = (proc, stdout, stderr)
    return {"folder": folder, **out}


def test_ctrl_c_to_the_group_saves_the_checkpoint_then_stops_the_engine(stopped):
    proc, _, stderr = stopped["sigint"]
    run = stopped["folder"] / "runs" / "lightning-rl" / "version_0"
    saved = run / "checkpoints" / "interrupted-step=3.ckpt"  # the step the signal arrived in finished
    assert proc.returncode == 130, stderr[-3000:]
    assert saved.exists() and f"checkpoint saved to {saved}" in stderr
    assert not wait_until_gone(lambda: engines_of(proc.pid))


def test_a_trainer_killed_outright_leaves_no_engine(stopped):
    proc, stdout, stderr = stopped["sigkill"]
    assert proc.returncode == -signal.SIGKILL and "engine up" in stdout, stderr[-3000:]
    assert not wait_until_gone(lambda: engines_of(proc.pid))
