"""train-check: random plans on N real gloo ranks vs full-batch float64 training."""

from __future__ import annotations

import pytest
from hetpilot.trainer.check import run_check


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_train_check_matches_full_batch(ranks: int) -> None:
    lines: list[str] = []
    worst = run_check(ranks, seed=ranks, timeout_s=120, log=lines.append)
    assert worst <= 1e-9, "\n".join(lines)
    text = "\n".join(lines)
    for schedule in ("gpipe", "1f1b", "custom"):
        assert schedule in text
