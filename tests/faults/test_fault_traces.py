"""The trace of an engine run with injected faults keeps exact host conservation (spec/TRACE.md, CONS-HOST): every
fault path (a failed copy either way, a corrupt host copy, the host tier lost mid-run) moves host blocks only
through the transitions it traces, so `kvstate validate` can check the law exactly on it."""

from __future__ import annotations

import warnings

from executor import FaultPlan, HostTierFallbackWarning
from executor.checks import random_workload, submit_all
from kvstate.checker.trace import validate_trace


def test_a_faulty_run_trace_keeps_exact_host_conservation(make_engine, tmp_path):
    path = tmp_path / "faults.ndjson"
    faults = FaultPlan.of(4, copy_to_host=0.3, copy_to_gpu=0.3, corrupt_host=0.3, host_loss=[80])
    engine = make_engine(
        gpu_blocks=16, host_blocks=8, block_size=4, faults=faults, trace_path=path, verify_host_checksums=True
    )
    submit_all(engine, random_workload(14, 1, (4, 30), (4, 24)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HostTierFallbackWarning)
        engine.run()
    engine.close()
    events = engine.totals.events
    assert events["lose_host_copy"] > 0 and events["suspend"] > 0 and engine.totals.host_tier_losses == 1
    report = validate_trace(path)
    assert report.ok, report.divergence.describe()
    assert report.lines == sum(events.values())
