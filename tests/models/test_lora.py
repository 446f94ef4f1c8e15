"""LoRA from the config (``model.policy.peft``): only the adapters train, the reference is the base with the
adapters off, checkpoints hold the adapters and resume exactly, both export forms reload in plain transformers
/ peft, DPO and PPO train adapters too, DDP and FSDP2 on 2 ranks, and a clear error without the extra."""

from __future__ import annotations

import json
import re
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers import CONFIGS, make, make_trainer, run_cli, scalars
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_rl.algorithms import DPO, GRPO, PPO
from lightning_rl.algorithms.options import PolicyOptions
from lightning_rl.callbacks import ExportPolicy
from lightning_rl.cli.main import ConfigError
from lightning_rl.data import PromptDataModule
from lightning_rl.data.preference import PreferenceDataModule
from lightning_rl.models.adapters import PEFT_EXTRA, base_state_dict
from lightning_rl.models.builtin import EMBEDDED_MODEL
from lightning_rl.models.model_utils import eval_mode

peft = pytest.importorskip("peft")

HERE = Path(__file__).resolve().parents[1]  # tests/
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"class_path": "peft.LoraConfig",
        "init_args": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ALL_LINEAR}}
IDS = torch.tensor([[5, 9, 12, 7, 8, 30, 17], [40, 41, 22, 5, 6, 70, 9]])
# the shortest run of configs/grpo_lora.yaml: 4 prompts x 4 samples per step, 16 held-out prompts
SMALL = ["--model.init_args.sampling.num_generations", "4", "--data.init_args.batch_size", "4",
         "--data.init_args.max_val_rows", "16", "--trainer.enable_progress_bar", "false"]


@pytest.fixture(scope="module")
def embedded() -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL).state_dict()


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad(), eval_mode(model):
        return model(input_ids=IDS).logits


def assert_only_adapters_trained(module, embedded: dict[str, torch.Tensor]) -> None:
    """Base weights bit-identical to the embedded model's, every lora_B moved away from its zero start."""
    base = base_state_dict(module.policy.model)
    assert set(base) == set(embedded)
    assert all(torch.equal(base[k], embedded[k]) for k in embedded)
    lora_b = [p for n, p in module.policy.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().max() > 0 for p in lora_b)


def optimised(optimizer) -> set[int]:
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


@pytest.mark.slow
def test_grpo_lora_yaml_trains_only_the_adapters_and_exports_the_adapter_folder(tmp_path, embedded):
    cli = run_cli("fit", "--config", CONFIGS / "grpo_lora.yaml", "--trainer.max_steps", "2", *SMALL,
                  "--trainer.val_check_interval", "2",  # validation at step 2 writes the checkpoint
                  "--trainer.logger.init_args.save_dir", tmp_path)
    module = cli.model
    assert isinstance(module.policy.model, peft.PeftModel)
    # the optimiser holds exactly the adapters (requires_grad), nothing of the frozen base
    adapters = {id(p) for n, p in module.policy.named_parameters() if "lora_" in n}
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    assert optimised(cli.trainer.optimizers[0]) == adapters == trainable
    assert_only_adapters_trained(module, embedded)
    # the KL reference is the same weights with the adapters off: no second copy
    assert module.reference_policy().shares_weights and list(module.reference_policy().parameters()) == []
    (run,) = (tmp_path / "lightning-rl").glob("version_*")
    assert "val/accuracy" in scalars(run) and "policy/kl_ref" in scalars(run)
    # the checkpoint holds the adapters and their optimiser state, not the frozen base
    (ckpt,) = (run / "checkpoints").glob("*.ckpt")
    saved = torch.load(ckpt, weights_only=False)
    assert saved["state_dict"] and all("lora_" in k for k in saved["state_dict"])
    assert len(saved["state_dict"]) == len(adapters)
    assert len(saved["optimizer_states"][0]["state"]) == len(adapters)
    # the export: peft's adapter folder (+ tokenizer) that reloads on the base model with identical logits
    folder = run / "policy"
    files = {p.name for p in folder.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= files
    assert not (folder / "model.safetensors").exists()
    assert json.loads((folder / "adapter_config.json").read_text())["task_type"] == "CAUSAL_LM"
    trained = logits(module.policy.model)
    on_base = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL), folder)
    assert torch.equal(logits(on_base), trained)
    assert torch.equal(logits(peft.AutoPeftModelForCausalLM.from_pretrained(folder)), trained)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.decode(tokenizer("31=")["input_ids"]) == "31="


RESUME = """
seed_everything: 3
trainer:
  max_steps: 4
  limit_val_batches: 0
  num_sanity_val_steps: 0
  enable_progress_bar: false
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: "{ckpt}", save_last: true, every_n_train_steps: 2, save_top_k: -1}}
model:
  init_args:
    sampling:
      num_generations: 4
    update:
      num_minibatches: 2
    policy:
      export_merged: {merged}
data:
  init_args:
    batch_size: 2
"""
KEYS = ["policy/loss", "policy/approx_kl", "policy/kl_ref", "policy/grad_norm", "rollout/reward_mean",
        "policy/ratio_mean"]


def _fit(tmp_path, name: str, ckpt: Path, max_steps: int, resume: bool = False, merged: bool = False):
    overlay = tmp_path / f"{name}.yaml"
    overlay.write_text(RESUME.format(ckpt=ckpt, merged=str(merged).lower()))
    args = ["fit", "--config", CONFIGS / "grpo_lora.yaml", "--config", overlay, "--trainer.max_steps",
            str(max_steps), "--trainer.logger.init_args.save_dir", tmp_path / name]
    cli = run_cli(*args, *(["--ckpt_path", "last"] if resume else []))
    (run,) = (tmp_path / name).glob("**/version_*")
    return cli.model, scalars(run), run / "policy"


@pytest.mark.slow
def test_lora_run_resumes_exactly_and_exports_merged_weights(tmp_path, embedded):
    """2 + 2 steps from an adapter-only checkpoint log and train exactly what 4 steps in one go do; the
    resumed run exports merged weights that plain ``AutoModelForCausalLM`` reloads."""
    full, full_logs, full_folder = _fit(tmp_path, "full", tmp_path / "ckpt_full", 4)
    _fit(tmp_path, "killed", tmp_path / "ckpt", 2)
    assert all("lora_" in k for k in torch.load(tmp_path / "ckpt" / "last.ckpt")["state_dict"])
    resumed, logs, folder = _fit(tmp_path, "resumed", tmp_path / "ckpt", 4, resume=True, merged=True)
    for key in KEYS:
        tail = [(s, v) for s, v in full_logs[key] if s > 2]
        again = [(s, v) for s, v in logs[key] if s > 2]
        assert len(tail) == 1 and [s for s, _ in tail] == [s for s, _ in again], (key, full_logs[key])
        assert tail[0][1] == pytest.approx(again[0][1], rel=1e-6, abs=1e-7), key
    a, b = (dict(m.policy.named_parameters()) for m in (full, resumed))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert_only_adapters_trained(resumed, embedded)
    # merged export: a plain causal LM folder, no adapter files, the trained module's logits
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert "adapter_config.json" not in names
    merged = AutoModelForCausalLM.from_pretrained(folder)
    assert not isinstance(merged, peft.PeftModel) and merged.config.tie_word_embeddings
    torch.testing.assert_close(logits(merged), logits(resumed.policy.model), rtol=0, atol=1e-5)
    uninterrupted = peft.AutoPeftModelForCausalLM.from_pretrained(full_folder)
    torch.testing.assert_close(logits(merged), logits(uninterrupted), rtol=0, atol=1e-5)


def test_reference_is_the_base_with_adapters_off_and_checkpointing_keeps_adapter_gradients(embedded):
    module = make(policy={"peft": LORA, "gradient_checkpointing": True}, objective={"kl_coef": 0.1})
    plain = make(objective={"kl_coef": 0.1})
    lora = sum(p.numel() for n, p in module.policy.named_parameters() if "lora_" in n)
    # no second copy: the module holds the base once plus the adapters (the plain module holds two copies)
    numel = lambda params: sum(p.numel() for p in params)  # noqa: E731
    assert numel(module.parameters()) == numel(plain.policy.parameters()) + lora
    shared = list(module.reference_policy().parameters())
    assert numel(plain.reference_policy().parameters()) > 0 == len(shared)
    with torch.no_grad():
        for n, p in module.policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    ids, mask = module.encode_prompts(["31=", "7737="])
    gen = module.policy.generate(ids, mask, num_samples=2, max_new_tokens=6)
    args = (gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask)
    ref, _ = module.reference_policy().token_logprobs(*args)
    base, _ = plain.reference_policy().token_logprobs(*args)  # the embedded model, unchanged
    torch.testing.assert_close(ref, base, rtol=0, atol=1e-5)
    # gradient checkpointing (non-reentrant): gradients reach every adapter through the frozen base
    logp, _ = module.policy.token_logprobs(*args)
    assert (logp - ref).abs().max() > 1e-3  # the adapters are on for the policy
    logp.sum().backward()
    lm = module.policy.model.get_base_model()
    assert getattr(lm, "is_activation_checkpointing", None) or lm.is_gradient_checkpointing
    for n, p in module.policy.named_parameters():
        assert (p.grad is not None and p.grad.abs().max() > 0) == ("lora_" in n), n


def test_dpo_with_lora_fits_and_exports_merged_weights(tmp_path, embedded):
    rows = [{"prompt": f"{n}=", "chosen": "".join(sorted(str(n))), "rejected": str(n)[::-1] + "7"}
            for n in (312, 9071, 57, 4410, 826, 73)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    module = DPO(policy=PolicyOptions(model="builtin:tiny-sort", max_prompt_length=16, peft=LORA,
                                      export_merged=True),
                 max_completion_length=10, optimizer=partial(torch.optim.AdamW, lr=1e-2))
    assert module.reference.shares_weights
    assert not any(k.startswith("reference.") for k in module.state_dict())
    trainer = make_trainer(tmp_path, max_steps=3, callbacks=[ExportPolicy(str(tmp_path / "policy"))],
                           log_every_n_steps=1)
    trainer.fit(module, PreferenceDataModule(path=str(path), batch_size=2))
    assert optimised(trainer.optimizers[0]) == {id(p) for p in module.parameters() if p.requires_grad}
    assert_only_adapters_trained(module, embedded)
    assert trainer.callback_metrics["rewards/margin"] != 0  # the policy moved away from the reference
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    torch.testing.assert_close(logits(merged), logits(module.policy.model), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_ppo_with_lora_trains_the_policy_adapters_and_a_full_critic(tmp_path, embedded):
    module = make(PPO, sampling={"num_generations": 1}, policy={"peft": LORA},
                  critic={"optimizer": partial(torch.optim.AdamW, lr=1e-3)})
    critic_start = {k: v.clone() for k, v in module.critic.model.model.state_dict().items()}
    # the critic's backbone starts from the base weights (no adapters in it)
    assert all(torch.equal(v, embedded[f"model.{k}"]) for k, v in critic_start.items())
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.fit(module, PromptDataModule(batch_size=4))
    policy_opt, critic_opt = trainer.optimizers
    assert optimised(policy_opt) == {id(p) for p in module.policy.parameters() if p.requires_grad}
    assert optimised(critic_opt) == {id(p) for p in module.critic.parameters()}
    assert_only_adapters_trained(module, embedded)
    moved = module.critic.model.model.state_dict()
    assert any(not torch.equal(moved[k], v) for k, v in critic_start.items())


def test_missing_peft_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError
    with pytest.raises(ImportError, match=f"model.policy.peft.*{re.escape(PEFT_EXTRA)}"):
        GRPO(policy=PolicyOptions(peft=LORA))
    with pytest.raises(ConfigError, match=re.escape(PEFT_EXTRA)):
        run_cli("fit", "--config", CONFIGS / "grpo_lora.yaml", "--trainer.logger.init_args.save_dir",
                tmp_path)
    GRPO(policy=PolicyOptions(peft=None))  # without adapters nothing needs peft


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"class_path": "peft.NoSuchConfig"}, "model.policy.peft.class_path"),
        ({"class_path": "torch.optim.AdamW"}, "not a peft.PeftConfig"),
        ({"class_path": "peft.LoraConfig", "init_args": {"rank": 4}}, "model.policy.peft.init_args"),
        ({"class_path": "peft.LoraConfig", "init_args": {"target_modules": ["qkv"]}}, "linear layers are"),
        ({"class_path": "peft.LoraConfig", "init_args": {"task_type": "SEQ_CLS"}}, "task_type"),
        ({"r": 4}, "class_path"),
    ],
)
def test_bad_peft_settings_name_the_key(spec, match):
    with pytest.raises(ValueError, match=match):
        GRPO(policy=PolicyOptions(peft=spec))


def test_lora_config_from_the_command_line_a_short_class_name_or_an_instance(tmp_path):
    from lightning_rl.cli.main import LightningRLCLI

    args = ["--config", CONFIGS / "grpo_lora.yaml", "--model.init_args.policy.peft.init_args.r", "2",
            "--trainer.logger.init_args.save_dir", tmp_path]
    cli = LightningRLCLI(args=[str(a) for a in args], run=False)
    short = GRPO(policy=PolicyOptions(peft={"class_path": "LoraConfig",
                                            "init_args": {"r": 2, "target_modules": ["q_proj"]}}))
    instance = GRPO(policy=PolicyOptions(peft=peft.LoraConfig(r=2, target_modules=["q_proj"])))
    for module in (cli.model, short, instance):
        assert module.policy.model.peft_config["default"].r == 2
    assert cli.model.policy.model.peft_config["default"].lora_alpha == 32  # the rest from the YAML


# ---- 2 ranks ------------------------------------------------------------------------------------------
def _lora_run(rank_jobs, strategy: str) -> tuple[Path, dict]:
    out = rank_jobs.out(f"{strategy}/lora")  # tests/fsdp2_fit.py lora 3
    return out, torch.load(out / "result.pt")


def _check_exports(out: Path, weights: dict[str, torch.Tensor], embedded: dict[str, torch.Tensor]) -> None:
    adapter = peft.AutoPeftModelForCausalLM.from_pretrained(out / "policy")
    reloaded = adapter.state_dict()
    assert set(reloaded) == set(weights)
    assert all(torch.equal(reloaded[k], weights[k]) for k in weights)
    base = base_state_dict(adapter)  # untouched by training
    assert all(torch.equal(base[k], embedded[k]) for k in embedded)
    assert any(v.abs().max() > 0 for k, v in weights.items() if "lora_B" in k)
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    torch.testing.assert_close(logits(merged), logits(adapter), rtol=0, atol=1e-5)


@pytest.mark.distributed
@pytest.mark.ranks("fsdp2/lora")
def test_fsdp2_grpo_with_lora_fits_shards_the_base_and_exports_both_forms(rank_jobs, embedded):
    out, result = _lora_run(rank_jobs, "fsdp2")
    assert result["global_step"] == 3 and {"val/accuracy", "policy/kl_ref"} <= set(result["metrics"])
    ranks = result["ranks"]
    assert all(r["sharded"] and r["reference_bytes"] == 0 for r in ranks)  # the reference is the policy
    _check_exports(out, result["weights"], embedded)


@pytest.mark.distributed
@pytest.mark.ranks("ddp/lora")
def test_ddp_grpo_with_lora_keeps_the_ranks_adapters_identical(rank_jobs, embedded):
    out, result = _lora_run(rank_jobs, "ddp")
    assert result["global_step"] == 3
    a, b = (r["adapters"] for r in result["ranks"])
    assert set(a) == set(b) and all("lora_" in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    _check_exports(out, result["weights"], embedded)
