"""LogSamples: prompt / completion tables in TensorBoard's Text tab, read back from the event files."""

from __future__ import annotations

import glob

import pytest
import torch
from helpers import CONFIGS, datamodule, make, make_trainer, run_cli, templated_model, texts
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_rl.callbacks import LogSamples
from lightning_rl.callbacks.base import RLCallback
from lightning_rl.callbacks.samples import escape_cell, markdown_table, spread_rows
from lightning_rl.step.rollout import Rollout


# ---- the table itself ------------------------------------------------------------------------------------
def test_cells_are_escaped_and_cut():
    assert escape_cell("<think>a|b</think>\nx*y_z`w") == (
        "&lt;think&gt;a\\|b&lt;/think&gt;<br>x\\*y\\_z\\`w")
    table = markdown_table(["3 1 2="], ["<think>" + "9" * 300 + "</think>42"], [0.5], [False], max_chars=21)
    header, rule, row = table.splitlines()
    assert header == "| prompt | completion | reward | correct |" and rule == "|---|---|---|---|"
    # 10 characters from the start, the mark, 10 from the end: the final answer stays visible
    assert row == "| 3 1 2= | &lt;think&gt;999…&lt;/think&gt;42 | 0.500 | no |"


def test_rows_spread_over_prompts_first():
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    assert spread_rows(groups, 4) == [0, 3, 1, 4]
    assert spread_rows(groups[:0], 4) == []


# ---- through TensorBoard -----------------------------------------------------------------------------------
class Record(RLCallback):
    """Keeps each rollout and the first validation batch's outputs."""

    def __init__(self) -> None:
        self.rollouts: list[tuple[int, int, Rollout]] = []
        self.val: list[tuple[int, dict]] = []

    def on_rollout_end(self, trainer, pl_module, rollout) -> None:
        self.rollouts.append((trainer.fit_loop.total_batch_idx, trainer.global_step, rollout))

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 0:
            self.val.append((trainer.global_step, outputs))


def expected_train(module, rollout: Rollout, k: int) -> str:
    part = rollout.select(torch.tensor(spread_rows(rollout.group_ids, k)))
    shown = torch.arange(part.completion_ids.shape[1])[None] < part.lengths[:, None]
    prompts = module.decode(part.prompt_ids, part.prompt_mask)
    completions = module.decode(part.completion_ids, shown.long())
    return markdown_table(prompts, completions, part.rewards.tolist(), part.correct.tolist())


@pytest.mark.slow
def test_train_and_val_tables_hold_the_steps_own_samples(tmp_path):
    module = make(sampling={"num_generations": 2})
    record, samples = Record(), LogSamples(log_samples_every_n_steps=2, num_samples=3)
    logger = TensorBoardLogger(str(tmp_path), name="run")
    trainer = make_trainer(tmp_path, max_steps=3, callbacks=[samples, record], logger=logger,
                           limit_val_batches=1, val_check_interval=3, check_val_every_n_epoch=None)
    trainer.fit(module, datamodule(batch_size=2, max_val_rows=4, val_batch_size=4))
    logged = texts(tmp_path)
    # rollouts 0 and 2 (of 0, 1, 2), at the optimiser step each started from
    assert [s for s, _ in logged["samples/train"]] == [0, 2]
    for (step, table), (_, start, rollout) in zip(logged["samples/train"], record.rollouts[::2], strict=True):
        assert step == start and table == expected_train(module, rollout, 3)
        assert len(table.splitlines()) == 2 + 3
    # some sampled rows are right and some wrong, so both rewards and verdicts are really read
    rows = [line for _, table in logged["samples/train"] for line in table.splitlines()[2:]]
    assert any(r.endswith("| 1.000 | yes |") for r in rows)
    assert any(r.endswith("| 0.000 | no |") for r in rows)

    ((val_step, table),) = logged["samples/val"]
    ((_, out),) = record.val
    assert val_step == 3
    correct = [float(c) for c in out["correct"][:3]]
    assert table == markdown_table(out["prompts"][:3], out["completions"][:3], correct, correct)
    first = table.splitlines()[2]
    assert first.startswith(f"| {out['prompts'][0]} | {out['completions'][0]} |")  # digits: nothing escaped


class ThinkingModule:
    """Stands in for a module whose completions hold markup (``decode`` is all LogSamples asks of it)."""

    def decode(self, ids, mask):
        return ["Sort: 3|1|2" if ids.shape[1] == 1 else "<think>a | b</think>\n<answer>1 2 3</answer>"
                for _ in range(len(ids))]


class FakeTrainer:
    def __init__(self, logger) -> None:
        self.loggers, self.is_global_zero, self.global_step = [logger], True, 7
        self.fit_loop = type("Loop", (), {"total_batch_idx": 0})()


def test_markup_is_escaped_in_the_event_file(tmp_path):
    logger = TensorBoardLogger(str(tmp_path), name="run")
    rollout = Rollout(prompt_ids=torch.ones(1, 1, dtype=torch.long), prompt_mask=torch.ones(1, 1),
                      completion_ids=torch.ones(1, 2, dtype=torch.long), attention_mask=torch.ones(1, 2),
                      loss_mask=torch.ones(1, 2),
                      truncated=torch.zeros(1, dtype=torch.bool), lengths=torch.tensor([2]),
                      group_ids=torch.tensor([0]), rewards=torch.tensor([1.0]), correct=torch.tensor([True]))
    LogSamples().on_rollout_end(FakeTrainer(logger), ThinkingModule(), rollout)
    logger.finalize("success")
    ((step, table),) = texts(tmp_path)["samples/train"]
    assert step == 7
    assert table.splitlines()[2] == (
        "| Sort: 3\\|1\\|2 | &lt;think&gt;a \\| b&lt;/think&gt;<br>&lt;answer&gt;1 2 3&lt;/answer&gt; "
        "| 1.000 | yes |")


@pytest.mark.slow
def test_other_loggers_get_nothing_and_no_error(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=1, callbacks=[LogSamples(log_samples_every_n_steps=1)],
                           logger=CSVLogger(str(tmp_path)), limit_val_batches=1, val_check_interval=1,
                           check_val_every_n_epoch=None)
    trainer.fit(make(sampling={"num_generations": 2}), datamodule(batch_size=2, max_val_rows=2))
    assert not glob.glob(f"{tmp_path}/**/events.out.tfevents.*", recursive=True)


@pytest.mark.parametrize("bad", [{"log_samples_every_n_steps": -1}, {"num_samples": 0}, {"max_chars": 0}])
def test_bad_settings_name_the_key(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        LogSamples(**bad)


@pytest.mark.slow
def test_shipped_config_logs_samples(tmp_path):
    """configs/grpo.yaml lists LogSamples: a 1-step run has a train table (rollout 0) and a val table."""
    run_cli("fit", "--config", CONFIGS / "grpo.yaml", "--trainer.logger.init_args.save_dir", tmp_path,
            "--trainer.max_steps", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_checkpointing", "false", "--trainer.num_sanity_val_steps", "0",
            "--trainer.val_check_interval", "1", "--trainer.limit_val_batches", "1",
            "--data.init_args.batch_size", "2", "--data.init_args.max_val_rows", "2",
            "--model.init_args.sampling.num_generations", "2")
    logged = texts(tmp_path)
    assert [s for s, _ in logged["samples/train"]] == [0] and [s for s, _ in logged["samples/val"]] == [1]
    assert len(logged["samples/train"][0][1].splitlines()) == 2 + 4  # num_samples: 4 (2 prompts x 2)



def test_train_and_val_tables_show_a_prompt_alike(tmp_path):
    """Both tables show a chat prompt as the model saw it: rendered through the template (the validation
    table once showed the raw messages, ``[{'role': 'system', ...}]``)."""
    import json

    from lightning_rl.data import PromptDataModule

    messages = [{"role": "system", "content": "sort"}, {"role": "user", "content": "321="}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"prompt": messages, "answer": "123"}) + "\n" for _ in range(4)))
    module = make(policy={"model": templated_model(tmp_path), "chat_template": True, "max_prompt_length": 40},
                  sampling={"num_generations": 2})
    trainer = make_trainer(tmp_path, max_steps=1, logger=TensorBoardLogger(str(tmp_path), name="run"),
                           callbacks=[LogSamples(log_samples_every_n_steps=1, num_samples=2)],
                           limit_val_batches=1, val_check_interval=1, check_val_every_n_epoch=None)
    trainer.fit(module, PromptDataModule(path=str(path), val_path=str(path), batch_size=2))
    logged = texts(tmp_path)
    cells = [row.split(" | ")[0].removeprefix("| ") for tag in ("samples/train", "samples/val")
             for row in logged[tag][0][1].splitlines()[2:]]
    assert cells == ["&lt;system&gt;sort&lt;user&gt;321=&lt;assistant&gt;"] * 4
