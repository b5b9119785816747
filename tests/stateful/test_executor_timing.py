"""The conformance machine over executor timing: micro-batches in flight, copies completing late or early, copies
failing when issued or later, micro-batches landing early, lost host copies and aborts at any moment, in the default
profile; the machine finding two bugs of such timing on the code before their fixes (a micro-batch livelock, a double
release); and a promotion that must not be made for a victim whose copy is in flight.

`TimingAdapter` is `KVStateAdapter` with a `SimExecutor` that keeps `micro_batches` outputs in flight and lets copies
complete up to `copy_delay` passes late; `TimingMachine` adds a rule for every choice the executor and the
environment have between two steps. A failure prints a step list that replays after `from
tests.stateful.test_executor_timing import *`.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

import kvstate.lifecycle as lifecycle_module
import kvstate.pool as pool_module
from kvstate import load_spec
from kvstate.config import SchedulerConfig
from kvstate.errors import InvariantViolation
from kvstate.sim import SimExecutor
from kvstate.spec import Spec
from kvstate.testing import ConformanceMachine, KVStateAdapter, LifecycleViolation, Submission
from tests.planted import old_release
from tests.stateful.test_conformance import TIGHT  # two stages, small everything: the tight machine's tiers

STEPS = settings(stateful_step_count=50)

# one stage, a host tier as large as the GPU tier, copies up to two passes late
ROOMY = SchedulerConfig(gpu_blocks=16, host_blocks=16, block_size=4, prefill_chunk_size=6, max_num_tokens=32)
# the tiers of the mb2_livelock bound: two stages, 3 blocks of 2 tokens, chunks of 2, no host tier
MB2 = SchedulerConfig(gpu_blocks=3, host_blocks=0, block_size=2, prefill_chunk_size=2, pipeline_stages=2)


def eager_offload() -> Spec:
    """The packaged spec with the `eager` offload policy: a victim's blocks all move down in the pass that suspends
    it (the eager suspension of earlier specs, as one schedule of the lazy design)."""
    spec = load_spec()
    return dataclasses.replace(spec, policy=dataclasses.replace(spec.policy, offload="eager"))


class TimingAdapter(KVStateAdapter):
    """`KVStateAdapter` driving a `SimExecutor` with `micro_batches` in flight and copies up to `copy_delay` passes
    late. Resizing the host tier first lets every copy in flight complete (an executor drains its copy stream)."""

    def __init__(self, config: SchedulerConfig, *, micro_batches: int = 1, copy_delay: int = 0, **kwargs) -> None:
        executor = functools.partial(SimExecutor, micro_batches=micro_batches, copy_delay=copy_delay)
        super().__init__(config, executor_factory=executor, **kwargs)

    def set_host_capacity(self, blocks: int) -> bool:
        while self.executor.copies:
            self.executor.complete_copy(self.executor.copies[0].plan.request_id)
        return super().set_host_capacity(blocks)


class TimingMachine(ConformanceMachine):
    """The conformance machine plus the executor's and the environment's choices between two steps."""

    def copying(self) -> list:
        return [c.plan.request_id for c in self.adapter.executor.copies]

    @precondition(lambda self: bool(self.copying()))
    @rule(nth=st.integers(0, 3))
    def complete_a_copy(self, nth: int) -> None:
        """A copy in flight completes before it is due."""
        ids = self.copying()
        self.adapter.executor.complete_copy(ids[nth % len(ids)])
        self.observe()

    @precondition(lambda self: bool(self.copying()))
    @rule(nth=st.integers(0, 3))
    def fail_a_copy(self, nth: int) -> None:
        """A copy in flight fails (undone while its request still waits for it)."""
        ids = self.copying()
        self.adapter.executor.fail_copy(ids[nth % len(ids)])
        self.observe()

    @rule(k=st.integers(0, 2))
    def step_failing_a_copy(self, k: int) -> None:
        """One step whose k-th copy fails when issued (a plain step if it issues fewer); its pass is checked against
        the policy at once, as the machine's own steps are (the check reads the requests as the pass left them)."""
        self.adapter.executor.step(fail={k})
        self.check_passes()
        self.observe()

    @precondition(lambda self: bool(self.adapter.executor.pipeline) and self.adapter.executor.micro_batches > 1)
    @rule()
    def land_early(self) -> None:
        """The oldest micro-batch in flight leaves the last stage before it has to."""
        self.adapter.executor.land()
        self.observe()

    @precondition(lambda self: bool(self.adapter.scheduler.suspended))
    @rule(nth=st.integers(0, 3))
    def lose_a_host_copy(self, nth: int) -> None:
        suspended = self.adapter.scheduler.suspended
        self._environment("lose_host_copy", suspended[nth % len(suspended)].request_id)

    @precondition(lambda self: bool(self.adapter.scheduler.requests))
    @rule(nth=st.integers(0, 7))
    def abort(self, nth: int) -> None:
        active = sorted(self.adapter.scheduler.requests, key=repr)
        rid = active[nth % len(active)]
        self.cancelled.add(rid)  # ended early on purpose: its output is a prefix of its reference
        self._environment("abort", rid)

    def _environment(self, event: str, rid) -> None:
        """Fire the environment event `event` on `rid`, which has an edge from the request's state: it must take
        effect (an error is a broken edge), then everything is checked."""
        state = self.adapter.scheduler.get(rid).state
        try:
            getattr(self.adapter.scheduler, event)(rid)
        except Exception as err:
            raise LifecycleViolation(
                f"{event}({rid!r}) from state {state!r} raised {type(err).__name__}: {err}; the spec's {event!r} "
                f"event has an edge from {state!r}"
            ) from err
        self.observe()


class ReleaseBurstMachine(TimingMachine):
    """The timing machine plus bursts of release-causing events on one request whose copy is in flight (a machine of
    its own: the one that finds the double release below)."""

    BURST = st.lists(st.sampled_from(["lose_host_copy", "cancel", "abort"]), min_size=1, max_size=3)

    @precondition(lambda self: any(rid in self.adapter.scheduler.requests for rid in self.copying()))
    @rule(events=BURST, nth=st.integers(0, 3))
    def releases_while_copying(self, events: list[str], nth: int) -> None:
        """A burst of environment events on one request whose copy is in flight, each while it has an edge from the
        request's state (a lost host copy only while it is suspended): every sequence of releases during a copy."""
        ids = [rid for rid in self.copying() if rid in self.adapter.scheduler.requests]
        self._burst(ids[nth % len(ids)], events)

    @rule(events=BURST)
    def releases_during_an_offload(self, events: list[str]) -> None:
        """Step until a suspended request's copy down is in flight (at most 4 x max_steps_per_rule steps), then a
        burst on it: held blocks move down only when an allocation needs their room, so the other rules seldom find
        such a copy in flight, the one a lost host copy and a cancel can both release."""
        held, terminal = self.model.held_states, self.model.terminal
        for _ in range(4 * self.probed.config.max_steps_per_rule):
            offloading = [rid for rid in self.copying() if self.last_states.get(rid) in held]
            if offloading:
                self._burst(offloading[0], events)
                return
            if all(s in terminal for s in self.last_states.values()):
                return
            self._step()

    def _burst(self, rid, events: list[str]) -> None:
        for event in events:
            request = self.adapter.scheduler.get(rid)
            if event == "cancel":
                self._cancel(rid)
            elif event == "abort" and request.state not in self.model.terminal:
                self.cancelled.add(rid)
                self._environment("abort", rid)
            elif event == "lose_host_copy" and request.state == self.model.spec.role("offloaded"):
                self._environment("lose_host_copy", rid)


def timing_machine(
    config: SchedulerConfig, name: str, *, spec: Spec | None = None, machine: type = TimingMachine, **timing
) -> type:
    return machine.bind(
        lambda: TimingAdapter(config, spec=spec, **timing), name=name, **({"spec": spec} if spec else {})
    )


TightTimingMachine = timing_machine(TIGHT, "TightTimingMachine", micro_batches=2, copy_delay=1)
RoomyTimingMachine = timing_machine(ROOMY, "RoomyTimingMachine", copy_delay=2)
Mb2TimingMachine = timing_machine(MB2, "Mb2TimingMachine", micro_batches=2)
ReleaseBurstTiming = timing_machine(
    TIGHT, "ReleaseBurstTiming", machine=ReleaseBurstMachine, micro_batches=2, copy_delay=1
)
EagerRoomyTimingMachine = timing_machine(ROOMY, "EagerRoomyTimingMachine", spec=eager_offload(), copy_delay=2)

TestTightTiming = TightTimingMachine.TestCase
TestRoomyTiming = RoomyTimingMachine.TestCase
TestMb2Timing = Mb2TimingMachine.TestCase  # where the policy before P1 livelocks (below): with P1 it holds
TestReleaseBursts = ReleaseBurstTiming.TestCase
for _case in (TestTightTiming, TestRoomyTiming, TestMb2Timing, TestReleaseBursts):
    _case.settings = STEPS
del _case


def test_the_timing_machines_keep_work_in_flight_between_steps() -> None:
    """The tight machine's executor keeps two outputs in flight and copies a pass late (so every rule above has
    something to act on), the roomy one copies up to two passes late."""
    tight, roomy = TightTimingMachine().adapter.executor, RoomyTimingMachine().adapter.executor
    assert (tight.micro_batches, tight.copy_delay, roomy.micro_batches, roomy.copy_delay) == (2, 1, 1, 2)


# ------------------------------------------------------------------------- two bugs of executor timing, found again
def policy_before_p1() -> Spec:
    """The packaged spec with the policy before P1: a requester without an eligible victim preempts itself."""
    spec = load_spec()
    assert spec.policy.no_eligible_victim == "wait_for_chunk_in_flight"
    return dataclasses.replace(spec, policy=dataclasses.replace(spec.policy, no_eligible_victim="preempt_self"))


def test_the_machine_finds_the_micro_batch_livelock_of_the_policy_before_p1(find_failure) -> None:
    """With two micro-batches in flight and the tiers of `mb2_livelock`, requests that fill the GPU tier pause each
    other forever under the old policy: the machine's LIVE-DONE (the scheduler's own detector set out of the way)."""
    config = dataclasses.replace(MB2, no_progress_limit=1_000_000)
    machine = timing_machine(config, "OldPolicyTiming", spec=policy_before_p1(), micro_batches=2)
    assert find_failure(machine).invariant_id == "LIVE-DONE"


def test_the_machine_finds_the_double_release_of_a_request_whose_copy_is_in_flight(find_failure, monkeypatch) -> None:
    """With copies a pass late, a request that lost its host copy while it is in flight and is then cancelled is
    released twice: before the fix the cancel raised KeyError half-way through (the machine reports it as a
    cancel that broke the spec's cancel edge)."""
    monkeypatch.setattr(pool_module.TieredBlockPool, "release", old_release)
    machine = timing_machine(TIGHT, "OldReleaseTiming", machine=ReleaseBurstMachine, micro_batches=2, copy_delay=1)
    err = find_failure(machine, LifecycleViolation)
    assert "raised KeyError" in str(err)


# ------------------------------------------------------------------ a promotion only for a victim that then suspends
def promote_for_a_victim_whose_copy_is_in_flight() -> None:
    """The roomy machine with eager offload, every check on, through the shortest run it found where a promotion
    would be wasted (with offload on demand this run wastes none, even with the question below planted away).

    Request 1 is suspended; four short requests arrive; request 1 resumes beside them, its copy up in flight, and the
    GPU tier fills. In the next pass request 5 is suspended for request 2, requests 2 and 3 wait for blocks on their
    way, and request 4 chooses request 1, whose copy is still in flight: promoting 5 would make host room for 1, yet 1
    cannot be suspended while a copy of it is in flight. Such a promotion frees the blocks 2 and 3 wait for."""
    state = EagerRoomyTimingMachine()
    state.submit_many(batch=[Submission((0,) * 31, 1), Submission((0,) * 33, 1)])
    state.step_until(in_state="suspended")
    state.submit_many(
        batch=[Submission((0,) * 9, 1), Submission((0,) * 9, 1), Submission((0,) * 9, 1), Submission((0,) * 7, 1)]
    )
    state.teardown()


def test_no_promotion_is_made_for_a_victim_whose_copy_is_in_flight() -> None:
    """That run passes every check: a promotion is tried only when `suspend` would then fire on its victim
    (`Scheduler._promote_for` asks the lifecycle's `can_fire`)."""
    promote_for_a_victim_whose_copy_is_in_flight()


def test_a_promotion_for_a_victim_that_cannot_suspend_breaks_promote_gate(monkeypatch) -> None:
    """With that question planted away (suspend always looks possible), the same run breaks PROMOTE-GATE: the
    policy's pass check finds a promotion whose victim was then recompute-paused."""
    monkeypatch.setattr(lifecycle_module._SpecRules, "can_fire", lambda self, request, event, pool: True)
    with pytest.raises(InvariantViolation) as info:
        promote_for_a_victim_whose_copy_is_in_flight()
    assert info.value.invariant_id == "PROMOTE-GATE" and "then not suspended" in str(info.value)
