"""Rows of a data source: loading a table (a file, a ``save_to_disk`` folder or a hub dataset) as dict rows,
naming a row in messages by its file line, and checking that the rows hold usable prompts and columns.

The prompt and preference DataModules load through :func:`load_rows` and check with :func:`check_rows`;
these names are also importable from :mod:`lightning_rl.data.prompts`, where they lived first.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_rl.errors import InputError
from lightning_rl.models.loading import hub_error, hub_unreachable, looks_local

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def load_rows(
    path: str,
    split: str = "train",
    name: str | None = None,
    require_split: bool = False,
    key: str = "data.path",
) -> list[dict[str, Any]]:
    """Load a table as a list of dict rows.

    ``path`` is a JSONL / JSON / CSV / Parquet file, a folder written by ``datasets.save_to_disk``, a
    local folder of data files, or a dataset name on the Hugging Face hub (loaded with
    ``datasets.load_dataset``). A single file or a single saved ``Dataset`` has no splits: it is returned
    whole, unless ``require_split`` (then a ``ValueError``, so a held-out split is never silently the
    training data). CSV cells are read as strings (an answer ``01358`` stays ``01358``); an empty file
    gives no rows.

    Raises:
        FileNotFoundError: ``path`` is plainly a local path (``lightning_rl.models.loading.looks_local``) and
            does not exist; the message names ``key``.
        ConnectionError: ``path`` is a hub name and the hub cannot be reached (one short try).
        ValueError: an unreadable file, naming it (and the 1-based line, for JSON / JSONL).
    """
    import datasets
    import huggingface_hub

    local = Path(path).expanduser()
    if looks_local(path) and not local.exists():
        raise FileNotFoundError(f"`{key}`: data file not found: {path}")
    if local.is_dir() and any(
        (local / f).exists() for f in ("dataset_info.json", "dataset_dict.json", "state.json")
    ):
        ds = datasets.load_from_disk(str(local))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"split `{split}` not in the saved dataset at {path}; it has {sorted(ds)}")
            return ds[split].to_list()
        if require_split:
            raise ValueError(f"{path} is a single dataset with no split {split!r}")
        return ds.to_list()
    if local.suffix in FILE_BUILDERS:
        if require_split:
            raise ValueError(f"{path} is a single file with no split {split!r}")
        return _load_file(local, key)
    if local.exists():  # a folder of data files
        return datasets.load_dataset(str(local), name, split=split).to_list()
    reason = None if huggingface_hub.constants.HF_HUB_OFFLINE else hub_unreachable()  # offline: the cache
    if reason is not None:
        hint = "a local JSONL / CSV / Parquet file or save_to_disk folder (HF_HUB_OFFLINE=1 reads the cache)"
        raise ConnectionError(hub_error(path, key, reason, hint))
    return datasets.load_dataset(path, name, split=split).to_list()


def _load_file(local: Path, key: str) -> list[dict[str, Any]]:
    import datasets

    if not local.exists():
        raise FileNotFoundError(f"`{key}`: data file not found: {local}")
    if local.stat().st_size == 0:
        return []
    kwargs: dict[str, Any] = {}
    if local.suffix == ".csv":
        with local.open(newline="") as f:
            header = next(csv.reader(f), [])
        kwargs = {
            "features": datasets.Features({c: datasets.Value("string") for c in header}),
            "keep_default_na": False,
        }
    try:
        return datasets.load_dataset(
            FILE_BUILDERS[local.suffix], data_files=str(local), split="train", **kwargs
        ).to_list()
    except (ValueError, datasets.exceptions.DatasetGenerationError) as err:
        cause = err.__cause__ or err  # DatasetGenerationError only says "an error occurred"
        if "corresponds to no data" in str(err):  # header-only CSV, blank JSONL, 0-row Parquet
            return []
        where = _json_error(local) if FILE_BUILDERS[local.suffix] == "json" else None
        if where is not None:  # our message is complete: no chained traceback from the builder
            raise InputError(f"`{key}`: cannot read {local}: {where}") from None
        raise InputError(f"`{key}`: cannot read {local}: {type(cause).__name__}: {cause}") from err


def _json_error(local: Path) -> str | None:
    """``"line N: why"`` for the first line of a JSON / JSONL file that is not one JSON object (1-based),
    or for a JSON array's syntax error; ``None`` if the file parses."""
    if _is_json_array(local):
        try:
            json.loads(local.read_bytes())
        except ValueError as err:
            return _decode_error(err, getattr(err, "lineno", 1))
        return None
    with local.open("rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as err:
                return _decode_error(err, n)
            if not isinstance(value, dict):
                return f"line {n}: expected one JSON object per line, got a {type(value).__name__}"
    return None


def _decode_error(err: ValueError, line: int) -> str:
    if isinstance(err, json.JSONDecodeError):
        return f"line {line}: {err.msg} (column {err.colno})"
    return f"line {line}: {err}"  # e.g. bytes that are not UTF-8


def row_locator(path: str | None) -> Callable[[int], str]:
    """How messages name row ``i`` of ``path``: ``line N`` (the 1-based line in the file) for JSONL /
    JSON-lines and CSV files, else ``row index i`` (0-based, as in ``dataset[i]``)."""
    local = Path(path).expanduser() if path else None
    if local is None or not local.is_file() or local.suffix not in (".jsonl", ".json", ".csv"):
        return lambda i: f"row index {i}"

    def locate(i: int) -> str:
        lines = _record_lines(local)  # read only when an error is being reported
        return f"line {lines[i]}" if i < len(lines) else f"row index {i}"

    return locate


def _record_lines(local: Path) -> list[int]:
    """The 1-based line where each record of a CSV (after its header) or JSON-lines file starts;
    blank lines hold no record. Empty for a JSON array."""
    if local.suffix == ".csv":
        with local.open(newline="") as f:
            reader, starts, previous = csv.reader(f), [], 0
            for record in reader:
                if record:
                    starts.append(previous + 1)
                previous = reader.line_num
        return starts[1:]
    if _is_json_array(local):
        return []
    with local.open("rb") as f:
        return [n for n, line in enumerate(f, 1) if line.strip()]


def _is_json_array(local: Path) -> bool:
    with local.open("rb") as f:
        return f.read(4096).lstrip().startswith(b"[")


def check_rows(
    rows: list[dict[str, Any]],
    columns: dict[str, str | None],
    source: str,
    locate: Callable[[int], str] | None = None,
) -> None:
    """Raise an ``InputError`` (a ``ValueError``) naming the source, key, column and row for unusable data:
    no rows, a missing column, an empty value, or a prompt (a ``*prompt_column`` key) that is neither a
    string nor a list of chat messages.

    Args:
        rows: the loaded rows.
        columns: ``{config key: column name}``; a ``None`` column is not required.
        source: where the rows came from, for the message.
        locate: names row ``i`` in messages (:func:`row_locator`); default ``row index i``.
    """
    locate = locate or (lambda i: f"row index {i}")
    if not rows:
        raise InputError(f"dataset {source} is empty")
    for key, column in columns.items():
        if column is None:
            continue
        if column not in rows[0]:
            raise InputError(f"`{key}`: column `{column}` not in dataset {source}; it has {sorted(rows[0])}")
        for i, row in enumerate(rows):
            value = row.get(column)
            if value is None or (isinstance(value, (str, list)) and len(value) == 0):
                raise InputError(f"dataset {source}, {locate(i)}: column `{column}` ({key}) is empty")
            if key.endswith("prompt_column") and not is_prompt(value):
                quote = f" (quote it: \"{value}\")" if isinstance(value, (int, float, bool)) else ""
                raise InputError(
                    f"dataset {source}, {locate(i)}: column `{column}` ({key}) holds the "
                    f"{type(value).__name__} {repr(value)[:60]}, not a prompt: write a string{quote} or a "
                    'list of {"role": ..., "content": ...} messages'
                )


def is_prompt(value: Any) -> bool:
    """Whether ``value`` is a prompt: a string, or a list of chat messages (dicts with ``role`` and
    ``content``)."""
    if isinstance(value, str):
        return True
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value
    )
