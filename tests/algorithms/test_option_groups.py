"""The option groups: a dozen constructor keys, presets as default groups, checks where a group is built."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_rl.algorithms import DAPO, GRPO, GSPO, PPO, RLOO, SAPO, OnlineRL
from lightning_rl.algorithms.assembly import objective_stages
from lightning_rl.algorithms.learner_options import FilterOptions, ObjectiveOptions, UpdateOptions
from lightning_rl.algorithms.presets import preset_defaults, with_changes
from lightning_rl.algorithms.sampler_options import SamplingOptions
from lightning_rl.maths.objective import Objective
from lightning_rl.maths.penalties import AdaptiveKL
from lightning_rl.models.critic import CriticOptions

ONLINE_KEYS = ["policy", "sampling", "rewards", "episodes", "objective", "advantage", "filters", "logprobs",
               "update", "engine", "optimizer", "lr_scheduler"]


@pytest.mark.parametrize("cls", [OnlineRL, GRPO, DAPO, GSPO, SAPO, RLOO])
def test_the_online_family_takes_twelve_keys(cls):
    assert sorted(preset_defaults(cls)) == sorted(ONLINE_KEYS)


def test_ppo_adds_only_its_critic_group():
    assert sorted(preset_defaults(PPO)) == sorted([*ONLINE_KEYS, "critic"])


def test_presets_differ_from_the_base_only_in_the_groups_they_declare():
    base = preset_defaults(OnlineRL)
    changed = {name: [k for k, v in preset_defaults(cls).items() if v != base[k]]
               for name, cls in {"GRPO": GRPO, "DAPO": DAPO, "GSPO": GSPO, "SAPO": SAPO}.items()}
    assert changed == {"GRPO": ["objective"], "DAPO": ["objective", "filters", "rewards"],
                       "GSPO": ["objective"], "SAPO": ["objective"]}
    assert preset_defaults(GRPO)["objective"].kl_coef == 0.04
    dapo = preset_defaults(DAPO)
    assert (dapo["objective"].trust_region.high, dapo["objective"].aggregation) == (0.28, "token-mean")
    assert dapo["filters"].dynamic_sampling and dapo["rewards"].overlong_buffer == "auto"


def test_a_mapping_changes_fields_of_the_presets_group_and_keeps_the_rest():
    args = with_changes(DAPO, {"objective": {"kl_coef": 0.01}, "sampling": SamplingOptions(top_k=5)})
    assert args["objective"] == dataclasses.replace(preset_defaults(DAPO)["objective"], kl_coef=0.01)
    assert args["sampling"] == SamplingOptions(top_k=5)  # a whole group replaces the preset's


@pytest.mark.parametrize(("build", "message"), [
    (lambda: SamplingOptions(temperature=0.0), "`model.sampling.temperature` must be > 0, got 0.0"),
    (lambda: SamplingOptions(top_p=1.5), "`model.sampling.top_p` must be in (0, 1], got 1.5"),
    (lambda: SamplingOptions(worker="fork"), "`model.sampling.worker` must be one of auto, process, thread, "
                                             "got 'fork'"),
    (lambda: UpdateOptions(epochs=0), "`model.update.epochs` must be >= 1, got 0"),
    (lambda: UpdateOptions(max_grad_norm=0.0), "`model.update.max_grad_norm` must be > 0 or null, got 0.0"),
    (lambda: FilterOptions(max_gen_batches=0), "`model.filters.max_gen_batches` must be >= 1, got 0"),
    (lambda: ObjectiveOptions(kl_in_reward=AdaptiveKL(0.1)),
     "`model.objective.kl_in_reward: AdaptiveKL` needs"),
    (lambda: ObjectiveOptions(aggregation="seq-mean-token-sum-norm", aggregation_length=0),
     "`model.objective.aggregation_length` must be >= 1 or null, got 0"),
    (lambda: ObjectiveOptions(aggregation_length=64),
     "`model.objective.aggregation_length` has no effect under "
     "`model.objective.aggregation: seq-mean-token-mean`"),
    (lambda: CriticOptions(vf_coef=0.0), "`model.critic.vf_coef` must be > 0, got 0.0"),
])
def test_a_group_refuses_a_bad_field_naming_its_key_and_range(build, message):
    with pytest.raises(ValueError) as err:
        build()
    assert message in str(err.value)


def test_the_objective_group_holds_every_axis_of_the_objective_with_its_default():
    """The group is built into ``Objective`` field by field: a new axis, or a default changed on one side
    only, shows here."""
    group = {f.name: f.default for f in dataclasses.fields(ObjectiveOptions)}
    axes = {f.name: f.default for f in dataclasses.fields(Objective)}
    assert {name: group.get(name, "missing") for name in axes} == axes


def test_the_aggregation_length_defaults_to_the_budget_the_module_passes():
    """``aggregation_length: null`` is the completion budget that ``OnlineRL`` hands ``objective_stages``; a
    length set in the group wins; without a budget it stays ``None`` (the pure function's ``T``)."""
    norm = ObjectiveOptions(aggregation="seq-mean-token-sum-norm")
    assert objective_stages(norm, default_length=64)[0].aggregation_length == 64
    assert objective_stages(dataclasses.replace(norm, aggregation_length=200),
                            default_length=64)[0].aggregation_length == 200
    assert objective_stages(norm)[0].aggregation_length is None


def test_the_online_module_normalises_by_its_completion_budget():
    from helpers import make

    module = make(GRPO, objective={"aggregation": "seq-mean-token-sum-norm"})
    assert module.objective.aggregation_length == 8  # helpers.make: sampling.max_new_tokens 8


def test_an_explicit_option_that_another_would_override_is_refused_naming_both_keys():
    """The KL in the reward needs the trained policy's own log-probs (``recompute``): ``auto`` and
    ``recompute`` follow it; an explicit other source was once replaced silently, now refused."""
    from lightning_rl.algorithms.assembly import behaviour_source

    assert behaviour_source("auto", kl_in_reward=True) == "recompute"
    assert behaviour_source("recompute", kl_in_reward=True) == "recompute"
    assert behaviour_source("on_policy", kl_in_reward=False) == "on_policy"
    for explicit in ("on_policy", "from_engine"):
        with pytest.raises(ValueError, match=rf"`model.objective.kl_in_reward`.*"
                                             rf"`model.logprobs.behaviour: {explicit}`"):
            behaviour_source(explicit, kl_in_reward=True)
