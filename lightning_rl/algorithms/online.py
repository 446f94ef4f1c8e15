"""The shared online RL step: one ``training_step`` = one RL iteration (manual optimisation).

prompt batch -> G completions per prompt -> rewards -> group advantages -> (callbacks: dynamic
sampling) -> reference log-probs if a KL term is on -> (callbacks: old-policy log-probs, metrics)
-> ``ppo_epochs`` passes over ``num_minibatches`` minibatches, each split into micro-batches whose
losses are normalised by the counts of the whole minibatch (all ranks), so the gradient does not
depend on micro-batch size, accumulation or world size.

Scoring: top-k / top-p filtering belongs to sampling only. Current, behaviour and reference log-probs
are all scored on the *tempered, unfiltered* distribution (as verl does), so the three share one support
and ratios and KL stay finite when a model would have filtered out a sampled token. A token whose
behaviour or reference log-prob is still not finite is left out and counted in ``rollout/excluded_tokens``.

Statistics flow one way: each stage returns its numbers, the module merges them, and callbacks get the
step's final, read-only statistics once in ``on_step_end``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from types import MappingProxyType
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_only

from lightning_rl.algorithms.base import PolicyModule, batch_columns, has_callback, render_prompts
from lightning_rl.losses import (
    Aggregation,
    KLEstimator,
    RatioLevel,
    TrustRegion,
    aggregate,
    group_advantages,
    masked_mean,
    normalizer_counts,
)
from lightning_rl.objective import Objective
from lightning_rl.reward_model import RewardModelScorer
from lightning_rl.rewards import RewardScorer, RewardScores, import_reward, overlong_reward
from lightning_rl.rollout import Rollout, exclude_nonfinite, merge_stats
from lightning_rl.sharding import (
    agreed_count,
    collective_forward,
    deepspeed_engine,
    full_value,
    is_sharded,
    needs_synced_generation,
    no_gradient_sync,
    start_deepspeed_micro_batch,
    zero_loss,
)

log = logging.getLogger(__name__)


@rank_zero_only
def warn_rank_zero(message: str) -> None:
    """A warning line on rank zero, every time (``warnings.warn`` would show a repeated message once)."""
    log.warning(message)


def pad_fraction(micro: Rollout) -> torch.Tensor:
    """The share of a training micro-batch's positions (prompt + completion) that are padding."""
    total = micro.prompt_ids.numel() + micro.completion_ids.numel()
    real = micro.prompt_mask.sum() + micro.completion_mask.sum()
    return 1.0 - real.float() / max(total, 1)


class OnlineRL(PolicyModule):
    """Online RL on prompts with verifiable or model-scored rewards (GRPO family; PPO extends it).

    Args:
        num_generations: completions sampled per prompt (G >= 2); the group of a group-relative baseline.
        temperature, top_p, top_k: sampling settings. Log-probs are scored at the same temperature,
            without the top-k / top-p filter (see the module docstring).
        reward_fns: reward functions by import path, ``package.module:function`` (default: ``exact_match``,
            or none when a ``reward_model`` is given).
        reward_weights: one weight per reward function (default 1 each).
        reward_model: a reward-model folder or hub id (``RewardModel``'s export, or any one-label
            ``AutoModelForSequenceClassification``) whose score of the rendered prompt + completion text is
            added to the reward functions' total; it re-tokenises that text with its own tokenizer, runs
            batched under ``no_grad``, and is kept out of checkpoints and optimisers (whole on every rank).
        reward_model_weight: weight of the reward model's score.
        correctness_fn: ``module:function`` deciding correctness: ``rollout.correct`` (DAPO's group
            filter, ``rollout/correct_frac``) and ``val/accuracy``; ``None`` uses ``accuracy_fn``.
        on_reward_error: ``raise`` stops on a reward function error or NaN; ``zero`` scores it 0, counts
            it in ``rollout/reward_errors`` and prints a warning naming the function and its last error.
        max_reward_error_frac: with ``on_reward_error: zero``, stop the run when more than this fraction
            (in [0, 1]) of a step's samples, counted over all ranks, had a failed reward: a reward
            function that fails everywhere would otherwise train on zeros and exit 0.
        scale_advantages: divide group-centred rewards by the group std (``False``: Dr. GRPO).
        ppo_epochs: passes over each rollout.
        num_minibatches: optimiser steps per pass (each rank splits its rollout into this many).
        micro_batch_size: rows per forward/backward (``None``: a whole minibatch at once).
        max_grad_norm: gradient clipping by global norm (``None``: off).
        ratio_level, trust_region, clip_low, clip_high, clip_ratio_c, tau_pos, tau_neg, aggregation,
            kl_coef, kl_estimator: the objective axes, see :class:`lightning_rl.objective.Objective`.
        overlong_buffer: DAPO's soft overlong punishment (``advantages.overlong_penalty``, times
            ``overlong_penalty_factor``): 0 up to ``max_new_tokens - overlong_buffer`` tokens (EOS
            included), then down linearly to -1 at ``max_new_tokens``. ``None`` (default here) or 0: off;
            ``auto``: a fifth of ``max_new_tokens``, at least 1 (the ``DAPO`` preset's default). Logged
            as ``rollout/overlong_penalty_mean`` (first generation round; 0.0 when off).
        overlong_penalty_factor: weight of the overlong penalty added to the reward.
        mask_truncated: leave completions that hit ``max_new_tokens`` out of the loss.
        share_prompt_prefix: run each distinct prompt through the model once and reuse its keys and values
            for the group's samples, in generation and in every scoring pass (reference, behaviour and
            training log-probs; the gradient flows through the shared prefix), and sample with
            ``lightning_rl.sampling`` (finished rows leave the batch instead of decoding padding): the same
            log-probs and gradients to float rounding, and samples from the same distribution (greedy ones
            identical). Single process and DDP; off under FSDP2 / ZeRO-3 and with gradient checkpointing.
        entropy_coef: weight of an entropy bonus, ``- entropy_coef * aggregate(entropy)`` (same aggregation
            and normalisers as the policy loss); 0: off (entropy is still logged as ``policy/entropy``).
        dynamic_sampling: keep only groups with mixed correctness, refilling from new prompts
            (DAPO), for up to ``max_gen_batches`` generation rounds per step.
        rollout_seed: sampling is seeded by (this, step, rank), so a resumed run samples exactly
            what the uninterrupted one did.
        **base: see :class:`~lightning_rl.algorithms.base.PolicyModule`.
    """

    def __init__(
        self,
        *args: Any,
        num_generations: int = 8,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        reward_fns: list[str] | None = None,
        reward_weights: list[float] | None = None,
        reward_model: str | None = None,
        reward_model_weight: float = 1.0,
        correctness_fn: str | None = None,
        on_reward_error: Literal["raise", "zero"] = "raise",
        max_reward_error_frac: float = 0.5,
        scale_advantages: bool = True,
        ppo_epochs: int = 1,
        num_minibatches: int = 1,
        micro_batch_size: int | None = None,
        max_grad_norm: float | None = 1.0,
        ratio_level: RatioLevel = "token",
        trust_region: TrustRegion = "clip",
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        clip_ratio_c: float | None = None,
        tau_pos: float = 1.0,
        tau_neg: float = 1.05,
        aggregation: Aggregation = "seq-mean-token-mean",
        kl_coef: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        overlong_buffer: int | Literal["auto"] | None = None,
        overlong_penalty_factor: float = 1.0,
        mask_truncated: bool = False,
        entropy_coef: float = 0.0,
        share_prompt_prefix: bool = True,
        dynamic_sampling: bool = False,
        max_gen_batches: int = 3,
        rollout_seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False
        if num_generations < self.min_generations:
            raise ValueError(f"`model.num_generations` must be >= {self.min_generations} for "
                             f"{type(self).__name__}'s advantages, got {num_generations}")
        if entropy_coef < 0:
            raise ValueError(f"`model.entropy_coef` must be >= 0, got {entropy_coef}")
        for key, value in {"ppo_epochs": ppo_epochs, "num_minibatches": num_minibatches,
                           "max_gen_batches": max_gen_batches, "temperature": temperature}.items():
            if not value > 0:
                raise ValueError(f"`model.{key}` must be > 0, got {value}")
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"`model.micro_batch_size` must be >= 1, got {micro_batch_size}")
        if overlong_buffer == "auto":
            overlong_buffer = max(1, self.max_new_tokens // 5)
        if overlong_buffer is not None and not 0 <= overlong_buffer <= self.max_new_tokens:
            raise ValueError(
                f"`model.overlong_buffer` must be 'auto' or in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {overlong_buffer}"
            )
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"`model.max_grad_norm` must be > 0 or null, got {max_grad_norm}")
        self.objective = Objective(
            ratio_level=ratio_level, trust_region=trust_region, clip_low=clip_low, clip_high=clip_high,
            clip_ratio_c=clip_ratio_c, tau_pos=tau_pos, tau_neg=tau_neg, aggregation=aggregation,
            kl_coef=kl_coef, kl_estimator=kl_estimator,
        )
        self.num_generations, self.temperature = num_generations, temperature
        self.top_p, self.top_k = top_p, top_k
        if reward_fns is None and reward_model is None:
            reward_fns = ["lightning_rl.rewards:exact_match"]
        self.rewards = (RewardScorer(reward_fns, reward_weights, on_reward_error, max_reward_error_frac)
                        if reward_fns is not None else None)
        # a plain object (not an nn.Module): outside the module tree, so never checkpointed or optimised
        remote = kwargs.get("trust_remote_code", False)
        self.reward_model = (RewardModelScorer(reward_model, trust_remote_code=remote)
                             if reward_model is not None else None)
        self.reward_model_weight = reward_model_weight
        self.correctness_fn = import_reward(correctness_fn) if correctness_fn else self.accuracy_fn
        self.scale_advantages = scale_advantages
        self.ppo_epochs, self.num_minibatches = ppo_epochs, num_minibatches
        self.micro_batch_size = micro_batch_size
        self.max_grad_norm = max_grad_norm
        self.overlong_buffer, self.overlong_penalty_factor = overlong_buffer or None, overlong_penalty_factor
        self.mask_truncated, self.entropy_coef = mask_truncated, entropy_coef
        self.share_prompt_prefix = share_prompt_prefix
        self.dynamic_sampling, self.max_gen_batches = dynamic_sampling, max_gen_batches
        self.rollout_seed = rollout_seed
        # The reference is the policy as loaded, before any update (also when resuming, where the
        # checkpoint's weights arrive before on_fit_start). Kept out of the module tree (plain
        # __dict__ entry): frozen, never in checkpoints or optimisers; moved to the device in on_fit_start.
        self.__dict__["_reference"] = self.policy.reference() if self.objective.needs_reference else None
        self._generation_round = 0

    min_generations = 2  # group-relative advantages need a group; PPO's critic does not

    @property
    def updates_per_rollout(self) -> int:
        return self.ppo_epochs * self.num_minibatches

    # ---- callbacks and setup ---------------------------------------------------------------------
    def configure_callbacks(self) -> list:
        from lightning_rl.callbacks import DAPOGroupFilter, OldPolicySnapshot, PolicyMetrics

        callbacks = super().configure_callbacks()
        if self.dynamic_sampling and not has_callback(self.trainer, DAPOGroupFilter):
            callbacks.append(DAPOGroupFilter(max_gen_batches=self.max_gen_batches))
        for kind in (OldPolicySnapshot, PolicyMetrics):
            if not has_callback(self.trainer, kind):
                callbacks.append(kind())
        return callbacks

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.policy.disable_dropout()  # log-probs must match what sampling saw
        # one forward per distinct prompt in every scoring pass; off where forwards are collective (their
        # count would depend on each rank's data) and, for scoring, under gradient checkpointing (which
        # turns the training forward's cache off)
        model = self.policy.model
        checkpointing = getattr(model, "is_activation_checkpointing", None)
        if checkpointing is None:  # transformers < 5 names it differently
            checkpointing = getattr(model, "is_gradient_checkpointing", False)
        fast = self.share_prompt_prefix and not collective_forward(model)
        self.policy.compact_sampling = fast  # sampling runs in eval mode: no checkpointing there
        share = fast and not checkpointing
        self.policy.share_prompts = share
        if self._reference is not None:
            self._reference.share_prompts = share
            self._reference.to(self.device)
        if self.reward_model is not None:
            self.reward_model.to(self.device)

    def deepspeed_defaults(self) -> dict[str, Any]:
        """Under DeepSpeed the engine clips (after unscaling, on its partitions): ``max_grad_norm`` goes
        there."""
        return {**super().deepspeed_defaults(), "gradient_clipping": self.max_grad_norm or 0.0}

    def rl_callbacks(self) -> list:
        from lightning_rl.callbacks.base import RLCallback

        return [cb for cb in self.trainer.callbacks if isinstance(cb, RLCallback)]

    # ---- rollout --------------------------------------------------------------------------------
    def generate_and_score(self, batch: dict[str, list]) -> tuple[Rollout, dict[str, float]]:
        """Sample G completions per prompt of ``batch``, score them and compute group advantages.

        The step's first call (from ``collect_rollout``; dynamic sampling's refills are later calls)
        also decides whether too many rewards failed, and reports ``rollout/overlong_penalty_mean``.
        """
        G = self.num_generations
        first_round = self._generation_round == 0
        ids, mask = self.encode_prompts(batch["prompt"])
        step = self.trainer.fit_loop.total_batch_idx  # restored on resume, so sampling continues exactly
        seed = hash((self.rollout_seed, step, self._generation_round, self.global_rank)) % 2**31
        self._generation_round += 1
        devices = [self.device] if self.device.type == "cuda" else []
        start = time.perf_counter()
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            gen = self.policy.generate(ids, mask, num_samples=G, max_new_tokens=self.max_new_tokens,
                                       temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                       synced_gpus=self.sync_generation)
        gen_time = time.perf_counter() - start
        texts = self.decode(gen.completion_ids, gen.completion_mask)
        prompts = [p for p in batch["prompt"] for _ in range(G)]
        columns = {k: [v for v in vals for _ in range(G)] for k, vals in batch_columns(batch).items()}
        rewards, scores = self.score_completions(prompts, texts, gen.lengths.tolist(), columns)
        self.check_reward_errors(scores, decide=first_round)
        penalty = self.overlong_shaping(gen.lengths)
        if self.overlong_buffer is not None:
            rewards = rewards + penalty
        correct = self.correct(prompts, texts, columns)
        completion_mask = gen.completion_mask
        if self.mask_truncated:
            completion_mask = completion_mask * (~gen.truncated).long()[:, None]
        rollout = Rollout(
            prompt_ids=gen.prompt_ids, prompt_mask=gen.prompt_mask, completion_ids=gen.completion_ids,
            completion_mask=completion_mask, truncated=gen.truncated, lengths=gen.lengths,
            group_ids=torch.arange(len(batch["prompt"]), device=self.device).repeat_interleave(G),
            rewards=rewards, correct=torch.tensor([bool(c) for c in correct], device=self.device),
            # one sample per prompt (PPO) has no group baseline: the critic's advantages replace these
            advantages=group_advantages(rewards, G, scale=self.scale_advantages) if G > 1
            else torch.zeros_like(rewards),
        )
        stats = {"perf/generation_time": gen_time, "rollout/reward_errors": float(len(scores.failed)),
                 "perf/generated_tokens": float(gen.lengths.sum())}
        if first_round:  # refill rounds' statistics are summed into the step's, which a mean cannot be
            stats["rollout/overlong_penalty_mean"] = float(penalty.mean()) if len(penalty) else 0.0
        return rollout, stats

    def score_completions(
        self, prompts: list[Any], texts: list[str], lengths: list[int], columns: dict[str, list]
    ) -> tuple[torch.Tensor, RewardScores]:
        """``[N]`` rewards: the reward functions' weighted total plus the weighted reward-model score; and
        the functions' scores (failures included) for ``check_reward_errors``."""
        if self.rewards is not None:
            scores = self.rewards.score(prompts, texts, completion_lengths=lengths, **columns)
        else:
            scores = RewardScores([0.0] * len(texts), frozenset(), [])
        rewards = torch.tensor(scores.totals, dtype=torch.float32, device=self.device)
        if self.reward_model is not None and texts:
            rendered = render_prompts(self.tokenizer, prompts, self.chat_template)
            special = all(self.add_special_tokens(prompts))  # a chat template already holds the specials
            model_scores = self.reward_model.score(rendered, texts, add_special_tokens=special)
            rewards = rewards + self.reward_model_weight * model_scores.to(self.device).float()
        return rewards, scores

    def overlong_shaping(self, lengths: torch.Tensor) -> torch.Tensor:
        """The overlong penalty added to each completion's reward, [N] float; zeros when shaping is off."""
        if self.overlong_buffer is None:
            return torch.zeros(len(lengths), dtype=torch.float32, device=self.device)
        penalty = overlong_reward(lengths.tolist(), self.max_new_tokens, self.overlong_buffer)
        return self.overlong_penalty_factor * torch.tensor(penalty, dtype=torch.float32, device=self.device)

    def check_reward_errors(self, scores: RewardScores, decide: bool) -> None:
        """Stop when too many rewards failed (``model.max_reward_error_frac``); else warn when any did.

        The stop is decided on failures and samples summed over all ranks, so every rank reaches the
        same verdict and raises together; a rank raising alone would leave the others waiting in the
        next collective. Only the step's first generation round decides (``decide``): every rank runs
        it exactly once per step, whereas dynamic sampling refills a rank-dependent number of times, so
        a collective there could hang. Refill failures are still counted and warned about.
        """
        limits = self.rewards is not None and self.rewards.limits_failures
        if decide and limits:  # the same on every rank: a symmetric collective
            counts = torch.tensor([len(scores.failed), len(scores.totals)], dtype=torch.float32,
                                  device=self.device)
            failed, total = self.trainer.strategy.reduce(counts, reduce_op="sum").tolist()
            where = f"rank {self.global_rank}" if self.trainer.world_size > 1 else ""
            self.rewards.check_failures(scores, failed, total, where)
        for errors in scores.errors:
            warn_rank_zero(str(errors))

    def draw_prompts(self) -> dict[str, list]:
        """A fresh prompt batch for refilling (dynamic sampling), from the DataModule's refill stream."""
        dm = self.trainer.datamodule
        if dm is None or not hasattr(dm, "refill_batch"):
            raise RuntimeError("dynamic sampling needs a DataModule with `refill_batch()` (PromptDataModule)")
        return dm.refill_batch()

    @torch.no_grad()
    def logprobs(self, rollout: Rollout, model: Any = None) -> torch.Tensor:
        """Log-probs of the rollout's completions under ``model`` (default: the policy), micro-batched."""
        model = model if model is not None else self.policy
        size = self.micro_batch_size or max(len(rollout), 1)
        parts = list(rollout.minibatches(size))
        # The policy's forwards, and those of a reference running the policy's own (adapter-disabled)
        # weights, are collective when sharded: every rank agrees on the count *before* any forward, then
        # pads with empty forwards, so no rank's all-reduce meets another rank's weight gather.
        total = len(parts)
        if model is self.policy or getattr(model, "shares_weights", False):
            total = agreed_count(self.trainer, self.policy.model, len(parts))
        out = []
        for part in parts:
            logp, _ = model.token_logprobs(part.prompt_ids, part.prompt_mask, part.completion_ids,
                                           part.completion_mask, **self.scoring_kwargs)
            out.append(logp)
        for _ in range(total - len(parts)):
            zero_loss(self.policy, self.trainer)
        if not out:
            return rollout.completion_mask.new_zeros(rollout.completion_mask.shape).float()
        return torch.cat(out, 0)

    @property
    def scoring_kwargs(self) -> dict[str, Any]:
        """How sampled tokens are scored: at the sampling temperature, without top-k / top-p (see module)."""
        return {"temperature": self.temperature}

    @property
    def sync_generation(self) -> bool:
        """Sharded models must keep generating on every rank until all ranks finish (greedy too)."""
        return needs_synced_generation(self._trainer, self.policy.model)

    def collect_rollout(self, batch: dict[str, list]) -> tuple[Rollout, dict[str, float]]:
        """Generate, score, filter (callbacks), then add reference log-probs when a KL term is on."""
        self._generation_round = 0
        rollout, stats = self.generate_and_score(batch)
        for cb in self.rl_callbacks():
            rollout, extra = cb.on_rollout_scored(self.trainer, self, rollout)
            stats = merge_stats(stats, extra)
        start = time.perf_counter()
        if self._reference is not None:  # also for an empty rollout: its count may be collective
            rollout.ref_logp = self.logprobs(rollout, self._reference)
        stats["perf/reference_time"] = time.perf_counter() - start
        return rollout, stats

    # ---- update ---------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, list], batch_idx: int) -> None:
        start = time.perf_counter()
        rollout, stats = self.collect_rollout(batch)
        old_start = time.perf_counter()
        for cb in self.rl_callbacks():  # OldPolicySnapshot scores the behaviour log-probs here
            cb.on_rollout_end(self.trainer, self, rollout)
        stats["perf/old_logprob_time"] = time.perf_counter() - old_start
        if self.updates_per_rollout > 1 and rollout.old_logp is None and len(rollout):
            raise RuntimeError(
                "ppo_epochs * num_minibatches > 1 needs behaviour log-probs: "
                "keep the OldPolicySnapshot callback"
            )
        rollout, excluded = exclude_nonfinite(rollout)
        rollout, extra = self.prepare_update(rollout)
        stats = merge_stats(stats, extra)
        step = self.trainer.fit_loop.total_batch_idx
        generator = torch.Generator().manual_seed(self.rollout_seed * 1_000_003 + step)
        update_start = time.perf_counter()
        for _ in range(self.ppo_epochs):
            for minibatch in self.split_minibatches(rollout, generator):
                self.update(minibatch)
        step_time = time.perf_counter() - start
        stats = merge_stats(stats, {"rollout/excluded_tokens": excluded, "perf/step_time": step_time,
                                    "perf/update_time": time.perf_counter() - update_start,
                                    "perf/tokens_per_sec": stats["perf/generated_tokens"] / step_time})
        for cb in self.rl_callbacks():
            cb.on_step_end(self.trainer, self, MappingProxyType(stats))

    def prepare_update(self, rollout: Rollout) -> tuple[Rollout, dict[str, float]]:
        """Hook between the rollout (scored, filtered, behaviour log-probs) and the updates; PPO adds
        values, per-token advantages and returns here. Returns the rollout and step statistics."""
        return rollout, {}

    def split_minibatches(self, rollout: Rollout, generator: torch.Generator) -> list[Rollout]:
        """``num_minibatches`` minibatches of equal row counts (some may be empty when the rollout is small),
        from the rollout's groups in a shuffled order: a group's samples stay next to each other (and in one
        minibatch unless it straddles a boundary), so their shared prompt is scored once."""
        groups, inverse = torch.unique(rollout.group_ids.cpu(), return_inverse=True)
        place = torch.empty(len(groups), dtype=torch.long)
        place[torch.randperm(len(groups), generator=generator)] = torch.arange(len(groups))
        order = torch.argsort(place[inverse] * len(rollout) + torch.arange(len(rollout)))
        order = order.to(rollout.completion_ids.device)
        return [rollout.select(part) for part in torch.tensor_split(order, self.num_minibatches)]

    def update(self, minibatch: Rollout) -> None:
        """One optimiser step on ``minibatch``, accumulated over micro-batches."""
        optimizers = self.stepped_optimizers()
        num_tokens, num_seqs = self.global_counts(minibatch)
        world = self.trainer.world_size
        size = self.micro_batch_size or max(len(minibatch), 1)
        micros = list(minibatch.minibatches(size)) or [minibatch]
        # sharded: every rank runs as many micro-batches (the extra ones empty, joining with a zero loss)
        missing = agreed_count(self.trainer, self.policy.model, len(micros), backward=True) - len(micros)
        micros += [minibatch.select(torch.arange(0, device=minibatch.completion_ids.device))] * missing
        for opt in optimizers:
            opt.zero_grad()
        for i, micro in enumerate(micros):
            with self.accumulating(last=i == len(micros) - 1):
                if len(micro) == 0:  # this rank has nothing, but must join the gradient all-reduce
                    self.manual_backward(self.empty_loss())
                    continue
                loss, metrics = self.micro_loss(micro, num_tokens, num_seqs)
                # data-parallel strategies average gradients over ranks; the normalisers are already global
                self.manual_backward(loss * world)
            # each minibatch loss is the sum of its micro losses: report loss/share with weight share
            share = len(micro) / len(minibatch)
            for name in self.summed_metrics:
                if name in metrics:
                    metrics[name] = metrics[name].detach() * world / share
            metrics["perf/pad_frac"] = pad_fraction(micro)
            for cb in self.rl_callbacks():
                cb.on_update_end(self.trainer, self, metrics, share)
        for i, opt in enumerate(optimizers):
            self.step_optimizer(opt, counts=i == 0)

    summed_metrics: tuple[str, ...] = ("policy/loss",)  # micro-batch terms of a minibatch sum (see update)

    def stepped_optimizers(self) -> list[Any]:
        """The optimisers ``update`` steps (PPO: also the critic's; only the critic's while it warms up)."""
        opts = self.optimizers()
        return list(opts) if isinstance(opts, list) else [opts]

    def empty_loss(self) -> torch.Tensor:
        """The zero loss of a micro-batch a rank does not have (see ``sharding.zero_loss``)."""
        return zero_loss(self.policy, self.trainer)

    def step_optimizer(self, opt: Any, counts: bool = True) -> None:
        """Step ``opt`` (clipped in on_before_optimizer_step, after the precision plugin unscaled), then its
        LR scheduler. ``counts``: as a trainer step (``global_step``); another optimiser stepped in the same
        update (PPO's critic) goes through the strategy directly, so one trainer step stays one update."""
        if counts:
            opt.step()
        else:
            self.trainer.strategy.optimizer_step(opt.optimizer, closure=lambda: None, model=self)
        engine = deepspeed_engine(self.trainer)
        if engine is not None:  # the engine clipped and stepped the scheduler itself
            norm = engine.get_global_grad_norm()
            if norm is not None:
                norm = torch.as_tensor(float(norm), device=self.device)
                for cb in self.rl_callbacks():
                    cb.on_update_end(self.trainer, self, {"policy/grad_norm": norm}, 1.0)
            return
        for config in self.trainer.lr_scheduler_configs:
            if config.scheduler.optimizer is opt.optimizer:
                config.scheduler.step()

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Clip by global norm through Lightning (right under AMP, FSDP2); log the norm before clipping.

        Each optimiser's own parameters (PPO: policy and critic separately), logged as
        ``grad_norm_name(optimizer)``. DeepSpeed: the engine clips in its step and reports the norm.
        """
        if self.max_grad_norm is None or deepspeed_engine(self.trainer) is not None:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.device)
        norm = full_value(norm)  # FSDP2: a DTensor of partial norms; the global norm on every rank
        if is_sharded(self.policy.model):
            # clip_grad_norm_ reduces the DTensor norm over the mesh itself: the same clip on every shard
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        else:
            self.clip_gradients(optimizer, gradient_clip_val=self.max_grad_norm,
                                gradient_clip_algorithm="norm")
        for cb in self.rl_callbacks():
            cb.on_update_end(self.trainer, self, {self.grad_norm_name(optimizer): norm.detach()}, 1.0)

    def grad_norm_name(self, optimizer: Any) -> str:
        return "policy/grad_norm"

    def global_counts(self, minibatch: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """Valid tokens and non-empty rows of the minibatch summed over all ranks."""
        counts = torch.stack(normalizer_counts(minibatch.completion_mask)).float()
        counts = self.trainer.strategy.reduce(counts, reduce_op="sum")
        return counts[0], counts[1]

    def accumulating(self, last: bool) -> Any:
        """The context of one micro-batch's backward: gradients are reduced over ranks only for the last.

        DeepSpeed: the engine's accumulation boundary (its ``no_sync`` refuses ZeRO-2/3, which reduce
        partitions in every backward anyway); FSDP2: ``set_requires_gradient_sync``; DDP: ``no_sync``.
        """
        engine = deepspeed_engine(self.trainer)
        if engine is not None:
            start_deepspeed_micro_batch(engine, boundary=last)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last else self.no_sync()

    def no_sync(self) -> Any:
        """Skip the gradient all-reduce of a data-parallel wrapper (all but the last micro-batch)."""
        if is_sharded(self.policy.model):  # FSDP2: no wrapper; each trained model is a sharded root
            stack = contextlib.ExitStack()
            for root in self.sharded_roots():
                stack.enter_context(no_gradient_sync(root))
            return stack
        wrapped = getattr(self.trainer.strategy, "model", None)
        if wrapped is self or not hasattr(wrapped, "no_sync"):  # single device: strategy.model is this module
            return contextlib.nullcontext()
        return wrapped.no_sync()

    def sharded_roots(self) -> list[Any]:
        """The FSDP2 roots trained by ``update`` (PPO adds its critic)."""
        return [self.policy.model]

    def micro_loss(
        self, micro: Rollout, num_tokens: torch.Tensor, num_seqs: torch.Tensor
    ) -> tuple[torch.Tensor, dict]:
        """The policy loss of one micro-batch (normalised by the minibatch's global counts), and metrics
        (``policy/loss`` is this loss; ``update`` rescales it to the minibatch)."""
        logp, entropy = self.policy.token_logprobs(
            micro.prompt_ids, micro.prompt_mask, micro.completion_ids, micro.completion_mask,
            with_entropy=True, **self.scoring_kwargs,
        )
        old_logp = micro.old_logp if micro.old_logp is not None else logp.detach()
        loss, metrics = self.objective(logp, old_logp, micro.ref_logp, micro.advantages,
                                       micro.completion_mask, num_tokens=num_tokens, num_seqs=num_seqs)
        if self.entropy_coef:
            bonus = aggregate(entropy, micro.completion_mask, self.objective.aggregation,
                              num_tokens=num_tokens, num_seqs=num_seqs)
            loss = loss - self.entropy_coef * bonus
        metrics["policy/entropy"] = masked_mean(entropy.detach(), micro.completion_mask.bool())
        metrics["policy/loss"] = loss
        return loss, metrics

    def correct(self, prompts: list[Any], completions: list[str], columns: dict[str, list]) -> list[Any]:
        """Per-completion correctness by ``correctness_fn``: rollouts and ``val/accuracy`` alike."""
        return self.correctness_fn(prompts=prompts, completions=completions, **columns)

    # ---- validation -----------------------------------------------------------------------------
    def validation_extra(
        self, batch: dict[str, list], completions: list[str], lengths: list[int], weight: float
    ) -> None:
        rewards, _ = self.score_completions(batch["prompt"], completions, lengths, batch_columns(batch))
        self.log_val_mean("val/reward_mean", rewards.mean(), weight)


