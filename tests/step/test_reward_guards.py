"""Guards around rewards in the online RL step (issue 8): a run whose reward function fails on too many
samples under ``rewards.on_error: zero`` stops with the function's last error instead of training on zeros;
DAPO's overlong shaping is logged (``rollout/overlong_penalty_mean``) and described truly in the help and
in configs/dapo.yaml."""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch
import yaml
from helpers import CONFIGS, datamodule, make, make_trainer, read_csv_metrics, run_cli, sample_round
from lightning.pytorch.loggers import CSVLogger

from lightning_rl.algorithms import DAPO
from lightning_rl.callbacks.base import RLCallback
from lightning_rl.maths.penalties import overlong_penalty
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.reward_scorer import RewardError, RewardScorer

HERE = __name__  # reward functions below are named by import path, as in YAML
PROMPT = r"'\d+='"  # a sort prompt, as quoted in messages


# reward functions named by path ----------------------------------------------------------------------
def always_raises(completions, **_):
    raise ZeroDivisionError("bad reward code")


def nan_at_three(completions, **_):
    return [math.nan if i == 3 else 1.0 for i in range(len(completions))]


# -------------------------------------------------------------------------------------------- helpers
class Capture(RLCallback):
    """Keep every final rollout of a step."""

    def __init__(self):
        self.rollouts = []

    def on_rollout_end(self, trainer, pl_module, rollout):
        self.rollouts.append(rollout)


class Probe(RLCallback):
    """Run ``fn(trainer, module)`` once the fit has started, then stop before the first step."""

    def __init__(self, fn):
        self.fn, self.result = fn, None

    def on_train_start(self, trainer, pl_module):
        self.result = self.fn(trainer, pl_module)
        trainer.should_stop = True


def params(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.policy.named_parameters()}


def changed(before, module) -> bool:
    return any(not torch.equal(v, module.policy.get_parameter(n)) for n, v in before.items())


def logged_fit(module, tmp_path, steps=2, dm=None, callbacks=()):
    trainer = make_trainer(tmp_path, max_steps=steps, logger=CSVLogger(str(tmp_path)), log_every_n_steps=1,
                           callbacks=list(callbacks))
    trainer.fit(module, dm or datamodule())
    return trainer, read_csv_metrics(tmp_path)


# ------------------------------------------------------------------- 1. too many failed rewards: stop
@pytest.mark.slow
def test_reward_failing_everywhere_in_zero_mode_stops_the_run(tmp_path):
    module = make(rewards={"functions": [f"{HERE}:always_raises"], "on_error": "zero"})
    before = params(module)
    trainer = make_trainer(tmp_path, max_steps=2)
    with pytest.raises(RewardError) as info:
        trainer.fit(module, datamodule())
    message = str(info.value)
    # 4 prompts x G = 4: every one of the 16 samples failed, above the default limit of a half
    assert "rewards failed on 16 of 16 samples, more than `model.rewards.max_error_frac`=0.5" in message
    # the function, its count, the last sample (quoted) and the original exception text
    assert re.search(rf"reward function `{HERE}:always_raises` failed on 16 of 16 samples: "
                     rf"sample 15 \(prompt {PROMPT}, completion '[^']*'\): "
                     r"raised ZeroDivisionError: bad reward code", message), message
    assert "`model.rewards.on_error: raise`" in message  # the way to a traceback
    assert trainer.global_step == 0 and not changed(before, module)  # stopped before any update


def test_reward_failing_on_one_of_eight_samples_trains_warns_and_counts(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="lightning_rl.step.reward_pipeline")  # the rewards stage warns
    module = make(rewards={"functions": [f"{HERE}:nan_at_three"], "on_error": "zero"})  # default limit 0.5
    before = params(module)
    trainer, logged = logged_fit(module, tmp_path, dm=datamodule(batch_size=2))  # 2 prompts x G = 4
    assert trainer.global_step == 2 and changed(before, module)
    assert logged["rollout/reward_errors"] == [1.0, 1.0]
    lines = [r.getMessage() for r in caplog.records if r.name == "lightning_rl.step.reward_pipeline"]
    assert len(lines) == 2, lines  # one line per step
    for line in lines:
        assert re.fullmatch(rf"reward function `{HERE}:nan_at_three` failed on 1 of 8 samples: "
                            rf"sample 3 \(prompt {PROMPT}, completion '[^']*'\): returned nan", line), line
    assert logged["rollout/overlong_penalty_mean"] == [0.0, 0.0]  # GRPO: shaping off, the key still there


@pytest.mark.slow
def test_the_stop_is_decided_on_counts_summed_over_ranks(tmp_path):
    """The step's first round all-reduces (failed, samples), so every rank reaches the same verdict; refill
    rounds (rank-dependent in number under dynamic sampling) make no collective call."""
    module = make(rewards={"functions": [f"{HERE}:nan_at_three"], "on_error": "zero"})

    def experiment(trainer, module):
        batch = next(iter(trainer.datamodule.train_dataloader()))
        sent, out = [], {}

        def other_rank(failed):  # strategy.reduce as if a second rank had 8 samples, `failed` of them failed
            def reduce(t, reduce_op=None):
                sent.append((t.tolist(), reduce_op))
                return t + torch.tensor([failed, 8.0])
            return reduce

        for failed in (8.0, 7.0):  # 9 of 16 > 0.5 stops (here 1 of 8 only); 8 of 16 does not
            trainer.strategy.reduce = other_rank(failed)
            try:
                sample_round(module, batch, Collectives(trainer))  # the step's first round decides
                out[failed] = None
            except RewardError as err:
                out[failed] = str(err)
        sent_before_refill = len(sent)
        sample_round(module, batch, Collectives(trainer), decide=False)  # a refill round: no collective
        del trainer.strategy.reduce
        return out, sent, sent_before_refill

    p = Probe(experiment)
    make_trainer(tmp_path, callbacks=[p]).fit(module, datamodule(batch_size=2))
    out, sent, sent_before_refill = p.result
    assert out[8.0] is not None and "rewards failed on 9 of 16 samples" in out[8.0]
    assert f"`{HERE}:nan_at_three` failed on 1 of 8 samples: sample 3" in out[8.0]  # this rank's error
    assert out[7.0] is None  # exactly the limit: not more than it
    assert sent == [([1.0, 8.0], "sum")] * 2 and sent_before_refill == len(sent)


@pytest.mark.parametrize("frac", [-0.1, 1.5, math.nan])
def test_max_reward_error_frac_is_validated(frac):
    with pytest.raises(ValueError,
                       match=rf"`model.rewards.max_error_frac` must be in \[0, 1\], got {frac!r}"):
        make(rewards={"max_error_frac": frac})


def test_scorer_records_each_failing_function_and_its_last_sample():
    fns = ["lightning_rl.step.rewards:exact_match", f"{HERE}:nan_at_three", f"{HERE}:always_raises"]
    scorer = RewardScorer(fns, on_error="zero", max_error_frac=0.5)
    prompts, completions = [f"p{i}" for i in range(5)], [f"c{i}" for i in range(5)]
    scores = scorer.score(prompts, completions, answer=completions)
    assert scores.totals == [0.0] * 5 and scores.failed == frozenset(range(5))
    nan, raised = (str(e) for e in scores.errors)
    assert nan == f"reward function `{HERE}:nan_at_three` failed on 1 of 5 samples: " \
                  "sample 3 (prompt 'p3', completion 'c3'): returned nan"
    assert raised.startswith(f"reward function `{HERE}:always_raises` failed on 5 of 5 samples: sample 4 "
                             "(prompt 'p4', completion 'c4'): raised ZeroDivisionError: bad reward code")
    with pytest.raises(RewardError, match="rewards failed on 3 of 5 samples"):
        scorer.check_failures(scores, 3.0, 5.0)
    scorer.check_failures(scores, 2.0, 4.0)  # a half is not more than the limit
    assert scorer(prompts, completions, answer=completions) == ([0.0] * 5, 5)  # the old call form


# ------------------------------------------------------------------------------ 2. overlong shaping
@pytest.mark.slow
def test_overlong_penalty_mean_is_the_mean_penalty_added(tmp_path):
    module = make(DAPO, sampling={"max_new_tokens": 8},
                  rewards={"overlong_buffer": 4, "overlong_penalty_factor": 0.5},
                  filters={"dynamic_sampling": False})
    cap = Capture()
    _, logged = logged_fit(module, tmp_path, callbacks=[cap])
    assert len(cap.rollouts) == 2
    expected = []
    for rollout in cap.rollouts:
        # by hand: 8 - 4 = 4 tokens are free; L in (4, 8] loses 0.5 * (L - 4) / 4; L > 8 cannot happen
        penalty = [0.0 if n <= 4 else -0.5 * (n - 4) / 4 for n in rollout.lengths.tolist()]
        expected.append(sum(penalty) / len(penalty))
    assert any(e < 0 for e in expected)  # a real penalty, not the default 0
    assert logged["rollout/overlong_penalty_mean"] == pytest.approx(expected, abs=1e-6)


def test_dapo_yaml_states_the_overlong_numbers_of_its_settings():
    text = (CONFIGS / "dapo.yaml").read_text()
    args = yaml.safe_load(text)["model"]["init_args"]
    max_len, buffer = args["sampling"]["max_new_tokens"], args["rewards"]["overlong_buffer"]
    factor = args["rewards"].get("overlong_penalty_factor", 1.0)
    assert f"L <= {max_len} - {buffer} = {max_len - buffer}" in text
    stated = {int(n): float(v) for v, n in re.findall(r"(-\d\.\d+) at L = (\d+)", text)}
    assert len(stated) >= 2
    for n, value in stated.items():
        assert factor * float(overlong_penalty(torch.tensor([n]), max_len, buffer)[0]) == value, n
    # a sort answer (5 digits + EOS) is exactly the free length: never penalised, one more token is
    tokenizer = make(DAPO).tokenizer
    assert len(tokenizer("01358", add_special_tokens=False)["input_ids"]) + 1 == max_len - buffer
    assert stated[max_len - buffer + 1] < 0


ARGUMENT = re.compile(r"--model\.([\w.]+) (?:[A-Z_]+|\{[^}]*\}|\[ITEM,\.\.\.\])"
                      r"(?:, --model\.[\w.]+\+ (?:[A-Z_]+|\[ITEM,\.\.\.\]))? ")


def model_help(capsys, cls: str) -> tuple[dict[str, str], dict[str, str]]:
    """``lightning-rl fit --model.help <cls>``: ``{argument: its help text on one line}`` (``rewards.
    overlong_buffer``) and ``{group: the class's description of it on one line}`` (``rewards``)."""
    with pytest.raises(SystemExit):
        run_cli("fit", "--model.help", f"lightning_rl.algorithms.{cls}")
    arguments, groups = {}, {}
    for block in capsys.readouterr().out.split("Help for", 1)[1].split("\n\n"):
        lines = block.splitlines()
        first = next((i for i, line in enumerate(lines) if line.startswith("  -")), len(lines))
        parts = ARGUMENT.split(" ".join(" ".join(lines[first:]).split()))
        block_arguments = dict(zip(parts[1::2], (p.strip() for p in parts[2::2]), strict=True))
        arguments |= block_arguments
        if block_arguments and "." in next(iter(block_arguments)):
            groups[next(iter(block_arguments)).split(".")[0]] = " ".join(" ".join(lines[:first]).split())
    return arguments, groups


def test_help_describes_overlong_shaping_and_the_error_limit_truly(capsys):
    (online, _), (dapo, dapo_groups) = model_help(capsys, "OnlineRL"), model_help(capsys, "DAPO")
    # OnlineRL: off by default, `auto` named, the penalty and its metric described
    overlong = online["rewards.overlong_buffer"]
    assert "``auto``" in overlong and "default: null" in overlong
    assert "off" in overlong and "rollout/overlong_penalty_mean" in overlong
    assert online["rewards.overlong_penalty_factor"].startswith("weight of the overlong penalty")
    # DAPO: on by default (its description of its `rewards` group), `auto`, and what turns it off
    assert "overlong punishment on: ``overlong_buffer: auto``" in dapo_groups["rewards"]
    assert "default: auto" in dapo["rewards.overlong_buffer"]
    assert "``None`` or 0: off" in dapo["rewards.overlong_buffer"]
    assert dapo_groups["objective"].startswith("clip-higher")  # DAPO's own groups are described too
    assert online["rewards.max_error_frac"].startswith("with ``on_error: zero``, stop when more than")
