"""A character-level tokenizer built with the `tokenizers` library.

Every printable ASCII character and the newline is one token, so any text over that alphabet
round-trips exactly. It is saved as an ordinary Hugging Face tokenizer folder, which
`AutoTokenizer.from_pretrained` reloads unchanged when the model config is a Llama one (a Qwen2 config
would rebuild it as a BPE `Qwen2Tokenizer` and silently drop characters: see DESIGN.md).
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

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
