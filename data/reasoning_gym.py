"""reasoning-gym tasks: procedurally generated, verifiable reasoning problems, offline.

`reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ generates each of its ~100 tasks from a
seed (arithmetic, counting, puzzles, logic, ...) and scores answers with the task's own ``score_answer``.
Nothing is downloaded: ``pip install 'lightning-rl[reasoning-gym]'``.

Three pieces, each usable alone:

* :class:`ReasoningGymDataModule` (``data.class_path``:
  ``lightning_rl.data.reasoning_gym.ReasoningGymDataModule``) makes rows ``{"prompt", "answer", "rg_task",
  "rg_seed", "rg_size", "rg_config", "rg_index"}``: the question, its reference answer, and what rebuilds
  the generator's entry (JSON-serialisable, no metadata).
* :func:`reasoning_gym_score`
  (``model.rewards.functions: [lightning_rl.data.reasoning_gym:reasoning_gym_score]``) scores each
  completion with the task's ``score_answer`` against the rebuilt entry; and
  :func:`reasoning_gym_correct` (score 1.0) for ``model.rewards.correctness_fn`` /
  ``model.rewards.accuracy_fn``.
* :class:`ReasoningGymEnvironment` (``model.episodes.environment``): the same score as a single-turn episode.

The answer scored is the text of the last ``<answer>...</answer>`` in the completion when there is one
(reasoning-gym's convention for models that think first), else the whole completion, stripped.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import fields
from functools import lru_cache
from typing import Any

from lightning_rl.data.prompts import PromptDataModule
from lightning_rl.episodes.environments import Environment, Observation, StepResult
from lightning_rl.maths.checks import require

INSTALL = "pip install 'lightning-rl[reasoning-gym]'"
COLUMNS = ("rg_task", "rg_seed", "rg_size", "rg_config", "rg_index")


def require_reasoning_gym() -> Any:
    """The ``reasoning_gym`` package, or an ImportError that says how to install it."""
    try:
        import reasoning_gym
    except ImportError as err:
        raise ImportError(f"reasoning-gym tasks need the `reasoning-gym` package: {INSTALL}") from err
    return reasoning_gym


def check_task(task: str) -> str:
    """``task`` once reasoning-gym knows it.

    Raises:
        ValueError: naming ``data.task`` and the closest task names.
    """
    names = sorted(require_reasoning_gym().factory.DATASETS)
    if task in names:
        return task
    close = difflib.get_close_matches(task, names, n=5, cutoff=0.5)
    hint = f"did you mean one of {close}?" if close else f"e.g. {names[:5]}"
    raise ValueError(f"`data.task`={task!r} is not a reasoning-gym task ({len(names)} tasks; {hint})")


def check_config(task: str, config: dict[str, Any]) -> None:
    """Fail early on options the task's generator does not take (or that ``data`` sets itself).

    Raises:
        ValueError: naming ``data.config`` and the task's options.
    """
    _, config_cls = require_reasoning_gym().factory.DATASETS[task]
    known = sorted(f.name for f in fields(config_cls) if f.name not in ("seed", "size"))
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise ValueError(f"`data.config` has {unknown}, which task {task!r} does not take "
                         f"(`data.seed` and `data.size` are set apart); its options: {known}")


@lru_cache(maxsize=64)
def dataset(task: str, seed: int, size: int, config: str = "{}") -> Any:
    """The task's generator for ``seed`` and ``size`` (``config``: its other options, as JSON), cached."""
    rg = require_reasoning_gym()
    try:
        return rg.create_dataset(task, seed=seed, size=size, **json.loads(config))
    except (AssertionError, TypeError, ValueError) as err:  # the task's config.validate() asserts
        raise ValueError(f"reasoning-gym task {task!r} rejects `data.config`={config}: {err}") from err


@lru_cache(maxsize=65536)
def entry(task: str, seed: int, size: int, config: str, index: int) -> dict[str, Any]:
    """Entry ``index`` of the generator, as ``score_answer`` expects it (``question``, ``answer``,
    ``metadata``); generated once and cached."""
    return dataset(task, seed, size, config)[index]


def row_key(row: dict[str, Any]) -> tuple[str, int, int, str, int]:
    """What finds a row's entry again: its ``rg_task``, ``rg_seed``, ``rg_size``, ``rg_config`` and
    ``rg_index``."""
    check_columns(row)
    task, seed, size, config, index = (row[c] for c in COLUMNS)
    return str(task), int(seed), int(size), str(config), int(index)


def check_columns(columns: dict[str, Any]) -> None:
    """Raise a KeyError naming the ``rg_*`` columns a row (or a batch's columns) lacks."""
    missing = [c for c in COLUMNS if c not in columns]
    if missing:
        raise KeyError(f"no {missing} column: reasoning-gym scores need ReasoningGymDataModule's rows")


def extract(completion: str) -> str:
    """The last ``<answer>...</answer>`` of ``completion`` if it has one, else the completion; stripped."""
    from reasoning_gym.utils import extract_answer

    found = extract_answer(completion)
    return (found if found is not None else completion).strip()


def score(completion: str, row: dict[str, Any]) -> float:
    """The task's own ``score_answer`` of ``completion`` (see :func:`extract`) for the row's entry."""
    key = row_key(row)
    return float(dataset(*key[:4]).score_answer(extract(completion), entry(*key)))


def reasoning_gym_score(completions: list[str], **columns: Any) -> list[float]:
    """Reward function: each completion scored by its task's ``score_answer`` (in [0, 1]; 1.0 is correct,
    some tasks give partial credit). ``columns`` must hold the ``rg_*`` columns of the rows."""
    check_columns(columns)
    rows = zip(*(columns[c] for c in COLUMNS), strict=True)
    return [score(c, dict(zip(COLUMNS, row, strict=True))) for c, row in zip(completions, rows, strict=True)]


def reasoning_gym_correct(completions: list[str], **columns: Any) -> list[float]:
    """Correctness function: 1.0 where :func:`reasoning_gym_score` is 1.0, else 0.0."""
    return [float(s == 1.0) for s in reasoning_gym_score(completions, **columns)]


class ReasoningGymEnvironment(Environment):
    """A single-turn episode: the model answers the row's question once and gets the task's score.

    ``step`` returns ``StepResult(reward=score, done=True, info={"correct": score == 1.0})``. Use it with
    ``model.rewards.functions: []`` (else the reward functions' scores are added to the environment's).
    """

    def __init__(self) -> None:
        self.row: dict[str, Any] | None = None

    def reset(self, row: dict[str, Any]) -> Observation:
        entry(*row_key(row))  # fail at the start of the episode on a row without its entry
        self.row = row
        return None

    def step(self, turn: str) -> StepResult:
        if self.row is None:
            raise RuntimeError("ReasoningGymEnvironment.step before reset")
        value = score(turn, self.row)
        return StepResult(reward=value, done=True, info={"correct": value == 1.0, "score": value})


class ReasoningGymDataModule(PromptDataModule):
    """Prompts of one reasoning-gym task, generated offline; train and validation from disjoint seeds.

    Training entries are indices ``0 .. size-1`` of the generator seeded ``seed``; validation entries come
    from the generator seeded ``seed + size`` (most reasoning-gym tasks seed entry ``i`` with ``seed + i``,
    so the two share no random stream), minus any whose question also appears in training.

    Args:
        task: a reasoning-gym task name (``reasoning_gym.factory.DATASETS``), e.g. ``basic_arithmetic``,
            ``leg_counting``, ``chain_sum``.
        config: the task's own generator options (its config dataclass's fields, e.g. ``{max_terms: 3}``
            for ``basic_arithmetic``), besides ``seed`` and ``size``.
        size: training entries generated.
        val_size: validation entries generated.
        max_question_chars: drop entries whose question is longer (a small model's context); ``None``
            keeps all. Rows are then fewer than ``size`` / ``val_size``.
        system_prompt: ``None``: the prompt is the question as text. Otherwise the prompt is chat messages,
            this system prompt then the question: a name of ``reasoning_gym.utils.SYSTEM_PROMPTS``
            (``default``, ``DeepSeekZero``, ``simple``, ``direct``: answers in ``<answer>`` tags) or the
            text itself.
        batch_size: prompts per training step on each rank.
        val_batch_size: prompts per validation (and predict) batch.
        seed: seed of the training entries and of the training order.
        shuffle: shuffle the training rows each epoch.
    """

    def __init__(self, task: str = "basic_arithmetic", config: dict[str, Any] | None = None,
                 size: int = 10_000, val_size: int = 256, max_question_chars: int | None = None,
                 system_prompt: str | None = None, batch_size: int = 8, val_batch_size: int = 64,
                 seed: int = 0, shuffle: bool = True) -> None:
        super().__init__(batch_size=batch_size, val_batch_size=val_batch_size, seed=seed, shuffle=shuffle)
        self.task = None  # the built-in task PromptDataModule would make: unused
        self.task_name = check_task(task)
        require("data", size=(size >= 1, size, ">= 1"), val_size=(val_size >= 0, val_size, ">= 0"),
                max_question_chars=(max_question_chars is None or max_question_chars >= 1, max_question_chars,
                                    ">= 1 or null"))
        check_config(self.task_name, dict(config or {}))
        self.config = json.dumps(dict(config or {}), sort_keys=True)
        self.size, self.val_size, self.max_question_chars = size, val_size, max_question_chars
        self.system_prompt = self.resolve_system_prompt(system_prompt)

    @staticmethod
    def resolve_system_prompt(system_prompt: str | None) -> str | None:
        if system_prompt is None:
            return None
        return require_reasoning_gym().utils.SYSTEM_PROMPTS.get(system_prompt, system_prompt)

    def rows(self, seed: int, size: int) -> list[dict[str, Any]]:
        """The rows of the generator seeded ``seed`` with ``size`` entries (long questions dropped)."""
        out = []
        for i in range(size):
            item = entry(self.task_name, seed, size, self.config, i)
            question = str(item["question"])
            if self.max_question_chars is not None and len(question) > self.max_question_chars:
                continue
            prompt: Any = question
            if self.system_prompt is not None:
                prompt = [{"role": "system", "content": self.system_prompt},
                          {"role": "user", "content": question}]
            answer = item.get("answer")
            out.append({"prompt": prompt, "answer": None if answer is None else str(answer),
                        "rg_task": self.task_name, "rg_seed": seed, "rg_size": size,
                        "rg_config": self.config, "rg_index": i})
        return out

    def setup(self, stage: str | None = None) -> None:
        if self.train_rows:
            return
        self.train_rows = self.rows(self.seed, self.size)
        if not self.train_rows:
            raise ValueError(f"no question of task {self.task_name!r} is at most `data.max_question_chars`="
                             f"{self.max_question_chars} characters")
        seen = {question(r) for r in self.train_rows}
        val = self.rows(self.seed + self.size, self.val_size) if self.val_size else []
        self.val_rows = [r for r in val if question(r) not in seen]


def question(row: dict[str, Any]) -> str:
    """A row's question (its prompt's last message under a system prompt)."""
    prompt = row["prompt"]
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]
