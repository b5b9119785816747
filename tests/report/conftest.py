"""A small report of the packaged spec, written once for the picture and browser tests."""

from __future__ import annotations

import json

import pytest

from kvstate import load_spec


@pytest.fixture(scope="session")
def small_report(tmp_path_factory, spec_trace_lines):
    """`write_report` of `spec_trace_lines(load_spec())` (needs matplotlib)."""
    pytest.importorskip("matplotlib")
    from kvstate.report import write_report

    tmp = tmp_path_factory.mktemp("small-report")
    trace = tmp / "t.ndjson"
    trace.write_text("".join(json.dumps(line) + "\n" for line in spec_trace_lines(load_spec())))
    return write_report(trace, tmp / "out")
