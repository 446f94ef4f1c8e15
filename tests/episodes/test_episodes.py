"""Multi-turn episodes (``lightning_rl.episodes.environments``): token in / token out, masks, budgets, tools,
errors.

Most tests drive :class:`EpisodeRunner` with a scripted ``generate`` (each call answers the next scripted turn
and records the exact context it was given), so every id is known; the module tests run the real engine.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import make, make_trainer, sample_round

from lightning_rl.algorithms import GRPO
from lightning_rl.callbacks.base import RLCallback
from lightning_rl.episodes.environments import Environment, EpisodeError, StepResult
from lightning_rl.episodes.runner import EpisodeRunner
from lightning_rl.episodes.tool_formats import HermesFormat, PlainFormat
from lightning_rl.episodes.tools import Tool
from lightning_rl.maths.aggregation import aggregate
from lightning_rl.models.builtin import build_char_tokenizer
from lightning_rl.models.generation import SamplingParams, make_generation
from lightning_rl.step.rollout import Rollout

TOK = build_char_tokenizer()
EOS, PAD = TOK.eos_token_id, TOK.pad_token_id
# A chat template that rewrites history: earlier assistant turns lose their <think> block (Qwen3 does this).
THINK_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}A:"
    "{% if loop.last %}{{ m['content'] }}{% else %}{{ m['content'].split('</think>')[-1] }}{% endif %}"
    "<eos>\n{% else %}{{ m['role'][0] | upper }}:{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


class Scripted:
    """A ``generate`` that answers turn ``k`` of every row with ``turns[k]`` (+ EOS unless ``no_eos``),
    recording each call's contexts as id lists (left padding removed)."""

    def __init__(self, turns: list[str], no_eos: bool = False) -> None:
        self.turns, self.no_eos, self.contexts, self.calls = turns, no_eos, [], 0

    def __call__(self, prompt_ids, prompt_mask, *, num_samples, sampling, seed):
        ids_ = prompt_ids.repeat_interleave(num_samples, 0)
        mask = prompt_mask.repeat_interleave(num_samples, 0)
        self.contexts.append([row[m.bool()].tolist() for row, m in zip(ids_, mask, strict=True)])
        text = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        out = ids(text)[: sampling.max_new_tokens] + ([] if self.no_eos else [EOS])
        out = out[: sampling.max_new_tokens]
        completion = torch.tensor([out] * ids_.shape[0])
        return make_generation(ids_, mask, completion, EOS, PAD)


def encode(prompts):
    texts = [TOK.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True) if TOK.chat_template else p for p in prompts]
    from lightning_rl.text.pairs import pad_rows

    return pad_rows([ids(t) for t in texts], PAD, left=True)


class Echo(Environment):
    """Answers each turn with ``obs N`` until the row's ``needed`` turns; rewards 1 per step."""

    def reset(self, row):
        self.n, self.needed = 0, int(row.get("needed", 2))

    def step(self, turn):
        self.n += 1
        done = self.n >= self.needed
        return StepResult(observation=None if done else f"obs {self.n}", reward=1.0, done=done,
                          info={"correct": turn.endswith("!")})


def runner(env=None, tools=(), fmt=None, chat=False, **kw) -> EpisodeRunner:
    return EpisodeRunner(env, list(tools), fmt or PlainFormat(), TOK, chat=chat, **kw)


def run(r: EpisodeRunner, gen: Scripted, rows, n=2, max_new=40):
    return r(rows, num_samples=n, sampling=SamplingParams(max_new_tokens=max_new), seed=0, encode=encode,
             generate=gen)


@pytest.fixture
def think_template():
    TOK.chat_template = THINK_TEMPLATE
    yield
    TOK.chat_template = None


def test_token_in_token_out_under_a_template_that_rewrites_history(think_template):
    """Turn 2's context is exactly the prompt + turn 1's sampled ids + the observation's ids: the <think>
    block the template would drop from history is still there, and the trained ids are the sampled ids.
    (Broken variant that fails this: re-rendering the conversation with apply_chat_template each turn.)"""
    gen = Scripted(["<think>hm</think>x", "y!"])
    out = run(runner(Echo(), chat=True), gen, [{"prompt": "q", "needed": 2}], n=1)
    prompt = ids("U:q\nA:")
    turn1, obs = ids("<think>hm</think>x") + [EOS], ids("\nU:obs 1\nA:")
    assert gen.contexts == [[prompt], [prompt + turn1 + obs]]
    gen_ = out.generation
    assert gen_.completion_ids[0].tolist() == turn1 + obs + ids("y!") + [EOS]
    model = gen_.model_mask[0].bool()
    assert gen_.completion_ids[0][model].tolist() == turn1 + ids("y!") + [EOS]
    assert gen_.completion_mask[0].sum() == len(turn1) + len(obs) + 3
    (ep,) = out.episodes
    assert [t.role for t in ep.turns] == ["assistant", "environment", "assistant"]
    assert ep.final_text == "y!" and ep.correct is True and out.returns.tolist() == [2.0]


def test_masks_every_aggregation_counts_model_tokens_only():
    """The rollout's loss mask is the sampled tokens; each aggregation of per-token values equals the one
    over the model tokens alone and differs from the one that also counts the observation tokens. (Broken
    variant that fails this: `Rollout.from_generation` taking `completion_mask` as the loss mask.)"""
    rows = [{"prompt": "p", "needed": 2}, {"prompt": "r", "needed": 1}]
    out = run(runner(Echo()), Scripted(["ab", "cde!"]), rows)
    gen = out.generation
    n = len(out.episodes)
    correct = torch.zeros(n, dtype=torch.bool)
    rollout = Rollout.from_generation(gen, torch.arange(n) // 2, out.returns, correct, temperature=1.0)
    assert torch.equal(rollout.loss_mask, gen.model_mask) and torch.equal(rollout.attention_mask,
                                                                         gen.completion_mask)
    assert rollout.loss_mask.sum(-1).tolist() == [3 + 5, 3 + 5, 3, 3]  # "ab"+EOS, "cde!"+EOS
    values = torch.arange(gen.completion_ids.numel(), dtype=torch.float32).reshape(gen.completion_ids.shape)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        by_hand = [values[i][gen.model_mask[i].bool()] for i in range(n)]
        if mode == "token-mean":
            want = torch.cat(by_hand).mean()
        elif mode == "seq-mean-token-mean":
            want = torch.stack([v.mean() for v in by_hand]).mean()
        else:
            want = torch.stack([v.sum() for v in by_hand]).mean()
        assert aggregate(values, rollout.loss_mask, mode) == pytest.approx(float(want))
        assert aggregate(values, rollout.attention_mask, mode) != pytest.approx(float(want))


def test_budgets_truncate_and_never_pass_max_episode_tokens():
    r = runner(Echo(), max_turns=5, max_episode_tokens=12)
    out = run(r, Scripted(["abcd", "efgh", "ijkl", "mnop"]), [{"prompt": "p", "needed": 9}], n=1)
    (ep,) = out.episodes
    assert ep.truncated and ep.num_tokens <= 12
    assert out.generation.truncated.tolist() == [True]
    # a turn without EOS within max_new_tokens ends the episode truncated too
    out = run(runner(Echo()), Scripted(["abcdefgh"], no_eos=True), [{"prompt": "p"}], n=1, max_new=4)
    assert out.episodes[0].truncated and out.episodes[0].model_turns == 1
    # max_turns caps the turns, without truncation
    out = run(runner(Echo(), max_turns=2), Scripted(["a", "b", "c"]), [{"prompt": "p", "needed": 5}], n=1)
    assert out.episodes[0].model_turns == 2 and not out.episodes[0].truncated


def test_context_check_names_the_keys():
    with pytest.raises(ValueError,
                       match=r"model.policy.max_prompt_length.*model.episodes.max_episode_tokens.*256"):
        make(episodes={"environment": Echo(), "max_episode_tokens": 250}, policy={"max_prompt_length": 16})
    with pytest.raises(ValueError, match="model.episodes.max_episode_tokens` applies to episodes"):
        make(episodes={"max_episode_tokens": 20})


def divide(a: int, b: int) -> str:
    """Divide.

    Args:
        a: numerator.
        b: denominator.
    """
    return str(a // b)


def test_tool_calls_results_and_errors_are_observations_not_crashes():
    tools = [Tool.from_function(divide)]
    script = Scripted(["<tool>divide(7, 2)</tool>", "<tool>divide(1, 0)</tool><tool>nope(</tool>", "3"])
    out = run(runner(None, tools, max_turns=4, max_episode_tokens=1000), script, [{"prompt": "p"}], n=1,
              max_new=80)
    (ep,) = out.episodes
    assert [t.role for t in ep.turns] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert ep.turns[1].text == "<result>3</result>"
    assert ep.turns[3].text.startswith("<result>error: divide raised ZeroDivisionError")
    assert ep.tool_calls == 3 and ep.tool_errors == 2 and ep.final_text == "3"
    assert out.stats["rollout/tool_calls_mean"] == 3 and out.stats["rollout/tool_errors"] == 2
    assert out.stats["rollout/turns_mean"] == 3


def test_hermes_tool_turn_rendered_once_through_the_template(think_template):
    tools = [Tool.from_function(divide)]
    call = '<tool_call>{"name": "divide", "arguments": {"a": 9, "b": 3}}</tool_call>'
    gen = Scripted([call, "3"])
    run(runner(None, tools, fmt=HermesFormat(), chat=True), gen, [{"prompt": "q"}], n=1, max_new=80)
    prompt = ids("U:q\nA:")
    assert gen.contexts[1] == [prompt + ids(call) + [EOS] + ids("\nT:3\nA:")]


class Broken(Environment):
    def step(self, turn):
        raise KeyError("board")


def test_environment_errors_name_the_environment_and_episode_or_are_counted():
    with pytest.raises(EpisodeError, match=r"environment `Broken` raised KeyError in step of episode 0 "
                                           r"\(prompt 'p'\).*model.episodes.on_error: zero"):
        run(runner(Broken()), Scripted(["a"]), [{"prompt": "p"}])
    out = run(runner(Broken(), on_env_error="zero"), Scripted(["a"]), [{"prompt": "p"}])
    assert out.stats["rollout/env_errors"] == 2 and out.returns.tolist() == [0.0, 0.0]


def test_grpo_step_trains_on_episodes_with_observations_out_of_the_loss(tmp_path):
    """A real GRPO step on episodes: the loss mask equals the model tokens; observation tokens are context
    (their log-probs never reach the objective), rewards add the environment's return."""
    module = make(episodes={"environment": Echo(), "max_turns": 3},
                  sampling={"max_new_tokens": 8, "num_generations": 2},
                  rewards={"functions": ["lightning_rl.step.rewards:exact_match"]})
    batch = {"prompt": ["50318=", "92741="], "answer": ["01358", "12479"], "needed": [2, 1]}
    module.trainer = make_trainer(tmp_path)
    rollout, stats = sample_round(module, batch)
    assert rollout.model_mask is not None and torch.equal(rollout.loss_mask, rollout.model_mask)
    observation = rollout.attention_mask.bool() & ~rollout.model_mask.bool()
    assert observation[:2].any() and not observation[2:].any()  # only 2-turn episodes have observations
    assert stats["perf/generated_tokens"] == float(rollout.model_mask.sum())
    assert stats["rollout/turns_mean"] > 1
    assert (rollout.rewards[:2] >= 1.0).all()  # the environment's step reward is in the reward


@pytest.mark.distributed
@pytest.mark.ranks("ddp/episodes", "fsdp2/episodes")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_ranks_with_uneven_turn_counts_make_the_same_collectives(rank_jobs, strategy):
    """Rank 0's episodes take 1 model turn, rank 1's take 3: two GRPO steps and greedy validation on uneven
    held-out rows finish on both strategies (a rank that skipped a turn's all-reduce, or under FSDP2 a
    turn's generation, would hang and be killed). Broken variant that hangs: `any_active` without the
    all-reduce (each rank stopping when its own episodes are done)."""
    result = torch.load(rank_jobs.out(f"{strategy}/episodes") / "result.pt")  # tests/episodes_fit.py
    assert result["global_step"] == 2
    rank0, rank1 = result["turns"]
    assert {t for step in rank0 for t in step} == {1}
    assert max(t for step in rank1 for t in step) == 3
    metrics = result["metrics"]
    assert {"rollout/turns_mean", "rollout/env_time", "val/accuracy", "policy/loss"} <= set(metrics)


@pytest.mark.slow
def test_tool_config_trains_predicts_and_shows_turns_through_the_cli(tmp_path):
    """configs/grpo_tools.yaml through the real CLI: two steps whose sample tables show each turn (model text
    and tool results apart), then `predict` writes every turn of every episode to the JSONL."""
    import json

    from helpers import CONFIGS, run_cli, texts

    quiet = ["--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(tmp_path)]
    run_cli("fit", "--config", CONFIGS / "grpo_tools.yaml", "--trainer.max_steps", "2",
            "--trainer.val_check_interval", "2", "--data.init_args.max_val_rows", "16",
            "--trainer.num_sanity_val_steps", "0", *quiet)
    tables = texts(tmp_path)
    train, val = tables["samples/train"][-1][1], tables["samples/val"][-1][1]
    for table in (train, val):
        assert "**tool:**" in table or "**observation:**" in table
        assert "&lt;result&gt;" in table  # the tool's answer, escaped, on its own line
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{a}*{b}=", "answer": str(a * b)}) + "\n"
                            for a, b in [(37, 482), (12, 345), (999, 10)]))
    out = tmp_path / "pred.jsonl"
    run_cli("predict", "--config", CONFIGS / "grpo_tools.yaml", "--data.init_args.predict_path", str(rows),
            "--predictions.output", str(out), *quiet)
    predictions = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(predictions) == 3
    for p in predictions:
        roles = [t["role"] for t in p["turns"]]
        assert roles[0] == "assistant" and set(roles) <= {"assistant", "tool"}
        assert p["completion"] == [t["content"] for t in p["turns"] if t["role"] == "assistant"][-1]
        if "tool" in roles:
            assert p["turns"][roles.index("tool")]["content"].startswith("<result>")
        assert p["correct"] == (p["completion"].strip() == p["answer"])  # exact_match of the final turn


class Parity(Echo):
    """Correct when the turn's digits sum to an even number: groups with mixed outcomes for DAPO's filter."""

    def step(self, turn):
        even = sum(int(c) for c in turn if c.isdigit()) % 2 == 0
        return replace(super().step(turn), info={"correct": even})


class Capture(RLCallback):
    def __init__(self) -> None:
        self.rollouts: list[Rollout] = []

    def on_rollout_end(self, trainer, pl_module, rollout):
        self.rollouts.append(rollout)


LORA = {"class_path": "peft.LoraConfig", "init_args": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dapo", "ppo", "lora"])
def test_algorithms_train_on_episodes(tmp_path, kind):
    """DAPO (dynamic sampling, overlong shaping over the episode budget), PPO (a critic: values, returns and
    advantages on model tokens only, 0 on observations) and LoRA each run a step on episodes and move
    what they train."""
    from helpers import datamodule

    from lightning_rl.algorithms import DAPO, PPO

    cls, extra = {"dapo": (DAPO, {"filters": {"max_gen_batches": 2}}),
                  "ppo": (PPO, {"sampling": {"num_generations": 1}}),
                  "lora": (GRPO, {"policy": {"peft": LORA}})}[kind]
    env = Parity() if kind == "dapo" else Echo()
    sampling = {"max_new_tokens": 8, "num_generations": 2} | extra.pop("sampling", {})
    module = make(cls, episodes={"environment": env, "max_turns": 2}, sampling=sampling, **extra)
    trained = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    capture = Capture()
    make_trainer(tmp_path, callbacks=[capture]).fit(module, datamodule(batch_size=2))
    moved = [n for n, p in module.named_parameters() if p.requires_grad and not torch.equal(p, trained[n])]
    assert moved and (kind != "lora" or all("lora" in n for n in moved))
    rollout = capture.rollouts[-1]
    observation = (rollout.attention_mask.bool() & ~rollout.model_mask.bool())
    assert observation.any()
    if kind == "ppo":
        assert rollout.advantages.dim() == 2
        assert (rollout.advantages[observation] == 0).all() and (rollout.returns[observation] == 0).all()
        assert (rollout.advantages[rollout.loss_mask.bool()] != 0).any()


def test_engine_log_probs_land_on_the_sampled_tokens_of_every_turn(tmp_path):
    """With an engine that returns log-probs (an fp32 CopyEngine: the same numbers as the trainer), each
    turn's log-probs sit on that turn's tokens: they equal the trainer's scoring of the whole episode on the
    model tokens, and are 0 on observation tokens (a shifted placement would not match)."""
    from helpers import logprobs

    from lightning_rl.step.engine import CopyEngine

    module = make(engine=CopyEngine("float32"), sampling={"max_new_tokens": 8, "num_generations": 2},
                  episodes={"environment": Echo(), "max_turns": 3})
    module.trainer = make_trainer(tmp_path)
    batch = {"prompt": ["50318=", "92741="], "answer": ["01358", "12479"], "needed": [3, 2]}
    rollout, _ = sample_round(module, batch)
    model = rollout.model_mask.bool()
    assert (rollout.attention_mask.bool() & ~model).any()
    scored = logprobs(module, rollout)
    torch.testing.assert_close(rollout.rollout_logp[model], scored[model], atol=1e-4, rtol=1e-4)
    assert (rollout.rollout_logp[~model] == 0).all()
