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
    ("step state", ("forward_context", "ubatch", "ubatching", "distributed", "telemetry")),
    ("compilation", ("compilation",)),
    ("graphs", ("cudagraph",)),
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


def _import_graph() -> dict[str, set[str]]:
    """forwardkit module -> the forwardkit modules it imports at run time (module level or in
    functions)."""
    names = {m.removesuffix(".__init__") for m, _ in _modules()}
    graph: dict[str, set[str]] = {}
    for module, path in _modules():
        deps = set()
        tree = ast.parse(path.read_text())
        # imports under ``if TYPE_CHECKING:`` never run, so they cannot form a runtime cycle
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and getattr(block.test, "id", None) == "TYPE_CHECKING"
                       for stmt in block.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            found: list[str] = []
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            deps.update(n for n in found if n in names)
        name = module.removesuffix(".__init__")
        graph[name] = deps - {name}
    return graph


def test_no_import_cycles_between_modules():
    graph, done, path_stack, cycles = _import_graph(), set(), [], []

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
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
