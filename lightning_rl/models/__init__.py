"""Models: loading (hub id, folder, ``builtin:``), the policy, critic and reward network, adapters (LoRA),
scoring, generation mechanics, and sharding (FSDP2, DeepSpeed ZeRO) with its strategies."""
