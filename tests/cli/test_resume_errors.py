"""Resuming, single process and fast: `--ckpt_path last` finds sharded checkpoint folders and skips, naming
it, a checkpoint a kill cut short; checkpoint files that are not Lightning checkpoints, only unreadable ones
for `last`, a resume with another batch geometry, LoRA and full-model checkpoints crossed, a rerun into a
folder that holds an earlier run and a full disk each end in one `lightning-rl: error:` line naming the file
or key, with an earlier run folder left byte for byte as it was.

The error paths fail at setup (or at the first save), so they build nothing heavy.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import zipfile
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import CONFIGS, run_cli
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


def lightning_rl(tmp_path: Path, *args: str, config: str = "grpo.yaml") -> str:
    """``lightning-rl fit --config configs/<config> <args>`` in this process, expected to fail: its last
    line of output (what ``sys.exit`` prints)."""
    with pytest.raises(SystemExit) as stopped:
        main(["fit", "--config", str(CONFIGS / config), *TINY,
              "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), *map(str, args)])
    message = stopped.value.code
    assert isinstance(message, str) and message.startswith("lightning-rl: error: "), message
    assert "\n" not in message, message
    return message


# ---- `--ckpt_path last` finds files and sharded folders ---------------------------------------------------
def _age(path: Path, seconds_ago: float) -> None:
    when = os.path.getmtime(path) - seconds_ago if path.exists() else 0
    os.utime(path, (when, when))


def _lightning_checkpoint(path: Path, step: int = 1) -> None:
    """A small file shaped like a Lightning checkpoint (what the look inside checks)."""
    torch.save({"state_dict": {"w": torch.zeros(2)}, "pytorch-lightning_version": L.__version__,
                "global_step": step}, path)


def test_last_finds_sharded_checkpoint_folders_as_well_as_files(tmp_path, caplog):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    _lightning_checkpoint(folder / "epoch=0-step=2.ckpt")
    fsdp2 = folder / "epoch=0-step=4.ckpt"  # torch.distributed.checkpoint: shards, .metadata, meta.pt
    fsdp2.mkdir()
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata"):
        (fsdp2 / name).write_bytes(b"x")
    _lightning_checkpoint(fsdp2 / "meta.pt", step=4)
    deepspeed = folder / "epoch=0-step=6.ckpt"  # DeepSpeed: `latest` and checkpoint/
    (deepspeed / "checkpoint").mkdir(parents=True)
    (deepspeed / "latest").write_text("checkpoint")
    partial = folder / "epoch=0-step=8.ckpt"  # a save cut short before any of its markers: not a checkpoint
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"x")
    cut = folder / "epoch=0-step=10.ckpt"  # a save cut short after .metadata, before meta.pt
    cut.mkdir()
    for name in ("__0_0.distcp", ".metadata"):
        (cut / name).write_bytes(b"x")
    ages = ((40, folder / "epoch=0-step=2.ckpt"), (30, fsdp2), (20, deepspeed), (0, partial), (0, cut))
    for age, path in ages:
        _age(path, age)
    assert newest_checkpoint([str(folder)]) == str(cut)
    trainer = L.Trainer(logger=False, callbacks=[ModelCheckpoint(dirpath=folder)],
                        default_root_dir=tmp_path, enable_progress_bar=False)
    with caplog.at_level("INFO"):
        assert find_last_checkpoint(trainer) == str(deepspeed)
    assert f"`--ckpt_path last`: skipping {cut}: a sharded checkpoint folder without meta.pt" in caplog.text
    _age(fsdp2, -60)  # the FSDP2 folder written last
    assert find_last_checkpoint(trainer) == str(fsdp2)


# ---- `--ckpt_path last` skips a checkpoint a kill cut short ----------------------------------------------
def _truncated(path: Path, step: int) -> None:
    """A Lightning checkpoint whose write was cut halfway (a kill while it was copied into place)."""
    _lightning_checkpoint(path, step)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_last_skips_a_truncated_newest_checkpoint_naming_it(tmp_path, caplog):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    good, cut = folder / "interrupted-step=3.ckpt", folder / "last.ckpt"
    _lightning_checkpoint(good, step=3)
    _truncated(cut, step=5)
    _age(good, 30)
    trainer = L.Trainer(logger=False, callbacks=[ModelCheckpoint(dirpath=folder)],
                        default_root_dir=tmp_path, enable_progress_bar=False)
    with caplog.at_level("INFO"):
        assert find_last_checkpoint(trainer) == str(good)
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert skipped == [f"`--ckpt_path last`: skipping {cut}: not an archive written by torch.save "
                       "(truncated or corrupt?)"]


@pytest.mark.slow
def test_last_with_only_a_truncated_checkpoint_names_it_in_the_last_line(tmp_path):
    folder = tmp_path / "runs" / "lightning-rl" / "version_0" / "checkpoints"
    folder.mkdir(parents=True)
    _truncated(folder / "last.ckpt", step=5)
    line = lightning_rl(tmp_path, "--ckpt_path", "last")
    assert "`--ckpt_path last`: no readable checkpoint in " in line, line
    assert f"{folder / 'last.ckpt'} (not an archive written by torch.save (truncated or corrupt?))" in line


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


# ---- `--ckpt_path last` past a truncated checkpoint, and LoRA / full-model checkpoints crossed -------------
@pytest.mark.slow
def test_last_resumes_the_newest_readable_checkpoint_past_a_truncated_one(saved_run, tmp_path, caplog):
    runs = tmp_path / "runs"
    shutil.copytree(saved_run / "runs", runs)
    good = runs / "lightning-rl" / "version_0" / "checkpoints" / "last.ckpt"
    cut = runs / "lightning-rl" / "version_1" / "checkpoints" / "last.ckpt"  # a later run killed mid-save
    cut.parent.mkdir(parents=True)
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    _age(good, 60)
    with caplog.at_level("INFO"):  # max_steps 1: the good checkpoint's step, so it loads and trains no more
        cli = run_cli("fit", "--config", CONFIGS / "grpo.yaml", *TINY, "--trainer.max_steps", "1",
                      "--trainer.limit_val_batches", "0", "--ckpt_path", "last",
                      "--trainer.logger.init_args.save_dir", runs)
    said = [r.getMessage() for r in caplog.records if "--ckpt_path last" in r.getMessage()]
    assert said == [f"`--ckpt_path last`: skipping {cut}: not an archive written by torch.save (truncated or "
                    "corrupt?)", f"`--ckpt_path last`: resuming from {good}"]
    assert cli.trainer.ckpt_path == str(good) and cli.trainer.global_step == 1
    assert not list((runs / "lightning-rl" / "version_2").rglob("*.ckpt"))  # no step trained


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """A 1-step run of configs/grpo_lora.yaml (LoRA adapters) with its checkpoint."""
    tmp_path = tmp_path_factory.mktemp("lora")
    main(["fit", "--config", str(CONFIGS / "grpo_lora.yaml"), *TINY, "--trainer.max_steps", "1",
          "--trainer.limit_val_batches", "0", "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")])
    return tmp_path


@pytest.mark.slow
def test_a_lora_checkpoint_into_a_full_model_config_names_model_policy_peft(lora_run):
    line = lightning_rl(lora_run, "--ckpt_path", "last", "--trainer.max_steps", "2")
    saved = lora_run / "runs" / "lightning-rl" / "version_0" / "checkpoints" / "last.ckpt"
    assert f"the checkpoint {saved} holds PEFT (LoRA) adapters, saved by a run with `model.policy.peft`, " \
           "but this config has no `model.policy.peft`" in line, line


@pytest.mark.slow
def test_a_full_model_checkpoint_into_a_lora_config_names_model_policy_peft(saved_run):
    line = lightning_rl(saved_run, "--ckpt_path", "last", "--trainer.max_steps", "2", config="grpo_lora.yaml")
    saved = saved_run / "runs" / "lightning-rl" / "version_0" / "checkpoints" / "last.ckpt"
    assert f"the checkpoint {saved} holds a full model's weights, saved by a run without " \
           "`model.policy.peft`, but this config sets `model.policy.peft`" in line, line


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
