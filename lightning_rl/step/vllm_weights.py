"""How the trained weights reach a vLLM engine: a safetensors file in shared memory, loaded by vLLM's own
loading path in its worker (:mod:`lightning_rl.step.vllm_worker`).

The transport is a file because it is the one that serves every mode the same way on a CPU: vLLM's engine
core (colocate) and a server are other processes, vLLM's weight-transfer API ships NCCL and CUDA-IPC
transports only, and its RPC arguments travel as msgpack (tensors as lists). The file lives in ``/dev/shm``
(memory, not disk) when that has room, and is written in place tensor by tensor: under FSDP2 each
parameter is gathered alone (every rank makes the same gathers in the same order) and written before the
next is gathered, so no rank ever holds the whole model twice. vLLM memory-maps it, loads by Hugging Face
parameter name (``model.reload_weights``, which re-packs CPU kernels), and the file is rewritten for the
next version only after the load returned.

Under LoRA the adapters are merged into their base weights on the way (``W + scale * B @ A`` by PEFT's
``get_delta_weight``), so vLLM serves a plain model and needs no LoRA support; only the layers that carry
adapters change after the first push, and only they are sent again.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from lightning_rl.models.adapters import is_peft_model
from lightning_rl.models.sharding import full_value

PREFIX = "lightning-rl-vllm-"  # transfer folders: PREFIX<pid>-<random>
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


@dataclass
class Weight:
    """One tensor to send: its Hugging Face name, full shape, and how to get its full value (a gather
    under FSDP2: every rank calls it, in the same order)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    value: Callable[[], Tensor]


def model_weights(model: nn.Module, *, adapters_only: bool = False) -> list[Weight]:
    """The weights of ``model`` (a transformers model, or a ``PeftModel`` around one) by the names of its
    base checkpoint, as vLLM loads them: adapters merged into their base layers, adapter tensors left out,
    tied weights once. ``adapters_only``: just the layers whose value the adapters change."""
    if not is_peft_model(model):
        return [_weight(name, p) for name, p in model.named_parameters()]
    kinds = {str(getattr(c, "peft_type", "")).split(".")[-1] for c in model.peft_config.values()}
    if kinds != {"LORA"}:
        raise ValueError(f"`model.engine: VLLMEngine` merges the adapters into the weights it sends, which "
                         f"it can for LoRA only; `model.policy.peft` is {sorted(kinds)}")
    base, adapters = model.get_base_model(), set(model.peft_config)
    tuned = {name: m for name, m in base.named_modules() if hasattr(m, "get_delta_weight")}
    out = []
    for name, p in base.named_parameters():
        owner, _, leaf = name.rpartition(".")
        if ".modules_to_save." in name:  # a trained copy of a whole module: sent under the module's name
            out.append(_weight(name.split(".modules_to_save.")[0] + "." + leaf, p))
        elif ".original_module." in name or any(part in adapters for part in name.split(".")[:-1]):
            continue  # the copy's frozen original, and lora_A / lora_B (merged below)
        elif owner.endswith(".base_layer") and leaf == "weight":
            out.append(_weight(name.replace(".base_layer.", "."), p, _merged(tuned[owner[:-11]], p)))
        elif not adapters_only:
            out.append(_weight(name.replace(".base_layer.", "."), p))
    return out


def _weight(name: str, p: Tensor, value: Callable[[], Tensor] | None = None) -> Weight:
    return Weight(name, tuple(p.shape), p.dtype, value or (lambda: full_value(p.detach())))


def _merged(layer: nn.Module, weight: Tensor) -> Callable[[], Tensor]:
    """The base weight plus each active adapter's delta (PEFT's own ``get_delta_weight``)."""
    def value() -> Tensor:
        out = full_value(weight.detach())
        if getattr(layer, "merged", False):
            return out
        for name in layer.active_adapters:
            on_layer = {*getattr(layer, "lora_A", {}), *getattr(layer, "lora_embedding_A", {})}
            if name not in on_layer:
                continue  # an adapter that does not reach this layer
            if getattr(layer, "use_dora", {}).get(name, False):
                raise ValueError("`model.engine: VLLMEngine` merges LoRA adapters into the weights it "
                                 "sends; DoRA (`use_dora`) does not merge that way: train without it or use "
                                 "HFEngine")
            out = out + layer.get_delta_weight(name).to(out.dtype)
        return out
    return value


def tensor_weights(tensors: dict[str, Tensor]) -> list[Weight]:
    """Weights already whole (a published version's slot), by name."""
    return [Weight(name, tuple(t.shape), t.dtype, (lambda t=t: t)) for name, t in tensors.items()]


def transfer_folder(size_bytes: int, folder: str | None = None) -> str:
    """A fresh private folder for the weight file: in ``folder`` if given, else in ``/dev/shm`` when it has
    room for twice ``size_bytes``, else in the system's temporary folder. Its name holds this process's pid;
    folders left there by processes that no longer exist (killed outright) are removed first."""
    parent = folder
    if parent is None and os.path.isdir("/dev/shm"):
        if shutil.disk_usage("/dev/shm").free > 2 * size_bytes:
            parent = "/dev/shm"
    parent = parent or tempfile.gettempdir()
    for stale in Path(parent).glob(f"{PREFIX}*-*"):
        pid = stale.name[len(PREFIX):].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(stale, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent)


def write_safetensors(path: str, weights: list[Weight], dtype: torch.dtype | None,
                      write: bool = True) -> int:
    """Write ``weights`` to ``path`` in the safetensors format, each cast to ``dtype`` (``None``: its own),
    one tensor at a time (its value is taken only when it is written). ``write=False``: take every value
    (the gathers every rank must join) and write nothing. Returns the bytes of tensor data."""
    header, offset, dtypes = {}, 0, []
    for w in weights:
        kind = dtype if dtype is not None and w.dtype.is_floating_point else w.dtype
        dtypes.append(kind)
        size = kind.itemsize
        for dim in w.shape:
            size *= dim
        header[w.name] = {"dtype": SAFETENSORS_DTYPES[kind], "shape": list(w.shape),
                          "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") if write else _Discard() as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for w, kind in zip(weights, dtypes, strict=True):
            value = w.value()
            if tuple(value.shape) != w.shape:
                raise ValueError(f"weight {w.name}: shape {tuple(value.shape)}, expected {w.shape}")
            data = value.detach().to(device="cpu", dtype=kind).contiguous()
            f.write(memoryview(data.view(torch.uint8).reshape(-1).numpy()))
    return offset


class _Discard:
    """A file that writes nothing (ranks that only join the gathers)."""

    def __enter__(self) -> _Discard:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def write(self, data: object) -> None:
        pass


def iter_safetensors(path: str) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` of a safetensors file, memory-mapped (what the vLLM worker loads)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            yield name, f.get_tensor(name)
