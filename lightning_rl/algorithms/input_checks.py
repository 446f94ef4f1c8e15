"""Checks at the start of ``fit`` that the data, the scoring functions and the optimiser fit together.

They run in ``PolicyModule.on_fit_start``, after the DataModule has loaded its rows and before any validation
or training step, so a run that cannot work stops at once, with one line naming the YAML keys and the data,
instead of failing inside a library at its first step (or, for ``lr: 0``, training for nothing).

* :func:`check_prompt_lengths`: every train / held-out prompt fits ``model.policy.max_prompt_length``, as the
  module's prompt codec encodes it (the file line of the first that does not is named).
* :func:`check_scoring_columns`: every function that is called with the data's columns (reward functions,
  ``correctness_fn``, ``accuracy_fn``) must accept the columns the rows have: ``exact_match`` needs
  ``answer``. Checked against each function's signature, without calling it.
* :func:`warn_if_lr_is_zero`: an optimiser whose learning rate is 0 in every parameter group, for the whole
  run, moves no weight: a warning names the key.

Errors found while setting up ``fit`` are :class:`lightning_rl.errors.InputError`; ``lightning-rl`` prints
them as one line.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from lightning.pytorch.utilities import rank_zero_warn

from lightning_rl.errors import InputError

# what reward functions are given besides the data's columns (``RewardPipeline.score``)
REWARD_EXTRAS = ("prompts", "completions", "completion_lengths")
CORRECTNESS_EXTRAS = ("prompts", "completions")
LR_KEY = "model.init_args.optimizer.init_args.lr"


def function_name(fn: Callable[..., Any]) -> str:
    """``module:qualname`` of a function, as ``model.rewards.functions`` names it."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def missing_arguments(fn: Callable[..., Any], given: Sequence[str]) -> list[str]:
    """The required parameters of ``fn`` that a call with keyword arguments ``given`` leaves unfilled
    (``[]`` when its signature cannot be read: a builtin, say)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    required = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params
            if p.kind in required and p.default is inspect.Parameter.empty and p.name not in given]


class Scored(NamedTuple):
    """A function called with a split's data columns: its YAML key, a note on its role, what else it is
    given besides the columns, and what to set instead of adding columns."""

    split: str
    key: str
    fn: Callable[..., Any]
    extras: tuple[str, ...]
    note: str = ""
    instead: str = ""


def scored_functions(module: Any) -> list[Scored]:
    """Each function ``module`` calls with a split's data columns.

    Online RL (a module with a ``reward_pipeline``): the reward functions and ``correctness_fn`` (every
    rollout's correctness, DAPO's filter and ``val/accuracy``; ``accuracy_fn`` when unset, which itself
    follows the main reward function when unset) on train and val rows. Other modules whose validation is
    ``PolicyModule``'s own: ``accuracy_fn`` on the val rows.
    """
    from lightning_rl.algorithms.base import PolicyModule

    out = []
    if getattr(module, "reward_pipeline", None) is not None:
        unset = module.correctness_fn is module.accuracy_fn
        decides = ("also what decides correctness (DAPO's filter, `rollout/correct_frac`, `val/accuracy`): "
                   "`model.init_args.rewards.correctness_fn` and `model.init_args.rewards.accuracy_fn` are "
                   "unset")
        set_correctness = "set `model.init_args.rewards.correctness_fn` to a function of the columns present"
        if unset:
            note = " (the rollouts' correctness too: `model.init_args.rewards.correctness_fn` is unset)"
            correctness = Scored("", "model.init_args.rewards.accuracy_fn", module.accuracy_fn,
                                 CORRECTNESS_EXTRAS, note, set_correctness)
        else:
            correctness = Scored("", "model.init_args.rewards.correctness_fn", module.correctness_fn,
                                 CORRECTNESS_EXTRAS, "", set_correctness)
        scorer = module.reward_pipeline.scorer
        main = str(getattr(module, "accuracy_name", ""))  # "<reward fn> (correct at its full score...)"
        for split in ("train", "val"):
            for name, fn in zip(getattr(scorer, "names", []), getattr(scorer, "fns", []), strict=True):
                note = f" ({decides})" if unset and main.startswith(f"{name} (") else ""
                out.append(Scored(split, "model.init_args.rewards.functions", fn, REWARD_EXTRAS, note,
                                  "remove it from `model.init_args.rewards.functions`"))
            out.append(correctness._replace(split=split))
    elif type(module).validation_step is PolicyModule.validation_step and hasattr(module, "accuracy_fn"):
        key = "model.init_args.validation.accuracy_fn"
        out.append(Scored("val", key, module.accuracy_fn, CORRECTNESS_EXTRAS, "",
                          f"set `{key}` to a function of the columns present"))
    return out


def data_source(datamodule: Any, split: str) -> str:
    """Where a split's rows come from, for messages (``data.path``, ``data.val_path``, the built-in task)."""
    if split == "val" and hasattr(datamodule, "val_source"):
        return datamodule.val_source()
    path = getattr(datamodule, "path", None)
    return f"`data.path`={path}" if path else "the built-in task"


def check_prompt_lengths(codec: Any, datamodule: Any) -> None:
    """Fail before the first step if any train / val prompt of ``datamodule`` exceeds the ``codec``'s
    ``max_prompt_length`` (a :class:`~lightning_rl.models.prompt_codec.PromptCodec`), naming the file line (or
    row index) of the first one."""
    from lightning_rl.data.rows import row_locator

    sources = {"train": getattr(datamodule, "path", None), "val": getattr(datamodule, "val_path", None)}
    for split, source in sources.items():
        rows = getattr(datamodule, f"{split}_rows", None) or []
        for start in range(0, len(rows), 1024):
            chunk = [r["prompt"] for r in rows[start : start + 1024]]
            for i, n in enumerate(codec.lengths(chunk)):
                if n > codec.max_prompt_length:
                    where = row_locator(source)(start + i) + (f" of {source}" if source else "")
                    raise InputError(f"{split} prompt at {where} is {n} tokens, longer than "
                                     f"`model.policy.max_prompt_length`={codec.max_prompt_length}")


def check_scoring_columns(module: Any, datamodule: Any) -> None:
    """Fail before the first step when a function called with the data's columns needs one the rows lack
    (held-out rows only when the run validates).

    Raises:
        InputError: naming the function's key, the missing column, the data and what would fix it.
    """
    episodes = getattr(module, "episodes", None) is not None  # episodes add each sample's `turns`
    validating = bool(getattr(module.trainer, "enable_validation", True))
    for scored in scored_functions(module):
        rows = getattr(datamodule, f"{scored.split}_rows", None) or []
        if not rows or (scored.split == "val" and not validating):
            continue
        columns = [c for c in rows[0] if c != "prompt"] + (["turns"] if episodes else [])
        missing = missing_arguments(scored.fn, [*scored.extras, *columns])
        if not missing:
            continue
        needs = ", ".join(f"`{m}`" for m in missing)
        plural = "s" * (len(missing) > 1)
        fix = ("set `data.init_args.answer_column` to the column holding the reference answers"
               if "answer" in missing else f"add the column{plural} {needs} to the data")
        raise InputError(
            f"`{scored.key}`{scored.note}: `{function_name(scored.fn)}` needs the data column{plural} "
            f"{needs}, which the {scored.split} rows of {data_source(datamodule, scored.split)} do not have "
            f"(columns: {', '.join(sorted(rows[0]))}): {fix}, or {scored.instead}"
        )


def warn_if_lr_is_zero(optimizers: Sequence[Any], schedulers: Sequence[Any]) -> None:
    """Warn (rank 0) when the policy's optimiser (the first) has learning rate 0 in every parameter group
    for the whole run: no scheduler, or one whose base rates are 0 and that never rises above them (a
    warmup from 0 to a rate above 0 is fine)."""
    if not optimizers:
        return
    groups = optimizers[0].param_groups
    if not groups or any(float(g.get("lr", 0.0)) != 0.0 for g in groups):
        return
    for scheduler in schedulers:
        if getattr(scheduler, "optimizer", None) is not optimizers[0]:
            continue
        rates = [*getattr(scheduler, "base_lrs", []), *getattr(scheduler, "max_lrs", [])]
        if any(float(r) != 0.0 for r in rates) or float(getattr(scheduler, "eta_min", 0.0) or 0.0) != 0.0:
            return
    rank_zero_warn(f"`{LR_KEY}` is 0: no weight will move during this run; set a learning rate above 0 "
                   "(e.g. 1.0e-5)")
