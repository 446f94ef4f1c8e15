"""The standard-library functions that user code named in YAML must not be: one rule for tools
(``model.episodes.tools``: :mod:`lightning_rl.episodes.tools`) and reward functions (``model.rewards``'
``functions``, ``correctness_fn``, ``accuracy_fn``: :func:`lightning_rl.step.rewards.import_reward`).

A tool is called with the arguments the model wrote, a reward function with the data's columns as keyword
arguments (``os.system`` with a ``command`` column runs it): either way the function runs on the training
machine with the run's permissions. The rule matches the function object, so an alias (``posix:system``,
``io:open``) is caught and a function of your own that calls one of these is not.
"""

from __future__ import annotations

import sys
from typing import Any

# standard-library functions that run commands, evaluate code or delete files: (module, names, what they do)
UNSAFE: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("os", ("system", "popen", "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe",
            "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe",
            "posix_spawn", "posix_spawnp", "fork", "forkpty"), "runs commands"),
    ("os", ("kill", "killpg"), "kills processes"),
    ("subprocess", ("*",), "runs commands"),  # every name in its __all__
    ("pty", ("spawn", "fork"), "runs commands"),
    ("asyncio", ("create_subprocess_exec", "create_subprocess_shell"), "runs commands"),
    ("webbrowser", ("open", "open_new", "open_new_tab"), "runs commands"),
    ("builtins", ("eval", "exec", "compile", "__import__"), "evaluates code"),
    ("builtins", ("open",), "writes files"),
    ("runpy", ("run_module", "run_path"), "evaluates code"),
    ("importlib", ("import_module",), "evaluates code"),
    ("timeit", ("timeit", "repeat"), "evaluates code"),
    ("code", ("interact", "compile_command"), "evaluates code"),
    ("os", ("remove", "unlink", "rmdir", "removedirs", "truncate", "rename", "replace"), "deletes files"),
    ("shutil", ("rmtree", "move"), "deletes files"),
)


def unsafe(fn: Any) -> tuple[str, str] | None:
    """``(qualified name, what it does)`` when ``fn`` is one of the ``UNSAFE`` standard-library functions,
    whatever name it was imported under (``posix:system`` is ``os.system``)."""
    for module_name, names, does in UNSAFE:
        module = sys.modules.get(module_name)  # `fn` comes from an imported module, so its own is imported
        if module is None:
            continue
        for name in getattr(module, "__all__", ()) if names == ("*",) else names:
            if getattr(module, name, None) is fn:
                return f"{module_name}.{name}", does
    return None


def refuse_unsafe(fn: Any, where: str, consequence: str) -> None:
    """Raise ``ValueError`` when ``fn`` runs commands, evaluates code or deletes files.

    The message is one line: ``{where} is `os.system`, which runs commands: {consequence}``, where ``where``
    names the YAML key and the entry as written, and ``consequence`` says what would happen and what to do
    instead.
    """
    found = unsafe(fn)
    if found is not None:
        name, does = found
        raise ValueError(f"{where} is `{name}`, which {does}: {consequence}")
