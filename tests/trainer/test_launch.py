"""Local launching: a failing rank's own error is what the caller sees, not the other ranks'
reaction to losing it."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp
from hetpilot.trainer.launch import spawn
from hetpilot.trainer.testing.ranks import _fails_on_rank


@pytest.mark.timeout(120)
def test_the_failing_ranks_own_error_is_reported() -> None:
    """The others, waiting in an all-reduce, fail too ('Connection reset by peer'); at 4
    ranks the parent often saw one of them first and reported only that (here: rank 1
    fails, and the parent reported another rank's error in 6 runs of 6 before)."""
    with pytest.raises(mp.ProcessRaisedException, match="the job's own error on rank 1"):
        spawn(_fails_on_rank, 4, (1,), timeout_s=90)
