"""The package's layers: imports point one way (faces -> api -> decoders -> runtime; compiled plugs into the runtime
through a protocol), and no two modules import each other, directly or around a loop."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fafo_cli"

# what each layer may import from the package (besides itself and the shared leaves: errors, files, config, and the
# .gguf file format's reader, which the conversion and the packing of blocks share)
ALLOWED = {
    "runtime": set(),
    "compiled": {"runtime"},
    "decoders": {"runtime"},
}
LEAVES = {"errors", "files", "config", "gguf_header"}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every module's imports of other package modules, at any depth of the file (function-level ones too)."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")
                base = base[:len(base) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
                # `from pkg import module` names the module; `from module import name` the module itself
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    found.add(sub if sub in modules else target)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or around a loop (Tarjan's strongly connected
    components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return cycles


def _wrong_direction(graph: dict[str, set[str]], layer: str) -> set[tuple[str, str]]:
    """The imports of `layer`'s modules that point at a layer it may not import."""
    return {(module, target) for module, targets in graph.items() if _layer(module) == layer
            for target in targets
            if _layer(target) not in ALLOWED[layer] | LEAVES | {layer}}


def test_no_import_cycles():
    assert _cycles(_imports()) == []


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layers_import_only_downwards(layer):
    assert _wrong_direction(_imports(), layer) == set()


def test_the_checks_see_a_cycle_and_a_wrong_direction(tmp_path, monkeypatch):
    """The graph really holds the imports the tests judge (a relative import of a module, a function-level one),
    and the checks flag a cycle and an upward import in a package that has them."""
    graph = _imports()
    assert "fafo_cli.runtime.cache" in graph["fafo_cli.runtime.model"]
    assert "fafo_cli.runtime.session" in graph["fafo_cli.decoders.vanilla"]
    assert any(_layer(t) == "decoders" for t in graph["fafo_cli.api"])
    package = tmp_path / "fafo_cli"
    for path, text in {"__init__.py": "", "runtime/__init__.py": "", "decoders/__init__.py": "",
                       "runtime/cache.py": "def f():\n    from ..decoders import draft\n",  # upward, in a function
                       "decoders/draft.py": "from ..runtime import cache\n"}.items():  # and back: a cycle
        (package / path).parent.mkdir(parents=True, exist_ok=True)
        (package / path).write_text(text)
    monkeypatch.setitem(globals(), "PACKAGE", package)
    fake = _imports()
    assert _cycles(fake) == [["fafo_cli.decoders.draft", "fafo_cli.runtime.cache"]]
    assert _wrong_direction(fake, "runtime") == {("fafo_cli.runtime.cache", "fafo_cli.decoders.draft")}
    assert _wrong_direction(fake, "decoders") == set()
