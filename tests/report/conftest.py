"""A small report of the packaged spec, written once for the picture and browser tests."""

from __future__ import annotations

import json

import pytest

from kvstate import load_spec
from kvstate.trace import TRACE_FIELDS


def spec_trace_lines(spec) -> list[dict]:
    """A two-line trace: the spec's first transition, then a terminal edge out of its destination."""
    first = spec.transitions[0]
    end = next(t for t in spec.transitions if t.source == first.dest and spec.state_by_name[t.dest].terminal)
    common = {
        "gpu_blocks": 0,
        "host_blocks": 0,
        "host_free": 4,
        "gpu_fenced": 0,
        "host_fenced": 0,
        "gpu_capacity": 8,
        "host_capacity": 4,
        "generated": 0,
        "computed_tokens": 0,
    }
    lines = [
        {
            "iteration": 1,
            "request_id": "a",
            "event": first.event,
            "from": first.source,
            "to": first.dest,
            "gpu_free": 6,
            "done_reason": None,
            **common,
        },
        {
            "iteration": 4,
            "request_id": "a",
            "event": end.event,
            "from": end.source,
            "to": end.dest,
            "gpu_free": 8,
            "done_reason": "finished",
            **common,
        },
    ]
    return [{key: line[key] for key in TRACE_FIELDS} for line in lines]  # the trace's field order


@pytest.fixture(scope="session")
def small_report(tmp_path_factory):
    """`write_report` of `spec_trace_lines(load_spec())` (needs matplotlib)."""
    pytest.importorskip("matplotlib")
    from kvstate.report import write_report

    tmp = tmp_path_factory.mktemp("small-report")
    trace = tmp / "t.ndjson"
    trace.write_text("".join(json.dumps(line) + "\n" for line in spec_trace_lines(load_spec())))
    return write_report(trace, tmp / "out")
