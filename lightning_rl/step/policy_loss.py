"""The policy's loss in the update (:class:`PolicyLoss`): a micro-batch's objective and entropy bonus, the
rows it reaches, and the objective's whole-minibatch token selection, all from the objective it is built with.

``OnlineRL`` builds one from its online step for each update (``OnlineStep.policy_loss``); a preset with
companions (PPO) puts its :meth:`PolicyLoss.trained` beside theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lightning_rl.maths.aggregation import aggregate, masked_mean
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.rollout import Rollout
from lightning_rl.step.selection import SelectedRows, select_tokens
from lightning_rl.step.update import MicroLoss, TrainedModel


@dataclass(frozen=True)
class PolicyLoss:
    """The policy's loss of one update, as the updater calls it.

    Attributes:
        policy: the trained :class:`~lightning_rl.models.policy.Policy`.
        objective: the policy loss (``lightning_rl.maths.objective.Objective``).
        entropy_coef: the entropy bonus' weight.
        correction: the rollout correction, weighing on-policy rows whose engine log-probs differ.
        micro_rows: the updater's split of a minibatch into micro-batch rows (``Updater.micro_rows``).
    """

    policy: Any
    objective: Any
    entropy_coef: float
    correction: Any
    micro_rows: Callable[[Rollout], list[Tensor]]

    def __call__(self, micro: Rollout, num_tokens: Tensor, num_seqs: Tensor) -> tuple[Tensor, dict[str, Any]]:
        """The micro-batch's loss and metrics (:func:`micro_batch_policy_loss`)."""
        return micro_batch_policy_loss(self.policy, micro, self.objective, self.entropy_coef, num_tokens,
                                       num_seqs, self.correction)

    def rows(self, micro: Rollout) -> Tensor:
        """The rows this loss reaches (:func:`policy_rows`)."""
        return policy_rows(micro, self.objective.kl_coef, self.entropy_coef)

    def select(self, minibatch: Rollout, collectives: Collectives, seed: int) -> Rollout:
        """The objective's whole-minibatch token selection (entropy, Clip-Cov, KL-Cov), before the
        micro-batches (:func:`~lightning_rl.step.selection.select_tokens`)."""
        return select_tokens(self.policy, minibatch, self.objective, self.micro_rows, collectives, seed)

    def trained(self, optimizer: Any, loss: MicroLoss | None = None) -> TrainedModel:
        """The policy as the updater trains it: this loss (or ``loss``, one that wraps it), the rows it
        reaches, its token selection, packed as the policy packs."""
        loss = loss if loss is not None else self
        return TrainedModel("policy", self.policy, optimizer, loss, ("policy/loss",), reaches=self.rows,
                            select=self.select, packed=self.policy.packing)


def policy_rows(micro: Rollout, kl_coef: float, entropy_coef: float) -> Tensor:
    """The rows the policy loss reaches: those with a loss token and, without a KL or entropy term, a
    non-zero advantage on one (every trust region multiplies each token's term by its advantage, except
    KL-Cov's penalty on its selected tokens) among the tokens a high-entropy selection keeps."""
    mask = micro.loss_mask.bool()
    if kl_coef or entropy_coef or micro.advantages is None:
        return mask.any(1)
    advantages = micro.advantages if micro.advantages.dim() == 2 else micro.advantages[:, None]
    reached = mask & (advantages != 0)
    if isinstance(micro, SelectedRows):
        reached = reached | (mask & micro.selected) if micro.selected is not None else reached
        reached = reached & micro.high_entropy if micro.high_entropy is not None else reached
    return reached.any(1)



def micro_batch_policy_loss(policy: Any, micro: Rollout, objective: Any, entropy_coef: float,
                            num_tokens: Tensor, num_seqs: Tensor,
                            correction: Any = None) -> tuple[Tensor, dict[str, Any]]:
    """The policy's loss on a micro-batch: the objective (normalised by the minibatch's global counts)
    minus ``entropy_coef`` x the entropy, aggregated like the loss; ``policy/entropy`` is always logged.
    Log-probs are scored at the temperature the rows were sampled at (``micro.temperature``); on-policy rows
    (``old_logp`` None) use the current log-probs, detached, and when the engine's log-probs differ from them
    (``rollout_logp``: another copy of the weights) ``correction`` weighs each token here, as it would after a
    separate behaviour pass."""
    logp, entropy = policy.token_logprobs(micro.prompt_ids, micro.prompt_mask, micro.completion_ids,
                                          micro.attention_mask, with_entropy=True,
                                          temperature=micro.temperature)
    old_logp = micro.old_logp if micro.old_logp is not None else logp.detach()
    weights, mismatch = micro.is_weights, {}
    if micro.old_logp is None and micro.rollout_logp is not None and correction is not None:
        weights, mismatch = correction.weights(old_logp, micro.rollout_logp, micro.loss_mask)
    if objective.selects_tokens and not isinstance(micro, SelectedRows):
        raise RuntimeError("the objective selects tokens over the whole minibatch, but no `select` stage "
                           "ran before the micro-batches (`TrainedModel.select`: `select_tokens`)")
    selection = micro.selection if isinstance(micro, SelectedRows) else None
    loss, metrics = objective(logp, old_logp, micro.ref_logp, micro.advantages, micro.loss_mask,
                              num_tokens=num_tokens, num_seqs=num_seqs, token_weights=weights,
                              selection=selection, sampler_logp=micro.rollout_logp)
    metrics.update(mismatch)
    if entropy_coef:
        loss = loss - entropy_coef * aggregate(entropy, micro.loss_mask, objective.aggregation,
                                               num_tokens=num_tokens, num_seqs=num_seqs,
                                               norm_length=objective.aggregation_length)
    metrics["policy/entropy"] = masked_mean(entropy.detach(), micro.loss_mask.bool())
    metrics["policy/loss"] = loss
    return loss, metrics
