"""configs/strategy/ overlays through the real CLI: each composes with any algorithm config, resolves to
the intended Lightning strategy, never touches callbacks, and (DDP, FSDP2) builds a trainer on CPU."""

from __future__ import annotations

import math

import pytest
import yaml
from helpers import CONFIGS, run_cli, scalars
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from lightning_rl.cli.main import ConfigError, LightningRLCLI

STRATEGY = CONFIGS / "strategy"
OVERLAYS = sorted(STRATEGY.glob("*.yaml"))
ALGORITHMS = ["grpo.yaml", "dpo.yaml"]
# what each overlay must resolve to under `trainer` (only these keys may differ from the algorithm config)
EXPECTED = {
    "ddp.yaml": {"strategy": "ddp"},
    "multinode.yaml": {"strategy": "ddp", "num_nodes": 2},
    "fsdp2.yaml": {"strategy": {"class_path": "lightning_rl.models.strategies.FSDP2Strategy",
                                "init_args": {"data_parallel_size": "auto", "tensor_parallel_size": 1}}},
    "deepspeed_zero2.yaml": {"strategy": {"class_path": "lightning.pytorch.strategies.DeepSpeedStrategy",
                                          "init_args": {"stage": 2}}},
    "deepspeed_zero3.yaml": {"strategy": {"class_path": "lightning.pytorch.strategies.DeepSpeedStrategy",
                                          "init_args": {"stage": 3}}},
}


def resolved(capsys, *configs) -> dict:
    """``lightning-rl fit --config ... --print_config``, parsed."""
    args = [a for c in configs for a in ("--config", c)]
    with pytest.raises(SystemExit) as exit_info:
        run_cli("fit", *args, "--print_config")
    assert exit_info.value.code in (0, None)
    # importing DeepSpeed (for its strategy's class) logs its accelerator choice to stdout
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("[20")]
    return yaml.safe_load("\n".join(lines))


def contains(big, small) -> bool:
    if isinstance(small, dict):
        return isinstance(big, dict) and all(k in big and contains(big[k], v) for k, v in small.items())
    return big == small


def test_every_overlay_is_covered():
    assert {p.name for p in OVERLAYS} == set(EXPECTED)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.stem)
def test_overlay_sets_only_trainer_strategy_keys(overlay):
    """An overlay that set `trainer.callbacks` would replace the algorithm's list (DESIGN, traps)."""
    data = yaml.safe_load(overlay.read_text())
    assert set(data) == {"trainer"}
    assert set(data["trainer"]) <= {"strategy", "num_nodes"}, data["trainer"]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.stem)
def test_overlay_composes_with_algorithm_config(overlay, algorithm, capsys):
    base = resolved(capsys, CONFIGS / algorithm)
    composed = resolved(capsys, CONFIGS / algorithm, overlay)
    assert contains(composed["trainer"], EXPECTED[overlay.name]), composed["trainer"]
    # everything else is the algorithm config's, callbacks included
    assert composed["model"] == base["model"] and composed["data"] == base["data"]
    changed = {k for k in base["trainer"] if base["trainer"][k] != composed["trainer"][k]}
    assert changed <= set(EXPECTED[overlay.name]), changed


def test_overlay_keeps_callbacks_set_by_an_earlier_config(tmp_path, capsys):
    user = tmp_path / "user.yaml"
    user.write_text("trainer:\n  callbacks:\n"
                    "    - class_path: lightning.pytorch.callbacks.LearningRateMonitor\n")
    composed = resolved(capsys, CONFIGS / "grpo.yaml", user, STRATEGY / "fsdp2.yaml")
    assert [c["class_path"] for c in composed["trainer"]["callbacks"]] == [
        "lightning.pytorch.callbacks.LearningRateMonitor"]


def build(tmp_path, algorithm: str, overlay: str, *extra: str) -> LightningRLCLI:
    args = ["--config", CONFIGS / algorithm, "--config", STRATEGY / overlay,
            "--trainer.logger.init_args.save_dir", tmp_path, *extra]
    return LightningRLCLI(args=[str(a) for a in args], run=False)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_ddp_overlay_instantiates(tmp_path, algorithm):
    cli = build(tmp_path, algorithm, "ddp.yaml")
    assert isinstance(cli.trainer.strategy, DDPStrategy)
    assert cli.trainer.num_devices == 1 and cli.trainer.num_nodes == 1


def test_multinode_overlay_instantiates(tmp_path):
    cli = build(tmp_path, "grpo.yaml", "multinode.yaml")
    assert isinstance(cli.trainer.strategy, DDPStrategy)
    assert cli.trainer.num_nodes == 2


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_fsdp2_overlay_instantiates(tmp_path, algorithm):
    cli = build(tmp_path, algorithm, "fsdp2.yaml")
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ModelParallelStrategy)
    assert strategy.mesh_sizes() == (1, 1)
    # shards over every rank without a number; only tensor parallelism needs one
    cli = build(tmp_path, algorithm, "fsdp2.yaml", "--trainer.devices", "2")
    assert cli.trainer.strategy.mesh_sizes() == (2, 1)
    cli = build(tmp_path, algorithm, "fsdp2.yaml", "--trainer.devices", "2",
                "--trainer.strategy.init_args.tensor_parallel_size", "2")
    assert cli.trainer.strategy.mesh_sizes() == (1, 2)
    cli = build(tmp_path, algorithm, "fsdp2.yaml", "--trainer.devices", "2",
                "--trainer.strategy.init_args.data_parallel_size", "4")
    with pytest.raises(ValueError, match=r"`trainer.strategy.init_args.data_parallel_size` 4 x .* size 2"):
        cli.trainer.strategy.mesh_sizes()


@pytest.fixture
def without_deepspeed(monkeypatch):
    """The config check as it runs where the `deepspeed` extra is not installed."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real(name, *a))


@pytest.mark.parametrize("overlay", ["deepspeed_zero2.yaml", "deepspeed_zero3.yaml"])
def test_deepspeed_overlay_without_deepspeed_fails_naming_it(tmp_path, overlay, without_deepspeed):
    with pytest.raises(ConfigError, match="DeepSpeed installed") as info:
        build(tmp_path, "grpo.yaml", overlay)
    assert "lightning-rl[deepspeed]" in str(info.value)
    assert "Union" not in str(info.value)


@pytest.mark.parametrize(("overlay", "stage"), [("deepspeed_zero2.yaml", 2), ("deepspeed_zero3.yaml", 3)])
def test_deepspeed_overlay_builds_and_takes_clipping_from_the_model(tmp_path, overlay, stage):
    """The module writes what DeepSpeed must decide into the engine config before Lightning formats it:
    its ``max_grad_norm`` as ``gradient_clipping`` (the engine clips), and a micro-batch size for the
    throughput log (Lightning would otherwise read a batch sampler our prompt loaders do not have)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    cli = build(tmp_path, "grpo.yaml", overlay, "--model.init_args.update.max_grad_norm", "0.5")
    strategy = cli.trainer.strategy
    assert isinstance(strategy, DeepSpeedStrategy) and strategy.config["zero_optimization"]["stage"] == stage
    cli.model.trainer = cli.trainer
    cli.model.setup("fit")
    assert strategy.config["gradient_clipping"] == 0.5
    assert strategy.config["train_micro_batch_size_per_gpu"] == 1


# ---- configs/examples/qwen2_gsm8k_fsdp2.yaml ---------------------------------------------------------
EXAMPLE = CONFIGS / "examples" / "qwen2_gsm8k_fsdp2.yaml"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QUESTIONS = [
    ("Natalia sold clips to 48 of her friends in April, then half as many in May. How many in all?", "72"),
    ("Weng earns $12 an hour for babysitting. Yesterday she did 50 minutes. How much did she earn?", "10"),
    ("Betty needs $100 for a wallet. She has half of it. How much more does she need?", "50"),
    ("James writes a 3-page letter to 2 friends twice a week. How many pages a year?", "624"),
]


def tiny_qwen2(folder) -> None:
    """A random-init Qwen2 model with a small byte-level BPE tokenizer (Qwen's own kind, so it reloads
    unchanged as ``Qwen2Tokenizer``, unlike a character vocabulary) and a ChatML template."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([q for q, _ in QUESTIONS] + ["0123456789 #### user assistant"], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=None, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def gsm8k_jsonl(path) -> None:
    import json

    rows = [{"question": q, "answer": f"Some working.\n#### {a}"} for q, a in QUESTIONS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_example_resolves_through_the_cli(capsys):
    config = resolved(capsys, EXAMPLE)
    trainer, model, data = config["trainer"], config["model"]["init_args"], config["data"]["init_args"]
    strategy = {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                "init_args": {"data_parallel_size": 8, "tensor_parallel_size": 1}}
    assert contains(trainer, {"accelerator": "gpu", "devices": 8, "num_nodes": 1, "precision": "bf16-mixed",
                              "strategy": strategy}), trainer
    assert "callbacks" not in trainer or not trainer["callbacks"]
    assert config["model"]["class_path"] == "lightning_rl.algorithms.GRPO"
    policy = model["policy"]
    assert policy["model"] == "Qwen/Qwen2.5-0.5B-Instruct" and policy["chat_template"] is True
    assert model["rewards"]["functions"] == ["lightning_rl.step.math_rewards:math_verify_reward"]
    assert (data["prompt_column"], data["answer_column"]) == ("question", "answer")


@pytest.mark.slow
def test_example_runs_one_step_on_cpu_with_a_tiny_qwen2(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, data_file = tmp_path / "tiny-qwen2", tmp_path / "gsm8k.jsonl"
    tiny_qwen2(model_dir)
    gsm8k_jsonl(data_file)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    for question, _ in QUESTIONS:  # the reloaded tokenizer round-trips (no dropped characters)
        assert tokenizer.decode(tokenizer(question).input_ids) == question
    run_cli("fit", "--config", EXAMPLE, "--model.init_args.policy.model", model_dir,
            "--data.init_args.path", data_file, "--data.init_args.val_path", data_file,
            "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.strategy", "auto",
            "--trainer.precision", "32", "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0",
            "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
            "--model.init_args.sampling.max_new_tokens", "8",
            "--model.init_args.sampling.num_generations", "4",
            "--data.init_args.batch_size", "2", "--trainer.logger.init_args.save_dir", tmp_path / "runs")
    (run_dir,) = (tmp_path / "runs" / "qwen2-gsm8k-fsdp2").glob("version_*")
    logged = scalars(run_dir)
    assert [s for s, _ in logged["policy/loss"]] == [1]
    assert "rollout/reward_mean" in logged
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["init_args"]["policy"]["chat_template"] is True
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "policy")
    assert type(exported).__name__ == "Qwen2ForCausalLM"
    # a random model scores 0 on every sample (zero advantages, policy = reference), so the weights need
    # not move in one step at lr 1e-6: the step itself, its metrics and the reloadable export are the check
    assert math.isfinite(logged["policy/grad_norm"][0][1])
