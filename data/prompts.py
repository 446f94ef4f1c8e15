"""PromptDataModule: prompts (and any other columns) for online RL, SFT and evaluation.

Rows are plain dicts of strings; tokenisation happens in the LightningModule, which owns the
tokenizer. The training stream is an endless, seeded sequence of prompt batches whose position is
part of the checkpoint, so a resumed run sees exactly the prompts an uninterrupted run would. Each
rank takes its own slice of every global batch, and the G samples of a prompt are drawn on the rank
that holds the prompt, so groups are never split across ranks. Loading and checking the rows is
:mod:`lightning_rl.data.rows`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_rl.data.calc_task import MultiplyTask, tool_trace_rows
from lightning_rl.data.curriculum import Curriculum, CurriculumTracker
from lightning_rl.data.rows import check_rows, load_rows, row_locator
from lightning_rl.data.sort_task import SortTask
from lightning_rl.data.validation import ValidationShard
from lightning_rl.episodes.source import PromptBatches
from lightning_rl.text.keys import ROW_INDEX_KEY


class PromptStream(IterableDataset):
    """An endless, seeded stream of prompt batches for one rank.

    Global batch ``k`` is rows ``perm_e[j*G : (j+1)*G]`` of epoch ``e``'s permutation, where ``G`` is
    ``batch_size * world_size``; this rank yields its own ``batch_size`` rows of it. Batches are a
    pure function of (seed, k), so starting at ``start`` reproduces an uninterrupted run.
    """

    def __init__(
        self, rows, batch_size: int, seed: int, shuffle: bool, rank: int, world_size: int, start: int
    ):
        self.rows, self.batch_size, self.seed, self.shuffle = rows, batch_size, seed, shuffle
        self.rank, self.world_size, self.start = rank, world_size, start
        self.global_batch = batch_size * world_size
        self.per_epoch = len(rows) // self.global_batch
        if self.per_epoch == 0:
            raise ValueError(
                f"`batch_size`={batch_size} x world size {world_size} is larger than the dataset "
                f"({len(rows)} rows)"
            )

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.rows)))
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.rows), generator=g).tolist()

    def __iter__(self) -> Iterator[dict[str, list]]:
        k, epoch, order = self.start, None, []
        while True:
            if k // self.per_epoch != epoch:
                epoch = k // self.per_epoch
                order = self._order(epoch)
            lo = (k % self.per_epoch) * self.global_batch + self.rank * self.batch_size
            yield collate([self.rows[i] for i in order[lo : lo + self.batch_size]])
            k += 1


def collate(rows: list[dict[str, Any]]) -> dict[str, list]:
    """Rows -> a dict of columns (lists), keeping every column for reward functions."""
    return {key: [row[key] for row in rows] for key in rows[0]}


class RowsDataModule(L.LightningDataModule):
    """What the row-based DataModules share: the checkpointed training stream, validation and
    held-out loading.

    Subclasses set ``path``, ``val_path``, ``val_split``, ``name``, ``batch_size``, ``val_batch_size``,
    ``seed``, ``shuffle`` and fill ``train_rows`` / ``val_rows`` (and ``predict_rows``, else predictions
    are made for ``val_rows``) in ``setup``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.train_rows: list[dict[str, Any]] = []
        self.val_rows: list[dict[str, Any]] = []
        self.predict_rows: list[dict[str, Any]] = []
        self.batches_consumed = 0  # restored from checkpoints; the next training batch index

    def rank_and_world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def stream(self, seed: int, start: int) -> PromptStream:
        return PromptStream(
            self.train_rows, self.batch_size, seed, self.shuffle, *self.rank_and_world(), start
        )

    def load_val(self) -> list[dict[str, Any]]:
        """``val_path`` (its ``val_split``), else ``path``'s ``val_split`` if it has one, else no rows."""
        key = "data.path" if self.val_path is None else "data.val_path"
        try:
            return load_rows(self.val_path or self.path, self.val_split, self.name,
                             require_split=self.val_path is None, key=key)
        except (ValueError, KeyError):
            if self.val_path is not None:
                raise
            return []  # `path` has no held-out split: train without validation

    def val_source(self) -> str:
        """Where the validation rows come from, for messages."""
        if self.val_path is not None:
            return f"`data.val_path`={self.val_path} (split {self.val_split})"
        return f"`data.path`={self.path} (split {self.val_split})" if self.path else "the built-in task"

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.stream(self.seed, self.batches_consumed), batch_size=None, num_workers=0)

    def val_dataloader(self) -> DataLoader | list:
        """This rank's share of the held-out rows: each row scored once on any world size."""
        if not self.val_rows:
            return []
        shard = ValidationShard(self.val_rows, self.val_batch_size, *self.rank_and_world())
        return DataLoader(shard, batch_size=None, num_workers=0)

    def predict_dataloader(self) -> DataLoader:
        """This rank's share of the rows to predict for (``predict_rows``, else ``val_rows``), in batches of
        ``val_batch_size``, dealt like validation's: row ``i`` to rank ``i % world``, every rank running as
        many batches (placeholder rows of weight 0 fill the short ones). Each row carries its index in
        ``ROW_INDEX_KEY``, so the writer can order the rows and drop nothing twice."""
        rows = self.predict_rows or self.val_rows
        if not rows:
            raise ValueError("`predict` has no prompts: set `data.init_args.predict_path` (or give the data "
                             "a held-out split)")
        indexed = [{**row, ROW_INDEX_KEY: i} for i, row in enumerate(rows)]
        shard = ValidationShard(indexed, self.val_batch_size, *self.rank_and_world())
        return DataLoader(shard, batch_size=None, num_workers=0)

    def state_dict(self) -> dict[str, Any]:
        consumed = self.batches_consumed
        if self.trainer is not None:  # batches whose training step has run (prefetched ones don't count)
            consumed = self.trainer.fit_loop.epoch_loop.batch_progress.total.processed
        return {"batches_consumed": consumed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches_consumed = int(state_dict["batches_consumed"])


class PromptDataModule(RowsDataModule):
    """Prompts for RL and SFT: a built-in task (the sort task by default), or your own data.

    Args:
        path: a JSONL / JSON / CSV / Parquet file, a ``save_to_disk`` folder or a hub dataset name;
            ``None`` uses the built-in task ``task``.
        val_path: held-out data in the same forms; ``None`` takes ``val_split`` of ``path`` if it
            exists, else the built-in task's held-out set (built-in only), else no validation.
        predict_path: prompts for ``lightning-rl predict``, in the same forms and columns (a single file
            whole, a dataset with splits its ``val_split``); ``None`` predicts for the validation rows.
        split: split of ``path`` to train on.
        val_split: split of ``path`` (or ``val_path``) to validate on.
        name: dataset config name for hub datasets.
        prompt_column: column holding the prompt text (or a list of chat messages).
        answer_column: column holding the reference answer (``None`` if the task has none).
        batch_size: prompts per training step on each rank (each is sampled G times by RL modules).
        val_batch_size: prompts per validation (and predict) batch.
        max_val_rows: evaluate on at most this many held-out rows (``None``: all).
        sort_digits: digits per prompt of the built-in sort task.
        task: the built-in task when ``path`` is ``None``: ``sort`` (``lightning_rl.data.sort_task``),
            ``multiply`` (``A*B=`` with factors in [10, 999], for episodes with the ``calculator`` tool:
            ``lightning_rl.data.calc_task``) or ``multiply_tool_traces``, the SFT rows of solved calculator
            episodes (two per problem: the call, then the answer copied from the tool's result). Its
            held-out rows are the trace rows of the held-out problems too (call row, then copy row, so
            ``max_val_rows`` keeps whole pairs): ``val/accuracy`` is the fraction of turns reproduced
            exactly, as a plain ``multiply`` prompt would score the tool call, never the answer.
        seed: seed of the training order.
        shuffle: shuffle the training rows each epoch.
        curriculum: draw the training prompts by their recent pass rate instead of in epochs
            (:mod:`lightning_rl.data.curriculum`: the pools, the feedback rule, checkpoints, ranks); its
            ``curriculum/*`` statistics are logged every step. Online RL modules only. ``None``: off.
    """

    def __init__(
        self,
        path: str | None = None,
        val_path: str | None = None,
        split: str = "train",
        val_split: str = "test",
        name: str | None = None,
        prompt_column: str = "prompt",
        answer_column: str | None = "answer",
        batch_size: int = 8,
        val_batch_size: int = 64,
        max_val_rows: int | None = None,
        sort_digits: int = 5,
        seed: int = 0,
        shuffle: bool = True,
        predict_path: str | None = None,
        task: Literal["sort", "multiply", "multiply_tool_traces"] = "sort",
        curriculum: Curriculum | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"`data.batch_size` must be >= 1, got {batch_size}")
        self.task_name = check_task(task, path, sort_digits)
        self.path, self.val_path, self.split, self.val_split, self.name = (
            path, val_path, split, val_split, name
        )
        self.prompt_column, self.answer_column = prompt_column, answer_column
        self.batch_size, self.val_batch_size, self.max_val_rows = batch_size, val_batch_size, max_val_rows
        self.seed, self.shuffle = seed, shuffle
        self.predict_path = predict_path
        self.task: SortTask | MultiplyTask | None = None  # the built-in task, without `path`
        if path is None and task == "sort":
            self.task = SortTask(num_digits=sort_digits, seed=seed)
        elif path is None:
            self.task = MultiplyTask(seed=seed)
        self.refills_consumed = 0  # batches drawn by dynamic sampling, from a separately seeded stream
        self._refill: Iterator[dict[str, list]] | None = None
        self.curriculum = curriculum
        self.tracker: CurriculumTracker | None = None  # built with the rows; its state may come first
        self._curriculum_state: list[dict[str, Any]] | None = None

    def setup(self, stage: str | None = None) -> None:
        columns = {"data.prompt_column": self.prompt_column, "data.answer_column": self.answer_column}
        if stage == "predict" and self.predict_path is not None:
            if not self.predict_rows:
                rows = load_rows(self.predict_path, self.val_split, self.name, key="data.predict_path")
                source, locate = f"`data.predict_path`={self.predict_path}", row_locator(self.predict_path)
                check_rows(rows, columns, source, locate)
                self.predict_rows = [self._canonical(r) for r in rows]
            return
        if self.train_rows:
            return
        if self.task is not None:
            self.train_rows = [self.task.train_row(i) for i in range(self.task.num_train)]
            self.val_rows = self.task.val_rows()
            if self.task_name == "multiply_tool_traces":
                self.train_rows = [t for row in self.train_rows for t in tool_trace_rows(row)]
                self.val_rows = [t for row in self.val_rows for t in tool_trace_rows(row)]
        else:
            self.train_rows = load_rows(self.path, self.split, self.name)
            check_rows(self.train_rows, columns, f"`data.path`={self.path} (split {self.split})",
                       row_locator(self.path))
            self.val_rows = self.load_val()
        if self.val_rows:
            check_rows(self.val_rows, columns, self.val_source(), row_locator(self.val_path or self.path))
        if self.max_val_rows is not None:
            self.val_rows = self.val_rows[: self.max_val_rows]
        self.train_rows = [self._canonical(r) for r in self.train_rows]
        self.val_rows = [self._canonical(r) for r in self.val_rows]
        if self.curriculum is not None:
            self.tracker = CurriculumTracker(self.curriculum, len(self.train_rows), self.seed + 104729)
            self._restore_curriculum()

    def _canonical(self, row: dict[str, Any]) -> dict[str, Any]:
        """Expose the configured columns as ``prompt`` and ``answer``; keep every other column."""
        out = {**row, "prompt": row[self.prompt_column]}
        if self.answer_column is not None:
            out["answer"] = row[self.answer_column]
        return out

    def refill_batch(self) -> dict[str, list]:
        """One more prompt batch for dynamic sampling (DAPO), from its own seeded stream.

        Its position is checkpointed like the main stream's, so refills replay exactly on resume.
        """
        if self._refill is None:
            self._refill = self.refill_batches(self.refills_consumed)
        self.refills_consumed += 1
        return next(self._refill)

    def train_dataloader(self) -> DataLoader:
        if self.tracker is None:
            return super().train_dataloader()
        self.tracker.loader = self.tracker.stream(self.train_rows, self.batch_size, *self.rank_and_world(),
                                                  self.batches_consumed, collate)
        return DataLoader(self.tracker.loader, batch_size=None, num_workers=0)

    def train_batches(self, start: int) -> PromptBatches:
        """This rank's training batches from batch index ``start`` on, as the train loader yields them
        (for a sampler that runs ahead of the training steps). Its ``record(step, pass_rates)`` takes the
        outcomes of the steps it drew: a curriculum's draws learn from them (``start`` is then the next step
        to train), the seeded stream's ignore them."""
        if self.tracker is not None:
            return iter(self.tracker.stream(self.train_rows, self.batch_size, *self.rank_and_world(), start,
                                            collate))
        return PromptBatches(self.stream(self.seed, start))

    def record_outcomes(self, step: int, pass_rates: list[float]) -> dict[str, float]:
        """The pass rate of each prompt of trained step ``step`` (batch order), for the curriculum; returns
        its ``curriculum/*`` statistics (none without a curriculum)."""
        return {} if self.tracker is None else self.tracker.record(step, pass_rates, *self.rank_and_world())

    def refill_batches(self, start: int) -> Iterator[dict[str, list]]:
        """This rank's refill batches (dynamic sampling) from refill ``start`` on."""
        return iter(self.stream(self.seed + 7919, start))

    def state_dict(self) -> dict[str, Any]:
        """The main stream's position and the refill stream's, for every rank.

        Lightning saves the checkpoint that rank 0 built, so a position kept per rank must travel in
        it: with several ranks, every rank's refill position is gathered (an all-gather: Lightning
        builds the checkpoint on every rank) into ``refills_consumed_by_rank``, and each rank
        restores its own. ``refills_consumed`` stays this rank's position (rank 0's in the file).
        """
        state = {**super().state_dict(), "refills_consumed": self.refills_consumed}
        trainer = self.trainer
        if trainer is not None and trainer.world_size > 1:
            device = trainer.strategy.root_device
            mine = torch.tensor([self.refills_consumed], dtype=torch.long, device=device)
            state["refills_consumed_by_rank"] = [int(x) for x in trainer.strategy.all_gather(mine).flatten()]
        if self.tracker is not None:  # every rank's pass rates (each keeps its shard's)
            mine_rates = self.tracker.state_dict(state["batches_consumed"])
            by_rank = [mine_rates]
            if trainer is not None and trainer.world_size > 1:
                by_rank = [None] * trainer.world_size
                torch.distributed.all_gather_object(by_rank, mine_rates)
            state["curriculum_by_rank"] = by_rank
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the positions; each rank takes its own refill position. Resumed on another world
        size, every rank continues after the furthest one (refill batches are laid out per world size
        anyway, so no position is exact then, and none is reused)."""
        super().load_state_dict(state_dict)
        by_rank = state_dict.get("refills_consumed_by_rank")
        rank, world = self.rank_and_world()
        if by_rank and len(by_rank) == world:
            self.refills_consumed = int(by_rank[rank])
        elif by_rank:
            self.refills_consumed = max(int(x) for x in by_rank)
        else:
            self.refills_consumed = int(state_dict.get("refills_consumed", 0))
        self._refill = None
        self._curriculum_state = state_dict.get("curriculum_by_rank")
        self._restore_curriculum()

    def _restore_curriculum(self) -> None:
        """The checkpoint's pass rates, once both they and the rows are here; a checkpoint without them (the
        curriculum turned on at resume) starts from no outcomes at the next step."""
        if self.tracker is None:
            return
        if self._curriculum_state is not None:
            self.tracker.load_state_dict(self._curriculum_state, *self.rank_and_world(),
                                         self.batches_consumed)
        else:
            self.tracker.trained.applied = self.batches_consumed


TASKS = ("sort", "multiply", "multiply_tool_traces")


def check_task(task: str, path: str | None, sort_digits: int) -> str:
    """``task`` once it is a built-in task that applies: one of :data:`TASKS`, not combined with ``path``
    (your own data), and ``sort_digits`` left at its default unless the task is ``sort``.

    Raises:
        ValueError: naming ``data.task``.
    """
    if task not in TASKS:
        raise ValueError(f"`data.task` must be one of {TASKS}, got {task!r}")
    if task != "sort" and path is not None:
        raise ValueError(f"`data.task`={task!r} is a built-in task, used only without `data.path`; "
                         f"got `data.path`={path!r}: remove one of them")
    if task != "sort" and sort_digits != 5:
        raise ValueError(f"`data.sort_digits` applies only to `data.task: sort`, not `data.task`={task!r}")
    return task
