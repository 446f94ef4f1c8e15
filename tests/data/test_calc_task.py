"""Tests for lightning_rl.data.calc_task (the multiplication task with a calculator tool), its
``data.task`` option on PromptDataModule, and the shipped ``builtin:tiny-tools`` model."""

from __future__ import annotations

import random
import re

import pytest

from lightning_rl.data import MultiplyTask, PromptDataModule
from lightning_rl.data.calc_task import tool_call, tool_trace_rows
from lightning_rl.models.builtin import BUILTIN_MODELS, TOOLS_MODEL, build_char_tokenizer
from lightning_rl.models.loading import load_policy, load_pretrained

ROW = {"prompt": "37*482=", "answer": "17834"}
CALL = '<tool>calculator("37*482")</tool>'


def factors(row):
    a, b = re.fullmatch(r"(\d+)\*(\d+)=", row["prompt"]).groups()
    return int(a), int(b)


def test_rows_are_deterministic_correct_and_in_range():
    task = MultiplyTask(num_train=300)
    rows = [task.train_row(i) for i in range(300)]
    assert rows == [MultiplyTask(num_train=300).train_row(i) for i in range(300)]
    assert rows != [MultiplyTask(num_train=300, seed=1).train_row(i) for i in range(300)]
    assert task.val_rows() == MultiplyTask().val_rows() and len(task.val_rows()) == 256
    for row in rows + task.val_rows():
        a, b = factors(row)
        assert 10 <= a <= 999 and 10 <= b <= 999
        assert row["answer"] == str(a * b)
    sizes = {len(str(a)) for row in rows for a in factors(row)}
    assert sizes == {2, 3}
    with pytest.raises(IndexError):
        task.train_row(300)


def test_held_out_pairs_never_appear_in_training():
    task = MultiplyTask()
    held_out = {factors(r) for r in task.val_rows()}
    assert len(held_out) == 256
    train = {factors(task.train_row(i)) for i in range(task.num_train)}
    assert not held_out & train
    # and the redraw really ran: some indices first drew a held-out pair (seeded as train_row seeds them)
    first_draws = []
    for i in range(task.num_train):
        rng = random.Random(f"multiply-train-0-{i}")
        first_draws.append((rng.randint(10, 999), rng.randint(10, 999)))
    redrawn = [i for i, pair in enumerate(first_draws) if pair in held_out]
    assert redrawn and all(factors(task.train_row(i)) != first_draws[i] for i in redrawn)


def test_trace_rows_are_the_episode_token_sequence():
    first, second = tool_trace_rows(ROW)
    assert first == {"prompt": "37*482=", "answer": CALL}
    assert second == {"prompt": f"37*482={CALL}<eos><result>17834</result>", "answer": "17834"}
    assert tool_call("37*482") == CALL
    tok = build_char_tokenizer()

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    # the text `<eos>` is the EOS id, exactly where the runner puts the EOS that ended turn 1
    assert tok.eos_token_id == 2
    assert ids(second["prompt"]) == ids("37*482=") + ids(CALL) + [2] + ids("<result>17834</result>")
    # the same with the tokenizer's default (what PromptDataModule prompts get): no BOS / EOS added
    assert tok(second["prompt"])["input_ids"] == ids(second["prompt"])
    with pytest.raises(ValueError, match="not a multiplication prompt"):
        tool_trace_rows({"prompt": "50318=", "answer": "01358"})


@pytest.mark.slow
def test_prompt_data_module_tasks():
    dm = PromptDataModule(task="multiply", batch_size=4)
    dm.setup("fit")
    assert dm.train_rows[:5] == [MultiplyTask().train_row(i) for i in range(5)]
    assert dm.val_rows == MultiplyTask().val_rows()

    traces = PromptDataModule(task="multiply_tool_traces", batch_size=4, max_val_rows=6)
    traces.setup("fit")
    assert len(traces.train_rows) == 2 * MultiplyTask().num_train
    assert traces.train_rows[:4] == tool_trace_rows(dm.train_rows[0]) + tool_trace_rows(dm.train_rows[1])
    # held out: the trace rows of the held-out problems, whole pairs (call row, copy row)
    assert traces.val_rows == [t for r in dm.val_rows[:3] for t in tool_trace_rows(r)]
    batch = next(iter(traces.train_dataloader()))
    assert set(batch) == {"prompt", "answer"} and len(batch["prompt"]) == 4

    sort = PromptDataModule(batch_size=4)  # the default is still the sort task
    sort.setup("fit")
    assert sort.train_rows[0]["prompt"].endswith("=") and "*" not in sort.train_rows[0]["prompt"]


def test_prompt_data_module_task_resumes_where_it_stopped():
    dm = PromptDataModule(task="multiply_tool_traces", batch_size=4)
    dm.setup("fit")
    stream = iter(dm.stream(dm.seed, 0))
    batches = [next(stream) for _ in range(3)]
    resumed = PromptDataModule(task="multiply_tool_traces", batch_size=4)
    resumed.load_state_dict({"batches_consumed": 2})
    resumed.setup("fit")
    assert next(iter(resumed.train_dataloader())) == batches[2]


def test_prompt_data_module_task_errors_name_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"^`data\.task`='multiply' is a built-in task.*`data\.path`"):
        PromptDataModule(path=str(tmp_path / "d.jsonl"), task="multiply")
    with pytest.raises(ValueError, match=r"^`data\.sort_digits` applies only to `data\.task: sort`"):
        PromptDataModule(task="multiply_tool_traces", sort_digits=3)
    with pytest.raises(ValueError, match=r"^`data\.task` must be one of"):
        PromptDataModule(task="add")


def test_builtin_tiny_tools_loads_with_the_char_tokenizer():
    assert "builtin:tiny-tools" in BUILTIN_MODELS
    assert load_pretrained("builtin:tiny-tools", lambda src, offline: src, key="k") == TOOLS_MODEL
    assert TOOLS_MODEL.endswith("tiny_tools")
    policy = load_policy("builtin:tiny-tools", None, False)
    char = build_char_tokenizer()
    assert policy.tokenizer.get_vocab() == char.get_vocab()
    assert policy.tokenizer.eos_token_id == 2 and policy.tokenizer.pad_token_id == 0
    assert policy.tokenizer.padding_side == "left"
    assert policy.model.config.eos_token_id == 2


def test_builtin_tiny_tools_calls_the_calculator_greedily():
    """The shipped warm start writes well-formed calls (its held-out episode success is in
    configs/sft_tools.yaml; the copy of the factors and of the result is what RL is left to improve)."""
    import torch

    policy = load_policy("builtin:tiny-tools", None, False)
    rows = MultiplyTask().val_rows()[:16]
    ids, mask = policy.encode_prompts([r["prompt"] for r in rows])
    with torch.no_grad():
        out = policy.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                                    eos_token_id=2, pad_token_id=0)
    texts = policy.tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
    calls = [re.fullmatch(r'<tool>calculator\("(\d+\*\d+)"\)</tool>', t) for t in texts]
    assert sum(c is not None for c in calls) >= 14, texts
