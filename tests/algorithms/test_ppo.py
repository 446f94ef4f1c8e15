"""PPO: the advantage maths by hand, one update equal on 1 process / micro-batches / DDP / FSDP2 (policy and
critic), exact resume, export, critic warm-up, critic and reward model from folders, and learning."""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers import CONFIGS, make, make_trainer, run_cli, scalars
from rank_jobs import run_here

from lightning_rl.algorithms import GRPO, PPO
from lightning_rl.callbacks.base import RLCallback
from lightning_rl.data import PromptDataModule
from lightning_rl.maths.advantages import (
    explained_variance,
    gae_advantages,
    masked_moments,
    token_rewards,
    whiten,
)
from lightning_rl.maths.penalties import AdaptiveKL, FixedKL, adaptive_kl_coef
from lightning_rl.step.estimators import GAE

HERE = Path(__file__).resolve().parents[1]  # tests/


pytestmark = pytest.mark.usefixtures("one_thread")


# ---- maths ------------------------------------------------------------------------------------------------
def test_token_rewards_put_the_score_on_the_last_token_and_the_kl_on_every_token():
    scores = torch.tensor([1.0, 2.0, 0.5])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    kl = torch.tensor([[0.1, 0.2, 9.0], [0.0, 0.5, 1.0], [3.0, 3.0, 3.0]])
    out = token_rewards(scores, mask, kl, kl_coef=0.5)
    expected = torch.tensor([[-0.05, -0.1 + 1.0, 0.0], [0.0, -0.25, -0.5 + 2.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(out, expected)
    plain = torch.tensor([[0, 1.0, 0], [0, 0, 2.0], [0, 0, 0]])
    torch.testing.assert_close(token_rewards(scores, mask), plain)
    with pytest.raises(ValueError, match="scores"):
        token_rewards(scores[:2], mask)


def test_gae_on_token_rewards_by_hand():
    # one row of 2 tokens, reward 1 at the end, values 0.5 / 0.25, gamma 1, lam 0.5
    rewards = token_rewards(torch.tensor([1.0]), torch.tensor([[1, 1]]))
    values, mask = torch.tensor([[0.5, 0.25]]), torch.tensor([[1, 1]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.5)
    # delta_1 = 1 - 0.25 = 0.75; delta_0 = 0 + 0.25 - 0.5 = -0.25; A_0 = -0.25 + 0.5 * 0.75 = 0.125
    torch.testing.assert_close(adv, torch.tensor([[0.125, 0.75]]))
    torch.testing.assert_close(ret, torch.tensor([[0.625, 1.0]]))


def test_whiten_uses_the_global_moments_and_leaves_padding_at_zero():
    x = torch.tensor([[1.0, 2.0, 3.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    torch.testing.assert_close(whiten(x, mask), torch.tensor([[-1.0, 0.0, 1.0, 0.0]]), atol=1e-6, rtol=0)
    # two "ranks" holding halves of one batch: the summed moments whiten as the whole batch does
    a, b = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 4.0]])
    ones = torch.ones(1, 2)
    both = masked_moments(a, ones) + masked_moments(b, ones)
    whole = whiten(torch.cat([a, b], 1), torch.ones(1, 4))
    torch.testing.assert_close(torch.cat([whiten(a, ones, both), whiten(b, ones, both)], 1), whole)
    assert masked_moments(x, mask).tolist() == [6.0, 14.0, 3.0]


def test_explained_variance_and_the_adaptive_kl_controller_by_hand():
    returns = torch.tensor([[1.0, 2.0, 3.0]])
    ones = torch.ones(1, 3)
    perfect = explained_variance(masked_moments(returns - returns, ones), masked_moments(returns, ones))
    assert float(perfect) == 1.0
    mean_only = explained_variance(masked_moments(returns - 2.0, ones), masked_moments(returns, ones))
    assert float(mean_only) == pytest.approx(0.0, abs=1e-12)
    # error clipped to +0.2 / -0.2: 0.1 * (1 + 0.2 * 100 / 1000) and 0.1 * (1 - 0.2 * 100 / 1000)
    assert adaptive_kl_coef(0.1, kl=0.3, target=0.1, n_steps=100, horizon=1000) == pytest.approx(0.102)
    assert adaptive_kl_coef(0.1, kl=0.05, target=0.1, n_steps=100, horizon=1000) == pytest.approx(0.098)
    assert adaptive_kl_coef(0.1, kl=0.11, target=0.1, n_steps=100, horizon=1000) == pytest.approx(0.101)
    with pytest.raises(ValueError, match="kl_target"):
        adaptive_kl_coef(0.1, 0.1, 0.0, 1, 1)


# ---- configuration ----------------------------------------------------------------------------------------
def test_ppo_takes_one_sample_per_prompt_and_validates_its_keys():
    assert make(PPO, sampling={"num_generations": 1}).num_generations == 1
    with pytest.raises(ValueError, match="model.sampling.num_generations"):
        make(GRPO, sampling={"num_generations": 1})
    # GAE's keys are `advantage: {class_path: lightning_rl.step.estimators.GAE, init_args: {gamma, lam}}`
    for key, value in {"gamma": 1.5, "lam": -0.1}.items():
        with pytest.raises(ValueError, match=f"model.advantage.init_args.{key}"):
            make(PPO, advantage=GAE(**{key: value}))
    bad = {"vf_coef": 0.0, "value_clip": 0.0, "warmup": -1}
    for key, value in bad.items():
        with pytest.raises(ValueError, match=f"model.critic.{key}"):
            make(PPO, critic={key: value})
    with pytest.raises(ValueError, match=r"`model.objective.kl_in_reward.target` must be > 0"):
        AdaptiveKL(target=0.0)
    with pytest.raises(ValueError, match=r"`model.objective.kl_in_reward.horizon` must be >= 1"):
        AdaptiveKL(target=0.1, horizon=0)
    with pytest.raises(ValueError, match=r"`model.objective.kl_in_reward: AdaptiveKL` needs "
                                         r"`model.objective.kl_coef` > 0"):
        make(PPO, objective={"kl_in_reward": AdaptiveKL(0.1), "kl_coef": 0.0})
    with pytest.raises(TypeError, match="target"):  # the adaptive options exist only on AdaptiveKL
        FixedKL(target=0.1)
    # KL in the reward needs a reference but no in-loss term; in the loss, the other way round
    in_reward = make(PPO, objective={"kl_coef": 0.05})
    assert in_reward.reference_policy() is not None and in_reward.objective.kl_coef == 0.0
    in_loss = make(PPO, objective={"kl_in_reward": None, "kl_coef": 0.05})
    assert in_loss.reference_policy() is not None and in_loss.objective.kl_coef == 0.05
    assert make(PPO, objective={"kl_coef": 0.0}).reference_policy() is None


def test_ppo_refuses_deepspeed_naming_what_works():
    from lightning.pytorch.strategies import DeepSpeedStrategy

    module = make(PPO)
    module.trainer = make_trainer(Path("."))
    module.trainer.strategy.__class__ = type("CPUDeepSpeed", (DeepSpeedStrategy,), {})
    with pytest.raises(ValueError, match="fsdp2.yaml"):
        module.setup("fit")


# ---- one update: the same gradients on any micro-batching and world size --------------------------------
@pytest.fixture(scope="module")
def single_update(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ppo") / "single.pt"
    run_here("ppo_update.py", out, "1", "auto", "none")  # in this process
    return torch.load(out)


@pytest.mark.distributed
@pytest.mark.ranks("ppo/ddp", "ppo/fsdp2")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_policy_and_critic_gradients_do_not_depend_on_micro_batches_or_ranks(rank_jobs, single_update,
                                                                            strategy):
    """16 rows; ranks take rows rank::2 (different token counts) in micro-batches of 3, against one process
    with one micro-batch. The value loss is normalised by the minibatch's global token count like the
    policy loss, so both models' gradients are the same (FSDP2 shards the critic too)."""
    other = torch.load(rank_jobs.out(f"ppo/{strategy}") / "result.pt")
    assert other["sharded"] == (strategy == "fsdp2")
    for part in ("policy.", "critic."):
        names = [k for k in single_update["grads"] if k.startswith(part)]
        assert names and set(names) == {k for k in other["grads"] if k.startswith(part)}
        scale = max(single_update["grads"][k].abs().max().item() for k in names)
        diff = max((single_update["grads"][k] - other["grads"][k]).abs().max().item() for k in names)
        assert scale > 1e-2 and diff < 1e-5, (part, diff, scale)
    logged = single_update["metrics"][0]
    assert {"critic/vf_loss", "critic/vf_clip_frac", "policy/loss", "policy/kl_ref"} <= set(logged)


# ---- fit: warm-up, resume, export -------------------------------------------------------------------------
class Snapshots(RLCallback):
    """Policy and critic weights after each training batch."""

    def __init__(self) -> None:
        self.weights: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, module, *_):
        self.weights.append((module.policy.model.lm_head.weight.detach().clone(),
                             module.critic.model.score.weight.detach().clone()))


@pytest.mark.slow
def test_critic_warmup_trains_only_the_critic_then_both(tmp_path):
    torch.manual_seed(0)
    module = make(PPO, critic={"warmup": 2, "optimizer": partial(torch.optim.AdamW, lr=1e-3)})
    start = (module.policy.model.lm_head.weight.detach().clone(),
             module.critic.model.score.weight.detach().clone())
    snaps = Snapshots()
    trainer = make_trainer(tmp_path, max_steps=3, callbacks=[snaps])
    trainer.fit(module, PromptDataModule(batch_size=4, max_val_rows=8))
    assert trainer.global_step == 3  # the warm-up steps count: one trainer step per update
    (p1, c1), (p2, c2), (p3, c3) = snaps.weights
    assert torch.equal(p1, start[0]) and torch.equal(p2, start[0]) and not torch.equal(p3, p2)
    assert not torch.equal(c1, start[1]) and not torch.equal(c2, c1) and not torch.equal(c3, c2)


RESUME = """
seed_everything: 3
trainer:
  max_steps: 8
  val_check_interval: 2
  limit_val_batches: 1
  num_sanity_val_steps: 0
  enable_progress_bar: false
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: "{ckpt}", save_last: true, every_n_train_steps: 4, save_top_k: -1}}
model:
  init_args:
    sampling:
      num_generations: 2
    update:
      num_minibatches: 2
    objective:
      kl_in_reward:
        class_path: AdaptiveKL
        init_args: {{target: 0.001, horizon: 10}}
    critic:
      warmup: 1
data:
  init_args:
    batch_size: 4
    max_val_rows: 16
"""


def _fit(tmp_path, name: str, max_steps: int, resume: bool = False) -> dict:
    overlay = tmp_path / f"{name}.yaml"
    overlay.write_text(RESUME.format(ckpt=tmp_path / ("ckpt_full" if name == "full" else "ckpt")))
    args = ["fit", "--config", CONFIGS / "ppo.yaml", "--config", overlay,
            "--trainer.max_steps", str(max_steps), "--trainer.logger.init_args.save_dir", tmp_path / name]
    run_cli(*args, *(["--ckpt_path", "last"] if resume else []))
    return scalars(tmp_path / name)


@pytest.mark.slow
def test_killed_ppo_run_resumes_exactly_and_exports_policy_and_critic(tmp_path):
    """Policy, critic, both optimisers, the adaptive KL coefficient and the data position come back: the
    resumed steps log what the uninterrupted run logged."""
    from transformers import AutoModelForTokenClassification

    full = _fit(tmp_path, "full", 8)
    _fit(tmp_path, "killed", 4)
    resumed = _fit(tmp_path, "resumed", 8, resume=True)
    keys = ["policy/loss", "critic/vf_loss", "critic/grad_norm", "policy/grad_norm", "policy/kl_coef",
            "critic/explained_variance", "rollout/reward_mean", "policy/kl_in_reward"]
    for key in keys:
        tail = [(s, v) for s, v in full[key] if s > 4]
        again = [(s, v) for s, v in resumed[key] if s > 4]
        assert len(tail) == 2 and [s for s, _ in tail] == [s for s, _ in again], (key, full[key])
        for (_, a), (_, b) in zip(tail, again, strict=True):
            assert a == pytest.approx(b, rel=1e-6, abs=1e-7), key
    coefs = [v for _, v in full["policy/kl_coef"]]
    assert coefs[0] == pytest.approx(0.02) and coefs[-1] != coefs[0]  # the controller moved it
    assert all(s > 2 for s, _ in full["policy/loss"])  # the first rollout (steps 1-2) warmed the critic up
    # the export: the policy folder and a sibling critic folder that plain transformers reloads
    (run,) = (tmp_path / "full").glob("**/version_0")
    critic = AutoModelForTokenClassification.from_pretrained(run / "critic")
    assert critic.config.num_labels == 1 and (run / "policy" / "config.json").exists()
    ids = torch.tensor([[3, 4, 5, 6]])
    assert torch.isfinite(critic(input_ids=ids).logits).all()


# ---- critic and reward model from folders ---------------------------------------------------------------
@pytest.fixture(scope="module")
def reward_folder(tmp_path_factory) -> Path:
    """A one-label sequence classifier on the embedded backbone (untrained head), saved like an export."""
    from lightning_rl.models.reward_network import load_reward_network

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("rm") / "reward_model"
    load_reward_network("builtin:tiny-sort").save_pretrained(str(folder))
    return folder


def test_critic_starts_from_a_reward_model_folder(reward_folder):
    from transformers import AutoModelForSequenceClassification

    rm = AutoModelForSequenceClassification.from_pretrained(reward_folder)
    module = make(PPO, critic={"model": str(reward_folder)})
    torch.testing.assert_close(module.critic.model.score.weight, rm.score.weight)
    assert float(module.critic.model.score.bias.abs().sum()) == 0.0  # a reward head has no bias: 0
    with pytest.raises(FileNotFoundError, match="model.critic.model"):
        make(PPO, critic={"model": str(reward_folder) + "-missing"})


class Rollouts(RLCallback):
    def __init__(self) -> None:
        self.seen = []

    def on_rollout_end(self, trainer, module, rollout):
        self.seen.append(rollout)


@pytest.mark.slow
def test_reward_model_scores_are_added_to_the_reward_functions(tmp_path, reward_folder):
    """rewards = exact_match + 0.5 x the reward model's score of the rendered prompt + completion text."""
    from lightning_rl.models.reward_model import RewardModelScorer

    module = make(GRPO, rewards={"model": str(reward_folder), "model_weight": 0.5,
                                 "functions": ["lightning_rl.step.rewards:exact_match"]})
    seen = Rollouts()
    trainer = make_trainer(tmp_path, max_steps=1, callbacks=[seen])
    trainer.fit(module, PromptDataModule(batch_size=2, max_val_rows=8))
    (rollout,) = seen.seen
    texts = module.decode(rollout.completion_ids, rollout.attention_mask)
    prompt_ids = rollout.prompt_ids.masked_fill(rollout.prompt_mask == 0, 0)
    prompts = module.tokenizer.batch_decode(prompt_ids, skip_special_tokens=True)
    scorer = RewardModelScorer(str(reward_folder))
    expected = scorer.score(prompts, texts) * 0.5 + rollout.correct.float()
    torch.testing.assert_close(rollout.rewards, expected, atol=1e-5, rtol=0)
    assert "reward_model" not in "".join(module.state_dict())  # kept out of checkpoints
    # a reward model alone: no reward function is needed
    assert make(PPO, rewards={"model": str(reward_folder)}).reward_pipeline.scorer is None


@pytest.mark.slow
def test_reward_model_then_ppo_rm_through_the_cli(tmp_path):
    """The documented two-command sequence, cut to 2 steps each: the reward model's export feeds PPO."""
    run_cli("fit", "--config", CONFIGS / "reward_model.yaml", "--trainer.max_steps", "2",
            "--trainer.enable_progress_bar", "false",
            "--trainer.logger.init_args.save_dir", tmp_path / "runs")
    folder = tmp_path / "runs" / "reward_model" / "sort" / "reward_model"
    assert (folder / "config.json").exists()
    cli = run_cli("fit", "--config", CONFIGS / "ppo_rm.yaml", "--model.init_args.rewards.model", folder,
                  "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1",
                  "--data.init_args.max_val_rows", "8", "--trainer.enable_progress_bar", "false",
                  "--trainer.logger.init_args.save_dir", tmp_path / "ppo")
    assert cli.trainer.global_step == 2 and cli.model.reward_pipeline.scorer is None
    assert "rollout/reward_mean" in scalars(tmp_path / "ppo")


# ---- learning ------------------------------------------------------------------------------------------
@pytest.mark.learning
def test_ppo_config_learns_the_sort_task(tmp_path):
    """A cut-down configs/ppo.yaml (the full run is in benchmarks/algorithms.py and the README)."""
    run_cli("fit", "--config", CONFIGS / "ppo.yaml", "--trainer.max_steps", "60",
            "--trainer.val_check_interval", "30", "--data.init_args.max_val_rows", "128",
            "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", tmp_path)
    acc = [v for _, v in scalars(tmp_path)["val/accuracy"]]
    assert acc[-1] - acc[0] >= 0.1, acc
    assert math.isfinite(acc[-1])
