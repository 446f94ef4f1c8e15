"""Packaging: callbacks/ and data/ install only as lightning_rl.callbacks / lightning_rl.data."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["callbacks", "data"])
def test_bare_import_refused(name):
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import {name}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode != 0
    assert f"this package is `lightning_rl.{name}`" in proc.stderr


@pytest.mark.slow
def test_wheel_contains_every_module_under_lightning_rl(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), "-q"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("lightning_rl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, package in [("callbacks", "lightning_rl/callbacks"), ("data", "lightning_rl/data"),
                            ("lightning_rl", "lightning_rl")]:
        for src in (ROOT / folder).rglob("*.py"):
            rel = src.relative_to(ROOT / folder).as_posix()
            assert f"{package}/{rel}" in names, f"{folder}/{rel} missing from the wheel"
    for folder in ("tiny_sort", "tiny_tools"):  # the embedded models
        for shipped in (ROOT / "data" / folder).glob("*"):
            assert f"lightning_rl/data/{folder}/{shipped.name}" in names
    assert "lightning_rl/data/tiny_sort/config.json" in names
    top = {n.split("/")[0] for n in names}
    assert "callbacks" not in top and "data" not in top, f"top-level packages leaked: {top}"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "lightning-rl = lightning_rl.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
