"""The one hub-or-local loader (``models.load_pretrained``) behind the policy, critic and reward model,
and the model helpers of ``model_utils`` (gradient checkpointing, ``logits_to_keep``)."""

from __future__ import annotations

import warnings

import huggingface_hub
import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_rl.models.builtin import EMBEDDED_MODEL, build_char_tokenizer, tiny_llama_config
from lightning_rl.models.critic import load_critic
from lightning_rl.models.loading import load_policy, load_pretrained, torch_dtype
from lightning_rl.models.model_utils import (
    enable_gradient_checkpointing,
    is_gradient_checkpointing,
    keep_logits,
)
from lightning_rl.models.reward_network import load_reward_network


@pytest.fixture()
def hub_down(tmp_path, monkeypatch):
    """The hub endpoint is a closed local port (refused at once) and the hub cache is empty."""
    constants = huggingface_hub.constants
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 3)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))


def tiny_model():
    tokenizer = build_char_tokenizer()
    config = tiny_llama_config(tokenizer, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    return AutoModelForCausalLM.from_config(config)


def test_load_pretrained_resolves_builtin_names_and_local_folders(tmp_path):
    def record(source, offline):
        return source, offline

    assert load_pretrained("builtin:tiny-sort", record, key="k") == (EMBEDDED_MODEL, False)
    with pytest.raises(ValueError, match=r"^`k`: unknown built-in model `builtin:nope`; choose from"):
        load_pretrained("builtin:nope", lambda src, offline: None, key="k")
    with pytest.raises(FileNotFoundError, match=r"^`k`: model folder not found: "):
        load_pretrained(str(tmp_path / "missing"), lambda src, offline: None, key="k")
    (tmp_path / "weights.safetensors").write_text("")
    with pytest.raises(NotADirectoryError, match=r"^`k`: not a save_pretrained folder but a file"):
        load_pretrained(str(tmp_path / "weights.safetensors"), lambda src, offline: None, key="k")
    with pytest.raises(NotADirectoryError, match=r"^`k`: not a save_pretrained folder \(no config\.json\)"):
        load_pretrained(str(tmp_path), lambda src, offline: None, key="k")
    (tmp_path / "config.json").write_text("{}")
    assert load_pretrained(str(tmp_path), record, key="k") == (str(tmp_path), False)


def test_a_hub_id_with_the_hub_down_tries_the_cache_then_names_the_key(hub_down):
    calls = []

    def load(source, offline):
        calls.append(offline)
        raise OSError("not cached")

    message = r"^`model\.x`: `org/name` is not a local path.*set `model\.x` to a local folder"
    with pytest.raises(ConnectionError, match=message):
        load_pretrained("org/name", load, key="model.x", local_hint="a local folder")
    assert calls == [True]  # only the cache, never the network


def test_policy_critic_and_reward_model_share_the_errors(tmp_path, hub_down):
    policy = load_policy("builtin:tiny-sort")
    for load, key in ((lambda v: load_policy(v), "model.policy.model"),
                      (lambda v: load_critic(v, policy), "model.critic.model"),
                      (lambda v: load_reward_network(v), "model.rewards.model")):
        with pytest.raises(FileNotFoundError, match=rf"^`{key}`: model folder not found"):
            load(str(tmp_path / "missing"))
        with pytest.raises(NotADirectoryError, match=rf"^`{key}`: not a save_pretrained folder"):
            load(str(tmp_path))
        with pytest.raises(ConnectionError, match=rf"^`{key}`: `org/not-cached` is not a local path"):
            load("org/not-cached")
        with pytest.raises(ValueError, match=rf"^`{key}`: unknown built-in model"):
            load("builtin:nope")
    with pytest.raises(ValueError, match=r"choose from \('builtin:tiny-sort',\)"):
        load_critic("builtin:tiny-scratch", policy)  # the critic has no config-built model


def test_dtype_names():
    assert torch_dtype(None, "k") is torch.float32 and torch_dtype("bfloat16", "k") is torch.bfloat16
    assert torch_dtype("auto", "k") == "auto"
    with pytest.raises(ValueError, match=r"^`model\.policy\.dtype`: dtype must be one of"):
        torch_dtype("fp32", "model.policy.dtype")


def test_gradient_checkpointing_helpers_use_the_current_api():
    model = tiny_model()
    assert not is_gradient_checkpointing(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation warning from transformers
        enable_gradient_checkpointing(model)
    assert is_gradient_checkpointing(model)
    model.train()
    ids = torch.randint(4, 20, (2, 5))
    model(ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_keep_logits_asks_for_the_last_positions_only():
    model = tiny_model()
    assert keep_logits(model, 3) == {"logits_to_keep": 3}
    assert model(torch.randint(4, 20, (2, 5)), **keep_logits(model, 3)).logits.shape[1] == 3
    assert keep_logits(model.model, 3) == {}  # the decoder alone has no LM head


def test_a_loaded_critic_takes_the_policy_dtype_not_the_checkpoint_s(tmp_path):
    """A critic folder saved in bf16 beside a float32 policy loads as float32 (it kept bf16 before, and
    trained without a float32 master copy); ``dtype`` set explicitly still wins."""
    policy = load_policy("builtin:tiny-sort")
    saved = load_policy("builtin:tiny-sort")
    saved.model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    saved.tokenizer.save_pretrained(tmp_path / "bf16")
    assert load_critic(str(tmp_path / "bf16"), policy).model.dtype == torch.float32
    assert load_critic(str(tmp_path / "bf16"), policy, dtype="bfloat16").model.dtype == torch.bfloat16
