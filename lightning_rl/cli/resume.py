"""Resuming a run: the newest readable checkpoint of an experiment (files and sharded folders), a cheap look
inside a checkpoint before Lightning loads it, and the file a failed checkpoint save was writing.

A checkpoint is a file written by ``torch.save`` (single process, DDP, FSDP2 with
``save_distributed_checkpoint: false``) or a folder named like one: FSDP2's distributed checkpoint (one
``*.distcp`` shard per rank, ``.metadata`` and Lightning's ``meta.pt``) and DeepSpeed's (``latest`` and a
``checkpoint/`` folder of per-rank states). ``lightning_rl.callbacks.checkpoints.write_atomically`` writes
them under ``<name>.partial`` and renames them into place; a folder it was swapping when killed is left as
``<name>.previous``, which counts as a checkpoint here while ``<name>`` is missing.
"""

from __future__ import annotations

import errno
import functools
import glob
import os
import pickle
import re
import zipfile
from collections.abc import Callable, Iterable
from typing import Any

# files that make a folder a checkpoint: torch.distributed.checkpoint's (FSDP2) or DeepSpeed's
FOLDER_MARKERS = (".metadata", "meta.pt", "latest", "checkpoint")
LIGHTNING_KEYS = ("state_dict", "pytorch-lightning_version")


def is_checkpoint_folder(path: str) -> bool:
    """Whether ``path`` is a sharded checkpoint folder (FSDP2 distributed or DeepSpeed)."""
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, m)) for m in FOLDER_MARKERS)


def checkpoints_in(folders: Iterable[str]) -> list[str]:
    """Every ``*.ckpt`` in ``folders`` (glob patterns allowed): files, and folders that hold a sharded
    checkpoint (a folder without any of its markers, not a checkpoint at all, is left out); and each
    ``*.ckpt.previous`` whose ``*.ckpt`` is missing (a kill between the two renames of a folder swap)."""
    found = []
    for folder in folders:
        previous = [p for p in glob.glob(os.path.join(folder, "*.ckpt.previous"))
                    if not os.path.lexists(p.removesuffix(".previous"))]
        for path in [*glob.glob(os.path.join(folder, "*.ckpt")), *previous]:
            if os.path.isfile(path) or is_checkpoint_folder(path):
                found.append(path)
    return found


def newest_checkpoint(folders: Iterable[str]) -> str | None:
    """The most recently modified checkpoint in ``folders`` (a folder's own modification time, which its
    last shard written sets), or None."""
    found = checkpoints_in(folders)
    return max(found, key=os.path.getmtime) if found else None


def newest_readable_checkpoint(folders: Iterable[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest checkpoint in ``folders`` that can be resumed (None: none can), and ``(path, why not)`` for
    each newer one that cannot (:func:`checkpoint_problem`), newest first."""
    skipped = []
    for path in sorted(checkpoints_in(folders), key=os.path.getmtime, reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped


def checkpoint_problem(path: str) -> str | None:
    """Why the checkpoint ``path``, a file or a sharded folder, cannot be resumed, or None when it can."""
    return folder_problem(path) if os.path.isdir(path) else checkpoint_file_problem(path)


def folder_problem(path: str) -> str | None:
    """Why the sharded checkpoint folder ``path`` is not whole, or None: DeepSpeed's needs ``latest`` and
    ``checkpoint/``; FSDP2's needs ``.metadata`` (written after every shard) and a readable ``meta.pt``
    (written last). The shards themselves are not read."""
    names = set(os.listdir(path))
    deepspeed = "latest" in names or "checkpoint" in names
    markers = ("latest", "checkpoint") if deepspeed else (".metadata", "meta.pt")
    missing = [m for m in markers if m not in names]
    if missing:
        return f"a sharded checkpoint folder without {' or '.join(missing)} (its save was cut short?)"
    if deepspeed:
        return None
    problem = checkpoint_file_problem(os.path.join(path, "meta.pt"))
    return None if problem is None else f"its meta.pt: {problem}"


def checkpoint_file_problem(path: str) -> str | None:
    """Why the file ``path`` cannot be a Lightning checkpoint, in a few words, or None when it can.

    Cheap: the zip's table of contents, then (only for an archive written by torch) its pickle loaded with
    ``weights_only=True`` and memory-mapped tensors, so no weights are read. Folders are not looked at.
    """
    if os.path.getsize(path) == 0:
        return "the file is empty"
    if not zipfile.is_zipfile(path):
        return "not an archive written by torch.save (truncated or corrupt?)"
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError) as err:
        return f"a damaged zip archive ({err})"
    if not any(n.endswith("/data.pkl") or n == "data.pkl" for n in names):
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        return f"a zip archive not written by torch.save (it holds {shown or 'nothing'}, no data.pkl)"
    import torch

    try:
        content = torch.load(path, weights_only=True, map_location="cpu", mmap=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        what = f"a pickled `{found.group(1)}`" if found else "pickled Python objects"
        return (f"it holds {what}, which torch refuses to load with weights_only=True (a checkpoint holds "
                "tensors and plain values; a file from elsewhere can run code when unpickled)")
    except Exception as err:  # noqa: BLE001 - any reason torch gives, in one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"torch.load cannot read it ({type(err).__name__}: {first})"
    if not isinstance(content, dict):
        return f"it holds a {type(content).__name__}, not a checkpoint dictionary"
    if not any(key in content for key in LIGHTNING_KEYS):
        keys = [str(k) for k in list(content)[:2]]
        tensors = sum(1 for v in content.values() if hasattr(v, "shape"))
        return (f"a plain state dict ({len(content)} entries, {tensors} tensors, e.g. {', '.join(keys)}), "
                "not a Lightning checkpoint (no `state_dict` / `pytorch-lightning_version`): `--ckpt_path` "
                "resumes a run; to start from these weights, save the model with save_pretrained and set "
                "`model.init_args.policy.model` to that folder")
    return None


class CheckpointWriteError(OSError):
    """A checkpoint could not be written: the message names the file (``OSError``'s own often does not)."""


def naming_the_file(save: Callable[..., Any]) -> Callable[..., Any]:
    """``trainer.save_checkpoint`` whose write errors name the checkpoint being written (a full disk,
    ``ENOSPC``, says only "No space left on device")."""

    @functools.wraps(save)
    def save_checkpoint(filepath: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return save(filepath, *args, **kwargs)
        except CheckpointWriteError:
            raise
        except OSError as err:
            code = err.errno
            why = "the disk is full" if code in (errno.ENOSPC, errno.EDQUOT) else (err.strerror or str(err))
            failed = CheckpointWriteError(f"could not write checkpoint {filepath}: {why} "
                                          f"({type(err).__name__}: {err})")
            failed.errno = code
            raise failed from err

    return save_checkpoint


# what an earlier run leaves in its folder: its config and its exports
EARLIER_RUN = ("config.yaml", "policy", "reward_model", "critic")


def earlier_run_in_folder(trainer: Any) -> str | None:
    """A one-line refusal when the first logger's ``version`` is fixed and its run folder already holds an
    earlier run (its ``config.yaml`` or an exported model), which this run would replace; else None.

    Only TensorBoard and CSV loggers with a fixed ``version`` are looked at: without one, every run gets
    a new ``version_N`` folder.
    """
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    logger = trainer.loggers[0] if trainer.loggers else None
    if not isinstance(logger, (TensorBoardLogger, CSVLogger)) or logger._version is None:
        return None
    folder = logger.log_dir
    found = [name + ("/" if os.path.isdir(os.path.join(folder, name)) else "") for name in EARLIER_RUN
             if os.path.exists(os.path.join(folder, name))]
    if not found:
        return None
    return (f"the run folder {folder} already holds an earlier run ({', '.join(found)}) and "
            f"`trainer.logger.init_args.version` {logger._version!r} points this run at it, which would "
            "replace them: set another version (or none, for a new version_N folder), move the earlier "
            "run away, or resume it into this folder with `--ckpt_path`")
