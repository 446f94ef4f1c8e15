"""PreferenceDataModule and pair tokenisation: loading, errors, chat rendering, truncation, built-in pairs."""

from __future__ import annotations

import json

import datasets
import pytest

from lightning_rl.data import SortTask
from lightning_rl.data.preference import (
    BUILTIN_TRAIN,
    BUILTIN_VAL,
    PreferenceDataModule,
    encode_pairs,
    sort_pairs,
    split_implicit_prompt,
)
from lightning_rl.models.builtin import build_char_tokenizer

ROWS = [
    {"prompt": "12=", "chosen": "12", "rejected": "21", "answer": "12"},
    {"prompt": "331=", "chosen": "133", "rejected": "313", "answer": "133"},
    {"prompt": "9=", "chosen": "9", "rejected": "99", "answer": "9"},
    {"prompt": "54=", "chosen": "45", "rejected": "4", "answer": "45"},
]
# A minimal chat template over the character alphabet; the generation prompt is a prefix of the full text.
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture()
def tokenizer():
    return build_char_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def make_dm(path, **kwargs) -> PreferenceDataModule:
    dm = PreferenceDataModule(path=str(path), **kwargs)
    dm.setup("fit")
    return dm


# ---- loading -----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "save_to_disk"])
def test_loads_every_format_and_yields_raw_batches(tmp_path, fmt):
    if fmt == "jsonl":
        path = write_jsonl(tmp_path / "pairs.jsonl", ROWS)
    elif fmt == "parquet":
        path = str(tmp_path / "pairs.parquet")
        datasets.Dataset.from_list(ROWS).to_parquet(path)
    else:
        path = str(tmp_path / "saved")
        datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                              "test": datasets.Dataset.from_list(ROWS[:2])}).save_to_disk(path)
    dm = make_dm(path, batch_size=2, shuffle=False)
    assert [r["prompt"] for r in dm.train_rows] == [r["prompt"] for r in ROWS]
    assert len(dm.val_rows) == (2 if fmt == "save_to_disk" else 0)  # a file has no held-out split
    batch = next(iter(dm.train_dataloader()))
    assert (batch["prompt"] == ["12=", "331="] and batch["chosen"] == ["12", "133"]
            and batch["rejected"] == ["21", "313"])


def test_single_saved_dataset_is_not_its_own_validation_set(tmp_path):
    path = tmp_path / "one"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(path))
    dm = make_dm(path)
    assert len(dm.train_rows) == 4 and dm.val_rows == []
    dm = make_dm(path, val_path=write_jsonl(tmp_path / "val.jsonl", ROWS[:1]))
    assert [r["prompt"] for r in dm.val_rows] == ["12="]


def test_custom_columns_are_renamed(tmp_path):
    rows = [{"q": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in ROWS]
    dm = make_dm(write_jsonl(tmp_path / "p.jsonl", rows), prompt_column="q", chosen_column="good",
                 rejected_column="bad")
    assert dm.train_rows[1]["prompt"] == "331=" and dm.train_rows[1]["chosen"] == "133"
    assert "answer" not in dm.train_rows[0]  # no answer column: no greedy val/accuracy


def test_stream_position_resumes_exactly(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS * 4)
    full = iter(make_dm(path, batch_size=3).train_dataloader())
    batches = [next(full) for _ in range(7)]
    resumed = make_dm(path, batch_size=3)
    resumed.load_state_dict({"batches_consumed": 4})
    assert resumed.state_dict() == {"batches_consumed": 4}
    it = iter(resumed.train_dataloader())
    assert [next(it) for _ in range(3)] == batches[4:]


# ---- errors name the row and the field -----------------------------------------------------------
@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda rows: [{k: v for k, v in r.items() if k != "rejected"} for r in rows],
         ["data.rejected_column", "`rejected`"]),
        (lambda rows: rows[:2] + [{**rows[2], "chosen": ""}] + rows[3:], ["line 3", "`chosen`", "empty"]),
        (lambda rows: rows[:1] + [{**rows[1], "prompt": ""}] + rows[2:], ["line 2", "`prompt`", "empty"]),
        (lambda rows: [{k: v for k, v in r.items() if k != "prompt"} for r in rows],
         ["data.prompt_column", "`prompt`"]),
        (lambda rows: [{**r, "rejected": int(r["rejected"])} for r in rows],
         ["line 1", "`rejected`", "int 21"]),
    ],
    ids=["missing-column", "empty-chosen", "empty-prompt", "missing-prompt", "not-text"],
)
def test_bad_rows_fail_naming_row_and_field(tmp_path, mutate, expected):
    path = write_jsonl(tmp_path / "p.jsonl", mutate([dict(r) for r in ROWS]))
    with pytest.raises(ValueError) as err:
        make_dm(path)
    for text in expected:
        assert text in str(err.value)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "saved"])
def test_empty_dataset_fails(tmp_path, kind):
    empty = datasets.Dataset.from_list(ROWS).filter(lambda row: False)
    if kind == "jsonl":
        path = tmp_path / "e.jsonl"
        path.write_text("")
    elif kind == "parquet":
        path = tmp_path / "e.parquet"
        empty.to_parquet(str(path))
    else:
        path = tmp_path / "saved"
        empty.save_to_disk(str(path))
    with pytest.raises(ValueError, match="is empty"):
        make_dm(path)


def test_bad_batch_size_names_the_key():
    with pytest.raises(ValueError, match="data.batch_size"):
        PreferenceDataModule(batch_size=0)


# ---- conversational rows -----------------------------------------------------------------------------
def test_implicit_prompt_is_the_shared_conversation_prefix(tmp_path):
    user = {"role": "user", "content": "21="}
    rows = [
        {"chosen": [user, {"role": "assistant", "content": "12"}],
         "rejected": [user, {"role": "assistant", "content": "21"}]},
        {"chosen": [user, {"role": "assistant", "content": "12"}],
         "rejected": [user, {"role": "assistant", "content": "22"}]},
    ]
    dm = make_dm(write_jsonl(tmp_path / "c.jsonl", rows))
    assert dm.train_rows[0]["prompt"] == [user]
    assert dm.train_rows[0]["chosen"] == [{"role": "assistant", "content": "12"}]
    assert split_implicit_prompt([user], [{"role": "user", "content": "x"}]) == (
        [], [user], [{"role": "user", "content": "x"}])
    bad = [{"chosen": [user], "rejected": [{"role": "user", "content": "x"}]}]
    with pytest.raises(ValueError, match="line 1: .*share no leading prompt"):
        make_dm(write_jsonl(tmp_path / "bad.jsonl", bad))


def test_malformed_messages_fail(tmp_path):
    rows = [{"prompt": [{"content": "hi"}], "chosen": [{"role": "assistant", "content": "a"}],
             "rejected": [{"role": "assistant", "content": "b"}]}]
    with pytest.raises(ValueError, match="line 1: column `prompt`"):
        make_dm(write_jsonl(tmp_path / "m.jsonl", rows))


def test_conversational_rows_render_with_the_chat_template(tokenizer):
    tokenizer.chat_template = TEMPLATE
    prompt = [{"role": "system", "content": "sort"}, {"role": "user", "content": "31="}]
    enc = encode_pairs(
        tokenizer,
        [prompt],
        [[{"role": "assistant", "content": "13"}]],
        [[{"role": "assistant", "content": "31"}]],
        max_prompt_length=64,
        max_completion_length=16,
    )
    decode = lambda ids, mask: tokenizer.decode(ids[mask.bool()])  # noqa: E731
    assert decode(enc.prompt_ids[0], enc.prompt_mask[0]) == "[system]sort\n[user]31=\n[assistant]"
    assert decode(enc.prompt_ids[1], enc.prompt_mask[1]) == "[system]sort\n[user]31=\n[assistant]"
    # only the assistant turn (as the template ends it) plus EOS is scored
    assert decode(enc.completion_ids[0], enc.completion_mask[0]) == "13\n<eos>"
    assert decode(enc.completion_ids[1], enc.completion_mask[1]) == "31\n<eos>"
    # a plain-string prompt with chat_template on is one user message
    plain = encode_pairs(tokenizer, ["31="], ["13"], ["31"], max_prompt_length=64, max_completion_length=16,
                         chat_template=True)
    assert decode(plain.prompt_ids[0], plain.prompt_mask[0]) == "[user]31=\n[assistant]"


def test_messages_without_a_chat_template_fail(tokenizer):
    with pytest.raises(ValueError, match="chat template"):
        encode_pairs(tokenizer, [[{"role": "user", "content": "1"}]], ["a"], ["b"], max_prompt_length=8,
                     max_completion_length=8)


# ---- tokenisation: padding, masks, truncation --------------------------------------------------------
def test_encode_pairs_layout_and_masks(tokenizer):
    enc = encode_pairs(tokenizer, ["12=", "9="], ["12", "9"], ["21", "999"], max_prompt_length=16,
                       max_completion_length=16)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert enc.prompt_ids.shape == (4, 3) and enc.completion_ids.shape == (4, 4)
    # prompts left-padded (row order: chosen 0, chosen 1, rejected 0, rejected 1)
    assert enc.prompt_mask.tolist() == [[1, 1, 1], [0, 1, 1], [1, 1, 1], [0, 1, 1]]
    assert enc.prompt_ids[1, 0] == pad and enc.prompt_ids[1, 1:].tolist() == tokenizer("9=")["input_ids"]
    # completions right-padded, EOS appended and scored, padding not
    assert enc.completion_mask.tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert enc.completion_ids[3].tolist() == tokenizer("999")["input_ids"] + [eos]
    assert enc.completion_ids[1].tolist() == tokenizer("9")["input_ids"] + [eos, pad, pad]
    assert enc.prompt_truncated == 0 and enc.completion_truncated == 0


def test_truncation_cuts_prompts_left_and_completions_right_and_counts(tokenizer):
    enc = encode_pairs(
        tokenizer,
        ["abcdef=", "x="],
        ["123", "1"],
        ["1234", "12"],
        max_prompt_length=3,
        max_completion_length=3,
    )
    text = lambda row, ids, mask: tokenizer.decode(ids[row][mask[row].bool()])  # noqa: E731
    assert text(0, enc.prompt_ids, enc.prompt_mask) == "ef="  # the end of the prompt is kept
    assert text(1, enc.prompt_ids, enc.prompt_mask) == "x="
    assert text(0, enc.completion_ids, enc.completion_mask) == "123"  # EOS cut off
    assert text(2, enc.completion_ids, enc.completion_mask) == "123"
    assert text(3, enc.completion_ids, enc.completion_mask) == "12<eos>"
    assert enc.prompt_truncated == 1  # one pair's prompt (counted once, not per side)
    assert enc.completion_truncated == 2  # "123"+EOS and "1234"+EOS


# ---- the built-in pairs -----------------------------------------------------------------------------
def test_builtin_pairs_use_held_out_prompts_for_validation():
    dm = PreferenceDataModule()
    dm.setup("fit")
    task = SortTask()
    val_prompts = {r["prompt"] for r in task.val_rows()}
    assert len(dm.train_rows) == 4096 and len(dm.val_rows) == len(val_prompts)
    assert {r["prompt"] for r in dm.val_rows} == val_prompts
    assert not val_prompts & {r["prompt"] for r in dm.train_rows}
    assert dm.train_rows[7]["prompt"] == task.train_row(7)["prompt"]
    for row in dm.train_rows + dm.val_rows:
        assert row["chosen"] == row["answer"] == "".join(sorted(row["prompt"][:-1]))
        assert row["rejected"].strip() != row["answer"]


def test_builtin_pairs_regenerate_deterministically():
    from lightning_rl.models.loading import load_policy

    policy = load_policy("builtin:tiny-sort")
    shipped = [json.loads(line) for line in BUILTIN_VAL.read_text().splitlines()[:64]]
    regenerated = sort_pairs(policy, SortTask().val_rows()[:64], "sort-pairs-val-0")
    assert regenerated == shipped
    assert BUILTIN_TRAIN.exists()
    # the rejected answers really are the model's: mostly near misses of the right length
    assert sum(len(r["rejected"]) == 5 for r in regenerated) > len(regenerated) // 2
