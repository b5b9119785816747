"""The lifecycle trace (spec/TRACE.md): every line parses and is an edge of the spec; block counts add up."""

from __future__ import annotations

import json

from executor import TRACE_FIELDS, read_trace
from executor.checks import random_workload, submit_all
from kvstate import load_spec

SPEC = load_spec()
EDGES = {(t.event, t.source, t.dest) for t in SPEC.transitions}


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
    lines = list(read_trace(path))
    assert len(lines) == engine.trace.lines == sum(engine.totals.events.values())
    events = {line["event"] for line in lines}
    assert {"admit", "suspend", "resume", "recompute_pause", "replay", "finish", "cancel"} <= events
    last_state: dict = {}
    for line in lines:
        assert tuple(line) == TRACE_FIELDS
        assert (line["event"], line["from"], line["to"]) in EDGES, line
        assert last_state.get(line["request_id"], SPEC.initial) == line["from"], line
        last_state[line["request_id"]] = line["to"]
        residency = SPEC.residency(line["to"])
        assert residency == "gpu" or line["gpu_blocks"] == 0, line
        assert residency == "host" or line["host_blocks"] == 0, line
        assert line["gpu_free"] + line["gpu_fenced"] + line["gpu_blocks"] <= line["gpu_capacity"] == 16
        assert line["host_free"] + line["host_fenced"] + line["host_blocks"] <= line["host_capacity"] == 6
        assert (line["done_reason"] is not None) == (line["to"] == "done")
    assert set(last_state.values()) == {"done"}
    assert sorted(last_state) == sorted(engine.scheduler.finished)


def test_iterations_are_monotonic_and_fallback_runs_trace_too(make_engine, tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, path = _run_traced(make_engine, tmp_path, gpu_blocks=16, host_blocks=6, block_size=4,
                                   simulate_host_alloc_failure=True)
    lines = list(read_trace(path))
    iterations = [line["iteration"] for line in lines]
    assert iterations == sorted(iterations)
    assert all(line["host_capacity"] == 0 for line in lines)
    assert "suspend" not in {line["event"] for line in lines}
    assert (lines[-1]["iteration"]) == engine.scheduler.iteration
