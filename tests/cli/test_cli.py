"""The `lightning-rl` CLI: every YAML in configs/ through the real parser, errors that name keys,
SFT end to end."""

from __future__ import annotations

import pytest
import torch
import yaml
from helpers import CONFIGS, ROOT, run_cli, scalars
from lightning.pytorch import LightningDataModule
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_rl.algorithms.trained import TrainedModule
from lightning_rl.cli.main import LightningRLCLI
from lightning_rl.maths.trust_regions import Clip

ALL_CONFIGS = sorted(CONFIGS.glob("*.yaml"))  # strategy overlays and examples: tests/test_overlays.py
# overlays beside the algorithm configs (any online config takes them)
TOP_OVERLAYS = {"async.yaml", "vllm.yaml", "vllm_server.yaml", "packed.yaml", "curriculum.yaml"}


def test_configs_exist():
    names = {p.name for p in ALL_CONFIGS}
    assert {"sft.yaml", "grpo.yaml", "gspo.yaml", "dapo.yaml", "sapo.yaml", "dpo.yaml"} <= names


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_config_instantiates(config, tmp_path):
    args = ["--config", config, "--trainer.logger.init_args.save_dir", tmp_path]
    if config.parent.name != "configs" or config.name in TOP_OVERLAYS:  # overlays go over the GRPO config
        args = ["--config", CONFIGS / "grpo.yaml", *args]
    if config.name == "ppo_rm.yaml":  # its reward model is what configs/reward_model.yaml trains first
        from lightning_rl.models.reward_network import load_reward_network

        load_reward_network("builtin:tiny-sort").save_pretrained(str(tmp_path / "rm"))
        args += ["--model.init_args.rewards.model", tmp_path / "rm"]
    cli = LightningRLCLI(args=[str(a) for a in args], run=False)
    assert isinstance(cli.model, TrainedModule)
    assert isinstance(cli.datamodule, LightningDataModule)
    assert cli.trainer.max_steps > 0


def test_misspelt_key_names_the_key(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_cli("fit", "--config", CONFIGS / "grpo.yaml", "--model.init_args.sampling.num_generatons", "4")
    err = capsys.readouterr().err
    assert "num_generatons" in err


def test_invalid_value_names_the_key(tmp_path):
    with pytest.raises(ValueError, match="model.sampling.num_generations"):
        run_cli("fit", "--config", CONFIGS / "grpo.yaml", "--model.init_args.sampling.num_generations", "1",
                "--trainer.logger.init_args.save_dir", tmp_path)


def test_print_config(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli("fit", "--config", CONFIGS / "grpo.yaml", "--print_config")
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert "class_path: lightning_rl.algorithms.GRPO" in out
    assert "kl_coef: 0.04" in out and "num_generations: 8" in out


GROUPS = {"policy", "sampling", "rewards", "episodes", "objective", "advantage", "filters", "logprobs",
          "update", "optimizer", "lr_scheduler"}


def printed_model(capsys, *configs) -> dict:
    """``model.init_args`` of ``lightning-rl fit --config ... --print_config``, parsed."""
    with pytest.raises(SystemExit) as exit_info:
        run_cli("fit", *[a for c in configs for a in ("--config", c)], "--print_config")
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]


def test_print_config_shows_the_groups_with_the_presets_defaults(capsys):
    """configs/dapo.yaml sets no `objective`: DAPO's own (clip-higher, token-mean) shows; GRPO's KL too."""
    dapo = printed_model(capsys, CONFIGS / "dapo.yaml")
    assert GROUPS <= set(dapo)
    assert dapo["objective"]["trust_region"] == {"class_path": "lightning_rl.maths.trust_regions.Clip",
                                                 "init_args": {"low": 0.2, "high": 0.28, "dual_clip": None}}
    assert dapo["objective"]["aggregation"] == "token-mean" and dapo["objective"]["kl_coef"] == 0.0
    assert dapo["filters"]["dynamic_sampling"] is True
    grpo = printed_model(capsys, CONFIGS / "grpo.yaml")
    assert GROUPS <= set(grpo)
    assert grpo["objective"]["kl_coef"] == 0.04
    assert grpo["objective"]["trust_region"]["init_args"]["high"] == 0.2
    assert grpo["filters"]["dynamic_sampling"] is False


def test_a_yaml_setting_one_field_of_a_group_keeps_the_presets_others(tmp_path, capsys):
    overlay = tmp_path / "kl.yaml"
    overlay.write_text("model:\n  init_args:\n    objective:\n      kl_coef: 0.01\n")
    printed = printed_model(capsys, CONFIGS / "dapo.yaml", overlay)["objective"]
    high = printed["trust_region"]["init_args"]["high"]
    assert (printed["kl_coef"], high, printed["aggregation"]) == (0.01, 0.28, "token-mean")
    cli = LightningRLCLI(args=["--config", str(CONFIGS / "dapo.yaml"), "--config", str(overlay),
                               "--trainer.logger.init_args.save_dir", str(tmp_path)], run=False)
    objective = cli.model.objective
    assert objective.kl_coef == 0.01 and cli.model.online.needs_reference
    assert objective.trust_region == Clip(low=0.2, high=0.28) and objective.aggregation == "token-mean"
    # one option of the trust region changed: the preset's other options and its class are kept
    high = tmp_path / "high.yaml"
    high.write_text("model:\n  init_args:\n    objective:\n      trust_region:\n        init_args:\n"
                    "          low: 0.1\n")
    cli = LightningRLCLI(args=["--config", str(CONFIGS / "dapo.yaml"), "--config", str(high),
                               "--trainer.logger.init_args.save_dir", str(tmp_path)], run=False)
    assert cli.model.objective.trust_region == Clip(low=0.1, high=0.28)


def test_omegaconf_interpolation(tmp_path):
    overlay = tmp_path / "interp.yaml"
    overlay.write_text("model:\n  init_args:\n    sampling:\n      max_new_tokens: 9\n"
                       "    policy:\n      max_prompt_length: ${model.init_args.sampling.max_new_tokens}\n")
    cli = LightningRLCLI(args=["--config", str(CONFIGS / "grpo.yaml"), "--config", str(overlay),
                               "--trainer.logger.init_args.save_dir", str(tmp_path)], run=False)
    assert cli.model.codec.max_prompt_length == 9


@pytest.mark.slow
def test_sft_regenerates_the_embedded_model(tmp_path):
    """configs/sft.yaml from scratch reaches >= 0.3 held-out greedy accuracy; the export loads in
    transformers."""
    run_cli("fit", "--config", CONFIGS / "sft.yaml", "--trainer.logger.init_args.save_dir", tmp_path,
            "--trainer.enable_progress_bar", "false")
    (run_dir,) = (tmp_path / "lightning-rl").glob("version_*")
    acc = scalars(run_dir)["val/accuracy"]
    assert acc[0][1] < 0.05, "from scratch the model should not sort yet"
    assert acc[-1][1] >= 0.3, acc
    assert (run_dir / "config.yaml").exists()
    model = AutoModelForCausalLM.from_pretrained(run_dir / "policy")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "policy")
    ids = tokenizer("50318=", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > ids.shape[1]


def test_embedded_model_is_shipped():
    from lightning_rl.models.builtin import EMBEDDED_MODEL

    assert (ROOT / "data" / "tiny_sort" / "model.safetensors").exists()
    assert EMBEDDED_MODEL.endswith("tiny_sort")


@pytest.mark.learning
def test_grpo_config_learns(tmp_path):
    """The demo config, cut to 50 steps, lifts held-out greedy accuracy well above the warm start (0.562)."""
    run_cli("fit", "--config", CONFIGS / "grpo.yaml", "--trainer.max_steps", "50",
            "--trainer.val_check_interval", "50",
            "--trainer.logger.init_args.save_dir", tmp_path, "--trainer.enable_progress_bar", "false")
    (run_dir,) = (tmp_path / "lightning-rl").glob("version_*")
    logged = scalars(run_dir)
    acc = [v for _, v in logged["val/accuracy"]]
    assert acc[-1] >= 0.66, acc
    rewards = [v for _, v in sorted(logged["rollout/reward_mean"])]
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10, "training reward should rise"


@pytest.mark.slow
def test_startup_drops_lightnings_tips_and_its_torch_deprecation_only(tmp_path):
    """``main`` silences Lightning's litlogger / litmodels tips and the ``LeafSpec`` deprecation torch 2.13
    raises inside Lightning's pytree code; Lightning's other lines and other warnings still print."""
    import subprocess
    import sys

    script = (
        "import sys, warnings, torch, lightning as L\n"
        "from lightning.pytorch.loggers import TensorBoardLogger\n"
        "from lightning.pytorch.utilities import _pytree\n"
        "from lightning_rl.cli.main import quiet_startup\n"
        "if sys.argv[1] == 'quiet': quiet_startup()\n"
        "L.Trainer(accelerator='cpu', logger=TensorBoardLogger(sys.argv[2]), enable_checkpointing=False)\n"
        "_pytree._tree_flatten({'a': torch.ones(1)})\n"
        "warnings.warn('a real warning', stacklevel=1)\n"
    )
    # the two interpreters start at once (each spends seconds importing Lightning)
    procs = {mode: subprocess.Popen([sys.executable, "-c", script, mode, str(tmp_path / mode)],
                                    stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
             for mode in ("loud", "quiet")}
    err = {mode: proc.communicate(timeout=120)[1] for mode, proc in procs.items()}
    assert all(proc.returncode == 0 for proc in procs.values()), err
    assert "Tip:" in err["loud"] and "LeafSpec" in err["loud"]  # what Lightning prints by itself
    assert "Tip:" not in err["quiet"] and "LeafSpec" not in err["quiet"]
    assert "GPU available" in err["quiet"] and "a real warning" in err["quiet"]
