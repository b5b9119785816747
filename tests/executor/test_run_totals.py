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
    # one copy plan per offload, and per resume that found host blocks (the others re-lock GPU blocks, no copy)
    assert totals.migrations == totals.events["offload"] + totals.events["resume"] - totals.resumed_without_copy
    assert totals.blocks_migrated == sum(s.blocks_migrated for s in steps) > 0
    assert totals.blocks_offloaded == sum(s.blocks_offloaded for s in steps) > 0
    assert totals.blocks_onboarded == sum(s.blocks_onboarded for s in steps) > 0
    assert totals.blocks_offloaded + totals.blocks_onboarded == totals.blocks_migrated
    assert 0 <= totals.resumed_without_copy <= totals.events["resume"]
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


def test_resumes_without_a_copy_and_relocked_blocks_match_what_suspended_requests_held(make_engine) -> None:
    """Counted independently: between two steps, a suspended request holds some blocks on the GPU and some on the
    host; if it is running after the next step, that step resumed it, re-locking the GPU ones with no copy and
    copying the host ones up (a request with a copy in flight is not resumed, so the blocks held between the steps
    are those the resume found)."""
    engine = make_engine(gpu_blocks=12, host_blocks=6, block_size=4)
    _submit(engine, 8, seed=2)
    running = engine.scheduler.spec.role("active")
    without = relocked = onboarded = 0
    while engine.scheduler.has_unfinished:
        held = {r.request_id: (r.num_gpu_blocks, r.num_host_blocks) for r in engine.scheduler.suspended}
        engine.step()
        for rid, (gpu, host) in held.items():
            if rid in engine.scheduler.requests and engine.scheduler.get(rid).state == running:
                without += host == 0
                relocked += gpu
                onboarded += host
    totals = engine.totals
    assert (totals.resumed_without_copy, totals.blocks_relocked) == (without, relocked)
    assert relocked > 0 and totals.blocks_onboarded == onboarded
