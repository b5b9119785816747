"""The per-step hot paths: the column form of chunk planning, the plain `state` attribute the lifecycle
writes, and the decode fast path of `schedule()` / `complete_step()`. Every expectation is derived from the
scheduler's own records or from the general (row by row) reading of the same data."""

from __future__ import annotations

import pytest

from kvstate.config import SchedulerConfig
from kvstate.lifecycle import make_lifecycle
from kvstate.output import PlannedBatch, PlannedChunk, planned_chunks
from kvstate.request import STATE_ATTRIBUTE, new_request
from kvstate.scheduler import Scheduler


def mixed_scheduler(lifecycle: str = "compiled") -> Scheduler:
    """Prefilling, decoding and (after a few steps) block-crossing requests in one batch, with memory pressure."""
    sched = Scheduler(
        SchedulerConfig(
            gpu_blocks=24, block_size=4, max_batch_size=8, max_num_tokens=20, prefill_chunk_size=4, lifecycle=lifecycle
        )
    )
    for i in range(8):
        sched.submit(list(range(1, 3 + 3 * i)), 12)
    return sched


def row_by_row(out, pool) -> list[PlannedChunk]:
    """The rows `planned_chunks` must describe, read one request at a time from the scheduler's records."""
    rows = []
    for request in out.scheduled:
        table = pool.gpu_blocks(request.request_id)
        if not table:
            continue
        start, n = request.num_computed_tokens, out.chunk_tokens[request.request_id]
        tokens = request.prefill_tokens[start : start + n] if request.is_prefilling else (request.generated[-1],)
        rows.append(PlannedChunk(request, start, tokens, table, start + n >= len(request.prefill_tokens)))
    return rows


def test_planned_batch_columns_and_rows_agree_with_the_records() -> None:
    sched = mixed_scheduler()
    kinds = set()
    for _ in range(30):
        if not sched.has_unfinished:
            break
        out = sched.schedule()
        sched.check_invariants(out)
        batch = planned_chunks(out, sched.pool)
        expected = row_by_row(out, sched.pool)
        assert isinstance(batch, PlannedBatch) and list(batch) == expected and len(batch) == len(expected)
        assert [batch[i] for i in range(len(batch))] == expected and batch[1:] == expected[1:]
        columns = (batch.requests, batch.starts, batch.tokens, batch.block_tables, batch.produces_token)
        assert all(len(column) == len(batch) for column in columns)
        kinds |= {len(c.tokens) > 1 or not c.produces_token for c in batch}
        sched.complete_migrations(out)
        sched.complete_step(out, {c.request.request_id: 7 for c in batch if c.produces_token})
        sched.check_invariants()
    assert kinds == {True, False}  # both prefill chunks and decode steps were planned


def test_planned_batch_drops_requests_ended_since_planning() -> None:
    sched = mixed_scheduler()
    out = sched.schedule()
    cancelled = out.scheduled[1].request_id
    sched.cancel(cancelled)
    batch = planned_chunks(out, sched.pool)
    assert [r.request_id for r in batch.requests] == [r.request_id for r in out.scheduled if r.request_id != cancelled]
    assert list(batch) == row_by_row(out, sched.pool)


@pytest.mark.parametrize("kind", ["machine", "compiled"])
def test_lifecycle_writes_land_in_the_plain_state_attribute(kind: str) -> None:
    lifecycle = make_lifecycle(kind)
    request = new_request("r", [1, 2], 3)
    lifecycle.start(request)
    assert request.state == lifecycle.spec.initial == getattr(request, STATE_ATTRIBUTE)
    edge = next(t for t in lifecycle.spec.transitions if t.source == request.state and t.guard is None)
    assert lifecycle.fire(request, edge.event, pool=None) == edge
    assert request.state == edge.dest == getattr(request, STATE_ATTRIBUTE) != lifecycle.spec.initial


def test_the_prefill_count_follows_every_write_of_the_prefill_tokens() -> None:
    """The walk reads `num_prefill_tokens` instead of `len(prefill_tokens)`: the prompt, a replay prompt after a
    reset, and a write from outside (a list, stored as a tuple) all leave the two in agreement."""
    request = new_request("r", [1, 2, 3], 8)
    assert request.prefill_tokens == (1, 2, 3) and request.num_prefill_tokens == 3
    request.generated.extend([4, 5])
    request.reset_for_replay()
    assert request.prefill_tokens == (1, 2, 3, 4, 5) and request.num_prefill_tokens == 5
    request.num_computed_tokens = 4
    assert request.is_prefilling and request.prefill_tokens_left == 1 and request.next_step_tokens == 1
    request.prefill_tokens = [7]  # type: ignore[assignment]  (a caller's list)
    assert request.prefill_tokens == (7,) and request.num_prefill_tokens == 1 and not request.is_prefilling


@pytest.mark.parametrize("lifecycle", ["machine", "compiled"])
def test_decode_fast_path_matches_the_general_path_counters(lifecycle: str) -> None:
    """Decode steps (fast path) count one computed token and one generated token each, and a final one finishes
    the request through the lifecycle: the same records the general path keeps."""
    sched = mixed_scheduler(lifecycle)
    fired = []
    sched.on_transition = lambda request, transition: fired.append((request.request_id, transition.event))
    while sched.has_unfinished:
        out = sched.schedule()
        sched.check_invariants(out)
        before = {r.request_id: (r.num_computed_tokens, len(r.generated)) for r in out.scheduled}
        decoding = {r.request_id for r in out.scheduled if not r.is_prefilling}
        produced = sched.complete_step(out, {r.request_id: 5 for r in out.scheduled})
        for request in out.scheduled:
            if request.request_id in decoding and request.state != sched._ended:
                computed, generated = before[request.request_id]
                assert (request.num_computed_tokens, len(request.generated)) == (computed + 1, generated + 1)
        assert sched.stats().generated_tokens == len(produced)
        sched.complete_migrations(out)
        sched.check_invariants()
    finished = sched.finished.values()
    assert all(len(r.generated) == r.max_new_tokens for r in finished)
    assert sorted(rid for rid, event in fired if event == "finish") == sorted(r.request_id for r in finished)


@pytest.mark.parametrize("lifecycle", ["machine", "compiled"])
def test_a_transition_between_planning_and_landing_takes_the_checked_path(lifecycle: str) -> None:
    """A decode list lands without a per-request check only while no transition fired since it was planned: a
    request of it cancelled in between lands no token, and every other request lands exactly as in the same run
    left undisturbed."""
    calm, disturbed = mixed_scheduler(lifecycle), mixed_scheduler(lifecycle)
    for _ in range(40):
        outs = calm.schedule(), disturbed.schedule()
        decoding = [r.request_id for r in outs[1].generation]
        if len(decoding) >= 2:
            break
        for sched, out in zip((calm, disturbed), outs, strict=True):
            sched.complete_step(out, {r.request_id: 5 for r in out.scheduled})
            sched.complete_migrations(out)
    else:
        pytest.fail("the workload never decodes two requests in one pass")
    victim = disturbed.cancel(decoding[0])
    tokens_before = list(victim.generated)
    produced = [
        {r.request_id for r in sched.complete_step(out, {r.request_id: 5 for r in out.scheduled})}
        for sched, out in zip((calm, disturbed), outs, strict=True)
    ]
    assert victim.generated == tokens_before and decoding[0] not in produced[1]
    assert produced[1] == produced[0] - {decoding[0]}
    for rid in decoding[1:]:
        a, b = calm.get(rid), disturbed.get(rid)
        assert (a.num_computed_tokens, a.generated, a.state) == (b.num_computed_tokens, b.generated, b.state)
    disturbed.check_invariants()
