"""The default checkpoint policy (``lightning_rl.callbacks.Checkpoints``): one ``last.ckpt`` rewritten on a
step schedule and at the end, ``best.ckpt`` on request (its ``monitor`` checked before the first step), the
user's own checkpoint callback left alone, and writes that a kill cannot leave half done."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import datamodule, make
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_rl.algorithms.input_checks import InputError
from lightning_rl.callbacks import Checkpoints
from lightning_rl.callbacks.checkpoints import write_atomically
from lightning_rl.cli.resume import newest_checkpoint, newest_readable_checkpoint

pytestmark = pytest.mark.usefixtures("seeded_one_thread")


class Recording(Checkpoints):
    """Checkpoints that also records each write as ``(file name, global step)``."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.writes: list[tuple[str, int]] = []

    def _save_checkpoint(self, trainer, filepath):
        super()._save_checkpoint(trainer, filepath)
        self.writes.append((filepath.rsplit("/", 1)[-1], trainer.global_step))


class Scripted(L.LightningModule):
    """A linear model whose validations log ``val/accuracy`` from a script; ``steps_per_batch`` optimiser
    steps per training batch (manual optimisation, like the RL step's several minibatches)."""

    def __init__(self, accuracies: list[float], steps_per_batch: int = 1) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layer = nn.Linear(2, 1)
        self.accuracies = list(accuracies)
        self.steps_per_batch = steps_per_batch

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        for _ in range(self.steps_per_batch):
            opt.zero_grad()
            self.manual_backward(self.layer(batch).pow(2).mean())
            opt.step()

    def validation_step(self, batch, batch_idx):
        sanity = self.trainer.sanity_checking  # the sanity pass logs without using up the script
        self.log("val/accuracy", self.accuracies[0] if sanity else self.accuracies.pop(0))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(64, 2), batch_size=1)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(1, 2), batch_size=1)


def fit_scripted(tmp_path, callback, accuracies, max_steps, val_every, steps_per_batch=1):
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, callbacks=[callback],
                        val_check_interval=val_every, check_val_every_n_epoch=None, num_sanity_val_steps=0,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(Scripted(accuracies, steps_per_batch))
    return trainer


def saved_step(path) -> int:
    return torch.load(path, weights_only=False)["global_step"]


def test_last_on_the_schedule_and_at_the_end_best_only_when_it_improves(tmp_path):
    callback = Recording(every_n_steps=3, keep_best=True, dirpath=str(tmp_path / "ckpt"))
    fit_scripted(tmp_path, callback, accuracies=[0.2, 0.6, 0.4], max_steps=7, val_every=2)
    # validations at steps 2 / 4 / 6 score 0.2 / 0.6 / 0.4: best written at 2 and 4, never at 6;
    # last.ckpt at 3 and 6 (the schedule) and 7 (the end)
    assert callback.writes == [("best.ckpt", 2), ("last.ckpt", 3), ("best.ckpt", 4), ("last.ckpt", 6),
                               ("last.ckpt", 7)]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["best.ckpt", "last.ckpt"]
    assert saved_step(tmp_path / "ckpt" / "best.ckpt") == 4
    assert saved_step(tmp_path / "ckpt" / "last.ckpt") == 7


def test_the_schedule_counts_optimiser_steps_passed_not_hit(tmp_path):
    # 2 optimiser steps per batch: steps 2, 4, 6, 8; every 3 steps passes a multiple of 3 at 4 and 6
    callback = Recording(every_n_steps=3, dirpath=str(tmp_path / "ckpt"))
    fit_scripted(tmp_path, callback, accuracies=[], max_steps=8, val_every=100, steps_per_batch=2)
    assert callback.writes == [("last.ckpt", 4), ("last.ckpt", 6), ("last.ckpt", 8)]
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["last.ckpt"]


def test_a_misspelt_keep_best_monitor_fails_before_the_first_training_step(tmp_path):
    # num_sanity_val_steps 0: the check validates one batch before training all the same
    callback = Checkpoints(keep_best=True, monitor="val/acuracy", dirpath=str(tmp_path / "ckpt"))
    trainer = L.Trainer(accelerator="cpu", max_steps=4, logger=False, callbacks=[callback],
                        val_check_interval=2, check_val_every_n_epoch=None, num_sanity_val_steps=0,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    with pytest.raises(InputError, match=r"`monitor` 'val/acuracy' is not logged by validation \(checked "
                                         r"before the first training step\); it logs \['val/accuracy'\] "
                                         r"\(did you mean 'val/accuracy'\?\)"):
        trainer.fit(Scripted([0.5, 0.6]))
    assert trainer.global_step == 0 and trainer.fit_loop.epoch_loop.batch_progress.total.started == 0
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(ValueError, match="every_n_steps"):
        Checkpoints(every_n_steps=0)


def rl_fit(tmp_path, max_steps=3, **trainer_kw):
    """A tiny GRPO run with validation after every step; returns the trainer and the paths it saved."""
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, limit_val_batches=1,
                        val_check_interval=1, check_val_every_n_epoch=None, num_sanity_val_steps=0,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                        **trainer_kw)
    writes: list[str] = []
    save = trainer.save_checkpoint

    def recording(path, *args, **kw):
        writes.append(str(path).rsplit("/", 1)[-1])
        return save(path, *args, **kw)

    trainer.save_checkpoint = recording
    trainer.fit(make(), datamodule=datamodule(max_val_rows=4))
    return trainer, writes


@pytest.mark.slow
def test_a_run_without_a_checkpoint_callback_keeps_one_last_checkpoint(tmp_path):
    # Lightning's stock ModelCheckpoint wrote a full checkpoint after each of the 3 validations
    trainer, writes = rl_fit(tmp_path)
    assert [type(cb) for cb in trainer.checkpoint_callbacks] == [Checkpoints]
    assert writes == ["last.ckpt"]
    folder = tmp_path / "checkpoints"
    assert [p.name for p in folder.iterdir()] == ["last.ckpt"]
    assert saved_step(folder / "last.ckpt") == 3


@pytest.mark.slow
def test_a_configured_checkpoint_callback_and_checkpointing_off_are_left_alone(tmp_path):
    own = ModelCheckpoint(dirpath=str(tmp_path / "own"), every_n_train_steps=1, save_top_k=-1)
    trainer, writes = rl_fit(tmp_path, max_steps=2, callbacks=[own])
    assert trainer.checkpoint_callbacks == [own]
    assert sorted(p.name for p in (tmp_path / "own").iterdir()) == ["epoch=0-step=1.ckpt",
                                                                   "epoch=0-step=2.ckpt"]
    trainer, writes = rl_fit(tmp_path / "off", max_steps=1, enable_checkpointing=False)
    assert trainer.checkpoint_callbacks == [] and writes == []


def test_a_run_ending_by_max_epochs_writes_last_at_its_last_epoch(tmp_path):
    callback = Recording(every_n_steps=5, dirpath=str(tmp_path / "ckpt"))
    trainer = L.Trainer(accelerator="cpu", max_epochs=2, limit_train_batches=3, logger=False,
                        callbacks=[callback], limit_val_batches=0, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(Scripted([]))
    assert callback.writes == [("last.ckpt", 5), ("last.ckpt", 6)]


# ---- a kill while a checkpoint is replaced ---------------------------------------------------------------
class Killed(BaseException):
    """What SIGKILL is to the process writing a checkpoint: nothing after it runs (not an ``Exception``, so
    no handler saves anything)."""


def move_across_filesystems(killed_at: int, moves: list[str]):
    """``shutil.move`` as it is when the temporary folder (where fsspec writes a checkpoint before moving
    it into place) is on another filesystem than the run: a copy into the destination, then the source
    removed. The ``killed_at``-th move is killed halfway through its copy."""

    def move(src: str, dst: str) -> str:
        moves.append(dst)
        data = Path(src).read_bytes()
        with open(dst, "wb") as f:
            if len(moves) == killed_at:
                f.write(data[: len(data) // 2])
                raise Killed
            f.write(data)
        os.unlink(src)
        return dst

    return move


def test_a_kill_while_last_ckpt_is_replaced_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    moves: list[str] = []
    monkeypatch.setattr(shutil, "move", move_across_filesystems(killed_at=3, moves=moves))
    folder = tmp_path / "ckpt"
    with pytest.raises(Killed):
        fit_scripted(tmp_path, Checkpoints(every_n_steps=1, dirpath=str(folder)), accuracies=[], max_steps=5,
                     val_every=100)
    assert len(moves) == 3  # last.ckpt written at steps 1 and 2, the kill while step 3's was written
    assert saved_step(folder / "last.ckpt") == 2  # the previous checkpoint, whole
    assert newest_checkpoint([str(folder)]) == str(folder / "last.ckpt")


class ShardedSaves:
    """A strategy whose checkpoint is a folder, as FSDP2's is (one process here): two shards, then
    ``.metadata`` and ``meta.pt``; a save is killed before shard ``kill_at`` when it is set."""

    is_global_zero = True
    kill_at: int | None = None

    def barrier(self, name=None) -> None:
        pass

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        os.makedirs(filepath, exist_ok=True)
        for rank in range(2):
            if rank == self.kill_at:
                raise Killed
            Path(filepath, f"__{rank}_0.distcp").write_text(str(checkpoint["global_step"]))
        Path(filepath, ".metadata").write_text("index")
        torch.save({"global_step": checkpoint["global_step"], "pytorch-lightning_version": L.__version__},
                   os.path.join(filepath, "meta.pt"))


def test_a_sharded_checkpoint_folder_is_swapped_in_whole(tmp_path):
    strategy, last = ShardedSaves(), tmp_path / "last.ckpt"
    write_atomically(strategy)
    wrapped = strategy.save_checkpoint
    write_atomically(strategy)  # idempotent
    assert strategy.save_checkpoint is wrapped
    for step in (1, 2):
        strategy.save_checkpoint({"global_step": step}, str(last))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert (last / "__1_0.distcp").read_text() == "2"
    strategy.kill_at = 1  # killed after the first shard of step 3
    with pytest.raises(Killed):
        strategy.save_checkpoint({"global_step": 3}, str(last))
    assert [(last / f"__{r}_0.distcp").read_text() for r in (0, 1)] == ["2", "2"]
    assert newest_readable_checkpoint([str(tmp_path)]) == (str(last), [])
    os.replace(last, tmp_path / "last.ckpt.previous")  # a kill between the swap's two renames
    assert newest_readable_checkpoint([str(tmp_path)]) == (str(tmp_path / "last.ckpt.previous"), [])
