"""Spec 5.6's tp_efficiency measured on the job's own layers (trainer/tpefficiency.py)."""

from __future__ import annotations

from hetpilot.planner.serde import model_from_dict
from hetpilot.trainer.examples import gpt_tp
from hetpilot.trainer.profile import profile_model
from hetpilot.trainer.tpefficiency import (
    measure_tp_efficiency,
    merged_efficiency,
    with_tp_efficiency,
)


def test_each_split_layer_gets_a_measured_efficiency_the_planner_reads() -> None:
    job = gpt_tp(blocks=2)
    eff = measure_tp_efficiency(job["layers"], job["sample"], 4, job["tp_plan"], (2, 4),
                                device="cpu", repeats=1)
    # the embedding, final norm and tied head match no pattern: only the two blocks
    assert sorted(eff) == [1, 2]
    assert all(sorted(by) == [2, 4] and all(0 < e <= 1 for e in by.values())
               for by in eff.values())
    profile = profile_model(job["layers"], job["sample"], tp_plan=job["tp_plan"])
    model = model_from_dict(with_tp_efficiency(profile, eff))
    assert model.layers[1].efficiency(2) == eff[1][2]
    assert model.layers[2].efficiency(4) == eff[2][4]
    assert model.layers[0].tp_efficiency == () and model.layers[0].efficiency(2) == 1.0
    assert "tp_efficiency" not in profile["layers"][1]  # the input profile is untouched


def test_rank_figures_merge_by_median_and_ranks_that_did_not_measure_count_nothing() -> None:
    got = merged_efficiency([{1: {2: 0.9, 4: 0.5}}, None, {1: {2: 0.7}}, {1: {2: 0.8}},
                             {3: {2: 0.6}}])
    assert got == {1: {2: 0.8, 4: 0.5}, 3: {2: 0.6}}
    assert merged_efficiency([None, None]) == {}
