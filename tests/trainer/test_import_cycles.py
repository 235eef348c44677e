"""No import cycle among the trainer's modules, imports inside functions included."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

TRAINER = Path(__file__).resolve().parents[2] / "trainer"
PACKAGE = "hetpilot.trainer"


def _module_name(path: Path) -> str:
    parts = path.relative_to(TRAINER).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The trainer modules ``path`` imports anywhere in its body (functions, classes and
    ``TYPE_CHECKING`` blocks too)."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            while target and target not in known:  # a name imported from a module
                target = target.rpartition(".")[0]
            if target and target != name and target != PACKAGE:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in TRAINER.rglob("*.py")}
    known = set(paths)
    return {name: _imports(path, name, known) for name, path in paths.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated), or None."""
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as exc:
        return list(exc.args[1])
    return None


def test_the_check_finds_a_cycle_through_a_function_level_import() -> None:
    cycle = _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"}
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_function_level_and_relative_imports_are_seen(tmp_path: Path) -> None:
    source = tmp_path / "mod.py"
    source.write_text("def f():\n    from .runtime import Trainer\n    from . import plans\n"
                      "from hetpilot.trainer.testing.jobs import bn_tiny\n")
    known = {f"{PACKAGE}.runtime", f"{PACKAGE}.plans", f"{PACKAGE}.testing.jobs"}
    assert _imports(source, f"{PACKAGE}.mod", known) == known


def test_trainer_has_no_import_cycle() -> None:
    graph = _graph()
    assert f"{PACKAGE}.runtime" in graph and f"{PACKAGE}.testing.jobs" in graph
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
