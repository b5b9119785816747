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
    # each stage's CPU time and loop wall, per mode and run; the note's free-core ratio is read from them
    cpu, wait, wall = (section.data[f"rank_{what}_s"] for what in ("cpu", "receive_wait", "wall"))
    for name in ("in flight", "lockstep"):
        (stages,) = cpu[name]
        assert len(stages) == 2 and all(seconds > 0 for seconds in stages)
        # a stage waits for the other within its loop; in lockstep each waits while the other computes
        assert all(0 < q < w for q, w in zip(wait[name][0], wall[name][0], strict=True))
    expected = pipeline.free_core_ratio(cpu["lockstep"][0], cpu["in flight"][0])
    assert row.note.endswith(f"with a free core per stage these CPU times give {expected:.2f}x")
    assert "; stage loops on a core/waiting for the other stage/the rest: in flight rank 0 " in row.note


def test_the_free_core_ratio_overlaps_the_stages_in_flight_only() -> None:
    from executor.bench.pipeline import free_core_ratio

    assert free_core_ratio([1.0, 1.0], [1.0, 1.0]) == 2.0  # balanced stages: in flight halves the time
    assert free_core_ratio([1.0, 3.0], [1.0, 3.0]) == pytest.approx(4 / 3)  # the slower stage bounds it
    assert free_core_ratio([1.0, 1.0], [2.0, 2.0]) == 1.0  # in flight's own cost eats the overlap
    for lockstep, flight in (([], []), ([1.0], [1.0, 1.0]), ([1.0, 1.0], [0.0, 1.0])):
        with pytest.raises(ValueError, match="one positive CPU time per stage"):
            free_core_ratio(lockstep, flight)
