"""Multi-node on localhost: 2 nodes x 1 process (gloo) trains exactly like 1 node x 2 processes.

The same 2-step GRPO fit through the real CLI (tests/multinode_fit.py) runs three ways: one node with two
processes (``--trainer.devices 2``, a job of the suite's shared 2-rank launch); two "nodes" started as a
user would on each machine (``MASTER_ADDR``/``MASTER_PORT``/``NODE_RANK``, ``--trainer.num_nodes 2
--trainer.devices 1``); and two ``torchrun --nnodes 2 --node_rank i`` agents. Global ranks, hence data
shards and seeds, are the same, so the logged metrics and the final weights must be identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import scalars
from rank_jobs import free_port
from safetensors.torch import load_file

from lightning_rl.models.builtin import EMBEDDED_MODEL

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[1] / "multinode_fit.py"
TIMEOUT = 240
COMPARED = ["rollout/reward_mean", "rollout/response_length_mean", "policy/loss", "policy/grad_norm",
            "policy/kl_ref", "policy/entropy", "policy/clip_frac"]


def launch(commands: list[tuple[list[str], dict]], cwd: Path) -> None:
    """Start every command at once, each in its own session; kill every group if any is still running at
    the deadline (a hung gloo rank ignores SIGTERM)."""
    procs = []
    for argv, env in commands:
        env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
        procs.append(subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=TIMEOUT)[0].decode())
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
        pytest.fail(f"multi-process run hung: {' | '.join(' '.join(a) for a, _ in commands)}")
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, log[-3000:]


def result(out: Path) -> dict:
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return {"ranks": ranks, "weights": torch.load(out / "weights.pt"), "scalars": scalars(out)}


def two_nodes_lightning(tmp_path: Path) -> dict:
    out, port = tmp_path / "2x1-env", str(free_port())
    out.mkdir()
    argv = [sys.executable, str(SCRIPT), str(out), "--trainer.num_nodes", "2", "--trainer.devices", "1"]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    launch([(argv, {**env, "NODE_RANK": str(node)}) for node in (0, 1)], tmp_path)
    return result(out)


def two_nodes_torchrun(tmp_path: Path) -> dict:
    out, port = tmp_path / "2x1-torchrun", str(free_port())
    out.mkdir()
    commands = []
    for node in (0, 1):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                "--master_addr", "127.0.0.1", "--master_port", port, "--nproc-per-node", "1",
                str(SCRIPT), str(out), "--trainer.num_nodes", "2", "--trainer.devices", "1"]
        commands.append((argv, {}))
    launch(commands, tmp_path)
    return result(out)


def assert_same_training(reference: dict, other: dict) -> None:
    for name, weights in reference["weights"].items():
        assert torch.equal(weights, other["weights"][name]), name
    for tag in COMPARED:
        assert reference["scalars"][tag] == other["scalars"][tag], tag


@pytest.mark.ranks("ddp/multinode-reference")
def test_two_nodes_train_like_one_node_with_two_processes(tmp_path, rank_jobs):
    single = result(rank_jobs.out("ddp/multinode-reference"))  # `--trainer.devices 2`, the shared launch
    ranks = [(r["node_rank"], r["local_rank"], r["world_size"]) for r in single["ranks"]]
    assert ranks == [(0, 0, 2), (0, 1, 2)]
    assert all(r["global_step"] == 2 for r in single["ranks"])
    # it trained: the weights moved from the embedded model and both steps were logged
    initial = load_file(str(Path(EMBEDDED_MODEL) / "model.safetensors"))
    weights = single["weights"]
    moved = max((weights[n] - w).abs().max().item() for n, w in initial.items() if n in weights)
    assert moved > 0
    assert [s for s, _ in single["scalars"]["policy/loss"]] == [1, 2]

    for launcher, environment, node_env in ((two_nodes_lightning, "LightningEnvironment", "NODE_RANK"),
                                            (two_nodes_torchrun, "TorchElasticEnvironment", "GROUP_RANK")):
        multi = launcher(tmp_path)
        ranks = [(r["global_rank"], r["node_rank"], r["local_rank"], r["world_size"], r["num_nodes"])
                 for r in multi["ranks"]]
        assert ranks == [(0, 0, 0, 2, 2), (1, 1, 0, 2, 2)], launcher.__name__
        assert {r["environment"] for r in multi["ranks"]} == {environment}
        assert [r[node_env] for r in multi["ranks"]] == ["0", "1"]
        assert_same_training(single, multi)
