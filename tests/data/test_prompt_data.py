"""Tests for lightning_rl.data.prompts: loading every file form, column mapping, data errors, the built-in
task, and the seeded, checkpointable PromptStream (and its refill stream)."""

from __future__ import annotations

import itertools

import datasets
import pytest

from lightning_rl.data import PromptDataModule
from lightning_rl.data.curriculum import Curriculum, CurriculumDraws
from lightning_rl.data.prompts import PromptStream, collate
from lightning_rl.data.rows import check_rows
from lightning_rl.episodes.source import PromptBatches

ROWS = [{"question": f"{i}{i + 1}{i + 2}=", "solution": f"q{i}", "difficulty": i % 3} for i in range(10)]


def write(tmp_path, kind: str, rows=ROWS):
    ds = datasets.Dataset.from_list(rows)
    path = tmp_path / {"jsonl": "d.jsonl", "csv": "d.csv", "parquet": "d.parquet", "disk": "saved"}[kind]
    if kind == "jsonl":
        ds.to_json(str(path))
    elif kind == "csv":
        ds.to_csv(str(path), index=False)
    elif kind == "parquet":
        ds.to_parquet(str(path))
    else:
        ds.save_to_disk(str(path))
    return path


def make_dm(path, **kw):
    dm = PromptDataModule(path=str(path), prompt_column="question", answer_column="solution", batch_size=2,
                          **kw)
    dm.setup("fit")
    return dm


# -------------------------------------------------------------------------------------------- loading
@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet", "disk"])
def test_every_file_form_with_custom_columns(tmp_path, kind):
    dm = make_dm(write(tmp_path, kind))
    assert len(dm.train_rows) == 10
    for i, row in enumerate(dm.train_rows):
        # configured columns exposed as prompt / answer, every original column kept
        assert row["prompt"] == row["question"] == f"{i}{i + 1}{i + 2}="
        assert row["answer"] == row["solution"] == f"q{i}"
        assert int(row["difficulty"]) == i % 3
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"question", "solution", "difficulty", "prompt", "answer"}
    assert len(batch["prompt"]) == 2


def test_save_to_disk_dataset_dict_uses_splits(tmp_path):
    ds = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict({"train": ds.select(range(7)), "test": ds.select(range(7, 10))}).save_to_disk(
        str(tmp_path / "dd"))
    dm = make_dm(tmp_path / "dd")
    assert [r["prompt"] for r in dm.train_rows] == [r["question"] for r in ROWS[:7]]
    assert [r["prompt"] for r in dm.val_rows] == [r["question"] for r in ROWS[7:]]
    with pytest.raises(ValueError, match=r"split `nope` not in the saved dataset.*\['test', 'train'\]"):
        make_dm(tmp_path / "dd", split="nope")


def test_val_path_and_max_val_rows(tmp_path):
    val = tmp_path / "val"
    val.mkdir()
    val_path = write(val, "jsonl", ROWS[:6])
    dm = make_dm(write(tmp_path, "parquet"), val_path=str(val_path), max_val_rows=4)
    assert [r["prompt"] for r in dm.val_rows] == [r["question"] for r in ROWS[:4]]
    assert all(r["answer"] == r["solution"] for r in dm.val_rows)


@pytest.mark.parametrize("kind", ["jsonl", "disk"])
def test_single_file_without_val_split_has_no_validation(tmp_path, kind):
    # PromptDataModule docstring: val_path None -> `val_split` of `path` if it exists, else no validation.
    # A JSONL file (or a saved single Dataset) has no `test` split, yet today the training rows come back.
    dm = make_dm(write(tmp_path, kind))
    assert dm.val_rows == []


def test_csv_answers_keep_leading_zeros(tmp_path):
    # the built-in task's answers look like this; read as a number, exact_match can never score 1
    (tmp_path / "sort.csv").write_text("prompt,answer\n50318=,01358\n90210=,00129\n")
    dm = PromptDataModule(path=str(tmp_path / "sort.csv"), batch_size=1)
    dm.setup("fit")
    assert [r["answer"] for r in dm.train_rows] == ["01358", "00129"]


# --------------------------------------------------------------------------------------------- errors
def test_missing_column_names_key_and_columns_present(tmp_path):
    path = write(tmp_path, "jsonl")
    with pytest.raises(ValueError, match=r"`data.prompt_column`: column `prompt` not in dataset.*"
                                         r"\['difficulty', 'question', 'solution'\]"):
        PromptDataModule(path=str(path)).setup("fit")
    with pytest.raises(ValueError, match=r"`data.answer_column`: column `answer`"):
        PromptDataModule(path=str(path), prompt_column="question").setup("fit")
    # no answer column configured: fine, and no `answer` key is invented
    dm = PromptDataModule(path=str(path), prompt_column="question", answer_column=None)
    dm.setup("fit")
    assert "answer" not in dm.train_rows[0]


@pytest.mark.parametrize("kind", ["jsonl", "csv"])
def test_empty_prompt_names_the_row(tmp_path, kind):
    line = {"jsonl": 4, "csv": 5}[kind]  # 1-based file lines; the CSV header is line 1
    rows = [dict(r) for r in ROWS]
    rows[3]["question"] = ""
    with pytest.raises(ValueError, match=rf"line {line}: column `question` \(data.prompt_column\) is empty"):
        make_dm(write(tmp_path, kind, rows))


def test_empty_answer_names_the_row(tmp_path):
    rows = [dict(r) for r in ROWS]
    rows[5]["solution"] = None
    with pytest.raises(ValueError, match=r"line 6: column `solution` \(data.answer_column\) is empty"):
        make_dm(write(tmp_path, "jsonl", rows))


def test_empty_dataset_raises(tmp_path):
    (tmp_path / "header_only.csv").write_text("prompt,answer\n")
    (tmp_path / "blank.jsonl").write_text("\n")
    datasets.Dataset.from_dict({"prompt": [], "answer": []}).to_parquet(str(tmp_path / "empty.parquet"))
    for name in ("header_only.csv", "blank.jsonl", "empty.parquet"):
        with pytest.raises(ValueError):
            PromptDataModule(path=str(tmp_path / name)).setup("fit")
    # rows that do load but are empty get the message naming the source
    with pytest.raises(ValueError, match="dataset `data.path`=X is empty"):
        check_rows([], {"data.prompt_column": "prompt"}, "`data.path`=X")


def test_empty_jsonl_file_raises_value_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        PromptDataModule(path=str(tmp_path / "empty.jsonl")).setup("fit")


def test_missing_file_and_bad_batch_size(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        PromptDataModule(path=str(tmp_path / "missing.jsonl")).setup("fit")
    with pytest.raises(ValueError, match="data.batch_size"):
        PromptDataModule(batch_size=0)


def test_batch_larger_than_dataset():
    with pytest.raises(ValueError, match="larger than the dataset"):
        PromptStream([{"prompt": "a"}] * 3, batch_size=2, seed=0, shuffle=True, rank=0, world_size=2, start=0)


# ------------------------------------------------------------------------------------------- built-in
def test_builtin_task_train_and_val_disjoint():
    dm = PromptDataModule(batch_size=4, max_val_rows=16)
    dm.setup("fit")
    assert len(dm.val_rows) == 16
    full = PromptDataModule(batch_size=4)
    full.setup("fit")
    train = {r["prompt"] for r in full.train_rows}
    val = {r["prompt"] for r in full.val_rows}
    assert len(full.train_rows) == 20_000 and len(val) == 256
    assert train.isdisjoint(val)
    for row in full.val_rows[:50] + full.train_rows[:50]:
        digits = row["prompt"].rstrip("=")
        assert len(digits) == 5 and row["answer"] == "".join(sorted(digits))
    assert [r["prompt"] for r in dm.val_rows] == [r["prompt"] for r in full.val_rows[:16]]


# --------------------------------------------------------------------------------------------- stream
ROWS_S = [{"prompt": f"p{i}", "answer": f"a{i}"} for i in range(10)]


def take(stream: PromptStream, n: int) -> list[list[str]]:
    return [b["prompt"] for b in itertools.islice(iter(stream), n)]


def stream(**kw) -> PromptStream:
    args = dict(rows=ROWS_S, batch_size=3, seed=0, shuffle=True, rank=0, world_size=1, start=0) | kw
    return PromptStream(**args)


def test_stream_is_deterministic_per_seed_and_covers_each_epoch():
    a = take(stream(), 9)  # 10 rows, batch 3: 3 batches per epoch (one row left out each epoch)
    assert a == take(stream(), 9)
    assert a != take(stream(seed=1), 9)
    for epoch in range(3):
        seen = [p for b in a[3 * epoch: 3 * epoch + 3] for p in b]
        assert len(seen) == 9 and len(set(seen)) == 9  # no repeats within an epoch
    assert a[0:3] != a[3:6]  # each epoch is reshuffled
    # unshuffled: plain order, wrapping every epoch
    assert take(stream(shuffle=False), 4) == [["p0", "p1", "p2"], ["p3", "p4", "p5"], ["p6", "p7", "p8"],
                                              ["p0", "p1", "p2"]]


def test_every_training_stream_hears_outcomes_and_the_seeded_one_ignores_them(tmp_path):
    """A sampler running ahead tells the stream it reads each step's outcome (``record``): every stream
    ``train_batches`` returns has it (``PromptBatches``); the seeded stream's does nothing, so its batches
    are those of a stream told nothing, while a curriculum's draws learn from them."""
    dm = make_dm(write(tmp_path, "jsonl"))
    heard, plain = dm.train_batches(0), dm.train_batches(0)
    assert isinstance(heard, PromptBatches) and issubclass(CurriculumDraws, PromptBatches)
    assert next(heard) == next(plain)
    assert heard.record(0, [1.0, 0.0]) == []
    assert [next(heard) for _ in range(6)] == [next(plain) for _ in range(6)]
    curriculum = make_dm(write(tmp_path, "csv"), curriculum=Curriculum()).train_batches(0)
    assert isinstance(curriculum, CurriculumDraws)
    # a user DataModule's plain iterable of batches is wrapped (it hears outcomes and ignores them); a
    # stream that is already one is kept as it is
    wrapped = PromptBatches.of(iter([{"prompt": ["a"]}, {"prompt": ["b"]}]))
    assert wrapped.record(0, [0.5]) == [] and [next(wrapped), next(wrapped)] == [{"prompt": ["a"]},
                                                                                  {"prompt": ["b"]}]
    assert PromptBatches.of(curriculum) is curriculum


@pytest.mark.parametrize("start", [1, 3, 5])
def test_stream_start_reproduces_the_tail(start):
    full = take(stream(), 9)
    assert take(stream(start=start), 9 - start) == full[start:]


def test_two_ranks_get_disjoint_halves_of_each_global_batch():
    glob = take(stream(batch_size=4), 6)  # world 1, batch 4 == global batch of 2 ranks x 2
    r0 = take(stream(batch_size=2, rank=0, world_size=2), 6)
    r1 = take(stream(batch_size=2, rank=1, world_size=2), 6)
    for g, a, b in zip(glob, r0, r1, strict=True):
        assert set(a).isdisjoint(b)
        assert a + b == g


def test_collate_keeps_every_column():
    assert collate([{"prompt": "a", "x": 1}, {"prompt": "b", "x": 2}]) == {"prompt": ["a", "b"], "x": [1, 2]}


# ----------------------------------------------------------------------------------- state and refill
def first_batch(dm: PromptDataModule) -> list[str]:
    return next(iter(dm.train_dataloader()))["prompt"]


def test_state_dict_round_trip_restores_main_and_refill_positions():
    dm = PromptDataModule(batch_size=4, seed=3)
    dm.setup("fit")
    main = take(PromptStream(dm.train_rows, 4, 3, True, 0, 1, 0), 8)
    assert first_batch(dm) == main[0]
    refills = [dm.refill_batch()["prompt"] for _ in range(5)]
    # the refill stream is its own stream: not the main one
    assert refills[0] != main[0] and refills[:3] != main[:3]

    fresh = PromptDataModule(batch_size=4, seed=3)
    fresh.setup("fit")
    for _ in range(2):
        fresh.refill_batch()
    fresh.batches_consumed = 5
    state = fresh.state_dict()
    assert state == {"batches_consumed": 5, "refills_consumed": 2}

    restored = PromptDataModule(batch_size=4, seed=3)
    restored.setup("fit")
    restored.load_state_dict(state)
    assert first_batch(restored) == main[5]  # the main stream continues at batch 5
    assert [restored.refill_batch()["prompt"] for _ in range(3)] == refills[2:5]  # and the refill one at 2
    assert restored.state_dict()["refills_consumed"] == 5


def test_load_state_dict_resets_an_open_refill_iterator():
    dm = PromptDataModule(batch_size=4)
    dm.setup("fit")
    first = [dm.refill_batch()["prompt"] for _ in range(3)]
    dm.load_state_dict({"batches_consumed": 0, "refills_consumed": 1})
    assert dm.refill_batch()["prompt"] == first[1]
