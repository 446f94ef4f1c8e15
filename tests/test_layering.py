"""Layering: the core imports neither the data package nor the callbacks when it is imported, and no module
imports another's private names. Shared names live in the core (``lightning_rl.keys``, ``lightning_rl.pairs``)
and stay importable from their old places in ``lightning_rl.data``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# every core module: lightning_rl/*.py and lightning_rl/algorithms/*.py
CORE = sorted(
    "lightning_rl." + str(p.relative_to(ROOT / "lightning_rl").with_suffix("")).replace("/", ".")
    for p in [*(ROOT / "lightning_rl").glob("*.py"), *(ROOT / "lightning_rl" / "algorithms").glob("*.py")]
    if p.name != "__init__.py"
)
# files whose imports must not name another module's private (``_``) names
PUBLIC_IMPORTS = sorted(
    str(p.relative_to(ROOT))
    for folder in ("lightning_rl", "lightning_rl/algorithms", "data", "callbacks")
    for p in (ROOT / folder).glob("*.py")
)


@pytest.mark.slow
def test_core_modules_import_no_data_or_callbacks():
    # one fresh interpreter for all: what the modules import together is the union of what each imports
    code = (f"import sys, {', '.join(CORE)}\n"
            "print(sorted(m for m in sys.modules\n"
            "             if m.startswith(('lightning_rl.data', 'lightning_rl.callbacks'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


@pytest.mark.parametrize("path", PUBLIC_IMPORTS)
def test_no_private_names_imported_from_other_modules(path):
    tree = ast.parse((ROOT / path).read_text())
    private = [
        f"line {node.lineno}: from {node.module} import {alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("lightning_rl"))
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert not private, f"{path} imports private names: {private}"


def test_shared_names_live_in_the_core_and_stay_importable_from_the_data_package():
    from lightning_rl import keys, pairs
    from lightning_rl.data import preference, prompts, validation

    assert validation.VAL_WEIGHT_KEY is keys.VAL_WEIGHT_KEY == "_weight"
    assert prompts.ROW_INDEX_KEY is keys.ROW_INDEX_KEY == "_row"
    for name in ("EncodedPairs", "encode_pairs", "render_pair"):
        assert getattr(preference, name) is getattr(pairs, name)


def test_pad_rows_pads_on_either_side():
    from lightning_rl.pairs import pad_rows

    ids, mask = pad_rows([[5, 6, 7], [8]], pad_id=0, left=True)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    ids, mask = pad_rows([[5, 6, 7], [8]], pad_id=0, left=False)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
