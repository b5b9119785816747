"""Every sequence of release-causing events during a copy is well defined.

A copy in flight is a suspend's (GPU -> host) or a resume's (host -> GPU). While it is in flight its request may
lose its host copy, be cancelled or aborted, the copy may fail or complete, and the scheduler may step. Each call
either takes effect whole or raises a `KVStateError` having changed nothing; after each, `check_invariants` holds
(and raises nothing but `InvariantViolation`); and once the copies complete every request ends with every block
free and its output a prefix of (finished: equal to) its reference.
"""

from __future__ import annotations

import itertools

import pytest

from kvstate.checker.world import prompt_of
from kvstate.config import SchedulerConfig
from kvstate.errors import InvariantViolation, KVStateError
from kvstate.pool import TO_GPU, TO_HOST
from kvstate.scheduler import Scheduler
from kvstate.sim import SimExecutor, reference_output

CONFIG = SchedulerConfig(gpu_blocks=5, host_blocks=2, block_size=1, prefill_chunk_size=2)
EVENTS = ("lose_host_copy", "cancel", "abort", "fail", "complete", "step")


def with_copy_in_flight(direction: str) -> tuple[Scheduler, SimExecutor, int]:
    """Two requests of 3 + 2 tokens in 5 GPU blocks: request 1 is suspended in the second step. Copies complete one
    pass late, so between two steps the copy of `direction` is in flight."""
    s = Scheduler(CONFIG)
    for rid in (0, 1):
        s.submit(prompt_of(rid, 3), 2, request_id=rid)
    ex = SimExecutor(s, copy_delay=1)
    for _ in range(40):
        ex.step()
        copy = next((c for c in ex.copies if c.plan.direction == direction), None)
        if copy is not None:
            return s, ex, copy.plan.request_id
    raise AssertionError(f"no {direction} copy was ever in flight between two steps")


def snapshot(s: Scheduler, ex: SimExecutor) -> tuple:
    requests = {**s.requests, **s.finished}
    return (
        {rid: (r.state, tuple(r.generated), r.done_reason) for rid, r in requests.items()},
        s.pool.usage(),
        sorted(s.pool.in_flight),
        [c.plan.plan_id for c in ex.copies],
    )


def act(s: Scheduler, ex: SimExecutor, event: str, rid: int) -> None:
    if event == "fail":
        ex.fail_copy(rid)
    elif event == "complete":
        ex.complete_copy(rid)
    elif event == "step":
        ex.step()
    else:
        getattr(s, event)(rid)


def check_sequence(direction: str, sequence: tuple[str, ...]) -> None:
    s, ex, rid = with_copy_in_flight(direction)
    for event in sequence:
        before = snapshot(s, ex)
        try:
            act(s, ex, event, rid)
        except (KVStateError, ValueError) as refused:  # refused: nothing changed
            assert not isinstance(refused, InvariantViolation), refused
            assert snapshot(s, ex) == before, f"{event} refused ({refused}) but changed the scheduler"
        s.check_invariants()
    ex.run(max_iterations=500)
    s.check_invariants()
    assert not s.requests and not s.pool.in_flight
    usage = s.pool.usage()
    assert usage["gpu_free"] == CONFIG.gpu_blocks and usage["host_free"] == CONFIG.host_blocks, usage
    for r in s.finished.values():
        reference = reference_output(prompt_of(r.request_id, 3), 2)
        assert r.generated == (reference if r.done_reason == "finished" else reference[: len(r.generated)])


SEQUENCES = [seq for n in (1, 2, 3) for seq in itertools.permutations(EVENTS, n)]


@pytest.mark.parametrize("direction", [TO_HOST, TO_GPU])
def test_every_sequence_of_release_causing_events_during_a_copy_is_well_defined(direction: str) -> None:
    for sequence in SEQUENCES:
        try:
            check_sequence(direction, sequence)
        except AssertionError as err:
            raise AssertionError(f"{direction} copy in flight, then {sequence}: {err}") from err


def test_the_issue_25_double_release_leaves_the_scheduler_whole() -> None:
    """The reproduction: a lost host copy, then a cancel, while the copy to host is in flight."""
    s = Scheduler(CONFIG)
    s.submit(prompt_of(0, 3), 2, request_id=0)
    s.submit(prompt_of(1, 3), 2, request_id=1)
    ex = SimExecutor(s, complete_fences=False)
    for _ in range(3):  # 1 suspends itself (held), then one of its blocks is offloaded for request 0's next step
        ex.step()
    assert s.get(1).state == "suspended" and s.pool.in_flight
    s.lose_host_copy(1)
    s.cancel(1)
    s.check_invariants()
    assert s.get(1).done_reason == "cancelled" and 1 in s.finished and 1 not in s.requests
    usage = s.pool.usage()
    assert usage["host_fenced"] == 1 and usage["host_owned"] == 0  # its host block waits for the copy (FENCE)
    ex.complete_copy(1)
    s.check_invariants()
    assert s.pool.usage()["host_free"] == CONFIG.host_blocks


def test_an_effect_that_fails_leaves_the_request_in_its_old_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transition happens whole or not at all: an effect that raises leaves the state and the counts as they were."""
    s, ex, rid = with_copy_in_flight(TO_HOST)
    before = snapshot(s, ex)

    def refuses(self, owner):
        raise KVStateError("the pool refuses")

    monkeypatch.setattr(type(s.pool), "release", refuses)
    with pytest.raises(KVStateError, match="the pool refuses"):
        s.cancel(rid)
    assert snapshot(s, ex) == before and s.get(rid).state == "suspended"
    monkeypatch.undo()
    s.check_invariants()


def test_check_invariants_reports_a_half_applied_transition_as_an_invariant_violation() -> None:
    s, _, rid = with_copy_in_flight(TO_HOST)
    request = s.get(rid)
    request.state = "done"  # what the double release left behind: done, yet still active
    with pytest.raises(InvariantViolation) as info:
        s.check_invariants()
    assert info.value.invariant_id == "STATS-COUNT" and "half applied" in str(info.value)
