"""Issue 8: user inputs that are wrong fail at once, in one line naming the key, file and line.

Missing model folders and data files, an unreachable hub (simulated: the endpoint is a closed local port),
malformed JSONL, SFT data without answers, DPO validation split off the training file, identical pairs,
and the exported tokenizer's ``padding_side``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import huggingface_hub
import lightning as L
import pytest

from lightning_rl.algorithms import SFT
from lightning_rl.algorithms.options import PolicyOptions
from lightning_rl.data import PreferenceDataModule, PromptDataModule
from lightning_rl.models.builtin import build_char_tokenizer, tiny_llama_config
from lightning_rl.models.loading import load_policy
from lightning_rl.models.policy import Policy

PAIRS = [{"prompt": f"{i}{i + 1}=", "chosen": f"{i}{i + 1}", "rejected": f"{i + 1}{i}"} for i in range(1, 9)]
PROMPTS = [{"prompt": f"{i}{i + 1}=", "answer": f"{i}{i + 1}"} for i in range(1, 9)]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture()
def hub_down(tmp_path, monkeypatch):
    """The hub endpoint is a closed local port (refused at once) and the hub cache is empty."""
    constants = huggingface_hub.constants
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 3)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    return tmp_path / "hub-cache"


@pytest.fixture()
def info_log(caplog):
    """Capture Lightning's rank-zero info messages (its logger does not propagate to the root)."""
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    yield caplog
    logger.removeHandler(caplog.handler)


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def timed_error(kind: type[Exception], fn, *args) -> tuple[str, float]:
    start = time.perf_counter()
    with pytest.raises(kind) as err:
        fn(*args)
    return str(err.value), time.perf_counter() - start


def tiny_folder(path: Path, padding_side: str | None) -> Path:
    """A save_pretrained folder of a tiny Llama whose tokenizer_config has ``padding_side`` (or none)."""
    tokenizer = build_char_tokenizer()
    config = tiny_llama_config(tokenizer, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    Policy.from_config(config, tokenizer).save_pretrained(str(path))
    config_file = path / "tokenizer_config.json"
    tok_config = json.loads(config_file.read_text())
    tok_config.pop("padding_side", None)
    if padding_side is not None:
        tok_config["padding_side"] = padding_side
    config_file.write_text(json.dumps(tok_config))
    return path


# ------------------------------------------------------------------------ 1. missing paths, hub down
def test_path_or_hub_id():
    from lightning_rl.models.loading import (
        looks_local,  # new in issue 8 (imported here so older code fails per test)
    )

    assert looks_local("./m") and looks_local("/abs/m") and looks_local("~/m") and looks_local("a/b/c")
    assert looks_local("train.jsonl") and looks_local("nope_dir/model.safetensors")
    assert looks_local("tests/nope")  # first component exists here (pytest runs in the repo root)
    # `org/name` and bare names are hub ids; so is a missing `dir/sub` (the same form)
    assert not looks_local("org/model") and not looks_local("Qwen/Qwen2.5-0.5B") and not looks_local("gpt2")
    assert not looks_local("nope_dir/sub")


@pytest.mark.parametrize("value", ["./nope", "ABS", "~/surely-not-here-lightning-rl"])
def test_missing_model_folder_fails_at_once(value, tmp_path, monkeypatch, hub_down):
    monkeypatch.chdir(tmp_path)
    value = str(tmp_path / "nope") if value == "ABS" else value
    message, seconds = timed_error(FileNotFoundError, load_policy, value)
    assert message == f"`model.policy.model`: model folder not found: {value}"
    assert seconds < 2


def test_hub_form_of_a_missing_folder_fails_at_once_when_the_hub_is_down(tmp_path, monkeypatch, hub_down):
    monkeypatch.chdir(tmp_path)  # `nope_dir` does not exist: `nope_dir/sub` reads as a hub id
    message, seconds = timed_error(ConnectionError, load_policy, "nope_dir/sub")
    assert "`model.policy.model`: `nope_dir/sub` is not a local path" in message
    assert "hub could not be reached" in message and "\n" not in message
    assert seconds < 2


def test_hub_id_with_the_hub_down_fails_fast_saying_what_to_do(hub_down):
    message, seconds = timed_error(ConnectionError, load_policy, "lightning-rl-tests/no-such-model")
    assert "`model.policy.model`: `lightning-rl-tests/no-such-model` is not a local path" in message
    assert "could not be reached (http://127.0.0.1:9 did not answer" in message
    assert "local save_pretrained folder" in message and "\n" not in message
    assert seconds < 10


def test_hub_id_with_the_hub_down_loads_a_cached_copy(tmp_path, hub_down):
    # the hub cache layout: models--org--name/snapshots/<commit>/ and refs/main naming the commit
    repo = hub_down / "models--lightning-rl-tests--cached"
    tiny_folder(repo / "snapshots" / ("0" * 40), padding_side=None)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    start = time.perf_counter()
    policy = load_policy("lightning-rl-tests/cached")
    assert time.perf_counter() - start < 10
    assert policy.model.config.hidden_size == 16


@pytest.mark.parametrize("value", ["./nope", "/abs/nope", "nope_dir/train.jsonl"])
def test_missing_data_file_names_the_key(value, tmp_path, monkeypatch, hub_down):
    monkeypatch.chdir(tmp_path)
    message, seconds = timed_error(FileNotFoundError, PromptDataModule(path=value).setup, "fit")
    assert message == f"`data.path`: data file not found: {value}"
    train = write_jsonl(tmp_path / "train.jsonl", PAIRS)
    dm = PreferenceDataModule(path=train, val_path=value)
    message, seconds_val = timed_error(FileNotFoundError, dm.setup, "fit")
    assert message == f"`data.val_path`: data file not found: {value}"
    assert seconds < 2 and seconds_val < 2


def test_hub_dataset_with_the_hub_down_fails_fast(hub_down):
    message, seconds = timed_error(ConnectionError, PromptDataModule(path="lightning-rl-tests/no-data").setup,
                                   "fit")
    assert message.startswith("`data.path`: `lightning-rl-tests/no-data` is not a local path")
    assert "could not be reached" in message and "local JSONL" in message and "\n" not in message
    assert seconds < 10


# ------------------------------------------------------------------------------- 2. file and line
def test_malformed_jsonl_names_the_file_and_the_line(tmp_path):
    lines = [json.dumps(r) for r in PROMPTS]
    lines[2] = '{"prompt": "12=", "answer": '  # line 3 is cut short
    path = tmp_path / "broken.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as err:
        PromptDataModule(path=str(path)).setup("fit")
    message = str(err.value)
    assert "broken.jsonl" in message and "line 3:" in message and "\n" not in message
    assert message.startswith("`data.path`: cannot read")
    assert err.value.__cause__ is None and err.value.__suppress_context__  # no builder traceback above it


def test_jsonl_line_that_is_not_an_object(tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text(json.dumps(PROMPTS[0]) + "\n\n" + json.dumps(PROMPTS[1]) + "\nnot json\n")
    with pytest.raises(ValueError, match=r"list\.jsonl: line 4: Expecting value"):
        PromptDataModule(path=str(path)).setup("fit")


def test_row_errors_give_the_file_line(tmp_path):
    rows = [dict(r) for r in PROMPTS]
    rows[3]["prompt"] = ""
    path = tmp_path / "gaps.jsonl"  # a blank line before the bad row: line numbers, not row counts
    text = [json.dumps(r) for r in rows]
    path.write_text("\n".join(text[:2]) + "\n\n" + "\n".join(text[2:]))
    with pytest.raises(ValueError, match=r"gaps\.jsonl \(split train\), line 5: column `prompt` "
                                         r"\(data.prompt_column\) is empty"):
        PromptDataModule(path=str(path)).setup("fit")
    csv_path = tmp_path / "d.csv"  # the header is line 1
    csv_path.write_text("prompt,answer\n" + "".join(f"{r['prompt']},{r['answer']}\n" for r in rows))
    with pytest.raises(ValueError, match=r"line 5: column `prompt`"):
        PromptDataModule(path=str(csv_path)).setup("fit")
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    with pytest.raises(ValueError, match=r"row index 3: column `prompt`"):
        PromptDataModule(path=str(tmp_path / "d.parquet")).setup("fit")
    pairs = [dict(r) for r in PAIRS]
    pairs[1]["rejected"] = pairs[1]["chosen"]
    with pytest.raises(ValueError, match=r"line 2: chosen and rejected completions are identical.*"
                                         r"`data.skip_identical: true`"):
        PreferenceDataModule(path=write_jsonl(tmp_path / "p.jsonl", pairs), skip_identical=False).setup("fit")


# ------------------------------------------------------------------------------ 3. SFT without answers
def test_sft_without_answer_column_fails_at_setup_naming_the_key(tmp_path):
    rows = [{"prompt": r["prompt"], "solution": r["answer"]} for r in PROMPTS]  # no answer column at all
    dm = PromptDataModule(path=write_jsonl(tmp_path / "p.jsonl", rows), answer_column=None, batch_size=2)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    module = SFT(policy=PolicyOptions(model="builtin:tiny-sort"), max_completion_length=8)
    with pytest.raises(ValueError, match=r"`data.answer_column` is null"):
        trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 0


# --------------------------------------------------------------------------- 4. DPO validation, skips
def test_val_fraction_splits_off_a_seeded_disjoint_validation_set(tmp_path, info_log):
    path = write_jsonl(tmp_path / "p.jsonl", PAIRS + [{**r, "prompt": "9" + r["prompt"]} for r in PAIRS])
    dm = PreferenceDataModule(path=path, val_fraction=0.25, seed=3)
    dm.setup("fit")
    train, val = [r["prompt"] for r in dm.train_rows], [r["prompt"] for r in dm.val_rows]
    assert len(train) == 12 and len(val) == 4 and not set(train) & set(val)
    assert sorted(train + val) == sorted(json.loads(line)["prompt"] for line in open(path))
    assert "4 of 16 pairs held out for validation, 12 left for training" in info_log.text
    again = PreferenceDataModule(path=path, val_fraction=0.25, seed=3)
    again.setup("fit")
    assert [r["prompt"] for r in again.val_rows] == val  # the same on every rank and every run
    other = PreferenceDataModule(path=path, val_fraction=0.25, seed=4)
    other.setup("fit")
    assert [r["prompt"] for r in other.val_rows] != val
    with pytest.raises(ValueError, match="`data.val_fraction`.*`data.val_path`"):
        PreferenceDataModule(path=path, val_path=path, val_fraction=0.1)
    with pytest.raises(ValueError, match=r"`data.val_fraction` must be in \[0, 1\)"):
        PreferenceDataModule(path=path, val_fraction=1.0)
    with pytest.raises(ValueError, match="leaves 0 for validation"):
        PreferenceDataModule(path=path, val_fraction=0.01).setup("fit")


def test_identical_pairs_are_skipped_by_default_with_one_warning_naming_the_first(tmp_path):
    """Real preference sets hold a few degenerate pairs: they are skipped, counted and the first one's line
    named in one warning; only a file with no other pair is refused."""
    pairs = [dict(r) for r in PAIRS]
    for i in (2, 5):
        pairs[i]["rejected"] = pairs[i]["chosen"]
    dm = PreferenceDataModule(path=write_jsonl(tmp_path / "p.jsonl", pairs))
    with pytest.warns(UserWarning) as warned:
        dm.setup("fit")
    kept = [r["prompt"] for i, r in enumerate(PAIRS) if i not in (2, 5)]
    assert [r["prompt"] for r in dm.train_rows] == kept
    assert dm.skipped_identical == {"train": 2, "val": 0}
    (message,) = [str(w.message) for w in warned if "identical" in str(w.message)]
    assert "skipped 2 of 8 pairs" in message and "the first at line 3" in message, message
    same = [{**r, "rejected": r["chosen"]} for r in PAIRS]
    with pytest.raises(ValueError, match=r"every one of its 8 pairs has identical .*the first at line 1"):
        PreferenceDataModule(path=write_jsonl(tmp_path / "s.jsonl", same)).setup("fit")


# ---------------------------------------------------------------------------- 5. exported padding_side
@pytest.mark.parametrize("padding_side", [None, "right"])
def test_export_keeps_the_users_padding_side(tmp_path, padding_side):
    policy = load_policy(str(tiny_folder(tmp_path / "in", padding_side)))
    assert policy.tokenizer.padding_side == "left"  # generation needs it
    policy.save_pretrained(str(tmp_path / "out"))
    exported = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert exported.get("padding_side") == padding_side
    assert policy.tokenizer.padding_side == "left"
    rebuilt = Policy(policy.model, policy.tokenizer)  # e.g. around a PEFT-wrapped model
    rebuilt.save_pretrained(str(tmp_path / "again"))
    again = json.loads((tmp_path / "again" / "tokenizer_config.json").read_text())
    assert again.get("padding_side") == padding_side
