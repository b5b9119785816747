"""Iteration statistics (STATS-COUNT): suspended and recompute-paused requests and their KV tokens,
recomputed tokens during replay, and a JSON-safe dict. Every expectation is computed from the scheduler's own
request records and outputs, never hard-coded."""

from __future__ import annotations

import json
import random

import pytest

from kvstate.config import SchedulerConfig
from kvstate.errors import InvariantViolation
from kvstate.output import planned_chunks
from kvstate.scheduler import Scheduler, StateTally
from kvstate.sim import SimExecutor

BLOCK_BYTES = 4096


def scenario(host_blocks: int, pipeline_stages: int = 1) -> tuple[Scheduler, SimExecutor]:
    """GPU 15 blocks of 1 token, chunks of 6: pass 2 preempts the two tail requests (see test_scheduler)."""
    sched = Scheduler(
        SchedulerConfig(
            gpu_blocks=15,
            host_blocks=host_blocks,
            block_size=1,
            prefill_chunk_size=6,
            max_num_tokens=14,
            pipeline_stages=pipeline_stages,
            block_bytes=BLOCK_BYTES,
        )
    )
    sched.submit(list(range(1, 14)), 1, request_id="p")
    sched.submit(list(range(21, 29)), 2, request_id="x")
    sched.submit([31, 32, 33, 34, 35], 2, request_id="y")
    return sched, SimExecutor(sched)


def in_state(sched: Scheduler, state: str) -> list:
    return [r for r in sched.requests.values() if r.state == state]


def test_pressured_step_counts_suspended_and_recompute_paused_requests_and_their_tokens() -> None:
    sched, ex = scenario(host_blocks=6)
    ex.step()
    out = ex.step()
    stats = sched.stats()
    suspended, paused = in_state(sched, "suspended"), in_state(sched, "recompute_paused")
    assert suspended and paused  # the step was pressured both ways
    assert stats.iteration == sched.iteration
    assert stats.requests_per_state["suspended"] == len(suspended) == stats.num_suspended
    assert stats.requests_per_state["recompute_paused"] == len(paused) == stats.num_recompute_paused
    assert stats.requests_per_state["running"] == len(in_state(sched, "running"))
    assert sum(stats.requests_per_state.values()) == len(sched.requests) + len(sched.finished)
    assert stats.suspended_kv_tokens == sum(r.num_computed_tokens for r in suspended) > 0
    assert stats.recompute_paused_tokens_to_replay == sum(len(r.prefill_tokens) for r in paused) > 0
    assert stats.suspended_this_iteration == len(out.suspended)
    assert stats.recompute_paused_this_iteration == len(out.recompute_paused)
    assert stats.preemptions == len(out.suspended) + len(out.recompute_paused)
    blocks = sum(p.num_blocks for p in out.migrations)
    assert stats.blocks_migrated == blocks > 0 and stats.bytes_migrated == blocks * BLOCK_BYTES
    usage = sched.pool.usage()
    assert stats.host_blocks_used == usage["host_owned"] + usage["host_fenced"] > 0
    assert stats.gpu_blocks_used == usage["gpu_owned"] + usage["gpu_fenced"]
    assert (stats.gpu_capacity, stats.host_capacity) == (15, 6)


def test_requests_awaiting_consensus_count_as_recompute_paused() -> None:
    sched, ex = scenario(host_blocks=0, pipeline_stages=2)
    ex.step()
    out = ex.step()
    awaiting = in_state(sched, "awaiting_consensus")
    assert awaiting and out.recompute_paused
    stats = sched.stats()
    assert stats.requests_per_state["awaiting_consensus"] == len(awaiting)
    assert stats.num_recompute_paused == len(awaiting) + len(in_state(sched, "recompute_paused"))
    assert stats.suspended_kv_tokens == 0 and stats.num_suspended == 0


def test_recomputed_tokens_equal_the_replay_chunk_tokens() -> None:
    sched, ex = scenario(host_blocks=0)
    replay_steps = 0
    total = 0
    while sched.has_unfinished:
        out = ex.step()
        stats = sched.stats()
        replayed = sum(out.chunk_tokens[r.request_id] for r in out.replay)
        assert stats.recomputed_tokens == replayed
        assert stats.scheduled_tokens == out.num_tokens
        if out.replay:
            replay_steps += 1
            assert stats.recomputed_tokens > 0
            assert stats.scheduled_tokens >= stats.recomputed_tokens
        total += stats.recomputed_tokens
    assert replay_steps > 0
    assert total == sum(r.num_recomputed_tokens for r in sched.finished.values()) > 0


def test_generated_tokens_count_the_tokens_produced_in_the_step() -> None:
    sched, ex = scenario(host_blocks=6)
    while sched.has_unfinished:
        before = {rid: len(r.generated) for rid, r in sched.requests.items()}
        ex.step()
        after = {rid: len(r.generated) for rid, r in {**sched.requests, **sched.finished}.items() if rid in before}
        assert sched.stats().generated_tokens == sum(after[rid] - before[rid] for rid in before)


@pytest.mark.parametrize("host_blocks", [6, 0])
def test_stats_to_dict_is_json_safe(host_blocks: int) -> None:
    sched, ex = scenario(host_blocks)
    ex.step()
    ex.step()
    stats = sched.stats()
    d = stats.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["requests_per_state"] == stats.requests_per_state
    assert d["suspended_kv_tokens"] == stats.suspended_kv_tokens
    d["requests_per_state"]["running"] = -1  # the dict is a copy: the stats stay as they were
    assert stats.requests_per_state["running"] != -1


def test_requests_per_state_are_counted_on_transitions_and_checked_against_a_recount() -> None:
    """The per-state counts are kept by transitions (no walk per step); `check_invariants` recounts (STATS-COUNT)."""
    sched, ex = scenario(host_blocks=6)
    while sched.has_unfinished:
        ex.step()
        recount = {state: len(in_state(sched, state)) for state in sched.active_per_state}
        assert {s: n for s, n in sched.stats().requests_per_state.items() if s in recount} == recount
    sched.active_per_state["running"] += 1  # a planted drift
    with pytest.raises(InvariantViolation) as info:
        sched.check_invariants()
    assert info.value.invariant_id == "STATS-COUNT"


@pytest.mark.parametrize("lifecycle", ["machine", "compiled"])
def test_steady_decode_fires_no_lifecycle_event(lifecycle: str) -> None:
    """Once every request decodes, a step (schedule, chunk planning, completion) changes no state, whichever
    lifecycle implementation runs: what the per-step cost target relies on."""
    fired = []
    sched = Scheduler(
        SchedulerConfig(
            gpu_blocks=64, block_size=4, max_batch_size=8, max_num_tokens=64, prefill_chunk_size=4, lifecycle=lifecycle
        ),
        on_transition=lambda request, transition: fired.append(transition.event),
    )
    for i in range(8):
        sched.submit(list(range(1 + i % 4)), 20)
    out = sched.schedule()
    sched.complete_step(out, {c.request.request_id: 1 for c in planned_chunks(out, sched.pool) if c.produces_token})
    assert fired == ["admit"] * 8
    for _ in range(10):
        out = sched.schedule()
        chunks = planned_chunks(out, sched.pool)
        assert len(chunks) == 8 and all(c.produces_token and len(c.tokens) == 1 for c in chunks)
        sched.complete_step(out, {c.request.request_id: 1 for c in chunks})
        sched.check_invariants(out)
    assert fired == ["admit"] * 8


class SkipsLandedSteps(StateTally):
    """Planted: a step that lands on a preempted request changes its tokens, and the tally misses it."""

    def changed(self, request, before) -> None:
        pass


@pytest.mark.parametrize("tally", [StateTally, SkipsLandedSteps])
def test_steps_landing_on_preempted_requests_keep_the_tally_equal_to_a_recount(tally: type[StateTally]) -> None:
    """With two micro-batches in flight a decode step can land after its request was suspended or held for
    consensus: its tokens change without a transition. `SimExecutor` recounts (`check_invariants`) after every
    pass and every landing; the tally follows, and a tally that misses those changes is caught (STATS-COUNT)."""
    sched = Scheduler(
        SchedulerConfig(
            gpu_blocks=15, host_blocks=6, block_size=1, prefill_chunk_size=6, max_num_tokens=14, pipeline_stages=2
        )
    )
    sched.tally = tally(sched.tally.counts, sched.tally.held)
    rng = random.Random(0)
    for _ in range(12):
        sched.submit([rng.randrange(100) for _ in range(rng.randrange(1, 8))], rng.randrange(2, 8))
    executor = SimExecutor(sched, micro_batches=2)
    if tally is StateTally:
        assert len(executor.run()) == 12
        assert sched.tally.to_dict() == sched.tally.recount([]).to_dict()  # nothing active: all zero
        return
    with pytest.raises(InvariantViolation) as info:
        executor.run()
    assert info.value.invariant_id == "STATS-COUNT"


def test_stats_before_the_first_step_count_every_state() -> None:
    """Before any iteration completes, `stats()` describes the requests as they are, every state present."""
    sched, _ = scenario(host_blocks=6)
    stats = sched.stats()
    assert stats.iteration == 0 and set(stats.requests_per_state) == {s.name for s in sched.spec.states}
    assert stats.requests_per_state["waiting"] == 3 and stats.requests_per_state["done"] == 0
    assert (stats.gpu_capacity, stats.host_capacity, stats.gpu_blocks_used) == (15, 6, 0)


def test_stats_describe_the_iteration_as_it_ended_even_when_read_after_later_events() -> None:
    """`stats()` is built when first read, from figures taken when the iteration completed: a cancel or a
    submission after `complete_step` does not show in it, and reading it twice gives the same value; the next
    completed iteration shows them."""
    sched, ex = scenario(host_blocks=6)
    ex.step()
    out = ex.step()
    running = len(in_state(sched, "running"))
    used, finished = sched.pool.gpu.capacity - sched.pool.gpu.num_free, len(sched.finished)
    victim = next(r for r in sched.requests.values() if r.state == "running")
    sched.cancel(victim.request_id)
    sched.submit([7, 8], 1, request_id="late")
    stats = sched.stats()
    assert stats.requests_per_state["running"] == running and "late" in sched.requests
    assert stats.requests_per_state["waiting"] == len(in_state(sched, "waiting")) - 1
    assert stats.requests_per_state["done"] == finished < len(sched.finished)
    assert stats.gpu_blocks_used == used > sched.pool.gpu.capacity - sched.pool.gpu.num_free
    assert stats.scheduled_tokens == sum(out.chunk_tokens.values())
    assert sched.stats() is stats
    ex.step()
    after = sched.stats()
    assert after.iteration == stats.iteration + 1
    assert after.requests_per_state["done"] == len(sched.finished)
