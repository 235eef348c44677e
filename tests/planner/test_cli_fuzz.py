"""Mutated contract files never crash `hetpilot plan`, `evaluate` or `sim`: each answer is
exit 0 with JSON on stdout (no NaN or Infinity), or exit 2/3 with one line on stderr.

The mutations replace one or two fields of the shipped examples with hostile values
(null, negatives, 1e308, 1e-320, NaN, strings, lists, 2**70, ...), delete a field or
repeat a list item. This sweep found a 1e308 GFLOP layer printed as `Infinity`, and
tracebacks from a 2**70 global batch, a 1e308 TFLOP/s device in a scenario and a list
given as a host."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import random
from pathlib import Path
from typing import Any

import pytest

from hetpilot.cli import main

ROOT = Path(__file__).resolve().parents[2]
HOSTILE: list[Any] = [None, -1, 0, 1e308, -1e308, float("nan"), float("inf"), "x", "", [], {},
                      True, 2**70, 0.5, [1, 2], {"a": 1}, -0.0, 1e-320]


def _paths(obj: Any, pre: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [pre] if pre else []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        out += _paths(value, (*pre, key))
    return out


def _mutate(obj: Any, rng: random.Random) -> Any:
    obj = copy.deepcopy(obj)
    path = rng.choice(_paths(obj))
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    roll = rng.random()
    if roll < 0.15 and isinstance(parent, dict):
        del parent[path[-1]]
    elif roll < 0.2 and isinstance(parent, list):
        parent.append(copy.deepcopy(parent[path[-1]]))
    else:
        parent[path[-1]] = rng.choice(HOSTILE)
    return obj


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
    return rc, out.getvalue(), err.getvalue()


BASE = {name: json.loads((ROOT / "examples" / f"{name}.json").read_text())
        for name in ("cluster", "model", "plan", "scenario")}


def _answers(tmp_path: Path, files: dict[str, Any], which: str, command: str, where: str
             ) -> int:
    """Run ``command`` on ``files``; assert the answer's shape; return its exit code."""
    args = {name: str(tmp_path / f"{name}.json") for name in files}
    for name, value in files.items():
        Path(args[name]).write_text(json.dumps(value))
    argv = {"sim": ["sim", "--scenario", args["scenario"]],
            "evaluate": ["evaluate", "--cluster", args["cluster"], "--model", args["model"],
                         "--plan", args["plan"]],
            "plan": ["plan", "--cluster", args["cluster"], "--model", args["model"],
                     "--batch", "32", "--microbatch", "4"]}[command]
    rc, out, err = _run(argv)  # an exception fails the test with its traceback
    where = f"{where}: {command} of a mutated {which}: {json.dumps(files[which])[:400]}"
    assert rc in (0, 2, 3), (where, rc, err[-500:])
    if rc:
        assert err.strip() and "\n" not in err.strip(), (where, err[-500:])
    elif command != "sim":
        json.loads(out, parse_constant=lambda c: pytest.fail(f"{where}: {c} in the output"))
    return rc


@pytest.mark.parametrize(("which", "path", "value", "command"), [
    ("model", ("layers", 6, "bwd_gflop"), 1e308, "evaluate"),  # printed Infinity
    ("model", ("layers", 2, "bwd_gflop"), 1e308, "plan"),
    ("cluster", ("network", "host_links", 0, "gbps"), 1e-320, "evaluate"),
    ("plan", ("groups", 0, "samples"), 1e308, "evaluate"),  # OverflowError
    ("scenario", ("job", "global_batch"), 2**70, "sim"),  # OverflowError
    ("scenario", ("cluster", "devices", 0, "tflops"), 1e308, "sim"),  # OverflowError
    ("scenario", ("events", 1, "hosts", 0), [1, 2], "sim"),  # TypeError: unhashable
])
def test_hostile_values_found_by_the_sweep_are_refused(tmp_path: Path, which: str,
                                                       path: tuple[Any, ...], value: Any,
                                                       command: str) -> None:
    files = copy.deepcopy(BASE)
    parent = files[which]
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    assert _answers(tmp_path, files, which, command, "/".join(map(str, path))) == 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", [11, 12])
def test_mutated_inputs_get_an_answer_or_a_one_line_error(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    for case in range(100):
        which = rng.choice(sorted(BASE))
        files = copy.deepcopy(BASE)
        for _ in range(1 + (rng.random() < 0.3)):
            files[which] = _mutate(files[which], rng)
        command = ("sim" if which == "scenario" else "evaluate"
                   if which == "plan" or rng.random() < 0.5 else "plan")
        _answers(tmp_path, files, which, command, f"case {case}")
