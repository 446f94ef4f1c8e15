"""Runs as a user meets them on the command line: resuming with `--ckpt_path last`, Ctrl-C / SIGTERM,
errors as one last line, run folders (config, hyperparameters) and the progress bar."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import yaml
from helpers import CONFIGS, ROOT, run_cli, scalars

from lightning_rl.cli.main import ConfigError

pytestmark = pytest.mark.slow

TINY = ["--data.init_args.batch_size", "2", "--model.init_args.sampling.num_generations", "2",
        "--data.init_args.max_val_rows", "8", "--data.init_args.val_batch_size", "8",
        "--trainer.num_sanity_val_steps", "0"]


def fit(save_dir: Path, *extra: str, config: str = "grpo.yaml"):
    """`lightning-rl fit` on a tiny GRPO run, in this process."""
    return run_cli("fit", "--config", CONFIGS / config, *TINY, "--trainer.logger.init_args.save_dir",
                   save_dir, "--trainer.enable_progress_bar", "false", *extra)


def cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """`lightning-rl <args>` as a subprocess (exit status, stdout and stderr as the user sees them)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LRL_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "lightning_rl.cli.main", *map(str, args)], cwd=cwd or ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def cli_here(capfd, *args: str) -> tuple[int, str, str]:
    """`lightning-rl <args>` in this process (``main``): exit status, stdout and stderr as a subprocess would
    give them (a ``sys.exit`` message is printed last, as the interpreter prints it). Start-up costs a
    subprocess ~8 s here, and a subprocess shows nothing more for an error message or a printed line."""
    from lightning_rl.cli.main import main

    code, message = 0, ""
    try:
        main([str(a) for a in args])
    except SystemExit as exit_:
        code, message = (exit_.code, "") if isinstance(exit_.code, int | None) else (1, f"{exit_.code}\n")
    out, err = capfd.readouterr()
    return code or 0, out, err + message


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def files(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


# ---- 1. `--ckpt_path last` resumes the experiment's newest checkpoint, in a new version folder ----------
def test_ckpt_path_last_resumes_the_newest_checkpoint_of_the_experiment(tmp_path):
    fit(tmp_path, "--trainer.max_steps", "2", "--trainer.val_check_interval", "2")
    runs = tmp_path / "lightning-rl"
    (saved,) = (runs / "version_0" / "checkpoints").glob("*.ckpt")
    before = files(runs / "version_0")
    resumed = fit(tmp_path, "--trainer.max_steps", "4", "--trainer.val_check_interval", "2",
                  "--ckpt_path", "last")
    assert resumed.trainer.global_step == 4
    logged = scalars(runs / "version_1")
    assert [s for s, _ in logged["rollout/reward_mean"]] == [3, 4]  # 2 more steps, after step 2
    assert files(runs / "version_0") == before  # the old run is untouched
    config = yaml.safe_load((runs / "version_1" / "config.yaml").read_text())
    assert config["ckpt_path"] == str(saved)  # the run records what it resumed


def test_ckpt_path_last_without_a_checkpoint_names_the_folder(tmp_path):
    with pytest.raises(ConfigError, match=r"no checkpoint to resume in .*lightning-rl/\*/checkpoints"):
        fit(tmp_path, "--trainer.max_steps", "2", "--ckpt_path", "last")


# ---- 2. Ctrl-C / SIGTERM: finish the step, save a checkpoint that resumes --------------------------------
class SignalAt(L.Callback):
    """Sends this process ``signum`` when a training step starts at optimiser step ``step``."""

    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM}


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> dict[str, tuple[Path, int, str]]:
    """One GSPO run per signal through `lightning-rl fit` (subprocesses started at once: each spends
    seconds starting up), the signal sent at step 2; ``{name: (run folder, exit status, stderr)}``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LRL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), str(ROOT / "tests"),
                                          os.environ.get("PYTHONPATH", "")])}
    procs = {}
    for name, signum in SIGNALS.items():
        folder = tmp_path_factory.mktemp(name)
        overlay = folder / "signal.yaml"
        overlay.write_text(yaml.safe_dump({"trainer": {"callbacks": [
            {"class_path": "test_cli_runs.SignalAt", "init_args": {"step": 2, "signum": int(signum)}}]}}))
        # GSPO: 2 optimiser steps per rollout; the signal arrives during the rollout that starts at step 2
        argv = [sys.executable, "-m", "lightning_rl.cli.main", "fit", "--config", str(CONFIGS / "gspo.yaml"),
                "--config", str(overlay), *TINY, "--trainer.max_steps", "10", "--trainer.val_check_interval",
                "100", "--trainer.logger.init_args.save_dir", str(folder)]
        procs[name] = folder, subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.PIPE, text=True)
    out = {}
    for name, (folder, proc) in procs.items():
        _, err = proc.communicate(timeout=300)
        out[name] = folder, proc.returncode, err
    return out


@pytest.mark.parametrize("name", list(SIGNALS))
def test_interrupted_run_saves_a_checkpoint_that_resumes(interrupted, name):
    folder, code, stderr = interrupted[name]
    saved = folder / "lightning-rl" / "version_0" / "checkpoints" / "interrupted-step=4.ckpt"
    assert code == 128 + SIGNALS[name], stderr[-3000:]
    assert saved.exists() and f"checkpoint saved to {saved}" in stderr
    resumed = fit(folder, "--trainer.max_steps", "6", "--trainer.val_check_interval", "100",
                  "--ckpt_path", "last", config="gspo.yaml")
    assert resumed.trainer.global_step == 6
    logged = scalars(folder / "lightning-rl" / "version_1")
    assert [s for s, _ in logged["rollout/reward_mean"]] == [6]  # one rollout, after the 4 steps saved


# ---- 3-5. errors: our message is the last line, the exit status non-zero ----------------------------------
def test_invalid_value_is_the_last_line_without_the_config_dump(tmp_path, capfd):
    code, out, err = cli_here(capfd, "fit", "--config", CONFIGS / "grpo.yaml",
                              "--model.init_args.sampling.num_generations", "1",
                              "--trainer.logger.init_args.save_dir", tmp_path)
    assert code != 0
    assert "`model.sampling.num_generations` must be >= 2" in last_line(err)
    assert "Given value" not in out + err


@pytest.mark.parametrize("content", [b"", random.Random(0).randbytes(4096)], ids=["empty", "random"])
def test_corrupt_checkpoint_is_one_line_naming_the_file(tmp_path, content, capfd):
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(content)
    code, _, err = cli_here(capfd, "fit", "--config", CONFIGS / "grpo.yaml", "--ckpt_path", bad,
                            "--trainer.logger.init_args.save_dir", tmp_path)
    assert code != 0
    assert f"{bad} is not a valid checkpoint" in last_line(err)
    assert "Traceback" not in err and "weights_only" not in err and "EOFError" not in err


# ---- 6-7. run folders: the config goes with the run, and into hparams.yaml --------------------------------
def test_runs_without_a_logger_do_not_trip_over_each_other(tmp_path, capfd, caplog, monkeypatch):
    monkeypatch.chdir(tmp_path)
    said = []
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            code, _, err = cli_here(capfd, "fit", "--config", CONFIGS / "grpo.yaml", *TINY,
                                    "--trainer.logger", "false", "--trainer.max_steps", "1",
                                    "--trainer.enable_checkpointing", "false")
        assert code == 0, err[-3000:]
        said.append("its config is not saved" in caplog.text)
    assert said == [True, True]  # and the log says so
    assert not (tmp_path / "config.yaml").exists()


def test_hparams_yaml_holds_the_resolved_config(tmp_path):
    fit(tmp_path, "--trainer.max_steps", "1", "--trainer.enable_checkpointing", "false")
    hparams = yaml.safe_load((tmp_path / "lightning-rl" / "version_0" / "hparams.yaml").read_text())
    assert hparams["model"]["class_path"] == "lightning_rl.algorithms.GRPO"
    assert hparams["model"]["init_args"]["sampling"]["num_generations"] == 2
    assert hparams["trainer"]["max_steps"] == 1 and hparams["data"]["init_args"]["batch_size"] == 2


# ---- 8. one step is one optimiser step: progress bar, logs, printed lines and max_steps agree -------------
def test_progress_bar_and_logs_count_optimiser_steps(tmp_path):
    # GSPO takes 2 optimiser steps per rollout: max_steps 4 is 2 rollouts, validated after each
    run = cli("fit", "--config", CONFIGS / "gspo.yaml", *TINY, "--trainer.max_steps", "4",
              "--trainer.val_check_interval", "1", "--trainer.enable_progress_bar", "true",
              "--trainer.enable_checkpointing", "false", "--trainer.logger.init_args.save_dir", tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "args parameter is intended" not in run.stderr  # LightningCLI's warning about `args=` is gone
    bar = run.stdout.replace("\r", "\n")
    assert "4/4" in bar and "reward=" in bar and "val_acc=" in bar
    assert "v_num" not in bar and "/-2" not in bar and "rollout/reward_mean" not in bar
    assert "step 2: val/accuracy" in run.stderr and "step 4: val/accuracy" in run.stderr
    logged = scalars(tmp_path)
    assert [s for s, _ in logged["rollout/reward_mean"]] == [2, 4]
    assert [s for s, _ in logged["val/accuracy"]] == [2, 4]


def test_the_packed_overlay_trains_through_the_cli_and_logs_what_it_saved(tmp_path):
    """configs/packed.yaml over configs/grpo.yaml: packing, token-budget micro-batches and chunked log-probs
    run through `fit` (the packing check passed before the first step); the padding left and the rows
    skipped are logged."""
    fit(tmp_path, "--config", CONFIGS / "packed.yaml", "--trainer.max_steps", "3",
        "--trainer.log_every_n_steps", "1", "--model.init_args.update.micro_batch_tokens", "24")
    logged = scalars(tmp_path)
    assert len(logged["perf/pad_frac"]) == 3 and len(logged["perf/skipped_rows_frac"]) == 3
    assert all(0 <= value < 1 for _, value in logged["perf/pad_frac"] + logged["perf/skipped_rows_frac"])
    assert len(logged["policy/grad_norm"]) == 3
