"""PreferenceDataModule: (prompt, chosen, rejected) pairs for DPO and reward-model training.

Rows stay raw (dicts of strings or chat messages) like ``PromptDataModule``'s: the LightningModule owns
the tokenizer and calls :func:`~lightning_rl.text.pairs.encode_pairs`. The tokenisation lives in the core
module ``lightning_rl.text.pairs`` (``EncodedPairs``, ``encode_pairs`` and ``render_pair`` stay importable
from
here). Training batches come from the same endless, seeded ``PromptStream`` whose position is saved in the
checkpoint, so a resumed run sees exactly the pairs an uninterrupted run would.

Accepted row forms (TRL's): plain text (``prompt``, ``chosen``, ``rejected`` strings); conversational,
with ``prompt`` a list of ``{"role", "content"}`` messages and ``chosen`` / ``rejected`` lists holding
the assistant turn; and conversational with an implicit prompt (no prompt column: ``chosen`` and
``rejected`` are whole conversations and their shared leading messages are the prompt).

The built-in pairs (``path: null``) come from the sort task: chosen is the correct answer, rejected a
wrong answer sampled from the warm-started ``builtin:tiny-sort`` model. They are shipped in
``files/`` and regenerated with ``python -m lightning_rl.data.preference --make-sort-pairs DIR``.
"""

from __future__ import annotations

import argparse
import json
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_rl.data.prompts import RowsDataModule
from lightning_rl.data.rows import check_rows, load_rows, row_locator
from lightning_rl.data.sort_task import SortTask
from lightning_rl.text.pairs import EncodedPairs, encode_pairs, render_pair

FILES = Path(__file__).resolve().parent / "files"
BUILTIN_TRAIN = FILES / "sort_pairs_train.jsonl"
BUILTIN_VAL = FILES / "sort_pairs_val.jsonl"

__all__ = [
    "BUILTIN_TRAIN", "BUILTIN_VAL", "EncodedPairs", "PreferenceDataModule", "encode_pairs", "make_sort_pairs",
    "render_pair", "sort_pairs", "split_implicit_prompt",
]


# ------------------------------------------------------------------------------------------------- rows
def split_implicit_prompt(chosen: list[Any], rejected: list[Any]) -> tuple[list[Any], list[Any], list[Any]]:
    """TRL's implicit prompt: the leading messages shared by both conversations are the prompt.

    Returns:
        ``(prompt, chosen_rest, rejected_rest)``; the prompt is empty if the first messages differ.
    """
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    return list(chosen[:n]), list(chosen[n:]), list(rejected[n:])


def _check_messages(value: Any, where: str) -> None:
    if isinstance(value, str):
        return
    if not isinstance(value, list):  # e.g. CSV type inference turned "01358" into the int 1358
        raise ValueError(
            f"{where} must be a string or a list of messages, got {type(value).__name__} {value!r}"
        )
    for m in value:
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
            raise ValueError(
                f"{where} must be a string or a list of {{'role', 'content'}} messages, got {m!r}"
            )


class PreferenceDataModule(RowsDataModule):
    """Preference pairs for DPO: the built-in sort pairs by default, or your own data.

    Args:
        path: a JSONL / JSON / CSV / Parquet file, a ``save_to_disk`` folder or a hub dataset name;
            ``None`` uses the built-in sort-task pairs (held-out pairs use held-out sort prompts only).
        val_path: held-out pairs in the same forms; ``None`` takes ``val_split`` of ``path`` if it
            exists, else no validation.
        split: split of ``path`` to train on.
        val_split: split of ``path`` (or ``val_path``) to validate on.
        name: dataset config name for hub datasets.
        prompt_column: column holding the prompt (text or chat messages). If the data has no such
            column and the completions are conversations, their shared leading messages are the prompt.
        chosen_column: column holding the preferred completion (text or the assistant message list).
        rejected_column: column holding the dispreferred completion.
        answer_column: column with a verifiable reference answer; where the data has it, validation
            also reports greedy ``val/accuracy``. Ignored when absent.
        batch_size: pairs per training step on each rank.
        val_batch_size: pairs per validation batch.
        max_val_rows: validate on at most this many held-out pairs (``None``: all).
        val_fraction: hold out this fraction of the training pairs (0 < f < 1) for validation, chosen
            with ``seed``, instead of ``val_split``; the counts are logged. Not with ``val_path``.
        skip_identical: drop pairs whose chosen and rejected completions are identical (one warning names
            how many and the first one's line; refused only when no pair is left); ``false``: stop at the
            first one.
        seed: seed of the training order (and of the ``val_fraction`` split).
        shuffle: shuffle the training pairs each epoch.
    """

    def __init__(
        self,
        path: str | None = None,
        val_path: str | None = None,
        split: str = "train",
        val_split: str = "test",
        name: str | None = None,
        prompt_column: str = "prompt",
        chosen_column: str = "chosen",
        rejected_column: str = "rejected",
        answer_column: str | None = "answer",
        batch_size: int = 8,
        val_batch_size: int = 64,
        max_val_rows: int | None = None,
        val_fraction: float = 0.0,
        skip_identical: bool = True,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        if batch_size < 1 or val_batch_size < 1:
            raise ValueError(
                "`data.batch_size` and `data.val_batch_size` must be >= 1, "
                f"got {batch_size}, {val_batch_size}"
            )
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"`data.val_fraction` must be in [0, 1), got {val_fraction}")
        if val_fraction > 0 and (val_path is not None or path is None):
            raise ValueError(
                "`data.val_fraction` splits validation pairs off `data.path`: it needs `data.path` and "
                "cannot be combined with `data.val_path`"
            )
        self.path, self.val_path, self.split, self.val_split, self.name = (
            path, val_path, split, val_split, name
        )
        self.prompt_column, self.chosen_column, self.rejected_column = (
            prompt_column, chosen_column, rejected_column
        )
        self.answer_column = answer_column
        self.batch_size, self.val_batch_size, self.max_val_rows = batch_size, val_batch_size, max_val_rows
        self.val_fraction, self.skip_identical = val_fraction, skip_identical
        self.seed, self.shuffle = seed, shuffle
        self.skipped_identical = {"train": 0, "val": 0}  # pairs dropped by `skip_identical`

    def setup(self, stage: str | None = None) -> None:
        if self.train_rows:
            return
        if self.path is None:
            train_file, val_file = str(BUILTIN_TRAIN), str(BUILTIN_VAL)
            train, val = load_rows(train_file), load_rows(val_file)
            train_source, val_source = "built-in sort pairs", "built-in held-out sort pairs"
        else:
            train_file, val_file = self.path, self.val_path or self.path
            train = load_rows(self.path, self.split, self.name)
            val = [] if self.val_fraction > 0 else self.load_val()
            train_source, val_source = f"`data.path`={self.path} (split {self.split})", self.val_source()
        self.train_rows = self.prepare_rows(train, train_source, row_locator(train_file), "train")
        if val:
            self.val_rows = self.prepare_rows(val, val_source, row_locator(val_file), "val")
        if self.val_fraction > 0:
            self.train_rows, self.val_rows = self.split_off_val(self.train_rows)
        self.val_rows = self.val_rows[: self.max_val_rows]

    def split_off_val(self, rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """``(train, val)``: a seeded ``val_fraction`` of ``rows`` held out; both keep the file order.

        The same on every rank (a pure function of ``seed``), so ranks validate on the same pairs.
        """
        n_val = round(self.val_fraction * len(rows))
        if not 0 < n_val < len(rows):
            raise ValueError(
                f"`data.val_fraction`={self.val_fraction} of {len(rows)} pairs leaves {n_val} for validation "
                f"and {len(rows) - n_val} for training; both need at least one"
            )
        g = torch.Generator().manual_seed(self.seed + 104_729)  # not the training order's permutation
        held = set(torch.randperm(len(rows), generator=g)[:n_val].tolist())
        rank_zero_info(
            f"data.val_fraction={self.val_fraction}: {n_val} of {len(rows)} pairs held out for validation, "
            f"{len(rows) - n_val} left for training"
        )
        return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]

    def prepare_rows(
        self, rows: list[dict[str, Any]], source: str, locate: Callable[[int], str], part: str = "train"
    ) -> list[dict[str, Any]]:
        """Check ``rows`` and expose them as ``prompt`` / ``chosen`` / ``rejected`` (+ ``answer``).

        Args:
            rows: the loaded rows.
            source: where they came from, for messages; ``locate`` names row ``i`` (``line N``).
            part: ``"train"`` or ``"val"``, the key of ``skipped_identical`` to count in.

        Raises:
            ValueError: naming the row and the ``data.*`` key, for an empty dataset, a missing column,
                an empty field, malformed messages or (unless ``skip_identical``) identical chosen and
                rejected completions.
        """
        columns = {"data.chosen_column": self.chosen_column, "data.rejected_column": self.rejected_column}
        check_rows(rows, columns, source, locate)
        implicit = self.prompt_column not in rows[0] and isinstance(rows[0][self.chosen_column], list)
        if not implicit:
            check_rows(rows, {"data.prompt_column": self.prompt_column}, source, locate)
        answer = self.answer_column if self.answer_column in rows[0] else None
        if answer is not None:
            check_rows(rows, {"data.answer_column": answer}, source, locate)
        out = []
        for i, row in enumerate(rows):
            try:
                out.append(self._canonical(row, implicit, answer))
            except ValueError as err:  # locate only now: it may read the file to find the line
                raise ValueError(f"dataset {source}, {locate(i)}: {err}") from None
        kept = [row for row in out if row is not None]
        skipped = len(out) - len(kept)
        self.skipped_identical[part] = skipped
        if skipped:
            first = locate(next(i for i, row in enumerate(out) if row is None))
            if not kept:
                raise ValueError(f"dataset {source}: every one of its {skipped} pairs has identical chosen "
                                 f"and rejected completions (the first at {first}): no pair to train on")
            rank_zero_warn(
                f"dataset {source}: skipped {skipped} of {len(out)} pairs whose chosen and rejected "
                f"completions are identical (the first at {first}; `data.skip_identical: false` stops at "
                "the first instead)"
            )
        return kept

    def _canonical(self, row: dict[str, Any], implicit: bool, answer: str | None) -> dict[str, Any] | None:
        """The row in canonical form, or ``None`` for an identical pair when ``skip_identical``.

        Raises:
            ValueError: whose message the caller prefixes with the dataset and the row's line.
        """
        chosen, rejected = row[self.chosen_column], row[self.rejected_column]
        if implicit:
            if not isinstance(rejected, list):
                raise ValueError(
                    f"column `{self.rejected_column}` (data.rejected_column) "
                    f"must be messages like `{self.chosen_column}`"
                )
            prompt, chosen, rejected = split_implicit_prompt(chosen, rejected)
            if not prompt and chosen != rejected:
                raise ValueError(
                    f"no column `{self.prompt_column}` (data.prompt_column) and the conversations "
                    f"in `{self.chosen_column}` / `{self.rejected_column}` share no leading prompt messages"
                )
        else:
            prompt = row[self.prompt_column]
        for key, column, value in (
            ("data.prompt_column", self.prompt_column, prompt),
            ("data.chosen_column", self.chosen_column, chosen),
            ("data.rejected_column", self.rejected_column, rejected),
        ):
            _check_messages(value, f"column `{column}` ({key})")
        if chosen == rejected:
            if self.skip_identical:
                return None
            raise ValueError(
                f"chosen and rejected completions are identical (columns `{self.chosen_column}` / "
                f"`{self.rejected_column}`, data.chosen_column / data.rejected_column); "
                "set `data.skip_identical: true` (the default) to skip such pairs"
            )
        out = {**row, "prompt": prompt, "chosen": chosen, "rejected": rejected}
        if answer is not None:
            out["answer"] = row[answer]
        return out


# ------------------------------------------------------------------------------------ built-in sort pairs
def _corrupt(answer: str) -> str:
    """A deterministic wrong answer, for the rare prompt whose every sample was correct."""
    swapped = answer[-1] + answer[:-1]
    return swapped if swapped != answer else answer[:-1] + str((int(answer[-1]) + 1) % 10)


def sort_pairs(
    policy: Any, rows: list[dict[str, str]], tag: str, num_samples: int = 8, chunk: int = 64
) -> list[dict[str, str]]:
    """One pair per sort row: chosen = the answer, rejected = the first wrong sample of ``policy``.

    Each chunk of ``chunk`` rows is sampled under its own seed (from ``tag`` and the chunk index), so a
    prefix of the output can be regenerated alone.
    """
    pairs = []
    for start in range(0, len(rows), chunk):
        part = rows[start : start + chunk]
        torch.manual_seed(zlib.crc32(f"{tag}-{start // chunk}".encode()))
        ids, mask = policy.encode_prompts([r["prompt"] for r in part])
        gen = policy.generate(
            ids, mask, num_samples=num_samples, max_new_tokens=len(part[0]["answer"]) + 3, temperature=1.0
        )
        texts = policy.tokenizer.batch_decode(gen.completion_ids, skip_special_tokens=True)
        for i, row in enumerate(part):
            samples = texts[i * num_samples : (i + 1) * num_samples]
            wrong = [s for s in samples if s.strip() and s.strip() != row["answer"]]
            rejected = wrong[0] if wrong else _corrupt(row["answer"])
            pairs.append({"prompt": row["prompt"], "chosen": row["answer"], "rejected": rejected,
                          "answer": row["answer"]})
    return pairs


def make_sort_pairs(out_dir: str, num_train: int = 4096, seed: int = 0) -> list[Path]:
    """Write ``sort_pairs_train.jsonl`` (training sort prompts) and ``sort_pairs_val.jsonl`` (the task's
    held-out prompts only) with rejected answers sampled from ``builtin:tiny-sort``.

    Deterministic for a given torch build (one CPU thread, fixed per-chunk seeds).
    """
    from lightning_rl.models.loading import load_policy

    policy = load_policy("builtin:tiny-sort")
    task = SortTask(seed=seed)
    splits = {"train": [task.train_row(i) for i in range(num_train)], "val": task.val_rows()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for split, rows in splits.items():
        target = out / f"sort_pairs_{split}.jsonl"
        with target.open("w") as f:
            for pair in sort_pairs(policy, rows, f"sort-pairs-{split}-{seed}"):
                f.write(json.dumps(pair) + "\n")
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--make-sort-pairs", metavar="DIR", required=True, help="write the built-in pairs here"
    )
    parser.add_argument("--num-train", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for path in make_sort_pairs(args.make_sort_pairs, args.num_train, args.seed):
        print(path)


if __name__ == "__main__":
    main()
