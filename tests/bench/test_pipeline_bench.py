"""The `pipeline` group: in flight beside lockstep on two gloo stages, outputs checked (structure only)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.distributed


def test_the_pipeline_group_alternates_runs_and_checks_outputs() -> None:
    pytest.importorskip("torch")
    from executor.bench import pipeline

    messages: list[str] = []
    section = pipeline.run(quick=True, progress=messages.append)
    (row,) = section.rows
    assert section.data["outputs_equal"] and "outputs equal across runs and to the oracle" in row.note
    assert set(section.data["tokens_per_s"]) == {"in flight", "lockstep"}
    assert all(len(rates) == 1 and rates[0] > 0 for rates in section.data["tokens_per_s"].values())
    assert row.value > 0 and row.baseline > 0 and section.data["micro_batches"] == 2
    assert messages[:2] == ["repeat 1/1: in flight", "repeat 1/1: lockstep"] and messages[-1] == "checking outputs"
