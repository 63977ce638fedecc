"""The packages import one way (README "Layout"): a new import that breaks a layer fails here and
names the file, the line and the import.

    API and tools   edge/ (everything outside edge/core)   anything
    devices         devices/                                core, quant, kernels, streaming
    streaming       streaming/                              core, quant, kernels
    converters      converters/                             core, quant, kernels
    kernels         kernels/                                core, quant
    formats         quant/                                  core
    core            edge/core/                              nothing else of the project

Every import counts, also those inside functions (a lazy import is still a dependency)."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("edge", "quant", "kernels", "streaming", "converters", "devices")
ALLOWED = {
    "edge.core": set(),
    "quant": {"edge.core"},
    "kernels": {"edge.core", "quant"},
    "streaming": {"edge.core", "quant", "kernels"},
    "converters": {"edge.core", "quant", "kernels"},
    "devices": {"edge.core", "quant", "kernels", "streaming"},
    "edge": {"edge.core", "quant", "kernels", "streaming", "converters", "devices"},
}


def layer_of(module: str) -> str | None:
    """The layer a dotted module name belongs to (None: not the project's)."""
    parts = module.split(".")
    if parts[0] not in PACKAGES:
        return None
    if parts[:2] == ["edge", "core"]:
        return "edge.core"
    return parts[0]


def module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> tuple[str, bool]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def imported_modules(path: pathlib.Path, root: pathlib.Path = ROOT):
    """(line, module) for every import in a file, relative imports resolved."""
    name, is_package = module_name(path, root)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + is_package]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            yield node.lineno, module
            for alias in node.names:  # `from edge import core` imports the module edge.core
                submodule = root.joinpath(*module.split("."), alias.name)
                if submodule.with_suffix(".py").is_file() or (submodule / "__init__.py").is_file():
                    yield node.lineno, f"{module}.{alias.name}"


def source_files():
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def violations(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    own = layer_of(module_name(path, root)[0])
    found = []
    for line, module in imported_modules(path, root):
        target = layer_of(module)
        if target is None or target == own:
            continue
        if target not in ALLOWED[own]:
            found.append(f"{path.relative_to(root)}:{line}: {own} imports {module} ({target}); "
                         f"{own} may import {', '.join(sorted(ALLOWED[own])) or 'nothing else of the project'}")
    return found


def test_the_layer_rules_catch_a_wrong_import(tmp_path):
    """The check itself: an import against the arrows, a lazy one inside a function, is reported."""
    bad = tmp_path / "quant" / "probe.py"
    bad.parent.mkdir()
    bad.write_text("def f():\n    from streaming.store import ExpertStore\n    return ExpertStore\n")
    assert violations(bad, tmp_path) == [
        "quant/probe.py:2: quant imports streaming.store (streaming); quant may import edge.core"]


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_follow_the_layers(package):
    found = [v for path in source_files() if path.relative_to(ROOT).parts[0] == package for v in violations(path)]
    assert not found, "imports against the layers:\n" + "\n".join(found)


def test_the_edge_package_itself_imports_only_the_core():
    """Importing edge.core runs edge/__init__.py first: it may pull in nothing but the core at import time
    (the API loads on first use), or every lower layer importing the core would import the API."""
    tree = ast.parse((ROOT / "edge" / "__init__.py").read_text(encoding="utf-8"))
    top_level = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    modules = [alias.name for node in top_level if isinstance(node, ast.Import) for alias in node.names]
    modules += [node.module for node in top_level if isinstance(node, ast.ImportFrom)]
    assert all(layer_of(m) in (None, "edge.core") for m in modules), modules
