"""The shape of the whole package, read from its source with ``ast``: no import
cycle among the ``hetpilot.*`` modules (imports inside functions and under ``if
TYPE_CHECKING:`` count: a cycle held together that way still ties the modules to
each other), no module over 700 lines, no class over 450 lines; and the daemon, the
agents and the client do not import torch at import time.

Modules are named as pyproject's setuptools ``package-dir`` maps folders onto
``hetpilot.*``; the generated protobuf code (``hetpilot.v1``) is left out.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATED = {"hetpilot.v1"}
MAX_MODULE_LINES = 700
MAX_CLASS_LINES = 450


def _package_dirs() -> dict[str, Path]:
    """Each package's import name and folder, as pyproject maps them."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping: dict[str, str] = setup["package-dir"]
    return {name: ROOT / mapping.get(name, name.replace(".", "/"))
            for name in setup["packages"] if name not in GENERATED}


def _modules() -> dict[str, Path]:
    """Every module of the package by import name (a package by its ``__init__.py``)."""
    out: dict[str, Path] = {}
    for package, folder in _package_dirs().items():
        for path in sorted(folder.glob("*.py")):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` (module ``name``) imports anywhere in its
    body, functions, classes and ``TYPE_CHECKING`` blocks too. ``from P import x``
    counts ``P.x`` when that is a module, else ``P`` (a name from P's ``__init__``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def resolve(target: str) -> str:
        while target and target not in known:  # a name imported from a module
            target = target.rpartition(".")[0]
        return target

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
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if sub in known else base)
        found.update(t for t in map(resolve, targets) if t and t != name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(path, name, known) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated), or None."""
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as exc:
        return list(exc.args[1])
    return None


def _sizes(path: Path) -> tuple[int, list[tuple[str, int]]]:
    """The module's lines and each class's (nested ones too), by qualified name."""
    source = path.read_text()
    classes: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                assert child.end_lineno is not None
                classes.append((prefix + child.name, child.end_lineno - child.lineno + 1))
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source, str(path)), "")
    return len(source.splitlines()), classes


# -- the checker itself -------------------------------------------------------------


def test_the_cycle_finder_finds_a_cycle_and_only_a_cycle() -> None:
    cycle = _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"}
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_imports_in_functions_type_checking_relative_and_absolute_are_seen(
        tmp_path: Path) -> None:
    known = {"hetpilot.daemon", "hetpilot.daemon.x", "hetpilot.daemon.y", "hetpilot.daemon.z",
             "hetpilot.daemon.w", "hetpilot.planner", "hetpilot.planner.model",
             "hetpilot.trainer.testing.jobs"}
    probe = tmp_path / "probe.py"
    probe.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .x import A\n"
                     "def f():\n    from hetpilot.daemon import y\n    import hetpilot.daemon.z\n"
                     "class C:\n    def g(self):\n        from . import w\n"
                     "        from ..planner.model import Job\n"
                     "from hetpilot.planner import Plan\n"
                     "from hetpilot.trainer.testing.jobs import bn_tiny\n")
    assert _imports(probe, "hetpilot.daemon.probe", known) == known - {"hetpilot.daemon"}
    package = tmp_path / "__init__.py"
    package.write_text("from .x import A\nfrom . import y\n")
    assert _imports(package, "hetpilot.daemon", known) == {"hetpilot.daemon.x",
                                                           "hetpilot.daemon.y"}


def test_a_cycle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from .a import g\n")
    known = {"p.a", "p.b"}
    graph = {f"p.{m}": _imports(tmp_path / f"{m}.py", f"p.{m}", known) for m in "ab"}
    assert _cycle(graph) is not None


def test_sizes_count_classes_nested_and_whole(tmp_path: Path) -> None:
    probe = tmp_path / "m.py"
    probe.write_text("class A:\n    x = 1\n\n    class B:\n        y = 2\n\n\ndef f():\n"
                     "    class C:\n        pass\n")
    assert _sizes(probe) == (10, [("A", 5), ("A.B", 2), ("C", 2)])


# -- the house ------------------------------------------------------------------------


def test_every_package_folder_is_read() -> None:
    packages = {name.split(".")[1] for name in _package_dirs() if name.count(".")}
    assert packages >= {"planner", "sim", "daemon", "agents", "trainer", "client", "adapt",
                        "demo"}
    graph = _graph()
    assert {"hetpilot.cli", "hetpilot.daemon.server", "hetpilot.trainer.runtime",
            "hetpilot.trainer.testing.jobs"} <= set(graph)
    assert "hetpilot.daemon.records" in graph["hetpilot.daemon.servicers"]


def test_no_import_cycle() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_trainer_does_not_import_its_test_fixtures() -> None:
    """``hetpilot.trainer.testing`` holds fixtures for tests and benches only."""
    leaks = {name: sorted(t for t in deps if t.startswith("hetpilot.trainer.testing"))
             for name, deps in _graph().items()
             if name.startswith("hetpilot.trainer") and
             not name.startswith("hetpilot.trainer.testing")}
    assert not {k: v for k, v in leaks.items() if v}


def test_no_module_or_class_too_long() -> None:
    too_long = []
    for name, path in _modules().items():
        lines, classes = _sizes(path)
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{name}: {lines} lines (module)")
        too_long += [f"{name}.{cls}: {n} lines (class)" for cls, n in classes
                     if n > MAX_CLASS_LINES]
    assert not too_long, "\n".join(too_long)


@pytest.mark.parametrize("modules", [
    ("hetpilot.daemon.server", "hetpilot.daemon.controlplane", "hetpilot.daemon.cli"),
    ("hetpilot.agents.agent", "hetpilot.agents.launcher", "hetpilot.agents.cli"),
    ("hetpilot.client.cli", "hetpilot.client.nodes"),
])
def test_the_control_plane_does_not_import_torch(modules: tuple[str, ...]) -> None:
    """Importing these leaves torch out: they start fast and run where torch is not (the
    planner's own check, torch and grpc: tests/planner/test_search.py)."""
    code = (f"import sys\nfor m in {modules!r}: __import__(m)\n"
            "print([m for m in ('torch',) if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"{modules} import torch"
