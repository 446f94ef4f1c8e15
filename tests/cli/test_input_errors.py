"""Issue 19, family 2 (and two of family 3): wrong inputs that used to stop in a library's words now stop at
setup, before any training step, with one ``lightning-rl: error:`` line naming the YAML key and the file
(and line), and leave an earlier run folder untouched; ``lr: 0`` and a slow reward function get a warning.

Each case runs the real CLI in this process (``lightning_rl.cli.main.main``, the ``lightning-rl`` entry
point): its
``SystemExit`` message is what Python prints last on stderr, with exit status 1.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers import CONFIGS, scalars

from lightning_rl.cli.main import main
from lightning_rl.data.rows import check_rows
from lightning_rl.models.builtin import build_char_tokenizer, tiny_llama_config
from lightning_rl.models.policy import Policy
from lightning_rl.step.reward_pipeline import RewardPipeline
from lightning_rl.step.reward_scorer import RewardScorer

HERE = Path(__file__).stem
ROWS = [{"prompt": f"{i}{i + 1}=", "answer": f"{i}{i + 1}"} for i in range(1, 9)]
TINY = ["--data.init_args.batch_size", "2", "--model.init_args.sampling.num_generations", "2",
        "--data.init_args.val_batch_size", "8", "--data.init_args.max_val_rows", "8",
        "--trainer.num_sanity_val_steps", "0", "--trainer.max_steps", "1",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def length_reward(completions, **_):
    """A reward that needs no data column."""
    return [float(len(c)) for c in completions]


def slow_reward(completions, **_):
    """0.8 s a call: far more than the rest of a tiny model's step (~0.25 s)."""
    time.sleep(0.8)
    return [0.0] * len(completions)


pytestmark = pytest.mark.usefixtures("one_thread")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def plant_run(tmp_path: Path) -> Path:
    """An earlier run's folder in the experiment the failing runs log to."""
    run = tmp_path / "runs" / "lightning-rl" / "version_0"
    (run / "checkpoints").mkdir(parents=True)
    (run / "policy").mkdir()
    (run / "config.yaml").write_text("model: earlier\n")
    (run / "checkpoints" / "epoch=0-step=2.ckpt").write_bytes(os.urandom(256))
    (run / "policy" / "model.safetensors").write_bytes(os.urandom(256))
    return run


def fit_args(tmp_path: Path, *extra: object, config: str = "grpo.yaml") -> list[str]:
    return ["fit", "--config", str(CONFIGS / config), *TINY, "--trainer.logger.init_args.save_dir",
            str(tmp_path / "runs"), *map(str, extra)]


def fails(tmp_path: Path, *extra: object, config: str = "grpo.yaml") -> str:
    """``lightning-rl fit`` with ``extra`` must stop with one error line (exit status 1) before any
    training step, leaving the planted run folder byte-identical; returns that line."""
    run = plant_run(tmp_path)
    before = digest(run)
    with pytest.raises(SystemExit) as stop:
        main(fit_args(tmp_path, *extra, config=config))
    line = stop.value.code
    assert isinstance(line, str), line  # a message: Python prints it to stderr and exits with status 1
    assert line.startswith("lightning-rl: error: ") and "\n" not in line, line
    assert digest(run) == before
    assert not list((tmp_path / "runs").rglob("policy/config.json"))  # nothing trained, nothing exported
    return line


def model_folder(path: Path, vocab_size: int | None = None) -> Path:
    """A tiny save_pretrained folder (policy + tokenizer); ``vocab_size`` shrinks the embedding."""
    tokenizer = build_char_tokenizer()
    config = tiny_llama_config(tokenizer, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    if vocab_size is not None:
        config.vocab_size = vocab_size
    Policy.from_config(config, tokenizer).save_pretrained(str(path))
    return path


# ---- data ------------------------------------------------------------------------------------------------
def test_prompt_that_is_a_number_names_file_line_and_column(tmp_path):
    rows = [*ROWS[:3], {"prompt": 5, "answer": "5"}, *ROWS[3:]]
    data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    line = fails(tmp_path, "--data.init_args.path", data)
    assert f"`data.path`={data} (split train), line 4: column `prompt` (data.prompt_column)" in line
    assert "holds the int 5" in line and 'quote it: "5"' in line


def test_prompts_may_be_messages_but_not_other_lists():
    messages = [{"role": "system", "content": "Sort."}, {"role": "user", "content": "312="}]
    check_rows([{"prompt": messages, "answer": "123"}], {"data.prompt_column": "prompt"}, "X")
    with pytest.raises(ValueError, match=r"X, row index 1: column `prompt` \(data.prompt_column\) holds the "
                                         r"list \[1, 2\], not a prompt"):
        check_rows([{"prompt": "1="}, {"prompt": [1, 2]}], {"data.prompt_column": "prompt"}, "X")


# ---- model folders ---------------------------------------------------------------------------------------
def test_model_folder_without_tokenizer_files_names_the_folder(tmp_path):
    folder = model_folder(tmp_path / "model")
    for f in folder.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            f.unlink()
    line = fails(tmp_path, "--model.init_args.policy.model", folder)
    assert (f"`model.policy.model`: {folder} has no tokenizer files (tokenizer.json / tokenizer_config.json"
            in line)
    assert "tokenizer.save_pretrained" in line


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_safetensors_names_the_file(tmp_path, damage):
    folder = model_folder(tmp_path / "model")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a safetensors file" * 20)
    line = fails(tmp_path, "--model.init_args.policy.model", folder)
    assert f"`model.policy.model`: {weights} is corrupt or truncated" in line


def test_vocabulary_smaller_than_the_tokenizer_fails_at_load(tmp_path):
    # 60 rows cover every id the sort task uses (digits, '='), so this run used to train and exit 0
    folder = model_folder(tmp_path / "model", vocab_size=60)
    line = fails(tmp_path, "--model.init_args.policy.model", folder)
    assert (f"`model.policy.model`: the model in {folder} has 60 embedding rows (`config.vocab_size`=60)"
            in line)
    assert "its tokenizer has 100 tokens" in line


# ---- scoring functions and the data's columns ------------------------------------------------------------
@pytest.mark.slow
def test_dynamic_sampling_without_answers_names_the_correctness_keys(tmp_path):
    """dapo.yaml's reward (exact_match) also decides correctness: without an answer column it used to fail
    at the first step with `exact_match() missing 1 required positional argument: 'answer'`."""
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": r["prompt"]} for r in ROWS])
    line = fails(tmp_path, "--data.init_args.path", data, "--data.init_args.answer_column", "null",
                 "--trainer.limit_val_batches", "0", config="dapo.yaml")
    assert line.startswith("lightning-rl: error: `model.init_args.rewards.functions` (also what decides "
                           "correctness (DAPO's filter")
    assert ("`model.init_args.rewards.correctness_fn` and `model.init_args.rewards.accuracy_fn` are unset"
            in line)
    assert "`lightning_rl.step.rewards:exact_match` needs the data column `answer`" in line
    assert f"train rows of `data.path`={data} do not have (columns: prompt)" in line
    assert "set `data.init_args.answer_column` to the column holding the reference answers" in line


def shaped_reward(completions, **_):
    """A shaped reward in [0, 0.9]: never the full score 1.0."""
    return [min(len(c), 9) / 10 for c in completions]


@pytest.mark.slow
def test_dynamic_sampling_on_a_shaped_reward_without_answers_trains_on_the_groups_that_differ(tmp_path):
    """dapo.yaml with prompts alone and a shaped reward: correctness (the reward at its full score) is never
    reached, and dynamic sampling used to drop every group; it compares the reward's score instead."""
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": r["prompt"]} for r in ROWS])
    main(fit_args(tmp_path, "--data.init_args.path", data, "--data.init_args.answer_column", "null",
                  "--model.init_args.rewards.functions", f"[{HERE}:shaped_reward]",
                  "--model.init_args.filters.max_gen_batches", "3", "--trainer.limit_val_batches", "0",
                  "--trainer.log_every_n_steps", "1", config="dapo.yaml"))
    logged = scalars(tmp_path / "runs")
    assert [v for _, v in logged["rollout/correct_frac"]] == [0.0]
    assert [v for _, v in logged["rollout/filtered_group_frac"]][0] < 1.0  # some group was kept


@pytest.mark.slow
def test_a_correctness_fn_that_needs_missing_columns_names_its_key(tmp_path):
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": r["prompt"]} for r in ROWS])
    line = fails(tmp_path, "--data.init_args.path", data, "--data.init_args.answer_column", "null",
                 "--model.init_args.rewards.functions", f"[{HERE}:length_reward]",
                 "--model.init_args.rewards.correctness_fn", "lightning_rl.step.rewards:exact_match",
                 "--trainer.limit_val_batches", "0", config="dapo.yaml")
    assert line.startswith("lightning-rl: error: `model.init_args.rewards.correctness_fn`: "
                           "`lightning_rl.step.rewards:exact_match` needs the data column `answer`")
    assert f"`data.path`={data}" in line and "`data.init_args.answer_column`" in line


@pytest.mark.slow
def test_validation_rows_without_the_accuracy_columns_name_the_val_file(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    val = write_jsonl(tmp_path / "val.jsonl", [{"prompt": r["prompt"], "solution": r["answer"]}
                                               for r in ROWS])
    line = fails(tmp_path, "--data.init_args.path", train, "--data.init_args.val_path", val,
                 "--data.init_args.answer_column", "null", "--trainer.limit_val_batches", "1")
    assert "needs the data column `answer`" in line
    assert f"val rows of `data.val_path`={val}" in line and "columns: prompt, solution" in line


# ---- warnings: lr 0, a slow reward function --------------------------------------------------------------
@pytest.mark.slow
def test_lr_zero_and_a_slow_reward_function_warn_once(tmp_path, recwarn):
    main(fit_args(tmp_path, "--model.init_args.optimizer.init_args.lr", "0",
                  "--model.init_args.rewards.functions", f"[{HERE}:slow_reward]",
                  "--trainer.limit_val_batches", "0", "--trainer.max_steps", "2"))
    messages = [str(w.message) for w in recwarn]
    lr = [m for m in messages if "`model.init_args.optimizer.init_args.lr` is 0: no weight will move" in m]
    slow = [m for m in messages if m.startswith("rewards took")]
    assert len(lr) == 1 and len(slow) == 1, messages
    assert f"the slowest is the reward function `{HERE}:slow_reward` at 0.8" in slow[0]
    assert "s per call (1 call)" in slow[0]


def test_lr_zero_warns_only_when_no_rate_ever_moves():
    from lightning_rl.algorithms.input_checks import warn_if_lr_is_zero

    param = torch.nn.Parameter(torch.zeros(1))

    def warned(lr: float, scheduler=None) -> bool:
        optimizer = torch.optim.SGD([param], lr=lr)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warn_if_lr_is_zero([optimizer], [scheduler(optimizer)] if scheduler else [])
        return any("no weight will move" in str(w.message) for w in caught)

    warmup = partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda step: min(1.0, step / 10))
    assert warned(0.0) and warned(0.0, warmup)
    assert not warned(1e-3) and not warned(1e-3, warmup)  # a warmup from 0 is fine


@pytest.mark.slow
def test_reward_timings_name_the_slowest_function_once():
    scorer = RewardScorer([f"{HERE}:length_reward", f"{HERE}:slow_reward"])
    pipeline = RewardPipeline(scorer, lambda prompts, completions, **_: [False] * len(completions))
    pipeline(["1="] * 2, ["1", "2"], [2, 2], {})
    assert set(pipeline.timings) == {f"reward function `{HERE}:length_reward`",
                                     f"reward function `{HERE}:slow_reward`",
                                     f"correctness function `{HERE}:test_reward_timings_name_the_slowest_"
                                     "function_once.<locals>.<lambda>`"}
    with pytest.warns(UserWarning, match=rf"slowest is the reward function `{HERE}:slow_reward` at 0\.8"):
        pipeline.warn_if_slow(0.9, 1.0)
    assert pipeline.timings == {}
    pipeline.timings["x"] = [5.0, 1]
    pipeline.warn_if_slow(5.0, 6.0)  # once per run: no second warning (pytest would fail on none here)
    pipeline.warned_slow = False
    pipeline.warn_if_slow(0.1, 1.0)  # half or less of the step: no warning
