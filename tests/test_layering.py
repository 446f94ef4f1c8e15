"""Layering: the core is layers, each importing only the layers below it (text < maths < models < step <
episodes < algorithms < cli); it imports neither the data package nor the callbacks when it is imported;
and no module imports another's private names. Shared names live in the core (``lightning_rl.text.keys``,
``lightning_rl.text.pairs``) and stay importable from their old places in ``lightning_rl.data``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_rl"
# every core module: everything under lightning_rl/ (data/ and callbacks/ live outside it in the tree)
CORE = sorted(
    "lightning_rl." + str(p.relative_to(PACKAGE).with_suffix("")).replace("/", ".").removesuffix(".__init__")
    for p in PACKAGE.rglob("*.py")
)
# the layers, lowest first; a module may import its own layer and those before it. `losses` at the top of
# the package is the published contract (DESIGN.md), a maths-level module; `sandbox` (model-written code in
# a limited child process) imports the standard library alone, the lowest level.
LAYERS = ["text", "maths", "models", "step", "episodes", "algorithms", "cli"]
LEVEL = {**{name: i for i, name in enumerate(LAYERS)}, "losses": LAYERS.index("maths"), "sandbox": 0,
         "errors": 0,
         **{f"sandbox_{part}": 0 for part in ("child", "kernel", "hook", "processes")},
         **{f"code_judge{part}": 0  # the reward code_tests, beside the sandbox
                                for part in ("", "_plan", "_harness", "_values", "_rewrite")}}
# the Lightning plugins: only algorithms (default callbacks, the predict writer, the row locator) and the
# CLI name them, inside functions, so that importing the core never imports them
PLUGINS = {"data", "callbacks"}
# what the plugins may import: the layers up to the episodes (the rollout, the stream's encoders) and the
# exception types (``lightning_rl.errors``); never the algorithms or the CLI, which import them
PLUGIN_LEVEL = LEVEL["episodes"]
PLUGIN_FILES = sorted([*(ROOT / "data").glob("*.py"), *(ROOT / "callbacks").glob("*.py")])
# files whose imports must not name another module's private (``_``) names
PUBLIC_IMPORTS = sorted(
    str(p.relative_to(ROOT))
    for p in [*PACKAGE.rglob("*.py"), *(ROOT / "data").glob("*.py"), *(ROOT / "callbacks").glob("*.py")]
)


def imported_layers(source: str) -> list[tuple[int, str, bool]]:
    """``(line, layer, at module level)`` for every ``lightning_rl.<layer>`` the source imports."""
    tree, found = ast.parse(source), []
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                 [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        if isinstance(node, ast.ImportFrom) and node.module == "lightning_rl":  # the root's modules count
            names = [f"lightning_rl.{a.name}" for a in node.names if a.name in LEVEL or a.name in PLUGINS]
        for name in names:
            if name.startswith("lightning_rl."):
                found.append((node.lineno, name.split(".")[1], id(node) in top))
    return found


def layer_violations(path: Path, source: str | None = None) -> list[str]:
    parts = path.relative_to(PACKAGE).parts
    mine = parts[0] if len(parts) > 1 else path.stem
    bad = []
    for line, layer, module_level in imported_layers(path.read_text() if source is None else source):
        if layer in PLUGINS:
            allowed = LEVEL[mine] >= LEVEL["algorithms"] and not module_level
        else:
            allowed = LEVEL[layer] <= LEVEL[mine]
        if not allowed:
            bad.append(f"{path.relative_to(ROOT)}:{line} ({mine}) imports lightning_rl.{layer}")
    return bad


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_core_module_imports_only_its_layer_and_those_below(path):
    assert not layer_violations(path)


def test_an_upward_import_is_caught():
    """The check fails on deliberately upward imports: the maths importing the rollout record, and a stage
    importing the callbacks (even inside a function)."""
    upward = "from lightning_rl.step.rollout import Rollout\n"
    maths = layer_violations(PACKAGE / "maths" / "probe.py", upward)
    assert maths == ["lightning_rl/maths/probe.py:1 (maths) imports lightning_rl.step"]
    stage = "def f():\n    from lightning_rl.callbacks import RLCallback\n"
    assert layer_violations(PACKAGE / "step" / "probe.py", stage) == [
        "lightning_rl/step/probe.py:2 (step) imports lightning_rl.callbacks"]
    lazy_plugin = "def f():\n    from lightning_rl.callbacks import ExportPolicy\n"
    assert layer_violations(PACKAGE / "algorithms" / "probe.py", lazy_plugin) == []


def plugin_violations(path: Path, source: str | None = None) -> list[str]:
    """The imports of a ``data`` or ``callbacks`` module (inside functions too) above :data:`PLUGIN_LEVEL`,
    or of the other plugin."""
    mine = path.parent.name
    source = path.read_text() if source is None else source
    found = imported_layers(source)
    tree = ast.parse(source)  # the plugins import each other as ``lightning_rl.<plugin>`` or by folder name
    for node in ast.walk(tree):
        absolute = isinstance(node, ast.ImportFrom) and node.module and not node.level
        names = ([node.module] if absolute else
                 [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        found += [(node.lineno, name.split(".")[0], True) for name in names if name.split(".")[0] in PLUGINS]
    return [f"{path.relative_to(ROOT)}:{line} ({mine}) imports {layer}" for line, layer, _ in found
            if (layer in PLUGINS and layer != mine) or (layer not in PLUGINS and LEVEL[layer] > PLUGIN_LEVEL)]


@pytest.mark.parametrize("path", PLUGIN_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_plugins_import_only_the_layers_below_the_algorithms(path):
    assert not plugin_violations(path)


def test_a_plugin_importing_upward_is_caught_and_no_package_cycle_remains():
    """A callback raising the CLI's error from inside a function was the last package cycle (cli -> callbacks
    -> cli); the check sees imports inside functions. With the plugins below the algorithms and the core
    importing them only from the algorithms up, the package graph has no cycle."""
    upward = "def f():\n    from lightning_rl.cli.main import ConfigError\n"
    assert plugin_violations(ROOT / "callbacks" / "probe.py", upward) == [
        "callbacks/probe.py:2 (callbacks) imports cli"]
    assert plugin_violations(ROOT / "data" / "probe.py", "from lightning_rl.errors import InputError\n") == []
    def room(name: str) -> str:  # the sandbox's modules and the code judge beside it are one room
        return "sandbox" if name.startswith(("sandbox", "code_judge")) else name

    edges = {(room(p.relative_to(PACKAGE).parts[0] if len(p.relative_to(PACKAGE).parts) > 1 else p.stem),
              room(layer)) for p in PACKAGE.rglob("*.py") for _, layer, _ in imported_layers(p.read_text())}
    edges |= {(p.parent.name, room(layer)) for p in PLUGIN_FILES
              for _, layer, _ in imported_layers(p.read_text())}
    packages = {a for a, _ in edges} | {b for _, b in edges}
    # repeatedly drop packages that import nothing left: a cycle is what remains
    left = {a: {b for x, b in edges if x == a and b != a} for a in packages}
    while any(not deps for deps in left.values()):
        done = {a for a, deps in left.items() if not deps}
        left = {a: deps - done for a, deps in left.items() if a not in done}
    assert not left, f"package cycle among {sorted(left)}"


def test_every_subpackage_is_a_layer():
    import lightning_rl

    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(LAYERS) and list(lightning_rl.LAYERS) == LAYERS


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
    from lightning_rl.data import preference, prompts, validation
    from lightning_rl.text import keys, pairs

    assert validation.VAL_WEIGHT_KEY is keys.VAL_WEIGHT_KEY == "_weight"
    assert prompts.ROW_INDEX_KEY is keys.ROW_INDEX_KEY == "_row"
    for name in ("EncodedPairs", "encode_pairs", "render_pair"):
        assert getattr(preference, name) is getattr(pairs, name)


def test_pad_rows_pads_on_either_side():
    from lightning_rl.text.pairs import pad_rows

    ids, mask = pad_rows([[5, 6, 7], [8]], pad_id=0, left=True)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    ids, mask = pad_rows([[5, 6, 7], [8]], pad_id=0, left=False)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
