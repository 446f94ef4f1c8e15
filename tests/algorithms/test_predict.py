"""``lightning-rl predict``: completions of a prompt file, scored, written once per sample with a summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import CONFIGS, make, make_trainer, run_cli
from rank_jobs import PREDICT_ROWS

from lightning_rl.callbacks import WritePredictions
from lightning_rl.data import PromptDataModule
from lightning_rl.step.rewards import exact_match

# held-out sort-task rows, and one the warm-started model gets right greedily ("80684=")
ROWS = PREDICT_ROWS
FIELDS = {"index", "sample", "prompt", "answer", "completion", "reward", "correct", "length"}
QUIET = ["--trainer.enable_progress_bar", "false"]


def prompt_file(folder: Path) -> Path:
    path = folder / "heldout.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in ROWS))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def predict(save_dir: Path, *extra: str, config: str = "grpo.yaml"):
    return run_cli("predict", "--config", CONFIGS / config, "--trainer.logger.init_args.save_dir", save_dir,
                   *QUIET, *extra)


def check_summary(rows: list[dict], summary: dict) -> None:
    n = len(rows)
    assert summary["samples"] == n and summary["prompts"] == len({r["index"] for r in rows})
    assert summary["accuracy"] == pytest.approx(sum(r["correct"] for r in rows) / n)
    assert summary["reward_mean"] == pytest.approx(sum(r["reward"] for r in rows) / n)
    assert summary["length_mean"] == pytest.approx(sum(r["length"] for r in rows) / n)


def test_predict_writes_each_sample_once_scored_by_the_reward_functions(tmp_path, caplog):
    with caplog.at_level("INFO"):
        predict(tmp_path, "--data.init_args.predict_path", prompt_file(tmp_path),
                "--predictions.num_generations", "2")
    run = tmp_path / "lightning-rl" / "version_0"
    rows = read_jsonl(run / "predictions.jsonl")
    assert len(rows) == len(ROWS) * 2
    assert [(r["index"], r["sample"]) for r in rows] == [(i, s) for i in range(len(ROWS)) for s in (0, 1)]
    for r in rows:
        assert set(r) == FIELDS
        assert (r["prompt"], r["answer"]) == ROWS[r["index"]]
        assert 1 <= r["length"] <= 8  # max_new_tokens of configs/grpo.yaml
    # the config's reward function (exact_match) and correctness (accuracy_fn: exact_match too)
    expected = exact_match([r["completion"] for r in rows], [r["answer"] for r in rows])
    assert [r["reward"] for r in rows] == expected
    assert [r["correct"] for r in rows] == [e == 1.0 for e in expected]
    assert len({r["completion"] for r in rows}) > len(ROWS)  # sampled (temperature 1.0), not greedy copies
    summary = json.loads((run / "predictions_summary.json").read_text())
    check_summary(rows, summary)
    assert summary["predictions"] == str(run / "predictions.jsonl")
    line = f"predict: 5 prompts, 10 samples: accuracy = {summary['accuracy']:.3f}"
    assert any(m.startswith(line) for m in caplog.messages)


def test_greedy_predictions_are_the_modules_greedy_completions(tmp_path):
    """One sample per prompt is greedy decoding, as validation does; `--predictions.output` is honoured."""
    out = tmp_path / "elsewhere" / "preds.jsonl"
    cli = predict(tmp_path, "--data.init_args.predict_path", prompt_file(tmp_path),
                  "--predictions.output", out)
    rows = read_jsonl(out)
    completions, lengths = cli.model.completer.greedy([p for p, _ in ROWS])
    assert [r["completion"] for r in rows] == completions and [r["length"] for r in rows] == lengths
    assert [r["sample"] for r in rows] == [0] * len(ROWS)
    assert any(r["correct"] for r in rows)  # the warm-started model sorts some of them
    check_summary(rows, json.loads((tmp_path / "elsewhere" / "preds_summary.json").read_text()))


@pytest.mark.slow
def test_predict_from_a_checkpoint_and_from_the_exported_policy(tmp_path):
    """Two training steps; the checkpoint's weights and the exported folder predict the same completions."""
    run_cli("fit", "--config", CONFIGS / "grpo.yaml", "--trainer.logger.init_args.save_dir", tmp_path, *QUIET,
            "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
            "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0",
            "--data.init_args.batch_size", "2", "--data.init_args.max_val_rows", "2",
            "--model.init_args.sampling.num_generations", "2",
            "--model.init_args.optimizer.init_args.lr", "1e-2")
    trained = tmp_path / "lightning-rl" / "version_0"
    (ckpt,) = (trained / "checkpoints").glob("*.ckpt")
    prompts = ["--data.init_args.predict_path", prompt_file(tmp_path)]
    from_ckpt = predict(tmp_path, *prompts, "--ckpt_path", ckpt)
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    loaded = from_ckpt.model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    from_folder = predict(tmp_path, *prompts, "--model.init_args.policy.model", trained / "policy")
    base = predict(tmp_path, *prompts)
    ckpt_rows, folder_rows, base_rows = (
        read_jsonl(tmp_path / "lightning-rl" / f"version_{v}" / "predictions.jsonl") for v in (1, 2, 3))
    assert ckpt_rows == folder_rows
    assert ckpt_rows != base_rows  # the trained weights, not the starting ones, answered
    del from_folder, base


def test_dpo_config_predicts_with_its_accuracy_fn_as_reward(tmp_path):
    """Without reward functions (DPO, SFT) the reward is `accuracy_fn`; a prompt file replaces the pairs."""
    predict(tmp_path, "--data", "lightning_rl.data.PromptDataModule", "--data.init_args.predict_path",
            prompt_file(tmp_path), config="dpo.yaml")
    rows = read_jsonl(tmp_path / "lightning-rl" / "version_0" / "predictions.jsonl")
    assert len(rows) == len(ROWS)
    assert [r["reward"] for r in rows] == [float(r["correct"]) for r in rows]
    assert [r["reward"] for r in rows] == exact_match([r["completion"] for r in rows], [a for _, a in ROWS])


def test_trainer_predict_adds_the_writer_itself(tmp_path):
    """`trainer.predict` from Python writes `<log_dir>/predictions.jsonl` without being given a writer;
    with no predict file the validation rows are used."""
    trainer = make_trainer(tmp_path)
    trainer.predict(make(), PromptDataModule(max_val_rows=3, val_batch_size=2))
    rows = read_jsonl(tmp_path / "predictions.jsonl")
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert any(isinstance(cb, WritePredictions) for cb in trainer.callbacks)


@pytest.mark.distributed
@pytest.mark.ranks("ddp/predict")
def test_predict_on_two_ranks_writes_each_prompt_once(tmp_path, rank_jobs):
    """5 prompts in batches of 2 on 2 ranks (tests/ddp_predict.py): rank 1 runs a placeholder batch, which
    is not written."""
    prompts, out = prompt_file(tmp_path), rank_jobs.out("ddp/predict")
    assert (out / "heldout.jsonl").read_text() == prompts.read_text()  # the job's prompts are these ROWS
    greedy, sampled = (read_jsonl(out / f"{name}.jsonl") for name in ("greedy", "sampled"))
    assert [(r["index"], r["prompt"]) for r in greedy] == [(i, p) for i, (p, _) in enumerate(ROWS)]
    assert [(r["index"], r["sample"]) for r in sampled] == [(i, s) for i in range(len(ROWS)) for s in (0, 1)]
    check_summary(sampled, json.loads((out / "sampled_summary.json").read_text()))
    # greedy completions do not depend on the world size
    one = tmp_path / "one.jsonl"
    make_trainer(tmp_path, callbacks=[WritePredictions(output=str(one))]).predict(
        make(), PromptDataModule(predict_path=str(prompts), val_batch_size=2))
    assert greedy == read_jsonl(one)
