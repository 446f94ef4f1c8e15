"""The small embedded model: a 2-layer Llama over the character tokenizer.

``EMBEDDED_MODEL`` is a ``save_pretrained`` folder shipped inside the package (a few MB), warm-started
on the sort task by ``configs/sft.yaml``, so every RL config starts from it with no network.
"""

from __future__ import annotations

from pathlib import Path

from transformers import LlamaConfig, PreTrainedTokenizerBase

EMBEDDED_MODEL = str(Path(__file__).resolve().parent / "tiny_sort")


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
