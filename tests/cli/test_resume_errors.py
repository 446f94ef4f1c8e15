"""Resuming, single process and fast: `--ckpt_path last` finds sharded checkpoint folders; checkpoint files
that are not Lightning checkpoints, a resume with another batch geometry, a rerun into a folder that holds
an earlier run and a full disk each end in one `lightning-rl: error:` line naming the file or key, with an
earlier run folder left byte for byte as it was.

The error paths fail at setup (or at the first save), so they build nothing heavy.
"""

from __future__ import annotations

import errno
import hashlib
import os
import zipfile
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import CONFIGS
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_rl.cli.main import find_last_checkpoint, main
from lightning_rl.cli.resume import newest_checkpoint

TINY = ["--data.init_args.batch_size", "2", "--model.init_args.sampling.num_generations", "2",
        "--data.init_args.max_val_rows", "2", "--data.init_args.val_batch_size", "2",
        "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false"]


def tree_hash(folder: Path) -> str:
    """Every file's path and bytes under ``folder``."""
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        digest.update(str(path.relative_to(folder)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


@pytest.fixture
def planted(tmp_path) -> Path:
    """An earlier run's folder: config, exported policy, a checkpoint."""
    run = tmp_path / "runs" / "lightning-rl" / "version_0"
    (run / "policy").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    (run / "config.yaml").write_text("seed_everything: 0\n")
    (run / "policy" / "config.json").write_text("{}")
    (run / "checkpoints" / "epoch=0-step=1.ckpt").write_bytes(b"earlier")
    return run


def lightning_rl(tmp_path: Path, *args: str) -> str:
    """``lightning-rl fit --config configs/grpo.yaml <args>`` in this process, expected to fail: its last
    line of output (what ``sys.exit`` prints)."""
    with pytest.raises(SystemExit) as stopped:
        main(["fit", "--config", str(CONFIGS / "grpo.yaml"), *TINY,
              "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), *map(str, args)])
    message = stopped.value.code
    assert isinstance(message, str) and message.startswith("lightning-rl: error: "), message
    assert "\n" not in message, message
    return message


# ---- `--ckpt_path last` finds files and sharded folders ---------------------------------------------------
def _age(path: Path, seconds_ago: float) -> None:
    when = os.path.getmtime(path) - seconds_ago if path.exists() else 0
    os.utime(path, (when, when))


def test_last_finds_sharded_checkpoint_folders_as_well_as_files(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "epoch=0-step=2.ckpt").write_bytes(b"file")
    fsdp2 = folder / "epoch=0-step=4.ckpt"  # torch.distributed.checkpoint: shards, .metadata, meta.pt
    fsdp2.mkdir()
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"):
        (fsdp2 / name).write_bytes(b"x")
    deepspeed = folder / "epoch=0-step=6.ckpt"  # DeepSpeed: `latest` and checkpoint/
    (deepspeed / "checkpoint").mkdir(parents=True)
    (deepspeed / "latest").write_text("checkpoint")
    partial = folder / "epoch=0-step=8.ckpt"  # a save cut short before any of its markers
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"x")
    for age, path in ((40, folder / "epoch=0-step=2.ckpt"), (30, fsdp2), (20, deepspeed), (0, partial)):
        _age(path, age)
    assert newest_checkpoint([str(folder)]) == str(deepspeed)
    trainer = L.Trainer(logger=False, callbacks=[ModelCheckpoint(dirpath=folder)],
                        default_root_dir=tmp_path, enable_progress_bar=False)
    assert find_last_checkpoint(trainer) == str(deepspeed)
    _age(fsdp2, -60)  # the FSDP2 folder written last
    assert find_last_checkpoint(trainer) == str(fsdp2)


# ---- checkpoint files that are not Lightning checkpoints ---------------------------------------------------
class Payload:
    """A pickle that would run a shell command when unpickled without ``weights_only``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _foreign_zip(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("notes.txt", "not a checkpoint")


def _state_dict(path: Path) -> None:
    torch.save({"model.embed.weight": torch.zeros(4, 2), "model.norm.weight": torch.ones(2)}, path)


def _pickle(path: Path) -> None:
    torch.save({"state_dict": {}, "payload": Payload(path.with_suffix(".ran"))}, path)


@pytest.mark.parametrize(("make", "says"), [
    (_foreign_zip, "a zip archive not written by torch.save (it holds notes.txt, no data.pkl)"),
    (_state_dict, "a plain state dict (2 entries, 2 tensors, e.g. model.embed.weight, model.norm.weight), "
                  "not a Lightning checkpoint"),
    (_pickle, "it holds a pickled `posix.system`, which torch refuses to load with weights_only=True"),
], ids=["foreign-zip", "state-dict", "pickle"])
def test_checkpoint_that_is_not_a_lightning_checkpoint_is_named_in_the_last_line(tmp_path, planted, make,
                                                                                   says):
    bad = tmp_path / "bad.ckpt"
    make(bad)
    before = tree_hash(planted)
    line = lightning_rl(tmp_path, "--ckpt_path", bad)
    assert f"`--ckpt_path` {bad} is not a valid checkpoint: " in line and says in line, line
    assert tree_hash(planted) == before
    assert not bad.with_suffix(".ran").exists()  # the payload never ran


def test_a_real_checkpoint_passes_the_look_inside(tmp_path):
    from lightning_rl.cli.resume import checkpoint_file_problem

    path = tmp_path / "real.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "pytorch-lightning_version": L.__version__,
                "rng_states": {"torch": torch.get_rng_state()}}, path)
    assert checkpoint_file_problem(str(path)) is None


# ---- a resume with another batch geometry ---------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A 1-step run (batch_size 2, G 2, 1 rank) with its checkpoint, as the earlier run of an experiment."""
    tmp_path = tmp_path_factory.mktemp("geometry")
    main(["fit", "--config", str(CONFIGS / "grpo.yaml"), *TINY, "--trainer.max_steps", "1",
          "--trainer.val_check_interval", "1", "--trainer.limit_val_batches", "1",
          "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")])
    assert list((tmp_path / "runs" / "lightning-rl" / "version_0" / "checkpoints").glob("*.ckpt"))
    return tmp_path


@pytest.mark.slow
def test_resume_with_another_batch_geometry_names_the_keys_and_values(saved_run):
    earlier = saved_run / "runs" / "lightning-rl" / "version_0"
    before = tree_hash(earlier)
    line = lightning_rl(saved_run, "--ckpt_path", "last", "--trainer.max_steps", "2",
                        "--data.init_args.batch_size", "3", "--model.init_args.sampling.num_generations", "4")
    assert "was saved with another batch geometry: `data.batch_size` 2 in the checkpoint, 3 now; " \
           "`model.sampling.num_generations` 2 in the checkpoint, 4 now." in line, line
    assert str(earlier / "checkpoints") in line and "LRL_ALLOW_GEOMETRY_CHANGE=1" in line
    assert tree_hash(earlier) == before


@pytest.mark.slow
def test_resume_with_another_geometry_when_the_user_opts_in(saved_run, monkeypatch):
    monkeypatch.setenv("LRL_ALLOW_GEOMETRY_CHANGE", "1")
    with pytest.warns(UserWarning, match=r"`data.batch_size` 2 in the checkpoint, 3 now. Resuming anyway"):
        main(["fit", "--config", str(CONFIGS / "grpo.yaml"), *TINY, "--data.init_args.batch_size", "3",
              "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0", "--ckpt_path", "last",
              "--trainer.logger.init_args.save_dir", str(saved_run / "runs")])


# ---- a rerun into a fixed version folder that holds an earlier run ---------------------------------------
def test_rerun_into_a_fixed_version_folder_with_an_earlier_run_is_refused(tmp_path):
    earlier = tmp_path / "runs" / "lightning-rl" / "first-try"
    (earlier / "policy").mkdir(parents=True)
    (earlier / "config.yaml").write_text("seed_everything: 0\n")
    (earlier / "policy" / "model.safetensors").write_bytes(b"weights")
    before = tree_hash(earlier)
    line = lightning_rl(tmp_path, "--trainer.logger.init_args.version", "first-try")
    assert f"the run folder {earlier} already holds an earlier run (config.yaml, policy/)" in line, line
    assert "`trainer.logger.init_args.version` 'first-try'" in line and "--ckpt_path" in line
    assert tree_hash(earlier) == before


# ---- a full disk while a checkpoint is written ------------------------------------------------------------
@pytest.mark.slow
def test_full_disk_during_a_checkpoint_save_names_the_file(tmp_path, planted, monkeypatch):
    import lightning.fabric.plugins.io.torch_io as torch_io

    def full_disk(checkpoint, path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch_io, "_atomic_save", full_disk)
    before = tree_hash(planted)
    line = lightning_rl(tmp_path, "--trainer.max_steps", "1", "--trainer.val_check_interval", "1",
                        "--trainer.limit_val_batches", "1")
    target = tmp_path / "runs" / "lightning-rl" / "version_1" / "checkpoints" / "last.ckpt"
    assert f"could not write checkpoint {target}: the disk is full" in line, line
    assert "No space left on device" in line
    assert tree_hash(planted) == before
