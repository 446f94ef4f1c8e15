"""configs/objectives/ overlays (issue 40: DPPO, high-entropy tokens, Clip-Cov, KL-Cov, OPSM; and CISPO)
through the real CLI over configs/grpo.yaml: each builds the objective it states and keeps the algorithm's
other settings, trains two steps and logs its own metric; a bad value names its key."""

from __future__ import annotations

import pytest
import yaml
from helpers import CONFIGS, run_cli, scalars

from lightning_rl.cli.main import LightningRLCLI

pytestmark = pytest.mark.slow

OBJECTIVES = CONFIGS / "objectives"
OVERLAYS = sorted(OBJECTIVES.glob("*.yaml"))
# the metric each overlay's option logs (its share of tokens dropped, kept, stopped or penalised)
METRIC = {"dppo": "policy/clip_frac", "cispo": "policy/clip_frac",
          "high_entropy": "policy/surrogate_token_frac",
          "clip_cov": "policy/cov_frac", "kl_cov": "policy/cov_frac", "opsm": "policy/opsm_masked_frac"}
TINY = ["--data.init_args.batch_size", "2", "--model.init_args.sampling.num_generations", "4",
        "--data.init_args.max_val_rows", "4", "--data.init_args.val_batch_size", "4",
        "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false"]


def test_every_objective_overlay_is_covered():
    assert {p.stem for p in OVERLAYS} == set(METRIC)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.stem)
def test_objective_overlay_builds_its_objective_over_grpo(overlay, tmp_path):
    data = yaml.safe_load(overlay.read_text())
    assert set(data) == {"model"} and set(data["model"]) == {"init_args"}  # never trainer.callbacks
    assert set(data["model"]["init_args"]) == {"objective"}
    cli = LightningRLCLI(args=["--config", str(CONFIGS / "grpo.yaml"), "--config", str(overlay),
                               "--trainer.logger.init_args.save_dir", str(tmp_path)], run=False)
    objective = cli.model.objective
    for key, value in data["model"]["init_args"]["objective"].items():
        if key == "trust_region":  # a class_path and its init_args: that class with those options
            assert type(objective.trust_region).__name__ == value["class_path"].rsplit(".", 1)[-1]
            assert {k: getattr(objective.trust_region, k) for k in value["init_args"]} == value["init_args"]
        else:
            assert getattr(objective, key) == value, key
    assert objective.kl_coef == 0.04  # configs/grpo.yaml's, kept


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.stem)
def test_objective_overlay_trains_and_logs_its_metric(overlay, tmp_path):
    # two rollouts of two updates each: the second update of a rollout is off-policy (DPPO and OPSM act)
    run_cli("fit", "--config", CONFIGS / "grpo.yaml", "--config", overlay, *TINY, "--trainer.max_steps", "4",
            "--model.init_args.update.num_minibatches", "2", "--trainer.logger.init_args.save_dir", tmp_path,
            "--trainer.log_every_n_steps", "1")
    logged = scalars(tmp_path)
    values = [v for _, v in logged[METRIC[overlay.stem]]]  # one per rollout
    assert len(values) == 2 and all(0 <= v <= 1 for v in values), values
    assert len(logged["policy/grad_norm"]) == 2
    if overlay.stem == "high_entropy":  # the top 20% of each minibatch's tokens (ties kept)
        assert all(0.1 < v < 0.5 for v in values), values


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("top_entropy_quantile", "1.5", "`model.objective.top_entropy_quantile` must be in [0, 1]"),
    ("off_policy_mask_threshold", "-1", "`model.objective.off_policy_mask_threshold` must be >= 0"),
])
def test_bad_objective_values_name_the_key(tmp_path, flag, value, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        run_cli("fit", "--config", CONFIGS / "grpo.yaml", f"--model.init_args.objective.{flag}", value,
                "--trainer.logger.init_args.save_dir", tmp_path)


def test_dppo_thresholds_are_checked_under_dppo(tmp_path):
    with pytest.raises(ValueError, match="`model.objective.trust_region.low` must be > 0"):
        run_cli("fit", "--config", CONFIGS / "grpo.yaml", "--config", OBJECTIVES / "dppo.yaml",
                "--model.init_args.objective.trust_region.init_args.low", "0",
                "--trainer.logger.init_args.save_dir", tmp_path)
