"""Building and resolving models: ``builtin:`` names, the character tokenizer and tiny configs.

The embedded default is a 2-layer Llama over a character tokenizer made with the ``tokenizers``
library; its warm-started weights (``configs/sft.yaml``) ship as package data in
``lightning_rl/data/tiny_sort``, so every config runs with no network. ``builtin:tiny-tools`` is the same
model briefly warm-started on calculator tool traces (``configs/sft_tools.yaml``), in ``data/tiny_tools``.
Any other ``model`` value is a hub id or a local folder passed to ``from_pretrained``.

:func:`load_pretrained` is the one loader of ``builtin:`` names, local folders and hub ids, used for the
policy, the critic and the reward model. A value that is plainly a path (see :func:`looks_local`) is never
sent to the hub: a missing folder fails at once. A hub id is only downloaded after one short probe of the
hub; when the hub cannot be reached the local cache is used, or the load fails at once with a message
saying how to point at a local folder (``transformers`` alone retries for ~50 s and then blames the repo
id). Errors name the YAML key.

The tokenizer is saved as an ordinary Hugging Face tokenizer folder, which ``AutoTokenizer`` reloads
unchanged when the model config is a Llama one (a Qwen2 config would rebuild it as a BPE
``Qwen2Tokenizer`` and silently drop characters: see DESIGN.md).
"""

from __future__ import annotations

import json
import os
import string
from collections.abc import Callable, Sequence
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, PreTrainedTokenizerBase, PreTrainedTokenizerFast

if TYPE_CHECKING:
    from lightning_rl.models.policy import Policy

T = TypeVar("T")
# The package data folder of `lightning_rl.data`, located without importing that package (the core does
# not depend on the data package; find_spec only imports the parent, `lightning_rl`).
EMBEDDED_MODEL = str(Path(find_spec("lightning_rl.data").origin).parent / "tiny_sort")
TOOLS_MODEL = str(Path(EMBEDDED_MODEL).parent / "tiny_tools")  # warm-started on calculator tool traces
# the built-in names that are shipped folders; `builtin:tiny-scratch` is built from a config
BUILTIN_FOLDERS = {"builtin:tiny-sort": EMBEDDED_MODEL, "builtin:tiny-tools": TOOLS_MODEL}
BUILTIN_MODELS = ("builtin:tiny-sort", "builtin:tiny-tools", "builtin:tiny-scratch")
# `dtype` values of the YAML (`model.policy.dtype`, ...) and what `from_pretrained(dtype=...)` receives
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}
LOCAL_HINT = "a local save_pretrained folder (e.g. `./my-model`)"
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# Endings that make a value a file path, never a hub id (hub names may hold dots: `Qwen/Qwen2.5-0.5B`).
FILE_SUFFIXES = (
    ".jsonl", ".json", ".csv", ".parquet", ".arrow", ".txt", ".safetensors", ".bin", ".gguf", ".pt"
)
ALPHABET = "".join(sorted(set(string.printable) - set("\t\r\x0b\x0c")))  # printable ASCII + space + newline


def build_char_tokenizer(alphabet: str = ALPHABET) -> PreTrainedTokenizerFast:
    """Return a fast tokenizer with one token per character of ``alphabet``.

    Ids: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3, then the alphabet in order. No BOS or EOS
    is added when encoding: the tasks append EOS to targets themselves.
    """
    chars = list(dict.fromkeys(alphabet))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(chars)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # One token per character, spaces and newlines included (no whitespace splitting or stripping).
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )
    return tokenizer


def tiny_llama_config(
    tokenizer: PreTrainedTokenizerBase,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 512,
    max_position_embeddings: int = 256,
) -> LlamaConfig:
    """A small Llama config whose vocabulary and special ids match ``tokenizer``."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
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
    """The ``dtype`` argument of ``from_pretrained`` for a config value: one of :data:`DTYPES`' names, or
    None for float32 (``transformers`` 5 alone would default to ``"auto"``, the checkpoint's dtype).

    Raises:
        ValueError: another name, naming ``key``.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"`{key}`: dtype must be one of {sorted(DTYPES)} or None, got {dtype!r}")
    return DTYPES[dtype or "float32"]


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
