"""DPO's frozen reference: :class:`ReferenceScoring` is the mixin of :class:`~lightning_rl.algorithms.dpo.DPO`
that builds the reference on first use (``Policy.reference()``), keeps its weights out of checkpoints,
shares each pair's prompt for it as for the policy, and scores the pairs' summed reference log-probs, on
the fly or from a cache (``precompute_ref_logps``) that scores every train and held-out pair once, keyed
by :func:`pair_key`.

It reads what ``DPO`` sets up: ``policy``, ``share_prompt_prefix``, ``precompute_ref_logps``, ``ref_cache``
and ``encode``, and the LightningModule's ``trainer`` and ``device``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_rl.models.sharding import prompt_sharing
from lightning_rl.text.pairs import EncodedPairs
from lightning_rl.text.prompts import real_rows

REFERENCE = "reference"


def pair_key(prompt: Any, chosen: Any, rejected: Any) -> str:
    """The reference-cache key of one pair (its content, so any batching finds it)."""
    return json.dumps([prompt, chosen, rejected], sort_keys=True, ensure_ascii=False)


def _drop_reference(
    module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    # state-dict post hook: the reference is rebuilt from `model`, never saved or loaded
    for key in [k for k in state_dict if k.startswith(f"{prefix}{REFERENCE}.")]:
        del state_dict[key]


def _allow_missing_reference(module: torch.nn.Module, incompatible_keys: Any) -> None:
    missing = incompatible_keys.missing_keys
    missing[:] = [k for k in missing if not k.startswith(f"{REFERENCE}.") and f".{REFERENCE}." not in k]


class ReferenceScoring:
    """Mixin for :class:`~lightning_rl.algorithms.dpo.DPO`: the frozen reference and its log-probs (see the
    module docstring)."""

    policy: Any
    share_prompt_prefix: bool
    precompute_ref_logps: bool
    ref_cache: dict[str, tuple[float, float]] | None

    def keep_reference_out_of_checkpoints(self) -> None:
        """Register the state-dict hooks that leave the reference's weights out of ``state_dict()`` and
        let ``load_state_dict`` miss them (it is rebuilt from ``model``)."""
        self.register_state_dict_post_hook(_drop_reference)
        self.register_load_state_dict_post_hook(_allow_missing_reference)

    @property
    def reference(self) -> Any:
        """The frozen reference, built on first use (``None`` once a precomputed cache freed it)."""
        if REFERENCE not in self._modules:
            self.reference = self.policy.reference()  # a registered submodule: moved with the policy
            self.configure_prefix_sharing()
        return self._modules[REFERENCE]

    def configure_prefix_sharing(self) -> None:
        """Decide ``share_prompts`` for policy and reference together (as ``OnlineRL`` does): one scoring
        path for both, so that their log-probs agree exactly while the policy equals the reference."""
        share = prompt_sharing(self.share_prompt_prefix, self.policy.model)
        self.policy.share_prompts = share
        if self._modules.get(REFERENCE) is not None:  # not built yet: the property calls this again
            self._modules[REFERENCE].share_prompts = share

    def _maybe_precompute(self) -> None:
        if not self.precompute_ref_logps or self.ref_cache is not None:
            return
        dm = getattr(self.trainer, "datamodule", None)
        if dm is None or not hasattr(dm, "train_rows"):
            raise ValueError(
                "`model.precompute_ref_logps` needs a DataModule with `train_rows` "
                "(e.g. PreferenceDataModule)"
            )
        start = time.perf_counter()
        # in the precision the steps score the policy in (bf16-mixed autocasts them): a cache scored in
        # another precision makes every margin at step 0 float noise instead of 0
        with self.trainer.precision_plugin.forward_context():
            table = self.reference_logps_table(list(dm.train_rows), getattr(dm, "batch_size", 8))
            if getattr(dm, "val_rows", None):
                table.update(self.held_out_table(dm.val_dataloader()))
            self.ref_cache = table
        rank_zero_info(
            f"reference log-probs of {len(self.ref_cache)} pairs precomputed in "
            f"{time.perf_counter() - start:.1f}s"
        )
        if self.reference is not None and not self.reference.shares_weights:
            self.reference = None  # every pair is cached: free the copy

    @torch.no_grad()
    def reference_logps_table(
        self, rows: list[dict[str, Any]], batch_size: int
    ) -> dict[str, tuple[float, float]]:
        """``{pair_key: (ref chosen logp, ref rejected logp)}`` for ``rows``, scored ``batch_size``
        pairs at a time.
        """
        unique = {pair_key(r["prompt"], r["chosen"], r["rejected"]): r for r in rows}
        keys, table = list(unique), {}
        for start in range(0, len(keys), batch_size):
            part = [unique[k] for k in keys[start : start + batch_size]]
            batch = {name: [r[name] for r in part] for name in ("prompt", "chosen", "rejected")}
            seq = self._reference_forward(self.encode(batch)).tolist()
            n = len(part)
            table.update({k: (seq[i], seq[n + i]) for i, k in enumerate(keys[start : start + n])})
        return table

    @torch.no_grad()
    def held_out_table(self, batches: Iterable[dict[str, list]]) -> dict[str, tuple[float, float]]:
        """:meth:`reference_logps_table` of the held-out pairs, scored in the very batches validation scores
        the policy in (same padding, same shared prompts): their margins at step 0 are then exactly 0,
        whatever the kernels do with other batch shapes."""
        table = {}
        for batch in batches:
            batch, _ = real_rows(batch)
            seq = self._reference_forward(self.encode(batch)).tolist()
            n = len(batch["prompt"])
            pairs = zip(batch["prompt"], batch["chosen"], batch["rejected"], strict=True)
            table.update({pair_key(*pair): (seq[i], seq[n + i]) for i, pair in enumerate(pairs)})
        return table

    def _reference_forward(self, enc: EncodedPairs) -> torch.Tensor:
        logp, _ = self.reference.token_logprobs(
            enc.prompt_ids, enc.prompt_mask, enc.completion_ids, enc.completion_mask
        )
        return logp.sum(-1)

    def reference_logps(self, batch: dict[str, list], enc: EncodedPairs) -> torch.Tensor:
        """``[2B]`` summed reference log-probs (chosen then rejected), from the cache when precomputed."""
        if self.ref_cache is None:
            return self._reference_forward(enc)
        keys = [pair_key(*p) for p in zip(batch["prompt"], batch["chosen"], batch["rejected"], strict=True)]
        missing = [i for i, k in enumerate(keys) if k not in self.ref_cache]
        if missing:
            raise KeyError(
                f"batch rows {missing} are not in the precomputed reference cache "
                "(`model.precompute_ref_logps`)"
            )
        values = [self.ref_cache[k][0] for k in keys] + [self.ref_cache[k][1] for k in keys]
        return torch.tensor(values, dtype=torch.float32, device=self.device)
