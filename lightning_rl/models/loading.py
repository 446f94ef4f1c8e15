"""Resolving and loading models (``builtin:`` names, local folders, hub ids) and checking their files.

The ``builtin:`` names and the embedded tiny model are :mod:`lightning_rl.models.builtin`'s. Any other
``model`` value is a hub id or a local folder passed to ``from_pretrained``.

:func:`load_pretrained` is the one loader of ``builtin:`` names, local folders and hub ids, used for the
policy, the critic and the reward model. A value that is plainly a path (see :func:`looks_local`) is never
sent to the hub: a missing folder fails at once. A hub id is only downloaded after one short probe of the
hub; when the hub cannot be reached the local cache is used, or the load fails at once with a message
saying how to point at a local folder (``transformers`` alone retries for ~50 s and then blames the repo
id). Errors name the YAML key.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from transformers import PreTrainedTokenizerBase

from lightning_rl.models.builtin import (
    BUILTIN_FOLDERS,
    BUILTIN_MODELS,
    build_char_tokenizer,
    tiny_llama_config,
)
from lightning_rl.models.model_utils import DTYPES

if TYPE_CHECKING:
    from lightning_rl.models.policy import Policy

T = TypeVar("T")
# `dtype` values of the YAML (`model.policy.dtype`, ...) and what `from_pretrained(dtype=...)` receives
FROM_PRETRAINED_DTYPES: dict[str, torch.dtype | str] = {**DTYPES, "auto": "auto"}
LOCAL_HINT = "a local save_pretrained folder (e.g. `./my-model`)"
# Endings that make a value a file path, never a hub id (hub names may hold dots: `Qwen/Qwen2.5-0.5B`).
FILE_SUFFIXES = (
    ".jsonl", ".json", ".csv", ".parquet", ".arrow", ".txt", ".safetensors", ".bin", ".gguf", ".pt"
)


def looks_local(value: str) -> bool:
    """Whether ``value`` names a local path rather than a hub id.

    A path is absolute, starts with ``.`` or ``~``, has a first component that exists here, has more
    than one ``/`` (a hub id has at most one), or ends like a file (``.jsonl``, ``.safetensors``, ...).
    A missing ``dir/sub`` is indistinguishable from the hub id ``org/name`` and counts as a hub id: if the
    hub cannot be reached, the error says that no such local folder exists either.
    """
    if value.startswith((".", "~")) or os.path.isabs(value):
        return True
    parts = value.replace(os.sep, "/").split("/")
    return Path(parts[0]).exists() or len(parts) > 2 or value.lower().endswith(FILE_SUFFIXES)


def hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be used now, or ``None`` if it answered one short request.

    One HEAD request to the endpoint (``HF_ENDPOINT``) with ``HF_HUB_ETAG_TIMEOUT`` seconds, through
    ``huggingface_hub``'s session (so its proxy settings apply) and without retries. Any HTTP answer
    counts as reachable; errors about a repo itself are left to the loader that follows.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        get_session().head(constants.ENDPOINT, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except Exception as err:  # any failure to get an answer (DNS, refused, timeout, proxy) means unreachable
        return f"{constants.ENDPOINT} did not answer: {type(err).__name__}: {err}"
    return None


def hub_error(value: str, key: str, reason: str, local_hint: str) -> str:
    """The one-line message for a hub id that cannot be loaded because the hub is unreachable."""
    return (
        f"`{key}`: `{value}` is not a local path and the Hugging Face hub could not be reached ({reason}), "
        f"nor is it in the local cache; set `{key}` to {local_hint}, or fetch it where the hub is reachable"
    )


def resolve_builtin(name_or_path: str, key: str, builtins: Sequence[str] = BUILTIN_MODELS) -> str:
    """The folder of a shipped built-in model that ``builtins`` accepts (:data:`BUILTIN_FOLDERS`:
    ``builtin:tiny-sort``, ``builtin:tiny-tools``), or ``name_or_path`` unchanged when it is not a
    ``builtin:`` name. The caller builds any other built-in it accepts (``builtin:tiny-scratch``, from a
    config) before calling; ``builtins`` lists them all for the error message.

    Raises:
        ValueError: any other ``builtin:`` name, naming ``key``.
    """
    if name_or_path in BUILTIN_FOLDERS and name_or_path in builtins:
        return BUILTIN_FOLDERS[name_or_path]
    if name_or_path.startswith("builtin:"):
        raise ValueError(f"`{key}`: unknown built-in model `{name_or_path}`; choose from {tuple(builtins)}")
    return name_or_path


def check_model_folder(name_or_path: str, key: str) -> Path:
    """The folder of a local path (:func:`looks_local`), once it is known to hold a model.

    Raises:
        FileNotFoundError: the path does not exist.
        NotADirectoryError: it is a file, or a folder with neither ``config.json`` nor ``adapter_config.json``
            (a PEFT adapter folder, which ``transformers`` loads onto its base model).
    """
    folder = Path(name_or_path).expanduser()
    if not folder.exists():
        raise FileNotFoundError(f"`{key}`: model folder not found: {name_or_path}")
    if not folder.is_dir():
        raise NotADirectoryError(f"`{key}`: not a save_pretrained folder but a file: {name_or_path}")
    if not any((folder / name).is_file() for name in ("config.json", "adapter_config.json")):
        raise NotADirectoryError(f"`{key}`: not a save_pretrained folder (no config.json): {name_or_path}")
    return folder


def check_safetensors(path: Path, key: str) -> None:
    """Fail, naming ``path``, unless its header is whole and its tensors fit in the file (a truncated copy
    or another file renamed; ``safetensors`` alone says "invalid header length" without the file).

    Raises:
        ValueError: naming ``key`` and the file.
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        header = f.read(length) if 0 <= length <= size - 8 else b""
    why = None
    if length < 0 or length > size - 8:
        why = f"its header length says {length} bytes, the file has {size}" if length >= 0 else "no header"
    else:
        try:
            entries = json.loads(header)
            ends = [int(v["data_offsets"][1]) for k, v in entries.items() if k != "__metadata__"]
            end = max(ends, default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            why = "its header is not a safetensors header"
        else:
            if 8 + length + end > size:
                why = f"its tensors need {8 + length + end} bytes, the file has {size}"
    if why is not None:
        raise ValueError(f"`{key}`: {path} is corrupt or truncated ({why}): save the model again "
                         "(`save_pretrained`) or download it again")


def check_model_files(folder: Path, key: str) -> None:
    """A policy folder's files: every ``*.safetensors`` whole (:func:`check_safetensors`) and a tokenizer
    (:func:`check_tokenizer_files`), checked before ``transformers`` reads them."""
    for weights in sorted(folder.glob("*.safetensors")):
        check_safetensors(weights, key)
    check_tokenizer_files(folder, key)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def check_tokenizer_files(folder: Path, key: str) -> None:
    """Fail, naming the folder, when it holds no tokenizer (``AutoTokenizer`` then tries to convert a slow
    tokenizer it cannot find and blames sentencepiece / tiktoken).

    Raises:
        FileNotFoundError: naming ``key``, the folder and the files looked for.
    """
    if not any((folder / name).is_file() for name in TOKENIZER_FILES) and not any(folder.glob("*.tiktoken")):
        raise FileNotFoundError(
            f"`{key}`: {folder} has no tokenizer files ({' / '.join(TOKENIZER_FILES[:3])}, ...): save the "
            "tokenizer into it too (`tokenizer.save_pretrained(folder)`), or copy those files from the model "
            "it was trained from"
        )


def check_vocabulary(model: Any, tokenizer: PreTrainedTokenizerBase, source: str, key: str) -> None:
    """Fail when ``model`` has fewer embedding (or output) rows than ``tokenizer`` has tokens: a token id
    past them indexes outside the embedding (an ``IndexError`` mid-run, or nothing at all when the task's
    ids happen to fit). More rows than tokens is common (padded vocabularies) and fine.

    Raises:
        ValueError: naming ``key``, ``source`` and both sizes.
    """
    rows = [getattr(model.get_input_embeddings(), "num_embeddings", None)]
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    rows.append(getattr(getattr(output, "weight", None), "shape", [None])[0])
    known = [r for r in rows if isinstance(r, int)]
    tokens = len(tokenizer)
    if known and min(known) < tokens:
        vocab, fewest = getattr(getattr(model, "config", None), "vocab_size", None), min(known)
        raise ValueError(
            f"`{key}`: the model in {source} has {fewest} embedding rows (`config.vocab_size`={vocab}) but "
            f"its tokenizer has {tokens} tokens, so ids >= {fewest} have no embedding: use the tokenizer the "
            "model was trained with, or resize the model to it "
            "(`model.resize_token_embeddings(len(tokenizer))`) and save both again"
        )


def load_pretrained(
    name_or_path: str,
    load: Callable[[str, bool], T],
    *,
    key: str,
    local_hint: str = LOCAL_HINT,
    builtins: Sequence[str] = BUILTIN_MODELS,
) -> T:
    """``load(source, local_files_only)`` for ``builtin:tiny-sort``, a local folder or a hub id, failing fast
    with messages that name the config key ``key``: the one loader of policies, critics and reward models.

    A local path (:func:`looks_local`) is checked (:func:`check_model_folder`) and never sent to the hub. A
    hub id is loaded when the hub answers one short probe (:func:`hub_unreachable`); otherwise only from the
    local cache (``local_files_only=True``), and a miss there is a ``ConnectionError`` whose message tells
    the user to set ``key`` to ``local_hint``. ``load`` does the ``from_pretrained`` calls (model, config,
    tokenizer: all with the same ``local_files_only``).

    Raises:
        ValueError: an unknown ``builtin:`` name (:func:`resolve_builtin`).
        FileNotFoundError / NotADirectoryError: a local path that is missing or not a model folder.
        ConnectionError: a hub id while the hub is unreachable and the id is not in the local cache.
    """
    source = resolve_builtin(name_or_path, key, builtins)
    if looks_local(source):
        return load(str(check_model_folder(source, key)), False)
    reason = hub_unreachable()
    if reason is None:
        return load(source, False)
    try:  # a copy in the local cache still loads
        return load(source, True)
    except OSError:
        raise ConnectionError(hub_error(name_or_path, key, reason, local_hint)) from None


def torch_dtype(dtype: str | None, key: str) -> torch.dtype | str:
    """The ``dtype`` argument of ``from_pretrained`` for a config value: one of
    :data:`FROM_PRETRAINED_DTYPES`' names, or
    None for float32 (``transformers`` 5 alone would default to ``"auto"``, the checkpoint's dtype).

    Raises:
        ValueError: another name, naming ``key``.
    """
    if dtype is not None and dtype not in FROM_PRETRAINED_DTYPES:
        raise ValueError(f"`{key}`: dtype must be one of {sorted(FROM_PRETRAINED_DTYPES)} or None, "
                         f"got {dtype!r}")
    return FROM_PRETRAINED_DTYPES[dtype or "float32"]


def load_policy(
    model: str, dtype: str | None = None, trust_remote_code: bool = False, *, key: str = "model.policy.model"
) -> Policy:
    """Load the policy named by ``model`` (the config key ``key``, for messages).

    ``builtin:tiny-sort`` is the embedded model warm-started on the sort task, ``builtin:tiny-tools`` the
    same model warm-started on calculator tool traces; ``builtin:tiny-scratch`` is the same architecture
    freshly initialised; anything else is a local folder or a hub id, loaded by
    :func:`load_pretrained` (which fails at once on a missing folder or an unreachable hub). A local folder
    must hold whole weights files and a tokenizer (:func:`check_model_files`), and the model at least one
    embedding row per token of its tokenizer (:func:`check_vocabulary`).
    """
    from lightning_rl.models.policy import Policy  # here: policy.py may import this module

    if model == "builtin:tiny-scratch":
        tokenizer = build_char_tokenizer()
        return Policy.from_config(tiny_llama_config(tokenizer), tokenizer)
    def load(source: str, offline: bool) -> Policy:
        if looks_local(source):  # a folder that load_pretrained checked
            check_model_files(Path(source), key)
        policy = Policy.from_pretrained(source, dtype=dtype, trust_remote_code=trust_remote_code,
                                        local_files_only=offline)
        check_vocabulary(policy.model, policy.tokenizer, model, key)
        return policy

    return load_pretrained(model, load, key=key)


def with_adapters(policy: Policy, peft: Any, export_merged: bool = False) -> Policy:
    """``policy`` with ``peft`` adapters (``model.policy.peft``; ``None``: as it is), every base weight
    frozen, its trainable share logged; wrapped before any reference is built, which is then this model with
    adapters disabled. ``export_merged`` without adapters only warns."""
    from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

    from lightning_rl.models.adapters import is_peft_model, parameter_counts, wrap_model
    from lightning_rl.models.policy import Policy  # here: policy.py may import this module

    if peft is not None:
        policy = Policy(wrap_model(policy.model, peft), policy.tokenizer)
    if is_peft_model(policy.model):  # from `peft`, or a PeftModel built by the user
        trainable, total = parameter_counts(policy)
        rank_zero_info(f"PEFT: training {trainable:,} of {total:,} parameters ({trainable / total:.2%})")
    elif export_merged:
        rank_zero_warn("`model.policy.export_merged` has no effect without adapters (`model.policy.peft`): "
                       "the policy folder holds the full weights anyway")
    return policy
