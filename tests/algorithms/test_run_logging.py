"""What a user reads in the logs: the warm start at step 0, the learning rate, and DPO's own preference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import CONFIGS, run_cli, scalars

from lightning_rl.models.builtin import EMBEDDED_MODEL


def fit(tmp_path: Path, config: str, *extra: str) -> dict[str, list[tuple[int, float]]]:
    run_cli("fit", "--config", CONFIGS / config, "--trainer.logger.init_args.save_dir", tmp_path,
            "--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "false", *extra)
    return scalars(tmp_path)


@pytest.mark.slow
def test_warm_start_validation_is_logged_at_step_0_and_the_learning_rate_every_step(tmp_path):
    logged = fit(tmp_path, "grpo.yaml", "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
                 "--data.init_args.max_val_rows", "32", "--data.init_args.val_batch_size", "32",
                 "--model.init_args.sampling.num_generations", "2", "--data.init_args.batch_size", "2")
    steps = dict(logged["val/accuracy"])
    assert len(steps) == 2 and min(steps) == 0  # the sanity pass starts the curve, then the check after 2
    # step 0 is the warm start: the same value `lightning-rl validate` gives on these rows
    run_cli("validate", "--config", CONFIGS / "grpo.yaml", "--trainer.logger.init_args.save_dir",
            tmp_path / "validate", "--data.init_args.max_val_rows", "32",
            "--data.init_args.val_batch_size", "32")
    (start,) = [v for _, v in scalars(tmp_path / "validate")["val/accuracy"]]
    assert steps[0] == pytest.approx(start, abs=1e-6)
    assert [v for _, v in sorted(logged["optim/lr"])] == pytest.approx([1e-4, 1e-4])


@pytest.mark.slow
def test_learning_rate_follows_the_scheduler(tmp_path):
    # SAPO's config decays the lr linearly to 0 over max_steps = 600 optimiser steps, 2 per rollout
    logged = fit(tmp_path, "sapo.yaml", "--trainer.max_steps", "6", "--trainer.val_check_interval", "100",
                 "--trainer.num_sanity_val_steps", "0", "--data.init_args.batch_size", "2",
                 "--model.init_args.sampling.num_generations", "2")
    lrs = [v for _, v in sorted(logged["optim/lr"])]
    # logged once per RL step (3 rollouts x 2 optimiser steps): the lr of its first optimiser step
    assert lrs == pytest.approx([2e-4 * (1 - k / 600) for k in (0, 2, 4)], rel=1e-5)


def test_dpo_logs_the_policys_own_preference(tmp_path):
    from lightning_rl.algorithms import DPO
    from lightning_rl.algorithms.options import PolicyOptions
    from lightning_rl.data.preference import encode_pairs

    rows = [json.loads(line) for line in (Path(EMBEDDED_MODEL).parent / "files" / "sort_pairs_val.jsonl")
            .read_text().splitlines()[:16]]
    batch = {k: [r[k] for r in rows] for k in ("prompt", "chosen", "rejected")}
    dpo = DPO(policy=PolicyOptions(model="builtin:tiny-sort", max_prompt_length=16), max_completion_length=10)
    enc = dpo.encode(batch)
    _, metrics = dpo.pair_loss(batch, enc)
    by_hand = encode_pairs(dpo.tokenizer, batch["prompt"], batch["chosen"], batch["rejected"],
                           max_prompt_length=16, max_completion_length=10, chat_template=False)
    logp, _ = dpo.policy.token_logprobs(by_hand.prompt_ids, by_hand.prompt_mask, by_hand.completion_ids,
                                        by_hand.completion_mask)
    seq = logp.sum(-1)
    expected = (seq[:16] > seq[16:]).float().mean()
    # at the start the policy is the reference: rewards/accuracy is 0 (ties), its own preference is not
    assert metrics["rewards/accuracy"].item() == 0.0
    assert metrics["logps/accuracy"].item() == pytest.approx(expected.item())
    assert 0.0 < metrics["logps/accuracy"].item() < 1.0
    assert torch.isfinite(metrics["logps/accuracy"])


@pytest.mark.parametrize(("bar", "rate"), [("rich", 1), ("tqdm", 5), ("rich-off", 0)])
def test_the_step_progress_bar_redraws_every_step_under_rich(tmp_path, bar, rate):
    """Rich's refresh rate is redraws per second (default 100); the step bar counts batches, so taking it
    as is froze the bar for 100 steps. A TQDM bar's own rate (batches) is kept."""
    import lightning as L
    from helpers import make
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    from lightning_rl.callbacks import StepProgressBar

    given = {"rich": RichProgressBar(), "tqdm": TQDMProgressBar(refresh_rate=5),
             "rich-off": RichProgressBar(refresh_rate=0)}[bar]
    trainer = L.Trainer(accelerator="cpu", callbacks=[given], logger=False, default_root_dir=tmp_path)
    module = make()
    module.trainer = trainer
    (step_bar,) = [cb for cb in module.configure_callbacks() if isinstance(cb, StepProgressBar)]
    assert step_bar.refresh_rate == rate
