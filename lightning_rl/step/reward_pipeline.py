"""The rewards stage of the online step (:class:`RewardPipeline`): the reward functions' weighted sum, a
reward model's score, DAPO's overlong shaping, correctness, and the check that stops a run whose rewards
fail too often."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_rl.step.reward_scorer import RewardScorer, RewardScores
from lightning_rl.step.rewards import FullScore, RewardFn

log = logging.getLogger(__name__)


def overlong_shaping(buffer: int | str | None, factor: float,
                     max_new_tokens: int) -> tuple[int, int, float] | None:
    """``(max_len, buffer, factor)`` of DAPO's overlong shaping for ``RewardPipeline``, or ``None`` when off
    (``buffer`` None or 0); ``auto``: a fifth of ``max_new_tokens``, at least 1."""
    buffer = max(1, max_new_tokens // 5) if buffer == "auto" else buffer
    if buffer is not None and not 0 <= buffer <= max_new_tokens:
        raise ValueError(f"`model.rewards.overlong_buffer` must be 'auto' or in "
                         f"[0, max_new_tokens={max_new_tokens}], got {buffer}")
    return (max_new_tokens, buffer, factor) if buffer else None


def overlong_reward(completion_lengths: Sequence[int], max_len: int, cache_len: int) -> list[float]:
    """DAPO's soft overlong punishment per completion (see ``losses.overlong_penalty``)."""
    import torch

    from lightning_rl.maths.penalties import overlong_penalty

    return overlong_penalty(torch.as_tensor(list(completion_lengths)), max_len, cache_len).tolist()


@dataclass
class RewardResult:
    """The rewards of one batch of samples.

    Attributes:
        rewards: ``[N]`` float: the functions' weighted total + the weighted reward-model score + shaping.
        correct: ``[N]`` bool: verifiable correctness (``correctness_fn``), what accuracy reads.
        scores: the reward functions' scores, failures and errors (``RewardScores``).
        stats: ``rollout/reward_errors``, ``rollout/overlong_penalty_mean``, ``perf/reward_time``.
        outcome: ``[N]`` float: what DAPO's filter compares within a group (:meth:`RewardPipeline.outcome`).
        decoupled: ``[N]`` float, GDPO's per-group decoupled sum of the functions' scores
            (``maths.multi_reward.gdpo_group_sum``), when the advantage estimator reads it; else ``None``.
    """

    rewards: Any
    correct: Any
    scores: RewardScores
    stats: dict[str, float]
    outcome: Any = None
    decoupled: Any = None


class RewardPipeline:
    """The rewards stage: reward functions, a reward model, overlong shaping, correctness, and the check
    that stops a run whose rewards fail too often (decided on counts summed over all ranks).

    Args:
        scorer: the weighted reward functions, or ``None`` (a reward model alone).
        correctness_fn: ``(prompts=, completions=, **columns) -> list`` of correctness per sample.
        reward_model: a ``RewardModelScorer`` (``score(texts, completions, add_special_tokens=)``) or None.
        reward_model_weight: weight of its score.
        render: ``prompts -> (rendered texts, add_special_tokens)`` for the reward model's re-tokenising.
        overlong: ``(max_len, buffer, factor)`` of DAPO's soft overlong punishment, or None.
        decouple_eps: GDPO (``lightning_rl.step.estimators.GDPO``): each function's scores are normalised
            within the group (this ``eps`` under the std) and summed with the weights, per batch of whole
            groups (``group_size``); DAPO's filter then reads that sum. ``None``: off.

    Each part's time (every reward function, the reward model, ``correctness_fn``) is summed in ``timings``
    until :meth:`warn_if_slow`, which names the slowest when rewards take most of a training step.
    """

    def __init__(self, scorer: RewardScorer | None, correctness_fn: RewardFn, *, reward_model: Any = None,
                 reward_model_weight: float = 1.0, render: Any = None,
                 overlong: tuple[int, int, float] | None = None, decouple_eps: float | None = None) -> None:
        self.scorer, self.correctness_fn, self.decouple_eps = scorer, correctness_fn, decouple_eps
        self.reward_model, self.reward_model_weight = reward_model, reward_model_weight
        self.render, self.overlong = render, overlong
        self.timings: dict[str, list[float]] = {}  # part -> [seconds, calls] since the last `warn_if_slow`
        self.warned_slow = False
        fn = correctness_fn
        self.correctness_part = f"correctness function `{getattr(fn, '__module__', '?')}:" \
                                f"{getattr(fn, '__qualname__', type(fn).__name__)}`"

    def timed(self, part: str, seconds: float) -> None:
        """Add one call of ``part`` (e.g. "reward function `pkg.mod:fn`") that took ``seconds``."""
        total = self.timings.setdefault(part, [0.0, 0])
        total[0] += seconds
        total[1] += 1

    def warn_if_slow(self, reward_time: float, step_time: float) -> None:
        """Warn (rank 0, once per run) when the rewards took more than half of a training step, naming the
        slowest part and its seconds per call; the timings then start again for the next step."""
        timings, self.timings = self.timings, {}
        if self.warned_slow or not timings or not reward_time > 0.5 * step_time:
            return
        from lightning.pytorch.utilities import rank_zero_warn

        part, (seconds, calls) = max(timings.items(), key=lambda item: item[1][0])
        self.warned_slow = True
        calls = int(calls)
        rank_zero_warn(
            f"rewards took {reward_time:.2f}s of a {step_time:.2f}s training step (`perf/reward_time` of "
            f"`perf/step_time`); the slowest is the {part} at {seconds / calls:.2f}s per call ({calls} "
            f"call{'s' * (calls != 1)}): score the batch at once, cache or parallelise it, or it bounds the "
            "run's speed"
        )

    def score(self, prompts: Sequence[Any], texts: list[str], lengths: list[int], columns: dict[str, list],
              returns: Sequence[float] | None = None, failed: Sequence[bool] | None = None,
              group_size: int | None = None) -> tuple[Any, RewardScores]:
        """``[N]`` rewards (functions + reward model + an episode's ``returns``, unshaped: what validation,
        predictions and sample tables show; 0 where the episode's environment ``failed``) and the functions'
        scores. ``group_size``: the groups group rewards score (``None``: runs of one prompt)."""
        import torch

        if self.scorer is not None:
            scores = self.scorer.score(prompts, texts, group_size, completion_lengths=lengths, **columns)
            for name, seconds in zip(self.scorer.names, scores.seconds, strict=False):
                self.timed(f"reward function `{name}`", seconds)
        else:
            scores = RewardScores([0.0] * len(texts), frozenset(), [])
        rewards = torch.tensor(scores.totals, dtype=torch.float32)
        if self.reward_model is not None and texts:
            start = time.perf_counter()
            rendered, special = self.render(prompts)
            model_scores = self.reward_model.score(rendered, texts, add_special_tokens=special)
            self.timed("reward model", time.perf_counter() - start)
            rewards = rewards + self.reward_model_weight * model_scores.cpu().float()
        if returns is not None:
            rewards = rewards + torch.as_tensor(returns, dtype=torch.float32)
        return unless_failed(rewards, failed), scores

    def __call__(self, prompts: Sequence[Any], texts: list[str], lengths: list[int], columns: dict[str, list],
                 *, collectives: Any = None, decide: bool = True, returns: Any = None,
                 said_correct: Sequence[bool | None] | None = None,
                 failed: Sequence[bool] | None = None, group_size: int | None = None) -> RewardResult:
        """Score one batch; warnings on rank 0. ``decide``: whether too many rewards failed, on counts summed
        over ranks (every rank once per step, on its first batch; refill rounds are rank-dependent in
        number, so they never decide, their failures are counted and warned about).

        Episodes: ``returns`` (``[N]``, each episode's environment rewards) are added last;
        ``said_correct`` (the environments' ``info["correct"]``) is the correctness when every episode has
        one, else ``correctness_fn`` decides; an episode whose environment ``failed`` (``on_error: zero``)
        gets reward 0 and is not correct, whatever the functions, a reward model or shaping said.
        ``group_size``: the sampler's G (group rewards and GDPO read the groups)."""
        import torch

        start = time.perf_counter()
        rewards, scores = self.score(prompts, texts, lengths, columns, group_size=group_size)
        if collectives is not None and decide:
            self.check_failures(scores, collectives)
        if collectives is None or collectives.rank == 0:
            for errors in scores.errors:
                log.warning(str(errors))
        penalty = torch.zeros(len(texts))
        if self.overlong is not None:
            max_len, buffer, factor = self.overlong
            penalty = factor * torch.tensor(overlong_reward(lengths, max_len, buffer), dtype=torch.float32)
            rewards = rewards + penalty
        if returns is not None:
            rewards = rewards + returns
        correct = unless_failed(self.correctness(prompts, texts, columns, scores, said_correct), failed)
        decoupled = None if self.decouple_eps is None else self.decoupled(scores, group_size)
        outcome = unless_failed(self.outcome(correct, scores, said_correct, decoupled), failed)
        rewards = unless_failed(rewards, failed)
        stats = {"rollout/reward_errors": float(len(scores.failed)),
                 "rollout/overlong_penalty_mean": float(penalty.mean()) if len(penalty) else 0.0,
                 "perf/reward_time": time.perf_counter() - start, **(scores.metrics or {})}
        return RewardResult(rewards, correct, scores, stats, outcome, decoupled)

    def decoupled(self, scores: RewardScores, group_size: int | None) -> Any:
        """``[N]`` GDPO's decoupled sum of the functions' scores within each group of ``group_size``."""
        import torch

        from lightning_rl.maths.multi_reward import gdpo_group_sum

        assert self.scorer is not None and self.decouple_eps is not None
        if group_size is None:
            raise ValueError("GDPO normalises each reward function within its group: score whole groups "
                             "(`group_size`)")
        values = torch.tensor(scores.values, dtype=torch.float64).reshape(len(scores.values), -1).T
        return gdpo_group_sum(values, group_size, torch.tensor(self.scorer.weights), self.decouple_eps)

    def correctness(self, prompts: Sequence[Any], texts: list[str], columns: dict[str, list],
                    scores: RewardScores, said: Sequence[bool | None] | None) -> Any:
        """``[N]`` bool: what the environments said when all did, else ``correctness_fn`` (read off the
        scores just computed when it is a reward function at its full score)."""
        import torch

        if said and all(c is not None for c in said):
            return torch.tensor(list(said), dtype=torch.bool)
        correctness_start = time.perf_counter()
        if self.scores_correctness:  # the scores just computed, not a 2nd call
            values = scores.values[self.scorer.names.index(self.correctness_fn.name)]
            correct = torch.tensor([v >= FullScore.FULL for v in values], dtype=torch.bool)
        else:
            correct = torch.tensor([bool(c) for c in self.correctness_fn(prompts=prompts, completions=texts,
                                                                       **columns)], dtype=torch.bool)
        self.timed(self.correctness_part, time.perf_counter() - correctness_start)
        return correct

    @property
    def scores_correctness(self) -> bool:
        """Whether correctness is read off a reward function's score (``FullScore``: ``correctness_fn`` and
        ``accuracy_fn`` unset) rather than decided by a correctness function of its own."""
        return isinstance(self.correctness_fn, FullScore) and self.scorer is not None \
            and self.correctness_fn.name in self.scorer.names

    def outcome(self, correct: Any, scores: RewardScores, said: Sequence[bool | None] | None,
                decoupled: Any = None) -> Any:
        """``[N]`` float, what DAPO's dynamic sampling compares within a group (it keeps groups whose
        outcomes differ): correctness (0 / 1) when it is a signal of its own (the environments' or a
        correctness function's); when it is read off the main reward function at its full score, that
        function's raw score, unshaped (for a 0 / 1 function the same; for a shaped one, a group whose
        samples all fall short of 1.0 but score differently is informative and kept); under GDPO
        (``decoupled``) the decoupled sum instead, rounded to 1e-6: a group whose functions vary carries
        signal even where their weighted sum, or the main function, is constant (SkyRL#2104), and one whose
        normalised scores cancel exactly carries none."""
        import torch

        if (said and all(c is not None for c in said)) or not self.scores_correctness:
            return correct.float()
        if decoupled is not None:
            return torch.round(decoupled, decimals=6)
        assert self.scorer is not None
        return torch.tensor(scores.values[self.scorer.names.index(self.correctness_fn.name)],
                            dtype=torch.float32)

    def outcome_name(self) -> str:
        """What :meth:`outcome` is, for the first log line of a run that filters on it."""
        if self.scores_correctness and self.decouple_eps is not None:
            return ("GDPO's sum of the reward functions' scores, each normalised within its group (no "
                    "correctness signal of its own: `model.rewards.correctness_fn` and `accuracy_fn` are "
                    "unset)")
        if self.scores_correctness:
            return (f"the score of `{self.correctness_fn.name}` (no correctness signal of its own: "
                    "`model.rewards.correctness_fn` and `accuracy_fn` are unset; a 0 / 1 score is "
                    "correctness)")
        return f"correctness ({getattr(self.correctness_fn, '__qualname__', repr(self.correctness_fn))})"

    def check_failures(self, scores: RewardScores, collectives: Any) -> None:
        """Stop when failures summed over all ranks exceed ``model.rewards.max_error_frac`` (every rank
        makes the all-reduce and reaches the same verdict, so they raise together)."""
        import torch

        if self.scorer is None or not self.scorer.limits_failures:
            return
        counts = torch.tensor([len(scores.failed), len(scores.totals)], dtype=torch.float32)
        failed, total = collectives.sum(counts).tolist()
        where = f"rank {collectives.rank}" if collectives.world_size > 1 else ""
        self.scorer.check_failures(scores, failed, total, where)


def unless_failed(values: Any, failed: Sequence[bool] | None) -> Any:
    """``[N]`` ``values`` with 0 / False where the episode's environment ``failed`` (``None``: none did)."""
    if failed is None:
        return values
    import torch

    return values.masked_fill(torch.as_tensor(failed, dtype=torch.bool), 0)
