"""The engine's run totals (`Engine.totals`) and its statistics from the start: per-state counts before the first
step, preemptions by path, recomputed tokens, copies and failures summed over a run (every expectation computed
from the per-step statistics and the requests, never hard-coded)."""

from __future__ import annotations

import json
import random

from executor import FaultPlan


def _submit(engine, count: int, seed: int) -> list:
    rng = random.Random(seed)
    return [
        engine.add_request([rng.randrange(512) for _ in range(rng.randint(4, 16))], rng.randint(8, 24))
        for _ in range(count)
    ]


def test_stats_count_every_state_before_the_first_step(make_engine) -> None:
    engine = make_engine(gpu_blocks=16, host_blocks=8, block_size=4)
    counts = engine.stats().requests_per_state
    assert set(counts) == {s.name for s in engine.scheduler.spec.states} and not any(counts.values())
    _submit(engine, 3, seed=1)
    stats = engine.stats()
    assert stats.iteration == 0 and stats.requests_per_state["done"] == 0
    assert stats.requests_per_state["waiting"] == 3 and stats.gpu_capacity == 16


def test_run_totals_sum_every_step_under_memory_pressure(make_engine) -> None:
    engine = make_engine(gpu_blocks=12, host_blocks=6, block_size=4)
    ids = _submit(engine, 8, seed=2)
    steps = []
    while engine.scheduler.has_unfinished:
        steps.append(engine.step())
    totals = engine.totals
    assert totals.steps == len(steps)
    assert totals.generated_tokens == sum(s.generated_tokens for s in steps) == sum(map(len, engine.outputs().values()))
    assert totals.recomputed_tokens == sum(s.recomputed_tokens for s in steps) > 0
    assert totals.preemptions == {
        "suspend": sum(s.suspended_this_iteration for s in steps),
        "recompute_pause": sum(s.recompute_paused_this_iteration for s in steps),
    }
    assert totals.preemptions["suspend"] > 0 and totals.preemptions["recompute_pause"] > 0  # both paths ran
    assert totals.migrations == totals.events["suspend"] + totals.events["resume"]  # one copy plan each
    assert totals.blocks_migrated == sum(s.blocks_migrated for s in steps) > 0
    assert totals.failures == dict.fromkeys(totals.failures, 0)
    assert engine.stats().requests_per_state["done"] == len(ids)
    doc = json.loads(json.dumps(totals.to_dict()))
    assert doc["preemptions"] == totals.preemptions and doc["steps"] == totals.steps


def test_run_totals_count_failures_by_kind(make_engine) -> None:
    engine = make_engine(gpu_blocks=12, host_blocks=6, block_size=4, faults=FaultPlan.of(3, copy_to_host=0.5))
    _submit(engine, 8, seed=2)
    engine.run()
    totals = engine.totals
    failures = totals.failures
    assert failures["failed_copies"] == totals.failed_copies == totals.faults["copy_to_host"] > 0
    assert failures["lost_host_copies"] == totals.events["lose_host_copy"] >= failures["failed_copies"]
