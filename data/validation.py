"""Held-out rows dealt to ranks so that every row is scored exactly once on any world size.

A plain ``DistributedSampler`` pads the held-out set by repeating rows until it divides by the world
size, so a metric averaged over ranks counts some rows twice. Here row ``i`` goes to rank
``i % world`` and nothing is repeated; ranks whose share runs out early still yield a batch (one row
with weight 0, ``VAL_WEIGHT_KEY``) so that every rank runs the same number of validation steps, and
the modules leave weight-0 rows out of their metrics (``lightning_rl.algorithms.base.real_rows``).
``VAL_WEIGHT_KEY`` lives in ``lightning_rl.text.keys`` (the modules read it without importing this package);
it stays importable from here.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset

from lightning_rl.text.keys import VAL_WEIGHT_KEY

# Lightning warns that `__len__` of an IterableDataset may be wrong with several loader workers; the
# shard is read in the main process (num_workers=0), where its length is exact.
warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")

__all__ = ["VAL_WEIGHT_KEY", "ValidationShard"]


class ValidationShard(IterableDataset):
    """This rank's held-out rows in batches of ``batch_size``, each batch a dict of columns plus
    ``VAL_WEIGHT_KEY``; every rank yields ``len(self)`` batches."""

    def __init__(
        self, rows: list[dict[str, Any]], batch_size: int, rank: int = 0, world_size: int = 1
    ) -> None:
        self.rows, self.batch_size, self.rank, self.world_size = rows, batch_size, rank, world_size

    def __len__(self) -> int:
        longest_share = math.ceil(len(self.rows) / self.world_size)
        return math.ceil(longest_share / self.batch_size)

    def __iter__(self) -> Iterator[dict[str, list]]:
        mine = self.rows[self.rank :: self.world_size]
        for b in range(len(self)):
            chunk = mine[b * self.batch_size : (b + 1) * self.batch_size]
            weights = [1.0] * len(chunk)
            if not chunk:  # this rank's share ran out: one placeholder row that counts for nothing
                chunk, weights = [self.rows[0]], [0.0]
            batch = {key: [row[key] for row in chunk] for key in chunk[0]}
            batch[VAL_WEIGHT_KEY] = weights
            yield batch
