"""The package's layers, declared once (LAYERS, bottom first), held against the code: no module imports a module of a
higher layer, in-function imports included; the dispatcher and the public face reach the kernels through their
package's face only; ARCHITECTURE.md's layer table lists the same layers and modules. Read with ast: nothing is
imported or executed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from checkout import ROOT

PACKAGE = ROOT / "volta_train"

# (layer, modules), bottom first; a module is named relative to volta_train/ ("kernels" is the package and all of
# its modules, "__init__" the package's own face). A module may import its own layer's modules and lower layers'.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("options", "philox", "resources", "versions")),
    ("checks and caches", ("validation", "rotary", "kvcache")),
    ("backends", ("kernels", "reference", "cutlass_backward", "sinks", "attn_probs")),
    ("dispatcher", ("dispatch",)),
    ("public face", ("__init__", "interface", "bert_padding", "flash_attn_compat", "integrations")),
    ("training", ("training",)),
    ("entry points", ("recipes", "cli", "env", "bench")),
)
FACE_ONLY = {"dispatcher", "public face"}  # these import volta_train.kernels, never volta_train.kernels.<module>


def module_names() -> dict[str, Path]:
    """volta_train's modules, dotted ("volta_train.kernels.tiles"; a package by its own name)."""
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The volta_train modules `name` imports anywhere in its file (top level and inside functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "volta_train")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "volta_train":
                continue
            for alias in node.names:  # `from pkg import module` imports that module; else the names of pkg
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target)
    return found - {name}


def layer_of(name: str) -> int:
    relative = name.removeprefix("volta_train").removeprefix(".") or "__init__"
    for index, (_, members) in enumerate(LAYERS):
        if any(relative == m or relative.startswith(m + ".") for m in members):
            return index
    raise LookupError(name)


def test_every_module_has_a_layer():
    unplaced = []
    for name in module_names():
        try:
            layer_of(name)
        except LookupError:
            unplaced.append(name)
    assert not unplaced, f"modules in no layer of LAYERS (place each in one): {unplaced}"


def test_no_module_imports_a_higher_layer():
    modules = module_names()
    upward = []
    for name, path in modules.items():
        for target in sorted(imported_modules(name, path, modules)):
            if layer_of(target) > layer_of(name):
                upward.append(f"{name} ({LAYERS[layer_of(name)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})")
    assert not upward, "\n".join(upward)


def test_dispatcher_and_public_face_use_the_kernels_face():
    modules = module_names()
    reaching = [f"{name} imports {target}" for name, path in modules.items()
                if LAYERS[layer_of(name)][0] in FACE_ONLY
                for target in imported_modules(name, path, modules) if target.startswith("volta_train.kernels.")]
    assert not reaching, "\n".join(reaching) + "\n(export what they need from volta_train/kernels/__init__.py)"


def test_import_reader_sees_function_level_and_relative_imports(tmp_path):
    """The reader finds what the layer checks rest on: imports inside functions, relative ones, `from pkg import mod`."""
    package = tmp_path / "volta_train"
    (package / "kernels").mkdir(parents=True)
    for relative in ("__init__.py", "options.py", "kernels/__init__.py", "kernels/tiles.py"):
        (package / relative).write_text("")
    path = package / "kernels" / "launch.py"
    path.write_text("from . import tiles\nfrom ..options import AttentionOptions\n\n"
                    "def f():\n    from .. import dispatch\n    import volta_train.training\n")
    modules = {"volta_train", "volta_train.options", "volta_train.kernels", "volta_train.kernels.tiles",
               "volta_train.kernels.launch"}
    assert imported_modules("volta_train.kernels.launch", path, dict.fromkeys(modules, path)) == {
        "volta_train.kernels.tiles", "volta_train.options", "volta_train", "volta_train.training"}


def architecture_layers() -> list[tuple[str, tuple[str, ...]]]:
    """(layer, modules) of ARCHITECTURE.md's layer table, in its order."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    table = text[text.index("| layer (bottom first) | modules |"):].split("\n\n")[0]
    rows = []
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        names = re.findall(r"`([^`]+)`", cells[1])
        rows.append((cells[0], tuple(n.removesuffix(".py").removesuffix("/") for n in names)))
    return rows


def test_architecture_table_is_the_declared_layers():
    assert architecture_layers() == [(layer, members) for layer, members in LAYERS]


@pytest.mark.parametrize("package", ["training"])
def test_package_docstring_names_modules_that_exist(package):
    """training/__init__.py lists its modules; a renamed or removed module must leave that list too."""
    doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text())) or ""
    for listed in re.findall(r":mod:`\.(\w+)`", doc):
        assert (PACKAGE / package / f"{listed}.py").exists(), f"volta_train/{package}/__init__.py lists .{listed}"
