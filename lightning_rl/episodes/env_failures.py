"""What happens when an episode's environment fails (:class:`EnvironmentFailures`): it raises, or breaks the
contract of :mod:`lightning_rl.episodes.environments` (a ``ContractError``).

``model.episodes.on_error: raise`` stops the run naming the environment, the method and the episode;
``zero`` ends that episode with return 0 (its reward is 0 whatever the reward functions say, see
the rewards pipeline's ``failed=``), counts it (``rollout/env_errors``), warns once per run, and stops the
run when more than ``max_error_frac`` of a step's episodes (over all ranks) failed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch

from lightning_rl.episodes.environments import ContractError, Episode, EpisodeBatch, EpisodeError


class EnvironmentFailures:
    """The failure policy of one episode runner (see the module docstring).

    Args:
        env_name: the environment's class name, for messages.
        on_error: ``raise`` or ``zero`` (``model.episodes.on_error``).
        max_error_frac: under ``zero``, the largest fraction of a step's episodes that may fail (1.0: any).
    """

    def __init__(self, env_name: str, on_error: Literal["raise", "zero"], max_error_frac: float) -> None:
        self.env_name, self.on_error, self.max_error_frac = env_name, on_error, max_error_frac
        self.warned = False

    def guarded(self, ep: Episode, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` (the environment's method ``what``, its return checked); an exception or a
        :class:`ContractError` fails the episode (:meth:`fail`) and gives ``None``."""
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - re-raised with the environment named, or counted
            self.fail(ep, what, err)
            return None

    def fail(self, ep: Episode, what: str, err: Exception) -> None:
        """Stop the run naming the environment, the method and the episode (``raise``), or end the episode
        with return 0, counted (``zero``)."""
        where = f"episode {ep.index} (prompt {str(ep.row.get('prompt'))[:80]!r})"
        if isinstance(err, ContractError):
            message = f"environment `{self.env_name}.{what}` returned {err.got} for {where}: expected " \
                      f"{err.expected}"
        else:
            message = f"environment `{self.env_name}` raised {type(err).__name__} in {what} of {where}: {err}"
        if self.on_error == "raise":
            raise EpisodeError(message + "; set `model.episodes.on_error: zero` to score such episodes 0 "
                               "instead") from err
        ep.failed = ep.done = True
        ep.error = message

    def check(self, batch: EpisodeBatch, collectives: Any = None, decide: bool = True) -> None:
        """Under ``on_error: zero``: stop when more than ``max_error_frac`` of the episodes failed (counts
        summed over ranks, so every rank makes the all-reduce and raises together; ``decide``: the step's
        first round only, as for rewards), naming the environment, the count and the last failure; else
        warn once per run that failed episodes train with reward 0."""
        failed = [ep for ep in batch.episodes if ep.failed]
        where = f"rank {collectives.rank}: " if collectives is not None and collectives.world_size > 1 else ""
        last = where + (failed[-1].error if failed else "no episode failed here")
        if decide and self.on_error == "zero" and self.max_error_frac < 1.0:
            counts = torch.tensor([len(failed), len(batch.episodes)], dtype=torch.float32)
            n_failed, total = (collectives.sum(counts) if collectives is not None else counts).tolist()
            if total and n_failed / total > self.max_error_frac:
                raise EpisodeError(
                    f"environment `{self.env_name}` failed in {n_failed:.0f} of {total:.0f} episodes, more "
                    f"than `model.episodes.max_error_frac`={self.max_error_frac}. Last failure: {last}. Fix "
                    "the environment or raise the limit (`model.episodes.on_error: raise` stops at the first "
                    "failure, with its traceback)")
        if failed and not self.warned:
            self.warned = True
            warnings.warn(f"environment `{self.env_name}` failed in {len(failed)} of {len(batch.episodes)} "
                          "episodes; they train with reward 0 whatever the reward functions say "
                          "(`model.episodes.on_error: zero`, counted in `rollout/env_errors`; warned once). "
                          f"Last failure: {last}", stacklevel=2)
