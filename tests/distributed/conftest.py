"""Helpers of the pipeline tests: one torch thread, seeded workloads, oracle outputs and a trace validator.

Every test here is marked `distributed`; the spawning ones start two gloo ranks on the CPU, bounded by
`PipelineConfig.timeout_s` so a hang fails instead of blocking CI.
"""

from __future__ import annotations

import json

import pytest
import torch

from executor import Engine, EngineConfig
from executor.checks import random_workload
from kvstate import load_spec

SPEC = load_spec()


@pytest.fixture(autouse=True, scope="session")
def _single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pressured(**overrides) -> EngineConfig:
    """A small GPU tier (16 blocks x 4 tokens) that forces preemption, with invariant checks on rank 0."""
    settings = {"device": "cpu", "gpu_blocks": 16, "host_blocks": 6, "block_size": 4, "prefill_chunk_size": 16,
                "max_num_tokens": 64, "check_invariants": True, **overrides}
    return EngineConfig(**settings)


def workload(count: int = 10, seed: int = 1) -> list[tuple[list[int], int]]:
    return random_workload(count, seed, (4, 30), (8, 24), max_tokens=64)


def references(config: EngineConfig, work) -> dict:
    """{id: Engine.reference} of each (prompt, max_new_tokens), ids = positions (single process, same weights)."""
    with Engine(EngineConfig(**{**config.__dict__, "trace_path": None, "host_blocks": 0,
                                "check_invariants": False})) as oracle:
        return {rid: oracle.reference(prompt, new, request_id=rid) for rid, (prompt, new) in enumerate(work)}


def check_trace(lines: list[dict]) -> dict:
    """Validate one rank's trace against the spec (spec/TRACE.md); returns {id: last state}.

    Uses `kvstate.checker.trace.validate_trace` when it exists; the checks below always run as well."""
    try:
        from kvstate.checker.trace import validate_trace  # written by another engineer; may not exist yet
    except ImportError:
        validate_trace = None
    if validate_trace is not None:
        report = validate_trace([json.dumps(line) for line in lines], SPEC)
        assert report.ok, report.divergence.describe()
    edges = {(t.event, t.source, t.dest) for t in SPEC.transitions}
    state: dict = {}
    last_iteration = 0
    for line in lines:
        assert (line["event"], line["from"], line["to"]) in edges, line
        assert state.get(line["request_id"], SPEC.initial) == line["from"], line
        state[line["request_id"]] = line["to"]
        residency = SPEC.residency(line["to"])
        assert residency == "gpu" or line["gpu_blocks"] == 0, line
        assert residency == "host" or line["host_blocks"] == 0, line
        assert line["gpu_free"] + line["gpu_fenced"] + line["gpu_blocks"] <= line["gpu_capacity"], line
        assert line["host_free"] + line["host_fenced"] + line["host_blocks"] <= line["host_capacity"], line
        assert line["host_capacity"] or line["to"] != "suspended", line
        assert (line["done_reason"] is not None) == (line["to"] == "done"), line
        assert line["iteration"] >= last_iteration, line
        last_iteration = line["iteration"]
    return state
