"""Every module of the package imports, in the fast tier: a module no unit test reaches still fails here
on a syntax error, a broken import or a name that moved (the slow tier exercises the rest)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import lightning_rl
import lightning_rl.callbacks
import lightning_rl.data

# data/ and callbacks/ live outside lightning_rl/ in the tree (pyproject's package-dir): walked on their own
PACKAGES = (lightning_rl, lightning_rl.data, lightning_rl.callbacks)
MODULES = sorted({m.name for p in PACKAGES for m in pkgutil.walk_packages(p.__path__, p.__name__ + ".")})


def test_the_walk_finds_the_core_the_algorithms_the_data_and_the_callbacks():
    for name in ("lightning_rl.maths.losses", "lightning_rl.algorithms.online", "lightning_rl.data.prompts",
                 "lightning_rl.callbacks.checkpoints"):
        assert name in MODULES
    assert len(MODULES) > 60


@pytest.mark.parametrize("name", MODULES)
def test_every_module_imports_and_documents_itself(name):
    module = importlib.import_module(name)
    assert (module.__doc__ or "").strip(), f"{name} has no module docstring"
    public = [v for k, v in vars(module).items()
              if not k.startswith("_") and callable(v) and getattr(v, "__module__", None) == name]
    assert all(getattr(v, "__doc__", None) for v in public if isinstance(v, type)), name
