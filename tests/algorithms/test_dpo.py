"""DPO: the loss against log-probs computed by hand, the reference (copy, LoRA, cache), and the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM

from lightning_rl.algorithms import DPO
from lightning_rl.algorithms.options import PolicyOptions
from lightning_rl.cli.main import main
from lightning_rl.data.preference import BUILTIN_TRAIN, BUILTIN_VAL
from lightning_rl.models.builtin import EMBEDDED_MODEL

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "dpo.yaml")
# Different prompt and completion lengths, so left and right padding both matter.
PAIRS = [
    {"prompt": "50318=", "chosen": "01358", "rejected": "013588"},
    {"prompt": "21=", "chosen": "12", "rejected": "2"},
    {"prompt": "7737=", "chosen": "3777", "rejected": "3771"},
]
METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin", "logps/chosen",
           "logps/rejected"]


pytestmark = pytest.mark.usefixtures("seeded_one_thread")


def make_dpo(policy: dict | None = None, **kwargs) -> DPO:
    """A DPO module whose reference is built now, from the loaded model (as ``setup`` builds it for
    fit / validate), so that tests may move the policy away from it. ``policy``: more ``PolicyOptions``
    fields; ``kwargs``: DPO's own keys, ``validation``, ``engine``, ``optimizer``."""
    options = PolicyOptions(**{"model": "builtin:tiny-sort", "max_prompt_length": 16, **(policy or {})})
    dpo = DPO(policy=options, max_completion_length=10, **kwargs)
    assert dpo.reference is not None
    return dpo


def perturb(model: torch.nn.Module, scale: float = 0.05) -> None:
    """Move the policy away from the reference so that rewards are not all zero."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))


def as_batch(rows: list[dict]) -> dict[str, list]:
    return {k: [r[k] for r in rows] for k in rows[0]}


def logps_by_hand(model, tokenizer, prompt: str, completion: str) -> torch.Tensor:
    """Per-token log-probs of ``completion`` + EOS after ``prompt``: one unpadded sequence, full logits."""
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    with torch.no_grad():
        logits = model(torch.tensor([p + c])).logits[0].float()
    logp = torch.log_softmax(logits[len(p) - 1 : -1], dim=-1)
    return logp[torch.arange(len(c)), torch.tensor(c)]


def hand_loss(h: torch.Tensor, beta: float, loss_type: str, ls: float) -> torch.Tensor:
    if loss_type == "sigmoid":
        return (-(1 - ls) * F.logsigmoid(beta * h) - ls * F.logsigmoid(-beta * h)).mean()
    if loss_type == "robust":
        return ((-(1 - ls) * F.logsigmoid(beta * h) + ls * F.logsigmoid(-beta * h)) / (1 - 2 * ls)).mean()
    if loss_type == "ipo":
        return ((h - 1 / (2 * beta)) ** 2).mean()
    return torch.clamp(1 - beta * h, min=0).mean()  # hinge


# ---- the loss on a real batch ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "loss_type, ls, rpo_alpha",
    [("sigmoid", 0.0, None), ("sigmoid", 0.1, None), ("robust", 0.2, None), ("ipo", 0.0, None),
     ("hinge", 0.0, 0.5), ("sigmoid", 0.0, 1.0)],
)
def test_loss_matches_hand_computation(loss_type, ls, rpo_alpha):
    beta = 0.3
    dpo = make_dpo(beta=beta, loss_type=loss_type, label_smoothing=ls, rpo_alpha=rpo_alpha)
    reference = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL).eval()  # independent of DPO's reference
    perturb(dpo.policy.model)
    dpo.policy.eval()
    batch = as_batch(PAIRS)
    loss, metrics = dpo.pair_loss(batch, dpo.encode(batch))

    tok, model = dpo.tokenizer, dpo.policy.model
    per_token = {side: [logps_by_hand(model, tok, r["prompt"], r[side]) for r in PAIRS]
                 for side in ("chosen", "rejected")}
    c, r = (torch.stack([t.sum() for t in per_token[s]]) for s in ("chosen", "rejected"))
    rc, rr = (torch.stack([logps_by_hand(reference, tok, p["prompt"], p[s]).sum() for p in PAIRS])
              for s in ("chosen", "rejected"))
    expected = hand_loss((c - rc) - (r - rr), beta, loss_type, ls)
    if rpo_alpha is not None:
        chosen_tokens = torch.cat(per_token["chosen"])
        expected = expected + rpo_alpha * -chosen_tokens.mean()
        torch.testing.assert_close(metrics["nll"], -chosen_tokens.mean(), rtol=0, atol=1e-5)
    assert abs(float(expected)) > 1e-3
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-5)  # float32 sums of ~35
    torch.testing.assert_close(metrics["logps/chosen"], c.mean(), rtol=0, atol=1e-5)
    torch.testing.assert_close(metrics["rewards/rejected"], (beta * (r - rr)).mean(), rtol=0, atol=1e-5)
    torch.testing.assert_close(metrics["rewards/accuracy"], ((c - rc) > (r - rr)).float().mean())


def test_gradient_flows_to_the_policy_only():
    dpo = make_dpo()
    perturb(dpo.policy.model)
    batch = as_batch(PAIRS)
    loss, _ = dpo.pair_loss(batch, dpo.encode(batch))
    loss.backward()
    assert all(p.grad is not None for p in dpo.policy.parameters() if p.requires_grad)
    assert all(p.grad is None and not p.requires_grad for p in dpo.reference.parameters())


# ---- reference handling ---------------------------------------------------------------------------------
def test_precomputed_reference_logps_equal_on_the_fly():
    dpo = make_dpo(precompute_ref_logps=True)
    perturb(dpo.policy.model)  # a cache filled from the policy instead of the reference would now differ
    rows = [json.loads(line) for line in BUILTIN_TRAIN.read_text().splitlines()[:7]] + PAIRS
    table = dpo.reference_logps_table(rows, batch_size=3)  # other batches, other padding
    assert len(table) == len(rows)
    batch = as_batch([rows[9], rows[2], rows[5], rows[0]])
    batch.pop("answer", None)
    enc = dpo.encode(batch)
    on_the_fly = dpo.reference_logps(batch, enc)
    loss_fly, _ = dpo.pair_loss(batch, enc)
    dpo.ref_cache = table
    cached = dpo.reference_logps(batch, enc)
    torch.testing.assert_close(cached, on_the_fly, rtol=0, atol=1e-5)
    torch.testing.assert_close(dpo.pair_loss(batch, enc)[0], loss_fly, rtol=0, atol=1e-6)
    with pytest.raises(KeyError, match="precomputed reference cache"):
        dpo.reference_logps(as_batch([{**PAIRS[0], "rejected": "9"}]), dpo.encode(as_batch(PAIRS[:1])))


def test_reference_is_moved_but_never_saved():
    dpo = make_dpo()
    ref_weights = {k: v.clone() for k, v in dpo.reference.state_dict().items()}
    assert ref_weights and not any(k.startswith("reference.") for k in dpo.state_dict())
    assert all(k.startswith("policy.") for k in dpo.state_dict())
    # a checkpoint without the reference loads strictly, and leaves the reference as it was
    state = dpo.state_dict()
    perturb_state = {k: v + 1.0 for k, v in state.items()}
    dpo.load_state_dict(perturb_state, strict=True)
    assert all(torch.equal(v, ref_weights[k]) for k, v in dpo.reference.state_dict().items())
    assert not torch.equal(dpo.state_dict()["policy.model.lm_head.weight"],
                           ref_weights["model.lm_head.weight"])
    dpo.to(torch.float64)  # registered: casts and device moves follow the module
    assert all(p.dtype == torch.float64 for p in dpo.reference.parameters())


def test_only_fit_and_validate_build_the_reference(tmp_path):
    """``predict`` only generates: it holds no reference copy (it built one before, twice the weights in
    memory); ``validate`` scores implicit rewards against the reference, so it builds it in ``setup``."""
    import lightning as L

    from lightning_rl.data import PreferenceDataModule, PromptDataModule

    def trainer():
        return L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_predict_batches=1, limit_val_batches=1,
                         default_root_dir=str(tmp_path))

    dpo = DPO(policy=PolicyOptions(model="builtin:tiny-sort", max_prompt_length=16), max_completion_length=10)
    weights = sum(p.numel() for p in dpo.policy.parameters())
    trainer().predict(dpo, datamodule=PromptDataModule(max_val_rows=2, val_batch_size=2))
    assert sum(p.numel() for p in dpo.parameters()) == weights
    (metrics,) = trainer().validate(dpo, datamodule=PreferenceDataModule(max_val_rows=4))
    assert sum(p.numel() for p in dpo.parameters()) == 2 * weights  # the frozen copy
    assert metrics["val/rewards/margin"] == 0.0  # the policy is the reference: every margin is 0


def test_lora_reference_is_the_policy_with_adapters_off(monkeypatch):
    peft = pytest.importorskip("peft")
    import lightning_rl.algorithms.base as common

    real = common.load_policy

    def lora_policy(*args, **kwargs):
        policy = real(*args, **kwargs)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        return type(policy)(peft.get_peft_model(policy.model, config), policy.tokenizer)

    monkeypatch.setattr(common, "load_policy", lora_policy)
    dpo = make_dpo()
    assert dpo.reference.shares_weights and list(dpo.reference.parameters()) == []  # no copy
    assert not any(k.startswith("reference.") for k in dpo.state_dict())
    with torch.no_grad():
        for name, p in dpo.policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    batch = as_batch(PAIRS)
    enc = dpo.encode(batch)
    ref = dpo.reference_logps(batch, enc)
    base = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL).eval()
    expected = torch.stack([logps_by_hand(base, dpo.tokenizer, p["prompt"], p[s]).sum()
                            for s in ("chosen", "rejected") for p in PAIRS])
    torch.testing.assert_close(ref, expected, rtol=0, atol=1e-5)
    policy_seq = dpo.policy.token_logprobs(enc.prompt_ids, enc.prompt_mask, enc.completion_ids,
                                           enc.completion_mask)[0].sum(-1)
    assert (policy_seq - ref).abs().max() > 1e-2  # the adapters are on for the policy


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"beta": 0.0}, "model.beta"),
        ({"loss_type": "kto"}, "model.loss_type"),
        ({"label_smoothing": 0.5}, "model.label_smoothing"),
        ({"loss_type": "ipo", "label_smoothing": 0.1}, "model.label_smoothing"),
        ({"rpo_alpha": -1.0}, "model.rpo_alpha"),
        ({"max_completion_length": 0}, "model.max_completion_length"),
    ],
)
def test_bad_settings_name_the_yaml_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        DPO(**kwargs)


# ---- end to end through the CLI -------------------------------------------------------------------------
def scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    (events,) = {p.parent for p in log_dir.rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def fit(save_dir: Path, *extra: str) -> dict[str, dict[int, float]]:
    main(
        [
            "fit",
            "--config",
            CONFIG,
            "--trainer.logger.init_args.save_dir",
            str(save_dir),
            "--trainer.log_every_n_steps",
            "1",
            "--trainer.num_sanity_val_steps",
            "0",
            "--data.init_args.batch_size",
            "8",
            *extra,
        ]
    )
    return scalars(save_dir)


@pytest.mark.slow
def test_cli_fit_trains_and_logs_every_metric(tmp_path):
    logged = fit(
        tmp_path,
        "--trainer.max_steps=4",
        "--trainer.val_check_interval=4",
        "--trainer.enable_checkpointing=false",
        "--data.init_args.max_val_rows=16",
        "--data.init_args.val_batch_size=8",
    )
    for name in METRICS + ["train/loss", "train/nll", "data/prompt_truncated", "data/completion_truncated"]:
        assert name in logged and len(logged[name]) == 4, name
    for name in [f"val/{m}" for m in METRICS] + ["val/loss", "val/nll", "val/accuracy"]:
        assert name in logged, name
    (acc,) = logged["val/accuracy"].values()
    assert 0.0 <= acc <= 1.0
    assert logged["rewards/chosen"][0] == pytest.approx(0.0, abs=1e-6)  # policy == reference at step 0
    assert logged["train/loss"][3] < logged["train/loss"][0]
    (exported,) = tmp_path.rglob("policy/model.safetensors")
    before, after = load_file(str(Path(EMBEDDED_MODEL) / "model.safetensors")), load_file(str(exported))
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def small_data(tmp_path: Path) -> list[str]:
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text("\n".join(BUILTIN_TRAIN.read_text().splitlines()[:48]) + "\n")
    val.write_text("\n".join(BUILTIN_VAL.read_text().splitlines()[:8]) + "\n")
    return [f"--data.init_args.path={train}", f"--data.init_args.val_path={val}",
            "--trainer.enable_checkpointing=false"]


@pytest.mark.slow
def test_cli_precomputed_reference_trains_like_on_the_fly(tmp_path):
    data = small_data(tmp_path)
    steps = ["--trainer.max_steps=3", "--trainer.val_check_interval=3"]
    fly = fit(tmp_path / "fly", *data, *steps)
    cached = fit(tmp_path / "cached", *data, *steps, "--model.init_args.precompute_ref_logps=true")
    for name in ["train/loss", "rewards/margin", "val/rewards/accuracy", "val/loss"]:
        assert cached[name].keys() == fly[name].keys()
        for step, value in fly[name].items():
            assert cached[name][step] == pytest.approx(value, abs=1e-5), (name, step)


@pytest.mark.slow
def test_cli_resume_continues_exactly(tmp_path):
    data = [*small_data(tmp_path), "--trainer.limit_val_batches=0"]
    overlay = tmp_path / "ckpt.yaml"
    ckpt_dir = tmp_path / "ckpt"
    overlay.write_text(
        "trainer:\n  enable_checkpointing: true\n  callbacks:\n"
        "    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
        f"      init_args: {{dirpath: {ckpt_dir}, save_last: true, every_n_train_steps: 3}}\n"
    )
    full = fit(tmp_path / "full", *data, "--trainer.max_steps=7")["train/loss"]
    fit(tmp_path / "first", *data, "--config", str(overlay), "--trainer.max_steps=3")
    checkpoint = torch.load(ckpt_dir / "last.ckpt", weights_only=False)
    assert not any(k.startswith("reference.") for k in checkpoint["state_dict"])
    rest = fit(tmp_path / "rest", *data, "--trainer.max_steps=7",
               "--ckpt_path", str(ckpt_dir / "last.ckpt"))["train/loss"]
    assert sorted(rest) == [3, 4, 5, 6]  # 48 rows / 8 = 6 batches an epoch: step 6 starts a new permutation
    for step in rest:
        assert rest[step] == pytest.approx(full[step], abs=1e-6), step
