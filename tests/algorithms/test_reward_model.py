"""Reward model: the Bradley-Terry loss by hand, last-real-token scoring under any padding, a short fit that
learns, the export folder in plain transformers, the scorer for online RL, the config through the CLI."""

from __future__ import annotations

import json
import math
from functools import partial

import pytest
import torch
from helpers import CONFIGS, make_trainer, run_cli, scalars
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from lightning_rl.algorithms import RewardModel
from lightning_rl.cli.main import ConfigError
from lightning_rl.data import PreferenceDataModule
from lightning_rl.data.preference import BUILTIN_VAL
from lightning_rl.maths.preference_losses import reward_model_loss
from lightning_rl.models.builtin import EMBEDDED_MODEL, build_char_tokenizer, tiny_llama_config
from lightning_rl.models.reward_model import RewardModelScorer
from lightning_rl.models.reward_network import (
    RewardNetwork,
    gather_last,
    last_token_index,
    load_reward_network,
)

F64 = torch.float64
VAL_ROWS = [json.loads(line) for line in BUILTIN_VAL.read_text().splitlines()]


pytestmark = pytest.mark.usefixtures("seeded_one_thread")


def t(x):
    return torch.tensor(x, dtype=F64, requires_grad=True)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=F64), torch.tensor(expected, dtype=F64),
                               atol=atol, rtol=0)


# ---- the loss on hand-worked numbers --------------------------------------------------------------------
def test_bradley_terry_loss_and_metrics_by_hand():
    # d = r_c - r_r = [2, -1]; -logsigmoid(d) = log(1 + e^-d) = [0.126928, 1.313262]; mean 0.720095
    rc, rr = t([2.0, 0.0]), t([0.0, 1.0])
    loss, m = reward_model_loss(rc, rr)
    close(loss, 0.7200948)
    close(m["rm/accuracy"], 0.5)  # one of two pairs has chosen > rejected
    close(m["rm/margin"], 0.5)  # mean(2, -1)
    close(m["rm/chosen"], 1.0)
    close(m["rm/rejected"], 0.5)
    loss.backward()
    # d loss / d r_c = -sigmoid(-d) / B = [-0.119203 / 2, -0.731059 / 2]; d / d r_r is the opposite
    close(rc.grad, [-0.0596015, -0.3655293])
    close(rr.grad, [0.0596015, 0.3655293])


def test_margin_is_subtracted_inside_the_sigmoid_and_not_in_the_metric():
    # d - m = [2 - 1, -1 - (-1)] = [1, 0]: (log(1 + e^-1) + log 2) / 2 = (0.313262 + 0.693147) / 2
    loss, m = reward_model_loss(t([2.0, 0.0]), t([0.0, 1.0]), margin=t([1.0, -1.0]))
    close(loss, 0.5032044)
    close(m["rm/margin"], 0.5)
    close(m["rm/accuracy"], 0.5)


def test_centering_penalty():
    # (r_c + r_r)^2 = [4, 1], mean 2.5; 0.720095 + 0.1 * 2.5 = 0.970095
    rc, rr = t([2.0, 0.0]), t([0.0, 1.0])
    loss, _ = reward_model_loss(rc, rr, center_coef=0.1)
    close(loss, 0.9700948)
    loss.backward()
    # + 0.1 * 2 (r_c + r_r) / B = [0.2, 0.1] on both sides
    close(rc.grad, [-0.0596015 + 0.2, -0.3655293 + 0.1])
    close(rr.grad, [0.0596015 + 0.2, 0.3655293 + 0.1])


def test_ties_count_as_wrong_and_errors_name_the_argument():
    loss, m = reward_model_loss(t([0.5]), t([0.5]))
    close(loss, math.log(2))
    close(m["rm/accuracy"], 0.0)
    with pytest.raises(ValueError, match="rejected_rewards"):
        reward_model_loss(t([0.0, 1.0]), t([0.0]))
    with pytest.raises(ValueError, match="margin"):
        reward_model_loss(t([0.0]), t([0.0]), margin=t([0.0, 1.0]))
    with pytest.raises(ValueError, match="center_coef"):
        reward_model_loss(t([0.0]), t([0.0]), center_coef=-0.1)


# ---- which token is scored -----------------------------------------------------------------------------
def test_last_token_index_by_hand():
    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert last_token_index(mask).tolist() == [1, 2, 0, 0]
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0], [0.5, 0.6, 0.7]])
    assert gather_last(values, mask).tolist() == [2.0, 6.0, 7.0, 0.5]


@pytest.fixture(scope="module")
def network() -> RewardNetwork:
    torch.manual_seed(0)
    net = load_reward_network("builtin:tiny-sort")  # a fresh head on the embedded backbone
    net.eval()
    return net


def left_pad(ids: torch.Tensor, mask: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    out_ids, out_mask = torch.full_like(ids, pad), torch.zeros_like(mask)
    for i, n in enumerate(mask.sum(-1).tolist()):
        out_ids[i, ids.shape[1] - n :], out_mask[i, ids.shape[1] - n :] = ids[i, :n], 1
    return out_ids, out_mask


@torch.no_grad()
def test_padded_rows_score_as_each_row_alone_on_either_side(network):
    texts = ["12=3", "50318=01358", "7=7", "10850=006887"]
    enc = network.encode(texts, max_length=64)
    assert enc.attention_mask[:, -1].tolist() == [0, 0, 0, 1]  # right-padded
    right = network(enc.input_ids, enc.attention_mask)
    alone = torch.cat([network(e.input_ids, e.attention_mask) for e in
                       (network.encode([text], max_length=64) for text in texts)])
    left = network(*left_pad(enc.input_ids, enc.attention_mask, network.pad_token_id))
    torch.testing.assert_close(right, alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(left, alone, atol=1e-5, rtol=0)
    assert right.dtype == torch.float32 and right.shape == (4,)
    # plain transformers (pad-token pooling, right padding) agrees when no row ends in the pad token
    plain = network.model(input_ids=enc.input_ids, attention_mask=enc.attention_mask).logits[:, 0]
    torch.testing.assert_close(plain, alone, atol=1e-5, rtol=0)


@torch.no_grad()
def test_a_real_token_equal_to_pad_is_still_the_scored_one(network):
    # pad == eos style: a row that ends in the pad id is read at that token, not the one before it
    pad = network.pad_token_id
    row = [22, 23, pad]
    ids = torch.tensor([row + [pad, pad], [22, 23, 24, 25, 26]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    alone = network(torch.tensor([row]), torch.ones(1, 3, dtype=torch.long))
    before = network(torch.tensor([row[:2]]), torch.ones(1, 2, dtype=torch.long))
    torch.testing.assert_close(network(ids, mask)[:1], alone, atol=1e-5, rtol=0)
    assert not torch.allclose(alone, before)


def test_long_rows_keep_their_last_tokens(network):
    enc = network.encode(["0123456789", "12"], max_length=4)
    assert enc.truncated == 1
    assert network.tokenizer.decode(enc.input_ids[0]) == "6789"
    assert enc.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]


# ---- a short fit learns; its export reloads in plain transformers ----------------------------------------
@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """50 steps of 32 pairs on the built-in sort pairs; held-out metrics (all 256 pairs) before and after."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("rm")
    module = RewardModel(max_length=32, optimizer=partial(torch.optim.AdamW, lr=3e-4, weight_decay=0.0))
    dm = PreferenceDataModule(batch_size=32, val_batch_size=256)
    trainer = make_trainer(root, max_steps=50, limit_val_batches=1.0, val_check_interval=50,
                           check_val_every_n_epoch=None)
    (before,) = trainer.validate(module, datamodule=dm, verbose=False)
    trainer.fit(module, datamodule=dm)
    (after,) = trainer.validate(module, datamodule=dm, verbose=False)
    return module, before, after, root / "reward_model"


@pytest.mark.learning
def test_short_fit_raises_held_out_accuracy_and_lowers_loss(fitted):
    module, before, after, _ = fitted
    assert module.global_step == 50
    assert after["val/rm/accuracy"] > before["val/rm/accuracy"] + 0.2, (before, after)
    assert after["val/rm/accuracy"] > 0.75, after
    assert after["val/rm/loss"] < before["val/rm/loss"] - 0.2, (before, after)
    assert after["val/rm/margin"] > before["val/rm/margin"]


@pytest.mark.slow  # reads the 50-step fit of `fitted`
def test_export_reloads_in_plain_transformers_with_the_same_scores(fitted):
    module, _, after, folder = fitted
    assert (folder / "config.json").is_file()
    model = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer.pad_token_id
    assert tokenizer.padding_side == "right"
    rows = VAL_ROWS[:16]
    texts = [r["prompt"] + r["chosen"] for r in rows]
    with torch.no_grad():
        plain = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits[:, 0]
    scorer = RewardModelScorer(str(folder), batch_size=5)  # chunks of 5: 5 + 5 + 5 + 1
    scores = scorer.score([r["prompt"] for r in rows], [r["chosen"] for r in rows])
    torch.testing.assert_close(scores, plain, atol=1e-5, rtol=0)
    module.eval()
    with torch.no_grad():
        enc = module.policy.encode(texts, max_length=32)
        own = module.policy(enc.input_ids, enc.attention_mask)
    torch.testing.assert_close(own, scores, atol=1e-5, rtol=0)
    # the scorer is frozen and outside any module tree
    assert not isinstance(scorer, torch.nn.Module)
    assert not any(p.requires_grad for p in scorer.network.parameters()) and not scorer.network.training
    assert scorer.to("cpu") is scorer and scorer.device.type == "cpu"


@pytest.mark.slow  # reads the 50-step fit of `fitted`
def test_scorer_prefers_chosen_on_held_out_pairs(fitted):
    *_, after, folder = fitted
    scorer = RewardModelScorer(str(folder))
    prompts = [r["prompt"] for r in VAL_ROWS]
    chosen = scorer.score(prompts, [r["chosen"] for r in VAL_ROWS])
    rejected = scorer.score(prompts, [r["rejected"] for r in VAL_ROWS])
    accuracy = (chosen > rejected).float().mean().item()
    assert accuracy > 0.75
    assert accuracy == pytest.approx(after["val/rm/accuracy"], abs=1e-6)  # the module's exact val mean
    enc = scorer.network.encode([p + c for p, c in zip(prompts[:3], [r["chosen"] for r in VAL_ROWS[:3]],
                                                       strict=True)], max_length=1024)
    torch.testing.assert_close(scorer.score_ids(enc.input_ids, enc.attention_mask), chosen[:3])


# ---- margins ------------------------------------------------------------------------------------------
def test_margin_column_reaches_the_loss(network):
    module = RewardModel(max_length=32, margin_column="margin")
    batch = {"prompt": ["12=", "31="], "chosen": ["12", "13"], "rejected": ["21", "3"], "margin": [1.0, 0.5]}
    with torch.no_grad():
        loss, metrics, _ = module.pair_loss(batch)
        enc = module.policy.encode(["12=12", "31=13", "12=21", "31=3"], max_length=32)
        s = module.policy(enc.input_ids, enc.attention_mask)
    expected, _ = reward_model_loss(s[:2], s[2:], torch.tensor([1.0, 0.5]))
    torch.testing.assert_close(loss, expected)
    with pytest.raises(ValueError, match=r"model\.margin_column"):
        module.pair_loss({**batch, "margin": ["big", 0.5]})
    with pytest.raises(ValueError, match=r"model\.margin_column"):
        module.pair_loss({k: v for k, v in batch.items() if k != "margin"})


# ---- errors -------------------------------------------------------------------------------------------
def test_scorer_errors_name_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"`model\.rewards\.model`: model folder not found"):
        RewardModelScorer(str(tmp_path / "missing"))
    with pytest.raises(NotADirectoryError, match=r"`model\.rewards\.model`.*no config\.json"):
        RewardModelScorer(str(tmp_path))
    with pytest.raises(ValueError, match=r"`model\.rewards\.model`: unknown built-in"):
        RewardModelScorer("builtin:nope")
    with pytest.raises(ValueError, match=r"`model\.model`: .*not a reward model but a LlamaForCausalLM"):
        RewardModelScorer(EMBEDDED_MODEL, key="model.model")


def test_a_causal_lm_folder_is_refused_by_the_scorer_and_builtin_names_warn():
    # a causal LM has no trained head: as a reward it would be random, so only `builtin:` names pass
    not_a_reward_model = r"`model\.rewards\.model`: .*not a reward model.*reward_model\.yaml"
    with pytest.raises(ValueError, match=not_a_reward_model):
        RewardModelScorer(EMBEDDED_MODEL)
    with pytest.warns(UserWarning, match="random"):
        scorer = RewardModelScorer("builtin:tiny-sort")
    assert scorer.score(["12="], ["12"]).shape == (1,)


def test_more_than_one_label_is_refused(tmp_path):
    tokenizer = build_char_tokenizer()
    config = tiny_llama_config(tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    config.num_labels = 2
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"`model\.rewards\.model`: .* 2 labels"):
        RewardModelScorer(str(tmp_path))


def test_missing_backbone_weights_are_an_error(tmp_path):
    tokenizer = build_char_tokenizer()
    config = tiny_llama_config(tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    model = AutoModelForCausalLM.from_config(config)
    kept = {k: v for k, v in model.state_dict().items() if "layers.0.mlp" not in k}
    model.save_pretrained(tmp_path, state_dict=kept)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"`model\.model`: .*did not provide the backbone .*layers\.0\.mlp"):
        load_reward_network(str(tmp_path), key="model.model")


def test_tokenizer_without_pad_pads_with_eos():
    tokenizer = build_char_tokenizer()
    tokenizer.pad_token = None
    config = tiny_llama_config(build_char_tokenizer(), hidden_size=32, num_layers=1, num_heads=2,
                               intermediate_size=64)
    config.num_labels, config.pad_token_id = 1, None
    with pytest.warns(UserWarning, match="no pad token"):
        net = RewardNetwork(AutoModelForSequenceClassification.from_config(config), tokenizer)
    assert net.pad_token_id == tokenizer.eos_token_id == net.model.config.pad_token_id


def test_reward_model_bad_values_name_the_key():
    with pytest.raises(FileNotFoundError, match=r"`model\.model`"):
        RewardModel(model="./no-such-model")
    with pytest.raises(ValueError, match=r"`model\.max_length`"):
        RewardModel(max_length=0)
    with pytest.raises(ValueError, match=r"`model\.center_rewards_coefficient`"):
        RewardModel(center_rewards_coefficient=-1.0)


# ---- the config through the real CLI ------------------------------------------------------------------
@pytest.mark.slow
def test_config_runs_through_the_cli(tmp_path):
    cli = run_cli("fit", "--config", CONFIGS / "reward_model.yaml", "--trainer.max_steps", "2",
                  "--trainer.val_check_interval", "2", "--trainer.num_sanity_val_steps", "0",
                  "--trainer.log_every_n_steps", "1",
                  "--data.init_args.max_val_rows", "16", "--data.init_args.val_batch_size", "16",
                  "--trainer.enable_progress_bar", "false",
                  "--trainer.logger.init_args.save_dir", tmp_path)
    assert isinstance(cli.model, RewardModel) and cli.trainer.global_step == 2
    run = tmp_path / "reward_model" / "sort"  # the config fixes the run folder for configs/ppo_rm.yaml
    assert (run / "reward_model" / "config.json").is_file()
    logged = scalars(run)
    for name in ("rm/loss", "rm/accuracy", "rm/margin", "val/rm/loss", "val/rm/accuracy", "val/rm/margin"):
        assert name in logged, sorted(logged)


def test_cli_names_the_key_of_a_missing_model(tmp_path):
    with pytest.raises(ConfigError, match=r"`model\.model`: model folder not found"):
        run_cli("fit", "--config", CONFIGS / "reward_model.yaml", "--model.init_args.model",
                "./no-such-model", "--trainer.logger.init_args.save_dir", tmp_path)


def _fit(save_dir, max_steps: int, *extra: str):
    return run_cli("fit", "--config", CONFIGS / "reward_model.yaml", "--trainer.max_steps", str(max_steps),
                   "--trainer.val_check_interval", "3", "--trainer.num_sanity_val_steps", "0",
                   "--trainer.log_every_n_steps", "1", "--data.init_args.batch_size", "8",
                   "--data.init_args.max_val_rows", "16", "--trainer.enable_progress_bar", "false",
                   "--trainer.logger.init_args.save_dir", save_dir, *extra)


@pytest.mark.slow
def test_resumed_run_continues_exactly(tmp_path):
    full = _fit(tmp_path / "full", 6)
    _fit(tmp_path / "cut", 3)
    resumed = _fit(tmp_path / "cut", 6, "--ckpt_path", "last")
    assert resumed.trainer.global_step == 6
    # the config fixes the run folder: the resumed run logs into the cut run's folder, after its steps
    a, b = (scalars(tmp_path / name / "reward_model" / "sort") for name in ("full", "cut"))
    tail = [(s, v) for s, v in a["rm/loss"] if s >= 3]
    again = [(s, v) for s, v in b["rm/loss"] if s >= 3]
    assert [s for s, _ in tail] == [s for s, _ in again] and len(tail) == 3
    for (_, x), (_, y) in zip(tail, again, strict=True):
        assert x == pytest.approx(y, rel=1e-5)
    for p, q in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
