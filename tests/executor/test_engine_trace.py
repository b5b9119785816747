"""The lifecycle trace (spec/TRACE.md) written by the engine passes the library validator (`kvstate validate`)."""

from __future__ import annotations

import json

from executor.checks import random_workload, submit_all
from kvstate import load_spec
from kvstate.checker.trace import validate_trace
from kvstate.trace import read_trace

SPEC = load_spec()


def _run_traced(make_engine, tmp_path, **overrides):
    path = tmp_path / "trace.ndjson"
    engine = make_engine(trace_path=path, **overrides)
    submit_all(engine, random_workload(12, 1, (4, 30), (8, 24)))
    for _ in range(6):
        engine.step()
    engine.cancel(next(iter(engine.scheduler.requests)))
    engine.run()
    engine.close()
    return engine, path


def test_every_line_is_a_spec_edge_with_consistent_counts(make_engine, tmp_path):
    engine, path = _run_traced(make_engine, tmp_path, gpu_blocks=16, host_blocks=6, block_size=4)
    raw = path.read_text().splitlines()
    assert raw and all(json.loads(line) is not None for line in raw)
    report = validate_trace(path, SPEC, require_done=True)  # edges, from-states, residency, counts, done_reason
    assert report.ok, report.divergence.describe()
    assert report.lines == len(raw) == engine.trace.lines == sum(engine.totals.events.values())
    expected = {"admit", "suspend", "offload", "resume", "recompute_pause", "replay", "finish", "cancel"}
    assert expected <= set(report.transitions)
    assert {(line["gpu_capacity"], line["host_capacity"]) for line in read_trace(path)} == {(16, 6)}
    assert set(report.final_states.values()) == {"done"}
    assert sorted(report.final_states) == sorted(engine.scheduler.finished)


def test_iterations_are_monotonic_and_fallback_runs_trace_too(make_engine, tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, path = _run_traced(
            make_engine, tmp_path, gpu_blocks=16, host_blocks=6, block_size=4, simulate_host_alloc_failure=True
        )
    report = validate_trace(path, SPEC)  # iterations non-decreasing; NO-HOST-NO-OFFLOAD
    assert report.ok, report.divergence.describe()
    lines = list(read_trace(path))
    assert all(line["host_capacity"] == 0 for line in lines)
    assert "suspend" not in report.transitions and "offload" not in report.transitions
    assert (lines[-1]["iteration"]) == engine.scheduler.iteration


def test_an_eager_run_traces_an_offload_with_every_suspension(make_engine, tmp_path):
    """Under the `eager` offload policy each suspension's blocks move at once: its trace has an `offload` line of
    the same request in the same iteration right after every `suspend` (the host tier has room for them here)."""
    from executor import offload_spec

    spec = offload_spec("eager")
    engine, path = _run_traced(make_engine, tmp_path, gpu_blocks=16, host_blocks=64, block_size=4, spec=spec)
    report = validate_trace(path, spec, require_done=True)
    assert report.ok, report.divergence.describe()
    lines = list(read_trace(path))
    suspends = [i for i, line in enumerate(lines) if line["event"] == "suspend"]
    assert suspends
    for i in suspends:
        after = lines[i + 1]
        assert (after["event"], after["request_id"], after["iteration"]) == (
            "offload",
            lines[i]["request_id"],
            lines[i]["iteration"],
        )
    assert engine.totals.resumed_without_copy == 0 and engine.totals.blocks_relocked == 0
