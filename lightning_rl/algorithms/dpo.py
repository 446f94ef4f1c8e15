"""Direct Preference Optimisation (and IPO, hinge, cDPO / robust DPO, RPO) on preference pairs.

Offline: no generation while training. Each step scores the chosen and the rejected completions of a
batch together (the two halves concatenated on the batch dimension), sums the completion tokens'
log-probs, and applies ``losses.dpo_loss`` against a frozen reference. With ``share_prompt_prefix`` each
pair's prompt runs through the model once and both completions are scored on its keys and values (the
online step's prefix sharing for groups, ``TokenScorer.share_prompts``): the same log-probs and gradient.

The reference (the mixin :class:`~lightning_rl.algorithms.dpo_reference.ReferenceScoring`) is
``Policy.reference()``: a frozen copy of the starting model, or the same weights with
the LoRA adapters disabled when the policy is a PEFT model. The copy is a registered submodule, so
``.to()`` / precision casts move it with the policy, but a state-dict hook keeps its weights out of
``state_dict()`` and hence out of checkpoints: it is built from ``model`` in ``setup`` for ``fit`` and
``validate``, before a checkpoint's weights load, which is what a resumed run needs (the reference is the
*starting* model, not the checkpointed one); ``predict`` builds none. With ``precompute_ref_logps`` the
reference scores every train and held-out pair once before training, and a copied reference is then freed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_rl.algorithms.base import PolicyModule
from lightning_rl.algorithms.dpo_reference import ReferenceScoring
from lightning_rl.maths.aggregation import aggregate
from lightning_rl.maths.preference_losses import DPO_LOSS_TYPES, DPOLossType, dpo_loss
from lightning_rl.text.pairs import EncodedPairs, encode_pairs
from lightning_rl.text.prompts import batch_columns, real_rows


class DPO(ReferenceScoring, PolicyModule):
    """DPO on a ``PreferenceDataModule`` (rows ``prompt``, ``chosen``, ``rejected``, optionally ``answer``).

    Logs ``train/loss``, ``rewards/{chosen,rejected,accuracy,margin}``, ``logps/{chosen,rejected}``
    (mean summed log-prob), ``data/{prompt,completion}_truncated`` (rows cut this step), ``train/nll``
    with RPO; the same under ``val/`` on the held-out pairs, plus greedy ``val/accuracy`` when the rows
    have an ``answer``. Each step also logs rank 0's ``perf/step_time`` (from the batch to after the
    optimiser step), ``perf/forward_time`` (the policy's scoring pass), ``perf/reference_time`` (the
    reference's, ~0 when precomputed), ``perf/backward_time`` and ``perf/tokens_per_sec`` (the real
    prompt + completion tokens of the step's ``2B`` sequences per second of ``perf/step_time``).

    Args:
        beta: strength of the implicit KL to the reference (> 0); rewards are ``beta * (logp - ref_logp)``.
        loss_type: ``sigmoid`` (DPO), ``ipo``, ``hinge`` (SLiC) or ``robust`` (rDPO).
        label_smoothing: assumed label-flip rate in [0, 0.5): cDPO with ``sigmoid``, rDPO with ``robust``.
        rpo_alpha: weight of the RPO term, the token-mean NLL of the chosen completions (``None``: off).
        max_completion_length: completion tokens kept (EOS included), cut on the right; prompts keep
            their last ``max_prompt_length`` tokens. Cut rows are counted in ``data/*_truncated``.
        precompute_ref_logps: score every train / held-out pair with the reference once before
            training and free a copied reference (needs a DataModule with ``train_rows`` / ``val_rows``).
        disable_dropout: set dropout to 0 so that policy and reference agree at the start (as TRL does).
        share_prompt_prefix: run each pair's prompt through the model once, for the policy and the
            reference alike, and score both completions on its keys and values (same log-probs and
            gradient, to float rounding). Off where the online modules turn it off: forwards that are
            collectives (FSDP2, ZeRO-3) and gradient checkpointing (which turns the cache off).
        *args, **kwargs: see ``PolicyModule`` (model, optimizer, ``max_prompt_length``,
            ``max_new_tokens`` for greedy validation, ``chat_template``, ``accuracy_fn``).
    """

    def __init__(
        self,
        *args: Any,
        beta: float = 0.1,
        loss_type: DPOLossType = "sigmoid",
        label_smoothing: float = 0.0,
        rpo_alpha: float | None = None,
        max_completion_length: int = 64,
        precompute_ref_logps: bool = False,
        disable_dropout: bool = True,
        share_prompt_prefix: bool = True,
        **kwargs: Any,
    ) -> None:
        _validate(beta, loss_type, label_smoothing, rpo_alpha, max_completion_length)
        super().__init__(*args, **kwargs)
        self.beta, self.loss_type, self.label_smoothing = beta, loss_type, label_smoothing
        self.rpo_alpha, self.max_completion_length = rpo_alpha, max_completion_length
        self.precompute_ref_logps, self.share_prompt_prefix = precompute_ref_logps, share_prompt_prefix
        if disable_dropout:
            self.policy.disable_dropout()
        self.keep_reference_out_of_checkpoints()
        self.ref_cache: dict[str, tuple[float, float]] | None = None
        self.step_perf: dict[str, float] = {}  # this training step's timings, logged at its end
        self.configure_prefix_sharing()

    # ---- setup (the reference and its cache: ReferenceScoring) ---------------------------------
    reference_stages = ("fit", "validate")  # built in `setup`; predict only generates: it builds no copy

    def reference_policy(self) -> Any:
        return self.reference

    refuses_long_prompts = False  # DPO cuts long prompts on the left (and counts them) instead

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.configure_prefix_sharing()  # after configure_model: sharded now where it will be
        self._maybe_precompute()

    def on_validation_start(self) -> None:
        self.configure_prefix_sharing()
        self._maybe_precompute()
        super().on_validation_start()  # a CopyEngine samples greedy answers with the current weights

    # ---- scoring -----------------------------------------------------------------------------
    def encode(self, batch: dict[str, list]) -> EncodedPairs:
        """Tokenise a batch of pairs onto this module's device (chosen rows first)."""
        enc = encode_pairs(
            self.tokenizer,
            list(batch["prompt"]),
            list(batch["chosen"]),
            list(batch["rejected"]),
            max_prompt_length=self.codec.max_prompt_length,
            max_completion_length=self.max_completion_length,
            chat_template=self.codec.chat_template,
        )
        return enc.to(self.device)

    def pair_loss(
        self, batch: dict[str, list], enc: EncodedPairs
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The objective of a batch and its metrics (``rewards/*``, ``logps/*``, ``nll`` with RPO)."""
        with self.timed("perf/forward_time"):
            logp, _ = self.policy.token_logprobs(
                enc.prompt_ids, enc.prompt_mask, enc.completion_ids, enc.completion_mask
            )
        seq = logp.sum(-1)  # token_logprobs zeroes padding: only completion tokens count
        with self.timed("perf/reference_time"):
            ref = self.reference_logps(batch, enc)
        n = len(batch["prompt"])
        loss, metrics = dpo_loss(
            seq[:n], seq[n:], ref[:n], ref[n:], self.beta,
            loss_type=self.loss_type, label_smoothing=self.label_smoothing,
        )
        metrics["logps/chosen"] = seq[:n].detach().mean()
        metrics["logps/rejected"] = seq[n:].detach().mean()
        # what the policy itself prefers (rewards/accuracy is 0 at the start only because ties count as wrong)
        metrics["logps/accuracy"] = (seq[:n] > seq[n:]).float().mean()
        if self.rpo_alpha is not None:
            nll = -aggregate(logp[:n], enc.completion_mask[:n], "token-mean")
            loss = loss + self.rpo_alpha * nll
            metrics["nll"] = nll.detach()
        return loss, metrics

    # ---- loop hooks --------------------------------------------------------------------------
    def training_step(self, batch: dict[str, list], batch_idx: int) -> torch.Tensor:
        """One DPO step. Train metrics are means over all ranks (``sync_dist``), not rank 0's: every rank
        logs the same, config-determined names each step, so the all-reduces pair up. Each rank holds
        ``batch_size`` pairs (the training stream never yields a short batch), so the plain mean over
        ranks is the mean over all pairs."""
        enc = self.encode(batch)
        loss, metrics = self.pair_loss(batch, enc)
        if self.step_perf:  # timed (inside a trainer's step): the tokens of perf/tokens_per_sec
            self.step_perf["tokens"] = float(enc.prompt_mask.sum() + enc.completion_mask.sum())
        n = len(batch["prompt"])
        values = {"train/loss": loss.detach(),
                  **{"train/nll" if k == "nll" else k: v for k, v in metrics.items()},
                  "data/prompt_truncated": float(enc.prompt_truncated),
                  "data/completion_truncated": float(enc.completion_truncated)}
        for name, value in values.items():
            self.log(name, value, batch_size=n, sync_dist=True,
                     prog_bar=name in ("train/loss", "rewards/accuracy"))
        return loss

    # ---- perf/*: one step is on_train_batch_start .. on_train_batch_end (after the optimiser step) -------
    def clock(self) -> float:
        """``time.perf_counter()`` once the device's queued work is done (CUDA runs asynchronously)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Add the seconds of the block to ``step_perf[name]`` while a training step is timed (no device
        synchronisation otherwise: validation is not timed)."""
        if not self.step_perf:
            yield
            return
        start = self.clock()
        yield
        self.step_perf[name] = self.step_perf.get(name, 0.0) + self.clock() - start

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.step_perf = {"start": self.clock()}

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.step_perf["backward_start"] = self.clock()

    def on_after_backward(self) -> None:
        if "backward_start" in self.step_perf:
            self.step_perf["perf/backward_time"] = self.clock() - self.step_perf.pop("backward_start")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        perf, self.step_perf = self.step_perf, {}
        if "start" not in perf or "tokens" not in perf:
            return
        step_time = self.clock() - perf.pop("start")
        values = {"perf/step_time": step_time, "perf/tokens_per_sec": perf.pop("tokens") / step_time, **perf}
        for name, value in values.items():  # rank 0's: timings need no all-reduce
            self.log(name, value, on_step=True, on_epoch=False, batch_size=1)

    # ---- validation ----------------------------------------------------------------------------------
    val_prog_bar = ("val/accuracy", "val/rewards/accuracy", "val/logps/accuracy")

    def on_validation_epoch_end(self) -> None:
        """Log ``val/*`` at the step printed beside them (``step N: ...``): Lightning's automatic
        optimisation logs a validation run inside step N at N - 1, before it counts the step."""
        super().on_validation_epoch_end()
        trainer = self.trainer
        if self.automatic_optimization and trainer.state.fn == "fit" and not trainer.sanity_checking:
            self.log("step", float(self.global_step), batch_size=1)

    def validation_step(self, batch: dict[str, list], batch_idx: int) -> None:
        batch, weight = real_rows(batch)
        enc = self.encode(batch)
        loss, metrics = self.pair_loss(batch, enc)
        self.log_val_mean("val/loss", loss, weight)
        for name, value in metrics.items():
            self.log_val_mean(f"val/{name}", value, weight)
        if "answer" in batch:
            self._greedy_accuracy(batch, enc, weight)

    def _greedy_accuracy(self, batch: dict[str, list], enc: EncodedPairs, weight: float) -> None:
        """``val/accuracy``: greedy completions of the (truncated) prompts scored by ``accuracy_fn``."""
        n = len(batch["prompt"])
        gen = self.completer.generate_tokens(enc.prompt_ids[:n], enc.prompt_mask[:n],
                                             sampling=self.sampling_params(do_sample=False))
        completions = self.codec.decode(gen.completion_ids, gen.completion_mask)
        scores = self.evaluator.correct(batch["prompt"], completions, batch_columns(batch))
        self.log_val_mean("val/accuracy", torch.tensor([float(x) for x in scores]).mean(), weight)


def _validate(
    beta: float, loss_type: str, label_smoothing: float, rpo_alpha: float | None, max_completion_length: int
) -> None:
    """Config errors naming the YAML key."""
    if not beta > 0:
        raise ValueError(f"`model.beta` must be > 0, got {beta}")
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"`model.loss_type` must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"`model.label_smoothing` must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing > 0 and loss_type not in ("sigmoid", "robust"):
        raise ValueError(
            f"`model.label_smoothing` applies to loss_type sigmoid or robust only, not {loss_type!r}"
        )
    if rpo_alpha is not None and not rpo_alpha >= 0:
        raise ValueError(f"`model.rpo_alpha` must be >= 0 or null, got {rpo_alpha}")
    if max_completion_length < 1:
        raise ValueError(f"`model.max_completion_length` must be >= 1, got {max_completion_length}")
