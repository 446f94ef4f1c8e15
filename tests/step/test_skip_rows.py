"""Rows the loss cannot reach are skipped by the updater, exactly: the gradient is the one without skipping.

A row reaches the policy loss when it has a loss token and, without a KL or entropy term, a non-zero
advantage on one; the others are not forwarded, while the minibatch's normalisers still count them.
"""

from __future__ import annotations

import dataclasses
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers import make, update

sys.path.insert(0, str(Path(__file__).parents[1] / "algorithms"))
from test_online_rl import AGGS, grads, max_diff, norm, prepare_rollout, probe  # noqa: E402

from lightning_rl.algorithms import OnlineRL  # noqa: E402
from lightning_rl.maths.trust_regions import Clip
from lightning_rl.step.filters import DropUniformGroups  # noqa: E402
from lightning_rl.step.policy_loss import policy_rows  # noqa: E402
from lightning_rl.step.rollout import Rollout  # noqa: E402
from lightning_rl.step.update import token_bins  # noqa: E402


def rollout_of(prompt_mask, attention_mask, advantages) -> Rollout:
    p, c = torch.tensor(prompt_mask), torch.tensor(attention_mask)
    n = len(p)
    return Rollout(prompt_ids=p * 7, prompt_mask=p, completion_ids=c * 5, attention_mask=c,
                   loss_mask=c.clone(), truncated=torch.zeros(n, dtype=torch.bool), lengths=c.sum(1),
                   group_ids=torch.arange(n),
                   rewards=torch.zeros(n), correct=torch.zeros(n, dtype=torch.bool),
                   advantages=torch.tensor(advantages), old_logp=c * -0.5)


def test_trimmed_drops_only_the_padding_columns_every_row_shares():
    r = rollout_of([[0, 0, 1, 1], [0, 1, 1, 1]], [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], [1.0, -1.0])
    t = r.trimmed()
    assert t.prompt_mask.tolist() == [[0, 1, 1], [1, 1, 1]]  # one leading column no row uses
    assert t.attention_mask.tolist() == [[1, 1, 0], [1, 1, 1]]  # two trailing columns no row attends
    assert t.old_logp.shape == (2, 3) and t.loss_mask.shape == (2, 3) and t.advantages.shape == (2,)
    full = rollout_of([[1, 1]], [[1, 1]], [0.5])
    assert full.trimmed() is full


def test_policy_rows_are_those_with_a_loss_token_and_a_non_zero_advantage():
    r = rollout_of([[1], [1], [1], [1]], [[1, 1], [1, 0], [0, 0], [1, 1]], [0.0, 2.0, 3.0, -1.0])
    assert policy_rows(r, kl_coef=0.0, entropy_coef=0.0).tolist() == [False, True, False, True]
    # a KL or entropy term reaches every row with a loss token, whatever its advantage
    assert policy_rows(r, kl_coef=0.1, entropy_coef=0.0).tolist() == [True, True, False, True]
    assert policy_rows(r, kl_coef=0.0, entropy_coef=0.01).tolist() == [True, True, False, True]
    per_token = dataclasses.replace(
        r, advantages=torch.tensor([[0.0, 1.0], [0.0, 5.0], [1.0, 1.0], [0.0, 0.0]]))
    assert policy_rows(per_token, 0.0, 0.0).tolist() == [True, False, False, False]  # row 1's 5.0 is padding


def skipping_grads(module, rollout, skip: bool, micro, aggregation):
    module.updater.skip_zero_rows, module.updater.micro_batch_size = skip, micro
    module.objective = dataclasses.replace(module.objective, aggregation=aggregation, aggregation_length=8)
    forwarded = []
    original = module.policy_loss

    def counting(m, num_tokens, num_seqs):
        forwarded.append(len(m))
        return original(m, num_tokens, num_seqs)

    module.policy_loss = counting
    metrics = update(module, rollout)
    del module.policy_loss
    return grads(module), sum(forwarded), metrics


@pytest.mark.slow
def test_skipping_zero_advantage_rows_leaves_the_gradient_unchanged_in_every_aggregation(tmp_path):
    """Off-policy old log-probs (the clip bites), two groups with zero advantage, two rows without a loss
    token, rows of different lengths: with and without skipping, whole and in micro-batches of 3."""
    module = make(OnlineRL, objective={"trust_region": Clip(0.2, 0.28), "kl_coef": 0.0},
                  update={"max_grad_norm": None}, optimizer=partial(torch.optim.SGD, lr=0.0))

    def experiment(trainer, module):
        rollout = prepare_rollout(module, trainer)
        rollout.advantages[4:12] = 0.0  # two whole groups of G = 4 carry no signal
        reached = policy_rows(rollout, 0.0, 0.0)
        assert int(reached.sum()) == 7  # 16 - 8 zero-advantage rows (9 among them) - row 3 (no loss token)
        out = {}
        for mode in AGGS:
            for micro in (None, 3):
                plain, n_plain, _ = skipping_grads(module, rollout, False, micro, mode)
                skipped, n_skipped, metrics = skipping_grads(module, rollout, True, micro, mode)
                out[(mode, micro)] = (max_diff(plain, skipped), norm(plain), n_plain, n_skipped,
                                      float(metrics[0][0]["perf/skipped_rows_frac"]))
        return out

    for (mode, micro), (diff, scale, n_plain, n_skipped, frac) in probe(module, experiment, tmp_path).items():
        assert scale > 1e-2, mode  # a real gradient
        assert diff < 1e-6, (mode, micro, diff)
        assert (n_plain, n_skipped) == (16, 7), (mode, micro)
        assert frac == pytest.approx(9 / 16)


@pytest.mark.slow
def test_a_kl_term_keeps_zero_advantage_rows_in_the_update(tmp_path):
    module = make(OnlineRL, objective={"kl_coef": 0.1}, update={"max_grad_norm": None},
                  optimizer=partial(torch.optim.SGD, lr=0.0))

    def experiment(trainer, module):
        rollout = prepare_rollout(module, trainer)
        rollout.advantages[:] = 0.0  # no signal at all: only the KL moves the weights
        plain, _, _ = skipping_grads(module, rollout, False, None, "token-mean")
        skipped, forwarded, _ = skipping_grads(module, rollout, True, None, "token-mean")
        return max_diff(plain, skipped), norm(plain), forwarded

    diff, scale, forwarded = probe(module, experiment, tmp_path)
    assert scale > 1e-4 and diff < 1e-6
    assert forwarded == 14  # every row but the two without a loss token


# ------------------------------------------------------------------------ token-budget micro-batches
def test_token_bins_pack_rows_of_like_lengths_within_the_budget():
    prompt = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [0, 1, 1], [1, 1, 1]])  # lengths 2 3 1 2 3
    completion = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]])
    # totals 6 4 3 6 6 -> longest first: rows 0 3 4 (6 each), then 1 (4), then 2 (3)
    bins = token_bins(prompt, completion, budget=12, max_rows=8)
    # [0, 3]: 2 x (2 + 4) = 12; + row 4 would be 3 x (3 + 4) = 21 > 12; [4, 1]: 2 x (3 + 3) = 12; [2] alone
    assert [b.tolist() for b in bins] == [[0, 3], [4, 1], [2]]
    assert [b.tolist() for b in token_bins(prompt, completion, budget=5, max_rows=8)] == [[0], [3], [4], [1],
                                                                                          [2]]
    assert [b.tolist() for b in token_bins(prompt, completion, budget=100, max_rows=2)] == [[0, 3], [4, 1],
                                                                                            [2]]


@pytest.mark.slow
def test_a_token_budget_makes_the_same_gradient_with_less_padding(tmp_path):
    module = make(OnlineRL, objective={"trust_region": Clip(0.2, 0.28), "kl_coef": 0.1},
                  update={"max_grad_norm": None}, optimizer=partial(torch.optim.SGD, lr=0.0))

    def experiment(trainer, module):
        rollout = prepare_rollout(module, trainer)
        out = {}
        for mode in AGGS:
            module.updater.micro_batch_tokens = None
            whole, _, plain = skipping_grads(module, rollout, True, None, mode)
            module.updater.micro_batch_tokens = 40
            binned, forwarded, metrics = skipping_grads(module, rollout, True, None, mode)
            pads = [float(m["perf/pad_frac"]) for m, _ in metrics]
            pad_whole = float(plain[0][0]["perf/pad_frac"])
            pad_binned = sum(p * s for p, (_, s) in zip(pads, metrics, strict=True))
            out[mode] = (max_diff(whole, binned), norm(whole), len(metrics), pad_whole, pad_binned)
        return out

    for mode, (diff, scale, micros, pad_whole, pad_binned) in probe(module, experiment, tmp_path).items():
        assert scale > 1e-2 and diff < 1e-6, (mode, diff)
        assert micros > 1  # the budget split the 14 rows with a loss token
        assert pad_binned < pad_whole, mode


# ------------------------------------------------------------------ the peers' variant: dropping groups
def test_drop_uniform_groups_drops_groups_of_equal_rewards_without_refill():
    r = rollout_of([[1]] * 6, [[1, 1]] * 6, [0.0] * 6)
    r = dataclasses.replace(r, rewards=torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]),
                            group_ids=torch.arange(3).repeat_interleave(2))
    out, stats = DropUniformGroups()(r, refill=None, collectives=None)
    assert out.rewards.tolist() == [0.0, 1.0]  # only the middle group's rewards differ
    assert stats == {"rollout/dropped_uniform_group_frac": pytest.approx(2 / 3)}


@pytest.mark.slow
def test_dropping_groups_changes_the_loss_where_skipping_does_not(tmp_path):
    """The control for the exact skip: removing the rows changes token-mean's normaliser (and so the
    gradient), as the peers' filter does."""
    module = make(OnlineRL, objective={"kl_coef": 0.0}, update={"max_grad_norm": None},
                  optimizer=partial(torch.optim.SGD, lr=0.0))

    def experiment(trainer, module):
        rollout = prepare_rollout(module, trainer)
        rollout.advantages[4:12] = 0.0
        full, _, _ = skipping_grads(module, rollout, True, None, "token-mean")
        dropped = rollout.select(torch.cat([torch.arange(4), torch.arange(12, 16)]))
        fewer, _, _ = skipping_grads(module, dropped, True, None, "token-mean")
        return max_diff(full, fewer), norm(full)

    diff, scale = probe(module, experiment, tmp_path)
    assert scale > 1e-2 and diff > 1e-3 * scale
