"""The embedded models: the ``builtin:`` names, the character tokenizer and the tiny Llama config.

The embedded default is a 2-layer Llama over a character tokenizer made with the ``tokenizers``
library; its warm-started weights (``configs/sft.yaml``) ship as package data in
``lightning_rl/data/tiny_sort``, so every config runs with no network. ``builtin:tiny-tools`` is the same
model briefly warm-started on calculator tool traces (``configs/sft_tools.yaml``), in ``data/tiny_tools``.
``builtin:tiny-sort-teacher`` is the warm start after 600 steps of ``configs/grpo.yaml``
(``make teacher-model``), in ``data/tiny_sort_teacher``: the teacher of ``configs/distill.yaml``.
``builtin:tiny-scratch`` is the same architecture freshly initialised (:func:`tiny_llama_config`).

The tokenizer is saved as an ordinary Hugging Face tokenizer folder, which ``AutoTokenizer`` reloads
unchanged when the model config is a Llama one (a Qwen2 config would rebuild it as a BPE
``Qwen2Tokenizer`` and silently drop characters: see DESIGN.md).
"""

from __future__ import annotations

import string
from importlib.util import find_spec
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, PreTrainedTokenizerBase, PreTrainedTokenizerFast

# The package data folder of `lightning_rl.data`, located without importing that package (the core does
# not depend on the data package; find_spec only imports the parent, `lightning_rl`).
EMBEDDED_MODEL = str(Path(find_spec("lightning_rl.data").origin).parent / "tiny_sort")
TOOLS_MODEL = str(Path(EMBEDDED_MODEL).parent / "tiny_tools")  # warm-started on calculator tool traces
TEACHER_MODEL = str(Path(EMBEDDED_MODEL).parent / "tiny_sort_teacher")  # the warm start after GRPO
# the built-in names that are shipped folders; `builtin:tiny-scratch` is built from a config
BUILTIN_FOLDERS = {"builtin:tiny-sort": EMBEDDED_MODEL, "builtin:tiny-tools": TOOLS_MODEL,
                   "builtin:tiny-sort-teacher": TEACHER_MODEL}
BUILTIN_MODELS = ("builtin:tiny-sort", "builtin:tiny-tools", "builtin:tiny-sort-teacher",
                  "builtin:tiny-scratch")
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
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
