"""The daemon's modules import each other without a cycle: every import counts,
those inside functions and under ``if TYPE_CHECKING:`` too (a cycle held
together that way still ties the modules to each other)."""

from __future__ import annotations

import ast
from pathlib import Path

DAEMON = Path(__file__).resolve().parents[2] / "daemon"
PACKAGE = "hetpilot.daemon"


def _imports(path: Path) -> set[str]:
    """The daemon modules ``path`` imports anywhere in its body (by module name)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: daemon/ is a flat package
                base = PACKAGE if node.level == 1 else ""
                module = f"{base}.{node.module}" if node.module else base
                # `from . import convert` names modules
                names = [module] + [f"{module}.{a.name}" for a in node.names]
            else:
                module = node.module or ""
                names = [module] + [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith(PACKAGE + "."):
                found.add(name[len(PACKAGE) + 1:].split(".")[0])
    return found


def _graph() -> dict[str, set[str]]:
    modules = {p.stem: p for p in DAEMON.glob("*.py") if p.stem != "__init__"}
    return {m: _imports(p) & set(modules) - {m} for m, p in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_the_checker_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_imports_inside_functions_and_type_checking(tmp_path: Path) -> None:
    graph = _graph()
    assert "servicers" in graph and "records" in graph["servicers"]
    probe = tmp_path / "probe.py"
    probe.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .x import A\n"
                     "def f():\n    from hetpilot.daemon import y\n    import hetpilot.daemon.z\n")
    assert _imports(probe) >= {"x", "y", "z"}


def test_daemon_modules_import_without_a_cycle() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "daemon import cycle: " + " -> ".join(cycle or [])
