"""Column names that the DataModules (``lightning_rl.data``) write into batches and the modules read.

They live in the core so that the LightningModules read them without importing the data package; the
data package imports them from here.
"""

from __future__ import annotations

# per-row weight of a validation batch: 1 for a held-out row, 0 for a placeholder row that only gives
# every rank the same number of validation steps (``lightning_rl.data.validation.ValidationShard``)
VAL_WEIGHT_KEY = "_weight"

# column of a predict batch: each row's index in the predict rows, so the writer can order the rows and
# drop nothing twice (``lightning_rl.data.prompts.RowsDataModule.predict_dataloader``)
ROW_INDEX_KEY = "_row"

__all__ = ["ROW_INDEX_KEY", "VAL_WEIGHT_KEY"]
