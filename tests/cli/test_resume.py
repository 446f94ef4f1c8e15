"""A killed GRPO (or on-policy distillation) run resumed with `fit --ckpt_path last` continues exactly like
the uninterrupted run."""

from __future__ import annotations

import pytest
from helpers import CONFIGS, run_cli, scalars

pytestmark = pytest.mark.slow

TINY = """
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
      num_generations: 4
      max_new_tokens: 8
    update:
      num_minibatches: 2
data:
  init_args:
    batch_size: 4
    max_val_rows: 16
"""


def _run(tmp_path, name: str, ckpt_dir, max_steps: int, resume: bool = False, config: str = "grpo") -> dict:
    overlay = tmp_path / f"{name}.yaml"
    overlay.write_text(TINY.format(ckpt=ckpt_dir))
    args = ["fit", "--config", CONFIGS / f"{config}.yaml", "--config", overlay,
            "--trainer.max_steps", str(max_steps), "--trainer.logger.init_args.save_dir", tmp_path / name]
    if resume:
        args += ["--ckpt_path", "last"]
    run_cli(*args)
    return scalars(tmp_path / name)


COMMON_KEYS = ["policy/loss", "policy/approx_kl", "policy/grad_norm", "rollout/reward_mean",
               "rollout/response_length_mean", "policy/ratio_mean"]
KEYS = {"grpo": [*COMMON_KEYS, "policy/kl_ref"], "distill": [*COMMON_KEYS, "distill/reverse_kl"]}


@pytest.mark.parametrize("config", ["grpo", "distill"])
def test_resume_continues_exactly(tmp_path, config):
    full = _run(tmp_path, "full", tmp_path / "ckpt_full", max_steps=8, config=config)
    _run(tmp_path, "killed", tmp_path / "ckpt", max_steps=4, config=config)
    assert (tmp_path / "ckpt" / "last.ckpt").exists()
    resumed = _run(tmp_path, "resumed", tmp_path / "ckpt", max_steps=8, resume=True, config=config)
    for key in KEYS[config]:
        # metrics are logged once per RL step (rollout), at the optimiser step it reached: 2, 4, 6, 8
        tail_full = [(s, v) for s, v in full[key] if s > 4]
        tail_resumed = [(s, v) for s, v in resumed[key] if s > 4]
        assert len(tail_full) == 2, (key, full[key])
        assert [s for s, _ in tail_full] == [s for s, _ in tail_resumed], key
        for (_, a), (_, b) in zip(tail_full, tail_resumed, strict=True):
            assert a == pytest.approx(b, rel=1e-6, abs=1e-7), key
    # the continuation really trained on new data: the resumed steps differ from the first ones
    head = [v for s, v in full["policy/loss"] if s <= 4]
    assert head != [v for s, v in resumed["policy/loss"] if s > 4]
    assert full["val/accuracy"][-1] == resumed["val/accuracy"][-1]
