"""FSDP2 over every rank by default: Lightning's ``ModelParallelStrategy`` sized from the world size.

Lightning's strategy needs ``data_parallel_size`` x ``tensor_parallel_size`` = world size, and its
``"auto"`` means num_nodes x (devices per node), a 2-D layout for tensor parallelism inside a node. Pure
FSDP2 shards over every rank, so here ``data_parallel_size`` defaults to world size / tensor parallel
size: ``--config configs/strategy/fsdp2.yaml --trainer.devices 8 [--trainer.num_nodes 2]`` needs no
number, only tensor parallelism does.

:func:`fill_deepspeed_config` gives Lightning's ``DeepSpeedStrategy`` the config keys a module decides.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn

from lightning_rl.models.sharding import strategy_is


class FSDP2Strategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose data-parallel size defaults to every rank (world size divided by the
    tensor-parallel size), so FSDP2 shards over all of them.

    Args:
        data_parallel_size: ranks in a data-parallel (sharding) group; ``"auto"``: world size /
            ``tensor_parallel_size``.
        tensor_parallel_size: ranks in a tensor-parallel group (1: pure FSDP2).
        save_distributed_checkpoint: each rank writes its shard (a checkpoint is a folder); ``False``:
            rank 0 writes one file with the full weights and optimiser states.
        process_group_backend, timeout: as Lightning's ``ModelParallelStrategy``.
    """

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: int = 1,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)

    def mesh_sizes(self) -> tuple[int, int]:
        """``(data_parallel_size, tensor_parallel_size)`` for this world size; a config error naming the
        keys when they cannot cover it."""
        world = self.num_processes * self.num_nodes
        tensor = self._tensor_parallel_size
        if not isinstance(tensor, int) or tensor < 1 or world % tensor:
            raise ValueError(f"`trainer.strategy.init_args.tensor_parallel_size` must divide the world size "
                             f"{world} (`trainer.devices` x `trainer.num_nodes`), got {tensor!r}")
        data = world // tensor if self._data_parallel_size == "auto" else self._data_parallel_size
        if data * tensor != world:
            raise ValueError(f"`trainer.strategy.init_args.data_parallel_size` {data} x "
                             f"`tensor_parallel_size` {tensor} must equal the world size {world} "
                             "(`trainer.devices` x `trainer.num_nodes`); leave data_parallel_size out "
                             "(\"auto\") to shard over every rank")
        return data, tensor

    def setup_environment(self) -> None:
        self._data_parallel_size, self._tensor_parallel_size = self.mesh_sizes()
        super().setup_environment()


def fill_deepspeed_config(strategy: Any, defaults: dict[str, Any]) -> None:
    """Set the keys of ``defaults`` that a DeepSpeed strategy's config leaves out (nothing for other
    strategies). Runs before the strategy formats its config. A key the user's config sets wins (a warning
    says so when it differs, except ``train_micro_batch_size_per_gpu``, which only DeepSpeed's throughput
    logs read: without it Lightning reads the train loader's batch sampler, which streamed loaders lack)."""
    config = getattr(strategy, "config", None)
    if not strategy_is(strategy, ("DeepSpeedStrategy",)) or not isinstance(config, dict):
        return
    for key, value in defaults.items():
        if key in config and config[key] != value and key != "train_micro_batch_size_per_gpu":
            rank_zero_warn(f"the DeepSpeed config sets `{key}: {config[key]}`, used instead of {value} "
                           "from the model's settings")
        config.setdefault(key, value)
