"""Tests for lightning_rl.models.policy on tiny models built from a config and a character tokenizer."""

import warnings

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, LlamaConfig, PreTrainedTokenizerFast

from lightning_rl.models.policy import Generation, Policy, ReferencePolicy, completion_mask

CHARS = list("0123456789=abcdefghijklmnopqrstuvwxyz ")
PAD, EOS = 0, 1
PROMPTS = ["12=", "abc def 345=", "7="]  # different lengths: rows 0 and 2 are left-padded


def make_tokenizer(with_pad: bool = True) -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    specials = {"eos_token": "<eos>", "unk_token": "<unk>"} | ({"pad_token": "<pad>"} if with_pad else {})
    return PreTrainedTokenizerFast(tokenizer_object=tok, **specials)


def make_config(kind: str, vocab_size: int):
    if kind == "llama":
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=128,
            tie_word_embeddings=True,
            initializer_range=0.1,
            pad_token_id=PAD,
            eos_token_id=EOS,
            bos_token_id=EOS,
        )
    # GPT-2 has learned absolute positions (wrong position ids show up here) and dropout 0.1.
    return GPT2Config(
        vocab_size=vocab_size,
        n_positions=128,
        n_embd=64,
        n_layer=2,
        n_head=4,
        initializer_range=0.1,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=EOS,
    )


def make_policy(kind: str = "llama", tokenizer=None) -> Policy:
    torch.manual_seed(0)
    tokenizer = tokenizer or make_tokenizer()
    return Policy.from_config(make_config(kind, len(tokenizer)), tokenizer)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: much faster on the shared machine
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


def raw_logprobs(gen: Generation, temperature: float) -> torch.Tensor:
    """Log-probs of the sampled tokens from generate's raw logits, tempered by hand."""
    logp = torch.log_softmax(gen.logits.float() / temperature, dim=-1)
    return logp.gather(-1, gen.completion_ids.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_match_generate_logits(kind, temperature):
    policy = make_policy(kind)
    ids, mask = policy.encode_prompts(PROMPTS)
    assert (mask == 0).any(), "the test needs left padding"
    gen = policy.generate(
        ids, mask, num_samples=2, max_new_tokens=10, temperature=temperature, return_logits=True
    )
    policy.eval()  # compare without dropout (GPT-2 has some)
    logp, entropy = policy.token_logprobs(
        gen.prompt_ids,
        gen.prompt_mask,
        gen.completion_ids,
        gen.completion_mask,
        temperature=temperature,
        with_entropy=True,
    )
    valid = gen.completion_mask.bool()
    assert logp.dtype == torch.float32 and logp.shape == gen.completion_ids.shape
    torch.testing.assert_close(logp[valid], raw_logprobs(gen, temperature)[valid], atol=1e-5, rtol=0)
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
    probs = torch.softmax(gen.logits / temperature, dim=-1)
    expected_entropy = -(probs * probs.log()).sum(-1)
    torch.testing.assert_close(entropy[valid], expected_entropy[valid], atol=1e-4, rtol=0)
    # forward is token_logprobs (DDP / FSDP wrappers call forward).
    torch.testing.assert_close(
        policy(
            gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask, temperature=temperature
        )[0],
        logp,
    )


def test_position_ids_matter_for_gpt2():
    """Negative control: without position ids, left-padded rows of GPT-2 score differently."""
    policy = make_policy("gpt2").eval()
    ids, mask = policy.encode_prompts(PROMPTS)
    gen = policy.generate(ids, mask, max_new_tokens=6, return_logits=True)
    full_mask = torch.cat([gen.prompt_mask, gen.completion_mask], 1)
    logits = policy.model(torch.cat([gen.prompt_ids, gen.completion_ids], 1), attention_mask=full_mask).logits
    naive = torch.log_softmax(logits[:, ids.shape[1] - 1 : -1], -1)
    naive = naive.gather(-1, gen.completion_ids.unsqueeze(-1)).squeeze(-1)
    padded_row = mask[:, 0] == 0
    gap = (naive - raw_logprobs(gen, 1.0)).abs()[padded_row & gen.completion_mask.bool().any(-1)]
    assert gap.max() > 1e-2


def test_top_k_top_p_scoring_matches_sampling():
    policy = make_policy("llama")
    ids, mask = policy.encode_prompts(PROMPTS)
    temperature, k = 0.8, 5
    gen = policy.generate(
        ids, mask, num_samples=4, max_new_tokens=8, temperature=temperature, top_k=k, return_logits=True
    )
    valid = gen.completion_mask.bool()
    tempered = gen.logits / temperature
    top_vals, top_idx = tempered.topk(k, dim=-1)
    # top-k was honoured: every sampled token is one of the k best.
    assert (top_idx == gen.completion_ids.unsqueeze(-1)).any(-1)[valid].all()
    expected = tempered.gather(-1, gen.completion_ids.unsqueeze(-1)).squeeze(-1) - top_vals.logsumexp(-1)
    policy.eval()
    logp, entropy = policy.token_logprobs(
        gen.prompt_ids,
        gen.prompt_mask,
        gen.completion_ids,
        gen.completion_mask,
        temperature=temperature,
        top_k=k,
        with_entropy=True,
    )
    torch.testing.assert_close(logp[valid], expected[valid], atol=1e-5, rtol=0)
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
    assert (entropy <= torch.log(torch.tensor(float(k))) + 1e-5).all()
    # top-p renormalises over fewer tokens: never lower than the unfiltered log-prob.
    plain, _ = policy.token_logprobs(gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask)
    nucleus, _ = policy.token_logprobs(
        gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask, top_p=0.9
    )
    assert torch.isfinite(nucleus).all() and (nucleus[valid] >= plain[valid] - 1e-6).all()


def test_checkpoint_generation_config_is_ignored_and_restored():
    policy = make_policy("llama")
    saved = policy.model.generation_config
    # A hub generation_config.json could carry options like this one; sampling must not use them.
    saved.suppress_tokens = list(range(3, len(policy.tokenizer)))
    ids, mask = policy.encode_prompts(PROMPTS)
    gen = policy.generate(ids, mask, num_samples=2, max_new_tokens=6)
    assert (gen.completion_ids >= 3).any()
    assert policy.model.generation_config is saved


def test_completion_mask_on_hand_made_rows():
    rows = torch.tensor(
        [
            [5, PAD, EOS, 7, EOS],  # pad sampled before EOS is a real token
            [5, 6, 7, 8, 9],  # no EOS: truncated, every token counts
            [EOS, 5, 6, 7, 8],  # EOS first: one token
            [5, 6, 7, 8, EOS],  # EOS at the last step: not truncated
        ]
    )
    mask, truncated = completion_mask(rows, EOS)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert truncated.tolist() == [False, True, False, False]


def test_generate_masks_with_frequent_eos_and_pad():
    policy = make_policy("llama")
    bias = torch.zeros(len(policy.tokenizer))
    bias[EOS], bias[PAD] = 1.5, 2.0  # make EOS and pad likely so every case shows up
    policy.model.lm_head.register_forward_hook(lambda module, args, out: out + bias)
    ids, mask = policy.encode_prompts(PROMPTS)
    gen = policy.generate(ids, mask, num_samples=12, max_new_tokens=10, return_logits=True)
    cids, cmask = gen.completion_ids, gen.completion_mask
    assert torch.equal(gen.lengths, cmask.sum(-1))
    for row in range(cids.shape[0]):
        n = int(gen.lengths[row])
        assert cmask[row, :n].all() and not cmask[row, n:].any()  # a prefix of ones
        assert (cids[row, n:] == PAD).all()
        eos_at = (cids[row, :n] == EOS).nonzero().flatten().tolist()
        assert eos_at == ([] if gen.truncated[row] else [n - 1])
        assert not gen.truncated[row] or n == cids.shape[1]
    assert gen.truncated.any() and (~gen.truncated).any()
    assert ((cids == PAD) & (cmask == 1)).any(), "a pad sampled before EOS must count as a token"
    policy.eval()
    logp, _ = policy.token_logprobs(gen.prompt_ids, gen.prompt_mask, cids, cmask)
    torch.testing.assert_close(logp[cmask.bool()], raw_logprobs(gen, 1.0)[cmask.bool()], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_greedy_left_padding_matches_unpadded(kind):
    policy = make_policy(kind)
    alone = policy.generate(
        *policy.encode_prompts(["12="]), do_sample=False, max_new_tokens=8, return_logits=True
    )
    batch = policy.generate(
        *policy.encode_prompts(["12=", "abcdefgh 12345="]),
        do_sample=False,
        max_new_tokens=8,
        return_logits=True,
    )
    assert batch.prompt_mask[0, 0] == 0, "the short prompt must be left-padded"
    n = int(alone.lengths[0])
    assert torch.equal(alone.completion_ids[0, :n], batch.completion_ids[0, :n])
    torch.testing.assert_close(alone.logits[0, :n], batch.logits[0, :n], atol=1e-4, rtol=0)
    # temperature 0 is greedy too.
    zero = policy.generate(*policy.encode_prompts(["12="]), temperature=0.0, max_new_tokens=8)
    assert torch.equal(zero.completion_ids, alone.completion_ids)


def test_samples_are_consecutive_and_shapes():
    policy = make_policy("llama")
    ids, mask = policy.encode_prompts(PROMPTS)
    assert ids.shape == mask.shape == (3, 12) and (ids[mask == 0] == PAD).all()
    was_training = policy.model.training
    gen = policy.generate(ids, mask, num_samples=4, max_new_tokens=7)
    assert policy.model.training == was_training, "generate must restore the previous mode"
    n, c = gen.completion_ids.shape
    assert n == 12 and c <= 7 and gen.prompt_ids.shape == (12, 12)
    assert gen.completion_mask.shape == (n, c) and gen.truncated.shape == (n,) and gen.logits is None
    assert (
        gen.completion_ids.dtype == gen.completion_mask.dtype == torch.long
        and gen.truncated.dtype == torch.bool
    )
    for i in range(3):
        assert torch.equal(gen.prompt_ids[i * 4 : i * 4 + 4], ids[i].expand(4, -1))
        assert torch.equal(gen.prompt_mask[i * 4 : i * 4 + 4], mask[i].expand(4, -1))
    assert len({tuple(row.tolist()) for row in gen.completion_ids}) > 3, "samples should differ"


def _score(scorer, gen):
    return scorer.token_logprobs(gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask)[0]


def test_frozen_reference():
    policy = make_policy("gpt2")
    ids, mask = policy.encode_prompts(PROMPTS)
    gen = policy.generate(ids, mask, num_samples=2, max_new_tokens=6)
    ref = policy.reference()
    assert isinstance(ref, ReferencePolicy) and not ref.shares_weights
    assert all(not p.requires_grad for p in ref.parameters()) and ref.model is not policy.model
    torch.nn.ModuleDict({"policy": policy, "ref": ref}).train()  # what Lightning does at fit start
    assert not any(m.training for m in ref.modules()), "the reference stays in eval mode"
    policy.eval()
    before = _score(policy, gen)
    ref_logp = _score(ref, gen)
    assert ref_logp.grad_fn is None
    torch.testing.assert_close(ref_logp, before, atol=1e-6, rtol=0)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert (_score(policy, gen) - before).abs().max() > 1e-3
    torch.testing.assert_close(_score(ref, gen), before, atol=1e-6, rtol=0)
    assert ref.to("cpu") is ref


def test_peft_reference_disables_adapters_without_copy():
    peft = pytest.importorskip("peft")
    policy = make_policy("llama")
    ids, mask = policy.encode_prompts(PROMPTS)
    gen = policy.generate(ids, mask, num_samples=2, max_new_tokens=6)
    base_logp = _score(policy.eval(), gen)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    peft_policy = Policy(peft.get_peft_model(policy.model, lora), policy.tokenizer)
    ref = peft_policy.reference()
    assert ref.shares_weights and len(list(ref.parameters())) == 0 and not ref.state_dict()
    assert ref.__dict__["_shared_model"] is peft_policy.model  # the same model, no deepcopy
    torch.testing.assert_close(_score(ref, gen), base_logp, atol=1e-6, rtol=0)
    with torch.no_grad():
        for name, p in peft_policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    policy_logp = _score(peft_policy, gen)
    assert policy_logp.requires_grad and (policy_logp - base_logp).abs().max() > 1e-3
    ref_logp = _score(ref, gen)
    torch.testing.assert_close(ref_logp, base_logp, atol=1e-6, rtol=0)
    assert ref_logp.grad_fn is None
    assert peft_policy.model.training, "the reference must restore the shared model's mode"
    assert (_score(peft_policy, gen) - policy_logp).abs().max() == 0, "adapters are back on"


def test_missing_pad_token_falls_back_to_eos():
    tokenizer = make_tokenizer(with_pad=False)
    assert tokenizer.pad_token is None
    with pytest.warns(UserWarning, match="pad token") as record:
        policy = make_policy("llama", tokenizer)
    assert len([w for w in record if "pad token" in str(w.message)]) == 1
    assert policy.pad_token_id == policy.eos_token_id == EOS
    assert policy.tokenizer.padding_side == "left"
    ids, mask = policy.encode_prompts(PROMPTS)
    assert (ids[mask == 0] == EOS).all()
    gen = policy.generate(ids, mask, num_samples=2, max_new_tokens=6)
    # With pad == EOS the mask still ends at the first EOS.
    assert torch.equal(gen.completion_mask, completion_mask(gen.completion_ids, EOS)[0])


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_save_and_from_pretrained_round_trip(kind, tmp_path):
    policy = make_policy(kind).eval()
    ids, mask = policy.encode_prompts(PROMPTS)
    gen = policy.generate(ids, mask, num_samples=2, max_new_tokens=6)
    policy.save_pretrained(str(tmp_path))
    loaded = Policy.from_pretrained(str(tmp_path))
    assert loaded.model.dtype == torch.float32 and loaded.training
    assert loaded.tokenizer.convert_ids_to_tokens(
        list(range(len(policy.tokenizer)))
    ) == policy.tokenizer.convert_ids_to_tokens(list(range(len(policy.tokenizer))))
    assert all(torch.equal(a, b) for a, b in zip(loaded.encode_prompts(PROMPTS), (ids, mask), strict=True))
    torch.testing.assert_close(_score(loaded.eval(), gen), _score(policy, gen), atol=0, rtol=0)
    assert Policy.from_pretrained(str(tmp_path), dtype="bfloat16").model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        Policy.from_pretrained(str(tmp_path), dtype="fp32")


def test_encode_prompts_errors_name_row_and_limit():
    policy = make_policy("llama")
    with pytest.raises(ValueError, match=r"prompt 1 has 12 tokens.*max_prompt_length=5"):
        policy.encode_prompts(PROMPTS, max_prompt_length=5)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        policy.encode_prompts(["1=", ""])
    ids, mask = policy.encode_prompts(PROMPTS, max_prompt_length=12)
    assert ids.device == policy.device and mask[0].tolist() == [0] * 9 + [1] * 3


def test_disable_dropout_and_gradient_checkpointing():
    policy = make_policy("gpt2")
    gen = policy.generate(*policy.encode_prompts(PROMPTS), max_new_tokens=5)
    policy.train()
    noisy = [_score(policy, gen) for _ in range(2)]
    assert not torch.equal(*noisy), "GPT-2 dropout is on in train mode"
    policy.disable_dropout()
    policy.enable_gradient_checkpointing()
    logp = _score(policy, gen)
    torch.testing.assert_close(logp, _score(policy.eval(), gen), atol=1e-5, rtol=0)
    policy.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = -(_score(policy, gen) * gen.completion_mask).sum()
    loss.backward()
    assert all(p.grad is not None for p in policy.model.parameters() if p.requires_grad)
