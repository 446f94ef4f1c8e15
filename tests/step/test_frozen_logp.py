"""Frozen models' log-probs on the rollout record: the reference's in ``ref_logp``, any other's in
``frozen_logp`` by its name, carried through every reshaping, device move, pickle and checkpoint like a tensor
field, refused when concatenated rows were scored by different models, and checked for non-finite values
with the behaviour and reference log-probs. ``FrozenLogProbs`` writes any name there: no table names it."""

from __future__ import annotations

import pickle

import pytest
import torch

from lightning_rl.episodes.async_source import as_state, from_state
from lightning_rl.episodes.async_worker import Sampled, rollout_to
from lightning_rl.models.frozen import FrozenModels
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.logprobs import ExcludeNonfinite, FrozenLogProbs
from lightning_rl.step.rollout import Rollout, exclude_nonfinite


def fake_rollout(rows: int = 4, width: int = 3, **fields) -> Rollout:
    """``rows`` rows in groups of 2, the last completion column padding (``trimmed`` cuts it); the frozen
    model ``judge_lm`` scored ``10 * row + column``."""
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[:, -1] = 0
    scores = (10 * torch.arange(rows)[:, None] + torch.arange(width)).float()
    return Rollout(torch.ones(rows, 2, dtype=torch.long), torch.ones(rows, 2, dtype=torch.long),
                   torch.ones(rows, width, dtype=torch.long), mask, mask.clone(),
                   torch.zeros(rows, dtype=torch.bool), mask.sum(1), torch.arange(rows) // 2,
                   torch.rand(rows), torch.zeros(rows, dtype=torch.bool),
                   **({"frozen_logp": {"judge_lm": scores}} | fields))


def test_a_frozen_models_logprobs_travel_with_their_rows():
    rollout = fake_rollout()
    scores = rollout.frozen_logp["judge_lm"]
    index = torch.tensor([2, 0])
    assert torch.equal(rollout.select(index).frozen_logp["judge_lm"], scores[index])
    assert torch.equal(rollout.select(torch.tensor([True, False, True, False])).frozen_logp["judge_lm"],
                       scores[[0, 2]])
    assert torch.equal(rollout.trimmed().frozen_logp["judge_lm"], scores[:, :2])
    assert rollout.empty().frozen_logp["judge_lm"].shape == (0, 3)
    parts = list(rollout.minibatches(3, torch.Generator().manual_seed(0)))
    assert sorted(float(r) for p in parts for r in p.frozen_logp["judge_lm"][:, 0]) == [0.0, 10.0, 20.0, 30.0]
    joined = Rollout.cat([rollout, fake_rollout(2, width=5)])  # right-padded to the wider part, like old_logp
    assert joined.frozen_logp["judge_lm"].shape == (6, 5)
    assert torch.equal(joined.frozen_logp["judge_lm"][:4, :3], scores)
    assert torch.equal(joined.frozen_logp["judge_lm"][:4, 3:], torch.zeros(4, 2))
    for kept in (pickle.loads(pickle.dumps(rollout)), rollout_to(rollout, "meta"),
                 from_state(as_state(Sampled(3, 2, ["p"] * 2, rollout, {}, 0)), 1.0).rollout):
        assert kept.frozen_logp.keys() == {"judge_lm"} and kept.frozen_logp["judge_lm"].shape == (4, 3)
    assert rollout_to(rollout, "meta").frozen_logp["judge_lm"].device.type == "meta"


def test_rows_scored_by_different_frozen_models_are_not_concatenated():
    with pytest.raises(ValueError, match=r"different frozen models \[\(\), \('judge_lm',\)\]"):
        Rollout.cat([fake_rollout(), fake_rollout(frozen_logp={})])


def test_a_checkpoint_of_an_older_record_loads_and_leaves_the_scoring_to_the_learner():
    """Sampled-ahead rollouts saved before ``frozen_logp`` held a field per frozen model (``teacher_logp``):
    the field is left out, so the learner's stage scores that model again."""
    state = as_state(Sampled(3, 2, ["p"] * 2, fake_rollout(frozen_logp={}), {}, 0))
    state["rollout"]["teacher_logp"] = torch.zeros(4, 3)
    assert from_state(state, 1.0).rollout.frozen_logp == {}


class Scores:
    """A frozen model whose log-probs are given (``nan`` ones included), like a ``ReferencePolicy``."""

    shares_weights = False

    def __init__(self, logp: torch.Tensor) -> None:
        self.logp, self.calls = logp, 0

    def token_logprobs(self, prompt_ids, prompt_mask, completion_ids, completion_mask, *, temperature):
        self.calls += 1
        return self.logp[: len(completion_ids)].clone(), None


def test_the_stage_scores_any_named_model_into_the_record_and_excludes_its_nonfinite_tokens():
    logp = -torch.ones(4, 3)
    logp[1, 0] = float("nan")
    frozen = FrozenModels({"judge_lm": Scores(logp)})
    stage = FrozenLogProbs(frozen, "judge_lm", policy=None, micro_batch_size=None, time_key="perf/judge_time",
                           excluded_key="judge/excluded_tokens")
    rollout, stats = stage(fake_rollout(frozen_logp={}), Collectives.local())
    assert stats["judge/excluded_tokens"] == 1.0 and rollout.ref_logp is None
    assert rollout.loss_mask[1].tolist() == [0, 1, 0] and rollout.attention_mask[1].tolist() == [1, 1, 0]
    assert torch.isfinite(rollout.frozen_logp["judge_lm"]).all()
    again, _ = stage(rollout, Collectives.local())  # scored already (a worker sampling ahead): kept
    assert frozen.get("judge_lm").calls == 1
    assert again.frozen_logp["judge_lm"] is rollout.frozen_logp["judge_lm"]
    reference = FrozenLogProbs(FrozenModels({"reference": Scores(logp)}), "reference", policy=None,
                               micro_batch_size=None, time_key="perf/reference_time")
    scored, _ = reference(fake_rollout(frozen_logp={}), Collectives.local())
    assert scored.frozen_logp == {} and torch.equal(scored.ref_logp.nan_to_num(), logp.nan_to_num())
    undeclared = FrozenLogProbs(FrozenModels(), "judge_lm", policy=None, micro_batch_size=None,
                                time_key="perf/judge_time")
    unscored, _ = undeclared(fake_rollout(frozen_logp={}), Collectives.local())
    assert unscored.frozen_logp == {}  # no such model declared: the record stays as it is


def test_the_common_exclusion_covers_every_frozen_models_logprobs():
    """The learner's ``ExcludeNonfinite`` reads the behaviour, the reference and every model in
    ``frozen_logp`` (a worker sampling ahead scored them before it runs)."""
    rollout = fake_rollout()
    judge, ref = rollout.frozen_logp["judge_lm"].clone(), torch.zeros(4, 3)
    judge[0, 1], ref[3, 0], judge[2, 2] = float("-inf"), float("nan"), float("nan")  # (2, 2) is padding
    rollout = fake_rollout(frozen_logp={"judge_lm": judge}, ref_logp=ref)
    out, stats = ExcludeNonfinite()(rollout, Collectives.local())
    assert stats == {"rollout/excluded_tokens": 2.0}
    assert out.loss_mask.tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 0], [0, 1, 0]]
    assert torch.isfinite(out.frozen_logp["judge_lm"]).all() and torch.isfinite(out.ref_logp).all()
    assert exclude_nonfinite(out) == (out, 0.0)
