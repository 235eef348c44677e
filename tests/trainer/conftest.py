"""Fixtures shared by the trainer tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spawned ranks import their worker function by its module name
    (``tests.trainer.test_...``); pytest's importlib mode does not put the repository
    root on ``sys.path``, so under a ``pytest`` launcher (not ``python -m pytest``) the
    ranks could not find it. This puts the root there for the test's duration."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
