"""DESIGN.md's layers: a module imports only from its own layer or the layers above it."""

from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "forwardkit"

# Top to bottom, as in DESIGN.md; each prefix is a dotted module path under forwardkit.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("envs", "logger", "platforms", "__init__")),
    ("config", ("config",)),
    ("step state", ("forward_context", "microbatching", "distributed", "telemetry")),
    ("compilation", ("compilation",)),
    ("graphs", ("cudagraph",)),
    ("kernels", ("kernels", "quantization")),
    ("model", ("layers", "models")),
    ("execution", ("runner",)),
    ("engine & tools", ("engine", "bench", "cli", "commands")),
]

# Imports inside a function that reach down on purpose, each with the reason.
ALLOWED_LAZY: set[tuple[str, str]] = set()  # no exceptions: every import respects the layers


def _layer_of(module: str) -> int:
    parts = module.split(".")
    head = parts[1] if len(parts) > 1 else "__init__"
    for index, (_, prefixes) in enumerate(LAYERS):
        if head in prefixes:
            return index
    raise AssertionError(f"module {module} belongs to no layer of DESIGN.md; add it to LAYERS")


def _imports(path: pathlib.Path) -> list[tuple[str, bool]]:
    """(imported forwardkit module, imported at module level?) for each import in ``path``."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            if name == "forwardkit" or name.startswith("forwardkit."):
                found.append((name, id(node) in top_level))
    return found


def _modules() -> list[tuple[str, pathlib.Path]]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        out.append((".".join(rel.parts), path))
    return out


@pytest.mark.parametrize("module, path", _modules(), ids=[m for m, _ in _modules()])
def test_no_import_reaches_a_lower_layer(module, path):
    mine = _layer_of(module)
    for imported, top in _imports(path):
        if imported == "forwardkit":
            continue
        theirs = _layer_of(imported)
        if theirs <= mine:
            continue
        pair = (LAYERS[mine][0], LAYERS[theirs][0])
        assert not top and pair in ALLOWED_LAZY, (
            f"{module} ({LAYERS[mine][0]}) imports {imported} ({LAYERS[theirs][0]}), a lower layer"
            + ("" if top else " (inside a function, and not in ALLOWED_LAZY)")
        )


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles found by a depth-first walk of ``graph`` (each as a closed path)."""
    done: set[str] = set()
    path_stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        path_stack.append(module)
        for dep in sorted(graph[module]):
            if dep in path_stack:
                cycles.append(path_stack[path_stack.index(dep):] + [dep])
            elif dep not in done:
                visit(dep)
        path_stack.pop()
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module)
    return cycles


def _static_import_graph(src: pathlib.Path = SRC) -> dict[str, set[str]]:
    """forwardkit module -> the forwardkit modules it names in any import: at module level,
    inside functions and under ``if TYPE_CHECKING:`` (what the type checker follows too).
    ``from package import name`` counts as importing ``package.name`` when that is a module,
    else ``package``; relative imports are resolved against the importing module."""
    files = {}
    for path in sorted(src.rglob("*.py")):
        parts = path.relative_to(src.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        files[name] = (path, is_package)
    graph: dict[str, set[str]] = {}
    for module, (path, is_package) in files.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                for alias in node.names:
                    if f"{base}.{alias.name}" in files:
                        deps.add(f"{base}.{alias.name}")
                    elif base in files:
                        deps.add(base)
        graph[module] = deps - {module}
    return graph


def test_no_import_cycles_even_for_the_type_checker():
    """Imports point one way across the whole package, counting ``if TYPE_CHECKING:`` and
    function-level imports: a module an annotation needs sits above the module that uses it
    (config/ used to be one such circle, closed by annotations and a bottom-of-file import)."""
    cycles = _cycles(_static_import_graph())
    assert cycles == [], "import cycles (type-checking imports included): " + "; ".join(
        " -> ".join(c) for c in cycles)


def test_static_import_graph_sees_typing_function_and_relative_imports(tmp_path):
    pkg = tmp_path / "forwardkit"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .a import A\n")
    (pkg / "sub" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from forwardkit.sub.b import B\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "c.py").write_text("from forwardkit import sub\nimport forwardkit.sub.b\n")
    graph = _static_import_graph(pkg)
    assert graph == {"forwardkit": set(), "forwardkit.sub": {"forwardkit.sub.a"},
                     "forwardkit.sub.a": {"forwardkit.sub.b"}, "forwardkit.sub.b": {"forwardkit.sub.a"},
                     "forwardkit.c": {"forwardkit.sub", "forwardkit.sub.b"}}
    assert _cycles(graph) == [["forwardkit.sub.a", "forwardkit.sub.b", "forwardkit.sub.a"]]
