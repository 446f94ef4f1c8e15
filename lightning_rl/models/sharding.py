"""Sharded training: FSDP2 (``fully_shard``) through Lightning's ``ModelParallelStrategy``; DeepSpeed ZeRO.

``PolicyModule.configure_model`` calls :func:`shard_policy_model`: each decoder layer is sharded, then the
root, over the data-parallel dimension of the strategy's device mesh. Lightning's FSDP1 ``fsdp``
strategy is refused (it breaks ``manual_backward`` and refuses CPU): the overlay
``configs/strategy/fsdp2.yaml`` selects ``ModelParallelStrategy`` instead.

The frozen reference (KL terms, DPO) is *not* sharded: each rank keeps a whole copy. It never trains,
and a whole copy lets each rank score its own, rank-dependent number of rows without collectives (a
sharded reference would all-gather in every forward, so every rank would have to run the same number
of reference forwards). Its memory per rank is the full model in its dtype.

Rules kept here (DESIGN.md, "Scaling out"): generation under sharded weights passes
``synced_gpus=True`` (:func:`needs_synced_generation`), gradient accumulation switches FSDP2's
reduce-scatter off with ``set_requires_gradient_sync`` (:func:`no_gradient_sync`), and an export gathers
a full state dict on every rank before rank 0 writes it (:func:`full_state_dict`).

DeepSpeed (Lightning's ``DeepSpeedStrategy``, ZeRO stage 1-3): gradient accumulation is the engine's
(:func:`deepspeed_engine` ``.set_gradient_accumulation_boundary``, DeepSpeed's ``no_sync`` refuses ZeRO-2/3),
clipping is the engine's (``gradient_clipping``, filled from ``model.update.max_grad_norm``) and so is the LR
scheduler step. ZeRO-2/3 reduce gradients in *every* backward, so every rank runs as many backward passes
(:func:`collective_backward`); ZeRO-3 also gathers parameters in every forward (:func:`collective_forward`)
and an export gathers them with ``GatheredParameters`` (:func:`full_state_dict`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_rl.maths.checks import require
from lightning_rl.models.adapters import is_peft_model, merged_model
from lightning_rl.models.model_utils import DTYPES

FSDP2_OVERLAY = "configs/strategy/fsdp2.yaml"
# strategies whose weights may be sharded: generation must then keep every rank stepping
SHARDED_STRATEGIES = ("ModelParallelStrategy", "FSDPStrategy", "DeepSpeedStrategy")


@dataclass(frozen=True)
class FSDPOptions:
    """How FSDP2 holds the trained weights (``model.init_args.policy.fsdp``; the critic's too): ``null``
    there is FSDP2's defaults (on the device, in the weights' dtype).

    Args:
        cpu_offload: keep sharded parameters, gradients and optimiser state in CPU memory.
        param_dtype: the compute dtype of gathered parameters (``None``: the weights').
        reduce_dtype: the dtype of the gradient reduce-scatter (``None``: the param dtype).
    """

    cpu_offload: bool = False
    param_dtype: str | None = None
    reduce_dtype: str | None = None

    def __post_init__(self) -> None:
        allowed = f"one of {sorted(DTYPES)} or null"
        require("model.policy.fsdp",
                param_dtype=(self.param_dtype in (None, *DTYPES), self.param_dtype, allowed),
                reduce_dtype=(self.reduce_dtype in (None, *DTYPES), self.reduce_dtype, allowed))


def fsdp_module_class() -> type:
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def is_sharded(model: nn.Module) -> bool:
    """True when ``model`` (or a submodule) has been passed to ``fully_shard``."""
    kind = fsdp_module_class()
    return any(isinstance(m, kind) for m in model.modules())


def strategy_is(strategy: Any, names: tuple[str, ...]) -> bool:
    """Whether ``strategy``'s class, or a base class, is one of Lightning's strategies ``names``."""
    return strategy is not None and any(c.__name__ in names for c in type(strategy).__mro__)


def zero3_partitioned(model: nn.Module) -> bool:
    """True when DeepSpeed ZeRO-3 has partitioned ``model``'s parameters (each then carries ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def deepspeed_engine(trainer: Any) -> Any | None:
    """The ``DeepSpeedEngine`` around the LightningModule under Lightning's ``DeepSpeedStrategy``, or None."""
    strategy = getattr(trainer, "strategy", None) if trainer is not None else None
    if not strategy_is(strategy, ("DeepSpeedStrategy",)):
        return None
    engine = getattr(strategy, "model", None)
    return engine if hasattr(engine, "set_gradient_accumulation_boundary") else None


def start_deepspeed_micro_batch(engine: Any, boundary: bool) -> None:
    """Prepare ``engine`` for one micro-batch's forward and backward inside a single ``training_step``.

    ``boundary`` marks the last micro-batch of an optimiser step (gradients are final after its backward).
    The engine does its per-micro-batch bookkeeping at the start of its own ``forward``; our micro-batches
    all run inside one engine forward (Lightning's ``training_step``), so it is done here too: without it
    ZeRO-3 copies each micro-batch's gradient partitions over the last instead of adding them.
    """
    if hasattr(engine.optimizer, "clear_backward_seen_flag"):  # DeepSpeed >= 0.17; earlier: in backward
        engine.optimizer.clear_backward_seen_flag()
    engine.set_gradient_accumulation_boundary(boundary)


def prompt_sharing(wanted: bool, model: nn.Module) -> bool:
    """Whether scoring may run each distinct prompt once (``share_prompt_prefix``): not where forwards are
    collectives (their count would depend on each rank's data), nor under gradient checkpointing (which
    turns the cache off). The policy and its reference are set alike, so their log-probs agree exactly."""
    from lightning_rl.models.model_utils import is_gradient_checkpointing

    return wanted and not collective_forward(model) and not is_gradient_checkpointing(model)


def collective_forward(model: nn.Module) -> bool:
    """Whether each forward of ``model`` is a collective (FSDP2 or ZeRO-3 gather weights from every rank)."""
    return is_sharded(model) or zero3_partitioned(model)


def collective_backward(trainer: Any, model: nn.Module) -> bool:
    """Whether each backward through ``model`` communicates, even while accumulating: FSDP2 and ZeRO-3 (whose
    forward is collective too) and any DeepSpeed engine (ZeRO-2 reduces buckets in every backward)."""
    return collective_forward(model) or deepspeed_engine(trainer) is not None


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (or a PEFT model around one).

    Found by the class names in ``_no_split_modules`` (what transformers itself never splits across
    devices), else the longest ``nn.ModuleList`` (``model.model.layers`` in Llama / Qwen, ``transformer.h``
    in GPT-2).
    """
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def refuse_fsdp1(strategy: Any) -> None:
    """Lightning's FSDP1 strategy cannot run the manual-optimisation step: say what to use instead."""
    if type(strategy).__name__ == "FSDPStrategy":
        raise ValueError(
            "`trainer.strategy: fsdp` (Lightning's FSDP1 FSDPStrategy) breaks manual_backward and refuses "
            f"CPU: use FSDP2 through ModelParallelStrategy, e.g. `--config {FSDP2_OVERLAY}` "
            "(class_path lightning.pytorch.strategies.ModelParallelStrategy, tensor_parallel_size: 1)"
        )


def shard_policy_model(model: nn.Module, device_mesh: Any, options: FSDPOptions | None = None) -> bool:
    """``fully_shard`` each decoder layer of ``model``, then ``model`` itself, on the data-parallel mesh.

    Idempotent: a model that is already an ``FSDPModule`` is left as it is (``configure_model`` runs
    again for ``validate`` / ``test`` after ``fit``). Of a PEFT model, the root sharded is the causal LM
    inside the wrapper: ``PeftModel.generate`` calls that model's ``generate``, which never enters the
    wrapper's forward (where a root's hooks would gather the embeddings and the head).

    Args:
        model: the policy's causal LM, or a ``peft.PeftModel`` around one.
        device_mesh: Lightning's 2-D mesh (``data_parallel``, ``tensor_parallel``) or a 1-D mesh.
        options: CPU offload and the ``MixedPrecisionPolicy`` dtypes (``None``: FSDP2's defaults).

    Returns:
        True when this call sharded the model, False when it already was.

    Raises:
        ValueError: when the mesh has a tensor-parallel dimension larger than 1 (not supported).
    """
    from torch.distributed.fsdp import fully_shard

    root = model.get_base_model() if is_peft_model(model) else model
    if isinstance(root, fsdp_module_class()):
        return False
    o = options or FSDPOptions()
    mesh = _data_parallel_mesh(device_mesh)
    kwargs = _fully_shard_kwargs(mesh, o.cpu_offload, o.param_dtype, o.reduce_dtype)
    for layer in decoder_layers(model):
        if not isinstance(layer, fsdp_module_class()):
            fully_shard(layer, **kwargs)
    fully_shard(root, **kwargs)
    return True


def _data_parallel_mesh(mesh: Any) -> Any:
    """The data-parallel dimension of a 2-D mesh (a 1-D mesh as it is); a ``ValueError`` when the mesh has
    a tensor-parallel dimension larger than 1 (not supported)."""
    if mesh.ndim <= 1:
        return mesh
    if "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            "tensor parallelism is not supported: set `trainer.strategy.init_args.tensor_parallel_size: "
            "1` and `data_parallel_size` to the number of processes"
        )
    return mesh["data_parallel"]


def _fully_shard_kwargs(
    mesh: Any, cpu_offload: bool, param_dtype: str | None, reduce_dtype: str | None
) -> dict[str, Any]:
    """``fully_shard``'s ``mesh``, ``offload_policy`` and (when a dtype is set) ``mp_policy`` arguments."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    if param_dtype is not None or reduce_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=DTYPES.get(param_dtype or ""), reduce_dtype=DTYPES.get(reduce_dtype or "")
        )
    return kwargs


def needs_synced_generation(trainer: Any, model: nn.Module | None = None) -> bool:
    """Whether ``generate`` must keep every rank stepping until all finish (``synced_gpus=True``).

    True under a sharding strategy (each forward gathers weights from every rank), or when ``model``
    is sharded whatever the strategy says.
    """
    strategy = getattr(trainer, "strategy", None) if trainer is not None else None
    if strategy_is(strategy, SHARDED_STRATEGIES):
        return True
    return model is not None and collective_forward(model)


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally under FSDP2: no reduce-scatter until the context exits."""
    model.set_requires_gradient_sync(False, recurse=True)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True, recurse=True)


def zero_loss(policy: Any, trainer: Any = None) -> torch.Tensor:
    """A zero loss whose backward joins the gradient reduction as a real micro-batch's would.

    DDP only needs every trainable parameter in the graph. FSDP2 and ZeRO-3 gather weights in forward and
    reduce in backward through module hooks, and ZeRO-2 reduces gradients in buckets in the order they
    become ready, so there (``collective_backward``) the model runs a real one-token forward.
    """
    if not collective_backward(trainer, policy.model):
        return sum(p.sum() * 0.0 for p in policy.parameters() if p.requires_grad)
    ids = torch.full((1, 1), policy.pad_token_id, dtype=torch.long, device=policy.device)
    return policy.model(input_ids=ids, use_cache=False).logits.float().sum() * 0.0


def agreed_count(trainer: Any, model: nn.Module, count: int, backward: bool = False) -> int:
    """The largest ``count`` over all ranks when each forward of ``model`` (or, with ``backward``, each
    backward) is a collective, so that every rank runs as many; ``count`` itself otherwise."""
    collective = collective_backward(trainer, model) if backward else collective_forward(model)
    if not collective:
        return count
    value = torch.tensor(float(count), device=next(model.parameters()).device)
    return int(trainer.strategy.reduce(value, reduce_op="max"))


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's global value (``full_tensor``, a collective: every rank must call it); else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def gathers_for_export(model: nn.Module) -> bool:
    """Whether ``model``'s full weights exist only across ranks (FSDP2 shards, ZeRO-3 partitions)."""
    return collective_forward(model)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict on CPU, gathered from every rank (call it on every rank).

    FSDP2: rank 0 gets the full tensors; with ``cpu_offload`` the other ranks get an empty dict. ZeRO-3:
    the partitions are gathered (``GatheredParameters``) and rank 0 copies them to CPU; others get ``{}``.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if zero3_partitioned(model):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            if torch.distributed.get_rank() != 0:
                return {}
            return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_full_pretrained(
    policy: Any, path: str, state_dict: dict[str, torch.Tensor], merged: bool = False
) -> None:
    """Rank 0's half of a sharded export: write ``state_dict`` with the model's ``save_pretrained``.

    No collective happens here, so no other rank has to be inside this call. A PEFT model writes its adapter
    folder, or with ``merged`` the weights with the adapters merged in (built on the CPU from ``state_dict``,
    which must then be the full one). The tokenizer is written with its original ``padding_side``, as
    ``Policy.save_pretrained`` does.
    """
    if merged and is_peft_model(policy.model):
        merged_model(policy.model, state_dict).save_pretrained(path)
    else:
        policy.model.save_pretrained(path, state_dict=state_dict)
    tokenizer = policy.tokenizer
    tokenizer.padding_side = getattr(policy, "export_padding_side", tokenizer.padding_side)
    try:
        tokenizer.save_pretrained(path)
    finally:
        tokenizer.padding_side = "left"
