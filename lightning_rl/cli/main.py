"""The ``lightning-rl`` command: LightningCLI over every algorithm and DataModule.

    lightning-rl fit --config configs/grpo.yaml
    lightning-rl fit --config configs/grpo.yaml --trainer.strategy ddp --trainer.devices 2
    lightning-rl fit --config configs/grpo.yaml --ckpt_path last     # resume the newest checkpoint
    lightning-rl fit --config configs/sft.yaml --print_config
    lightning-rl predict --config configs/grpo.yaml --data.init_args.predict_path heldout.jsonl \
        --model.init_args.policy.model runs/lightning-rl/version_0/policy --predictions.num_generations 4

Models and DataModules are chosen by ``class_path`` (subclass mode), YAML is parsed with omegaconf so
``${...}`` interpolation works, each run's full config is saved next to its TensorBoard logs (a new
``version_N`` folder per run, so nothing is overwritten) and logged as its hyperparameters, and TensorBoard
is the default logger. ``--ckpt_path last`` resumes the newest readable checkpoint of the experiment (the
logger's ``save_dir``/``name``, across its version folders; a newer one cut short by a kill is skipped with
a line naming it) into a new version folder. ``predict`` takes its settings
(``--predictions.output``, ``--predictions.num_generations``, ``--predictions.temperature``) from
:class:`~lightning_rl.callbacks.WritePredictions`, which writes ``<log_dir>/predictions.jsonl``.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
import warnings
from typing import Any

import lightning as L
import torch
import yaml
from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities import rank_zero_info

from lightning_rl.algorithms.trained import TrainedModule
from lightning_rl.cli import rank_failures
from lightning_rl.cli.checks import (
    check_checkpoint_file,
    check_peft_installed,
    check_strategy_installed,
    group_nulls,
)
from lightning_rl.cli.config_errors import SummarizingParser, check_class_paths, summarized
from lightning_rl.cli.resume import (
    CheckpointWriteError,
    earlier_run_in_folder,
    naming_the_file,
    newest_readable_checkpoint,
)
from lightning_rl.errors import ConfigError, InputError

DEFAULT_LOGGER = {
    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
    "init_args": {"save_dir": "runs", "name": "lightning-rl"},
}


class SaveRunConfig(SaveConfigCallback):
    """Save the resolved config as ``config.yaml`` in the run folder and log it as the run's hyperparameters.

    Without a logger there is no run folder: the config is not saved (a log line says so) rather than
    written into the working directory, where the next run would trip over it.
    """

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not self.already_saved and self.save_to_log_dir and trainer.logger is None:
            self.save_to_log_dir = False
            rank_zero_info("`trainer.logger` is off, so the run has no folder: its config is not saved "
                           "(`--print_config` prints it)")
        super().setup(trainer, pl_module, stage)

    def save_config(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Rank zero: the config, as written to ``config.yaml``, becomes the loggers' hyperparameters."""
        config = yaml.safe_load(self.parser.dump(self.config, skip_none=False))
        for logger in trainer.loggers:
            logger.log_hyperparams(config)


class LightningRLCLI(LightningCLI):
    """LightningCLI with lightning-rl's defaults.

    Errors raised while building the model, DataModule or trainer come out as :class:`ConfigError` with
    the original message (not jsonargparse's dump of the whole config); so do a ``--ckpt_path`` that is
    not a checkpoint and a ``--ckpt_path last`` with nothing to resume.
    """

    def __init__(self, args: list[str] | None = None, run: bool = True) -> None:
        super().__init__(
            model_class=TrainedModule,
            datamodule_class=LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            parser_kwargs={"parser_mode": "omegaconf"},
            parser_class=SummarizingParser,  # config errors end in one line: what, where, closest valid
            trainer_defaults={"logger": DEFAULT_LOGGER},
            # resumed into a fixed version folder (`--ckpt_path`), a run replaces its config; a rerun
            # without one is refused before it starts (`lightning_rl.cli.resume.earlier_run_in_folder`)
            save_config_callback=SaveRunConfig,
            save_config_kwargs={"overwrite": True},
            args=args,
            run=run,
        )

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> Any:
        """``predict`` also takes ``--predictions.*``: the ``WritePredictions`` callback's arguments
        (LightningCLI adds a callback given as a class group to the trainer's callbacks)."""
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        if subcommand == "predict":
            from lightning_rl.callbacks import WritePredictions

            parser.add_lightning_class_args(WritePredictions, "predictions")
        return parser

    def parse_arguments(self, parser: Any, args: Any) -> None:
        if args is None:  # rewritten in place: LightningCLI warns when given both, and ranks relaunch argv
            sys.argv[1:] = group_nulls(sys.argv[1:])
        else:
            args = group_nulls(args)
        check_peft_installed(sys.argv[1:] if args is None else args)
        with summarized(parser):
            super().parse_arguments(parser, args)
        check_class_paths(parser, self.config)
        # before LightningCLI reads the checkpoint's hyperparameters with torch.load
        if self.config.get("subcommand"):
            check_checkpoint_file(self.config[self.config.subcommand].get("ckpt_path"))

    def instantiate_classes(self) -> None:
        check_strategy_installed(self.config[self.subcommand] if self.subcommand else self.config)
        try:
            super().instantiate_classes()
        except Exception as err:
            origin = unwrap_jsonargparse(err)
            if isinstance(origin, (ValueError, TypeError, OSError, ImportError)):
                raise ConfigError(f"{type(origin).__name__}: {origin}") from origin
            raise origin from None
        if self.subcommand is not None and self.config_init[self.subcommand].get("ckpt_path") == "last":
            path = find_last_checkpoint(self.trainer)
            rank_zero_info(f"`--ckpt_path last`: resuming from {path}")
            self.config_init[self.subcommand]["ckpt_path"] = path
            self.config[self.subcommand]["ckpt_path"] = path  # what config.yaml records
        if self.subcommand is not None:
            rank_failures.active["trainer"] = self.trainer  # `main` stops the ranks it launched on a failure
            resuming = self.config_init[self.subcommand].get("ckpt_path") is not None
            earlier = None if resuming else earlier_run_in_folder(self.trainer)
            if earlier is not None:
                raise ConfigError(earlier)
            # a full disk says "No space left on device" without the file: name the checkpoint
            self.trainer.save_checkpoint = naming_the_file(self.trainer.save_checkpoint)


def unwrap_jsonargparse(err: BaseException) -> BaseException:
    """The error a class raised, out of jsonargparse's "Does not validate against any of the Union subtypes
    ... Given value: Namespace(...)" wrapper: the first in the chain not raised inside jsonargparse."""
    seen: BaseException | None = err
    while seen is not None:
        tb = seen.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is None or f"{os.sep}jsonargparse{os.sep}" not in tb.tb_frame.f_code.co_filename:
            return seen
        seen = seen.__cause__ or seen.__context__
    return err


def checkpoint_folders(trainer: L.Trainer) -> list[str]:
    """Where this experiment's checkpoints live: the folders of ModelCheckpoints given a ``dirpath``, and
    ``<save_dir>/<name>/*/checkpoints`` of the first logger (every version), as Lightning lays them out."""
    folders = [cb.dirpath for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
    if trainer.loggers:
        logger = trainer.loggers[0]
        save_dir = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
        folders.append(os.path.join(save_dir, str(logger.name), "*", "checkpoints"))
    else:
        folders.append(os.path.join(trainer.default_root_dir, "checkpoints"))
    return [str(f) for f in folders]


def find_last_checkpoint(trainer: L.Trainer) -> str:
    """The newest readable ``*.ckpt`` (by modification time) in :func:`checkpoint_folders`: a file, or a
    folder holding a sharded checkpoint (FSDP2's distributed checkpoint, DeepSpeed's). A newer one that cannot
    be read (a save cut short) is skipped with one line naming it; when none can be read, the error names
    each."""
    folders = checkpoint_folders(trainer)
    found, skipped = newest_readable_checkpoint(folders)
    for path, problem in skipped:
        rank_zero_info(f"`--ckpt_path last`: skipping {path}: {problem}")
    if found is None and skipped:
        unreadable = "; ".join(f"{path} ({problem})" for path, problem in skipped)
        where = " or ".join(folders)
        raise ConfigError(f"`--ckpt_path last`: no readable checkpoint in {where}: {unreadable}")
    if found is None:
        raise ConfigError(f"`--ckpt_path last`: no checkpoint to resume in {' or '.join(folders)}")
    return found


class DropLightningTips(logging.Filter):
    """Drops Lightning's "💡 Tip: ... try installing litlogger / litmodels" lines (advertising, printed
    because every run has a logger and a checkpoint callback); Lightning's other lines pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


def quiet_startup() -> None:
    """Silence what startup printed that is neither ours nor actionable: Lightning's tips, and the
    deprecation torch 2.13 raises inside Lightning's own pytree code (``LeafSpec``) on every step.
    Real warnings (a config, data or version problem) still print."""
    for handler in logging.getLogger("lightning.pytorch").handlers:
        if not any(isinstance(f, DropLightningTips) for f in handler.filters):
            handler.addFilter(DropLightningTips())
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


def main(args: list[str] | None = None) -> None:
    """Console entry point. ``LRL_NUM_THREADS`` sets torch's CPU threads (1 is often fastest for tiny
    models)."""
    quiet_startup()
    threads = os.environ.get("LRL_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    reports = rank_failures.RankReports()
    try:
        LightningRLCLI(args=args)  # None: LightningCLI reads sys.argv itself
    except (ConfigError, InputError, CheckpointWriteError) as err:  # InputError: the data or model
        reports.write(str(err))
        stop_launched_ranks(reports, grace_s=2.0)
        sys.exit(f"lightning-rl: error: {err}")
    except Exception as err:
        # a rank whose collective failed because another rank is gone ends with that rank's reason
        peer = reports.peer_reason(wait_s=10.0) if rank_failures.lost_a_peer(err) else None
        if peer is None:
            reports.write(rank_failures.one_line(err))
        stop_launched_ranks(reports, grace_s=2.0 if peer is None else 15.0)
        if peer is None:
            raise
        traceback.print_exc()
        sys.exit(f"lightning-rl: error: rank {peer[0]} failed: {peer[1]}")
    finally:
        rank_failures.active.pop("trainer", None)
        reports.close()


def stop_launched_ranks(reports: rank_failures.RankReports, grace_s: float) -> None:
    """In the process that launched the other ranks: they stop (and print) first, so that its own
    message is the last line of the run's output."""
    trainer = rank_failures.active.get("trainer")
    if reports.owner and trainer is not None and trainer.world_size > 1:
        rank_failures.stop_other_ranks(trainer, grace_s)


if __name__ == "__main__":
    main()
