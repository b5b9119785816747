"""Helpers of the pipeline tests: one torch thread, seeded workloads, oracle outputs and a trace validator.

Every test here is marked `distributed`; the spawning ones start two gloo ranks on the CPU, bounded by
`PipelineConfig.timeout_s` so a hang fails instead of blocking CI.
"""

from __future__ import annotations

import json
from dataclasses import replace

from executor import Engine, EngineConfig
from executor.checks import random_workload
from executor.pytest_fixtures import single_thread_torch
from kvstate import SchedulerConfig, load_spec
from kvstate.checker import validate_trace

SPEC = load_spec()
__all__ = ["SPEC", "check_trace", "pressured", "references", "single_thread_torch", "workload"]


def pressured(host_blocks: int = 6, **overrides) -> EngineConfig:
    """A small GPU tier (16 blocks x 4 tokens) that forces preemption, with invariant checks on rank 0;
    `overrides` are EngineConfig fields."""
    scheduler = SchedulerConfig(
        gpu_blocks=16, host_blocks=host_blocks, block_size=4, prefill_chunk_size=16, max_num_tokens=64
    )
    return EngineConfig(**{"scheduler": scheduler, "device": "cpu", "check_invariants": True, **overrides})


def workload(count: int = 10, seed: int = 1) -> list[tuple[list[int], int]]:
    return random_workload(count, seed, (4, 30), (8, 24), max_tokens=64)


def references(config: EngineConfig, work) -> dict:
    """{id: Engine.reference} of each (prompt, max_new_tokens), ids = positions (single process, same weights)."""
    oracle_config = replace(
        config, trace_path=None, check_invariants=False, scheduler=replace(config.scheduler, host_blocks=0)
    )
    with Engine(oracle_config) as oracle:
        return {rid: oracle.reference(prompt, new, request_id=rid) for rid, (prompt, new) in enumerate(work)}


def check_trace(lines: list[dict]) -> dict:
    """Validate one rank's trace against the spec with `kvstate validate`'s library; returns {id: last state}."""
    report = validate_trace([json.dumps(line) for line in lines], SPEC)
    assert report.ok, report.divergence.describe()
    return dict(report.final_states)
