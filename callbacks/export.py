"""Write the trained policy as a ``save_pretrained`` folder when training ends."""

from __future__ import annotations

import os

import lightning as L
from lightning.pytorch.utilities import rank_zero_info

from lightning_rl.models.adapters import is_peft_model
from lightning_rl.models.sharding import full_state_dict, gathers_for_export, save_full_pretrained


class ExportPolicy(L.Callback):
    """Save the policy and tokenizer with ``save_pretrained`` at the end of ``fit``.

    The folder loads directly with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer``. A policy
    with PEFT adapters (``model.policy.peft``) writes the adapter folder (``adapter_config.json`` +
    ``adapter_model.safetensors`` + tokenizer: ``AutoPeftModelForCausalLM``, or ``PeftModel.from_pretrained``
    on the base model), or with ``model.policy.export_merged`` the merged weights as a plain folder. Under
    FSDP2 and ZeRO-3 every rank first gathers the full state dict (a collective), then rank 0 alone writes it:
    no rank waits on another inside ``save_pretrained``.

    Args:
        dirpath: target folder; ``None`` writes ``<trainer.log_dir>/policy``.
    """

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath

    def target(self, trainer: L.Trainer) -> str:
        if self.dirpath is not None:
            return self.dirpath
        return os.path.join(trainer.log_dir or trainer.default_root_dir, "policy")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        path = self.target(trainer)
        policy = pl_module.policy  # the trained network: a policy, or a reward model's network
        merged = getattr(pl_module, "export_merged", False) and is_peft_model(policy.model)
        if gathers_for_export(policy.model):
            state_dict = full_state_dict(policy.model)  # every rank joins the gathers
            if trainer.is_global_zero:
                save_full_pretrained(policy, path, state_dict, merged=merged)
        elif trainer.is_global_zero and merged:
            policy.save_pretrained(path, merged=True)
        elif trainer.is_global_zero:
            policy.save_pretrained(path)
        rank_zero_info(f"policy saved to {path}")
        # other trained models (PPO's critic) go to sibling folders named by the module
        extras = pl_module.extra_exports()
        for name, holder in extras.items():
            sibling = os.path.join(os.path.dirname(os.path.abspath(path)), name)
            state_dict = full_state_dict(holder.model) if gathers_for_export(holder.model) else None
            if trainer.is_global_zero:
                if state_dict is None:
                    holder.save_pretrained(sibling)
                else:
                    save_full_pretrained(holder, sibling, state_dict)
            rank_zero_info(f"{name} saved to {sibling}")
        trainer.strategy.barrier()
