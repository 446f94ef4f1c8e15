"""Ctrl-C or SIGTERM: finish the current step, save a checkpoint that resumes exactly, stop."""

from __future__ import annotations

import os
import signal
import socket
import threading
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_rl.callbacks.checkpoints import write_atomically

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class CheckpointOnInterrupt(L.Callback):
    """Turn Ctrl-C (SIGINT) and SIGTERM into a stop at the end of the current training step, with a
    checkpoint saved there (``<checkpoint folder>/interrupted-step=N.ckpt``) and its path printed.

    The checkpoint is taken where Lightning's ``ModelCheckpoint`` takes its step checkpoints, so it resumes
    exactly (``fit --ckpt_path last`` finds it, a file or a sharded folder); an exception in the middle of a
    step would leave some of its optimiser steps done and its data position behind. A signal that arrives
    during a validation inside ``fit`` stops at its end, saved the same way. The process exits with status
    128 + the signal's number (130, 143), like a process the signal killed. A second signal stops the
    process at once, unsaved, with the same status. Nothing is saved when checkpointing is off.

    Every rank stops at the same step: a signal is only recorded, and the ranks agree on it with one
    all-reduce per step (the largest signal number wins). Lightning's own SIGTERM handler is replaced while
    training: it runs a ``broadcast`` inside the handler and re-sends the signal to the ranks it launched,
    so a rank that received SIGTERM twice (from the scheduler and from rank 0) broadcast once more than
    the others, and every rank then waited in mismatched collectives: a hang. Signals are counted by a
    thread reading Python's signal wakeup file descriptor, because Python runs a handler only when the
    main thread is back in the interpreter: a rank waiting inside a collective for a rank that is gone
    would otherwise never see the second signal.
    """

    def __init__(self) -> None:
        self.requested: int | None = None  # the signal received, until handled
        self._previous: dict[int, Any] = {}
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._previous_wakeup = -1
        self._announce = True  # rank zero says what happens; the other ranks stay quiet

    # ---- handlers ----------------------------------------------------------------------------------
    def _install(self, trainer: L.Trainer) -> None:
        """After Lightning registered its own (right before the run stage): ours replace them."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        self._announce = trainer.is_global_zero
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._previous_wakeup = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._wakeup = (reader, writer)
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        threading.Thread(target=self._count_signals, args=(reader,), name="lightning-rl-signals",
                         daemon=True).start()

    def _on_signal(self, signum: int, frame: Any) -> None:
        """Python's handler: present so that the signal reaches the wakeup descriptor; the counting thread
        has already recorded it."""

    def _count_signals(self, reader: socket.socket) -> None:
        """Runs in its own thread: one byte per signal delivered (written by Python's C-level handler, even
        while the main thread waits in C++). The first is recorded for the end of the step; the second
        ends the process."""
        received = 0
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                data = b""
            if not data:
                reader.close()
                return
            for signum in data:
                if signum not in SIGNALS:
                    continue
                received += 1
                if received > 1 or self.requested is not None:
                    os._exit(128 + signum)  # a second signal: stop now, unsaved
                self.requested = signum
                if self._announce:
                    os.write(2, f"\n{signal.Signals(signum).name}: saving a checkpoint at the end of this "
                                "step (send it again to stop now, unsaved)\n".encode())

    def _restore(self) -> None:
        """Put the previous handlers back, unless a signal came: then ours stay until the process exits, so
        that a second signal during the shutdown still stops it at once."""
        if self.requested is not None or not self._previous:
            return
        for signum, handler in self._previous.items():
            if handler is not None and signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, handler)
        self._previous = {}
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            reader, writer = self._wakeup
            writer.close()  # the counting thread reads the end of the stream and returns
            self._wakeup = None

    # ---- hooks -------------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """The checkpoint is written atomically, like ``Checkpoints``' (a second signal during the save
        leaves ``interrupted-step=N.ckpt.partial``, never a truncated ``.ckpt``)."""
        write_atomically(trainer.strategy)

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.requested = None
        self._install(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._previous:
            self.requested = None
        self._install(trainer)
        self._watch_sampler(trainer, pl_module)

    def _watch_sampler(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Let an asynchronous sampler's wait see the request (``AsyncRollouts.watch``): a step that waits for
        a stalled worker must not keep the signal from its checkpoint. In a single process it may stop
        there, with the checkpoint of the step's start; ranks cannot agree in the middle of a step."""
        watch = getattr(getattr(pl_module, "rollouts", None), "watch", None)
        if watch is None:
            return
        stop = (lambda: self._stop_before_step(trainer)) if trainer.world_size == 1 else None
        watch(lambda: self.requested is not None, stop)

    def _stop_before_step(self, trainer: L.Trainer) -> None:
        """Save and stop in the middle of a step that has changed nothing yet (it waited for its rollout):
        the loop's counters are rewound to before its batch (the DataModule counts the steps processed), so a
        resume runs this step again."""
        for progress in (trainer.fit_loop.epoch_loop.batch_progress.total,
                         trainer.fit_loop.epoch_loop.batch_progress.current):
            progress.ready = progress.started = progress.processed
        self._stop_if_requested(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        self._stop_if_requested(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "fit":
            self._stop_if_requested(trainer, save=not trainer.sanity_checking)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, err: BaseException) -> None:
        self._restore()

    # ---- the stop ----------------------------------------------------------------------------------
    def _agreed_signal(self, trainer: L.Trainer) -> int:
        """The largest signal any rank received (0: none); one all-reduce, on every rank."""
        if self.requested is None and trainer.received_sigterm:  # Lightning's handler, before ours was set
            self.requested = signal.SIGTERM
        mine = torch.tensor([self.requested or 0], device=trainer.strategy.root_device)
        return int(trainer.strategy.reduce(mine, reduce_op="max").item())

    def _stop_if_requested(self, trainer: L.Trainer, save: bool = True) -> None:
        signum = self._agreed_signal(trainer)
        if not signum:
            return
        self.requested = signum  # on every rank: a signal from now on stops the process at once
        name = signal.Signals(signum).name
        if trainer.checkpoint_callback is None or not save:
            why = "checkpointing is off" if save else "nothing trained yet"
            rank_zero_info(f"{name}: stopped at step {trainer.global_step} ({why}: not saved)")
        else:
            folder = trainer.checkpoint_callback.dirpath or os.path.join(trainer.default_root_dir,
                                                                         "checkpoints")
            path = os.path.join(folder, f"interrupted-step={trainer.global_step}.ckpt")
            trainer.save_checkpoint(path)
            rank_zero_info(f"{name}: stopped at step {trainer.global_step}; checkpoint saved to {path} "
                           "(resume with `--ckpt_path last`)")
        raise SystemExit(128 + signum)
