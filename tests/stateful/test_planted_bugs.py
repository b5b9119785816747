"""The conformance machine catches deliberately broken schedulers, executors, adapters and specs.

Each test plants one bug, runs the machine under the active Hypothesis profile, and asserts that Hypothesis
finds a failing case whose error names the expected spec invariant, and that the printed step list is
plain Python that replays the failure (`find_failure`, tests/stateful/conftest.py). The scheduler's own deep checks
are off (`deep_checks=False`) so that what catches the bug is the machine, through the adapter protocol only.
"""

from __future__ import annotations

import dataclasses

from kvstate import load_spec
from kvstate.config import RequestRejected, SchedulerConfig
from kvstate.pool import MigrationPlan
from kvstate.scheduler import Scheduler, SchedulerEffects
from kvstate.sim import SimExecutor
from kvstate.testing import KVStateAdapter, LifecycleViolation, conformance_machine

SPEC = load_spec()

# Small pools: preemption, replay and suspension happen within a few rules.
WITH_HOST = SchedulerConfig(gpu_blocks=8, host_blocks=8, block_size=2, prefill_chunk_size=3, max_num_tokens=16)
NO_HOST = dataclasses.replace(WITH_HOST, host_blocks=0)


def adapter_with(config: SchedulerConfig, **kwargs):
    return lambda: KVStateAdapter(config, deep_checks=False, **kwargs)


def scheduler_with_effects(effects: type[SchedulerEffects]) -> type[Scheduler]:
    class BrokenScheduler(Scheduler):
        def _effects_in(self, pass_):
            return effects(self, pass_)

    return BrokenScheduler


# ------------------------------------------------------------------------------------- broken schedulers
class ReplayForgetsGenerated(SchedulerEffects):
    """Reset for replay re-prefills the original prompt only, forgetting the generated tokens' KV."""

    def release_kv_and_reset(self, request, transition) -> None:
        super().release_kv_and_reset(request, transition)
        request.prefill_tokens = request.prompt


def test_a_replay_prompt_without_the_generated_tokens_breaks_output_equivalence(find_failure) -> None:
    machine = conformance_machine(
        adapter_with(NO_HOST, scheduler_factory=scheduler_with_effects(ReplayForgetsGenerated)), name="ForgetfulReplay"
    )
    assert find_failure(machine).invariant_id == "OUT-EQUIV"


class ResetClearsGenerated(SchedulerEffects):
    """Reset for replay throws the generated tokens away."""

    def release_kv_and_reset(self, request, transition) -> None:
        super().release_kv_and_reset(request, transition)
        request.generated.clear()
        request.prefill_tokens = request.prompt


def test_a_reset_that_drops_generated_tokens_breaks_append_only_output(find_failure) -> None:
    machine = conformance_machine(
        adapter_with(NO_HOST, scheduler_factory=scheduler_with_effects(ResetClearsGenerated)), name="ClearingReset"
    )
    assert find_failure(machine).invariant_id == "GEN-APPEND"


class FinishLeaksBlocks(SchedulerEffects):
    """A finished request keeps its blocks in the pool (the request record says it holds none)."""

    def release_kv_and_terminate(self, request, transition) -> None:
        if transition.done_reason != "finished":
            return super().release_kv_and_terminate(request, transition)
        request.num_gpu_blocks = request.num_host_blocks = 0
        request.done_reason = transition.done_reason


def test_blocks_kept_after_finish_are_caught_as_a_leak(find_failure) -> None:
    machine = conformance_machine(
        adapter_with(WITH_HOST, scheduler_factory=scheduler_with_effects(FinishLeaksBlocks)), name="LeakyFinish"
    )
    assert find_failure(machine).invariant_id == "RES-STATE"


# ------------------------------------------------------------------------- broken held blocks (lazy suspension)
def replaced_last_plan(effects: SchedulerEffects, pairs) -> None:
    """The pass's last migration plan, its copies replaced by `pairs` (the pool's fences are left as they are)."""
    plans = effects.pass_.output.migrations
    plan = plans[-1]
    plans[-1] = MigrationPlan(plan.plan_id, plan.request_id, plan.direction, tuple(pairs))


class OffloadForgetsABlock(SchedulerEffects):
    """An offload of two or more held blocks copies its first block twice and its last one never: the host block it
    took for the last holds stale KV."""

    def offload_held_blocks(self, request, transition) -> None:
        super().offload_held_blocks(request, transition)
        pairs = self.pass_.output.migrations[-1].pairs
        if len(pairs) > 1:
            replaced_last_plan(self, (*pairs[:-1], (pairs[0][0], pairs[-1][1])))


def test_an_offload_that_forgets_a_block_breaks_output_equivalence(find_failure) -> None:
    machine = conformance_machine(
        adapter_with(WITH_HOST, scheduler_factory=scheduler_with_effects(OffloadForgetsABlock)), name="LossyOffload"
    )
    assert find_failure(machine).invariant_id == "OUT-EQUIV"


def onboarded(effects: SchedulerEffects, request, transition) -> int:
    """Run the real `lock_and_onboard`; the number of host blocks it copied up (0: nothing, no plan)."""
    plans = effects.pass_.output.migrations
    before = len(plans)
    SchedulerEffects.lock_and_onboard(effects, request, transition)
    return plans[-1].num_blocks if len(plans) > before else 0


class ResumeCopiesHeldBlocksToo(SchedulerEffects):
    """A resume of a request split across the tiers also copies over its blocks still on the GPU (from one of its host
    blocks), as if they had been offloaded too: RESUME-COPY copies only the host blocks."""

    def lock_and_onboard(self, request, transition) -> None:
        copied = onboarded(self, request, transition)
        if copied:
            pairs = self.pass_.output.migrations[-1].pairs
            resident = self.s.pool.gpu_blocks(request.request_id)[copied:]
            replaced_last_plan(self, (*pairs, *((pairs[0][0], block) for block in resident)))


def test_a_resume_that_copies_its_gpu_resident_blocks_too_breaks_output_equivalence(find_failure) -> None:
    machine = conformance_machine(
        adapter_with(WITH_HOST, scheduler_factory=scheduler_with_effects(ResumeCopiesHeldBlocksToo)),
        name="OverCopyingResume",
    )
    assert find_failure(machine).invariant_id == "OUT-EQUIV"


class ResumeLosesHeldBlocks(SchedulerEffects):
    """A resume gives the request fresh GPU blocks in place of those it held on the GPU, whose KV it loses."""

    def lock_and_onboard(self, request, transition) -> None:
        copied = onboarded(self, request, transition)
        tier, rid = self.s.pool.gpu, request.request_id
        table = tier.held(rid)
        resident = table[copied:]
        if resident and tier.num_free >= len(resident):
            fresh = tier.take(rid, len(resident))
            tier.blocks_of[rid] = (*table[:copied], *fresh)
            for block in resident:
                del tier.owner_of[block]
            tier.give_back(resident)


def test_a_resume_that_loses_its_gpu_resident_blocks_breaks_output_equivalence(find_failure) -> None:
    machine = conformance_machine(
        adapter_with(WITH_HOST, scheduler_factory=scheduler_with_effects(ResumeLosesHeldBlocks)), name="LossyResume"
    )
    assert find_failure(machine).invariant_id == "OUT-EQUIV"


class ResumeKeepsItsHostBlocks(SchedulerEffects):
    """A resume copies the host blocks up but keeps owning them, unfenced: a running request holds host blocks."""

    def lock_and_onboard(self, request, transition) -> None:
        if onboarded(self, request, transition):
            tier, rid = self.s.pool.host, request.request_id
            sources = [src for src, _ in self.pass_.output.migrations[-1].pairs]
            for block in sources:
                del tier.fenced[block]
                tier.owner_of[block] = rid
            tier.blocks_of[rid] = (*tier.held(rid), *sources)


def test_host_blocks_kept_by_a_resumed_request_are_caught_as_a_leak(find_failure) -> None:
    machine = conformance_machine(
        adapter_with(WITH_HOST, scheduler_factory=scheduler_with_effects(ResumeKeepsItsHostBlocks)),
        name="HostKeepingResume",
    )
    assert find_failure(machine).invariant_id == "RES-STATE"


class HoldForgetsToHold(SchedulerEffects):
    """A suspension that never marks the victim's blocks held: they can never be offloaded, so it frees nothing."""

    def hold_blocks(self, request, transition) -> None:
        request.num_suspensions += 1
        request.suspended_in_pass = self.pass_.number


def test_a_suspension_whose_blocks_can_never_move_breaks_liveness(find_failure) -> None:
    config = dataclasses.replace(WITH_HOST, no_progress_limit=1_000_000)  # the machine, not the watchdog, sees it
    machine = conformance_machine(
        adapter_with(config, scheduler_factory=scheduler_with_effects(HoldForgetsToHold)), name="StuckSuspension"
    )
    assert find_failure(machine).invariant_id == "LIVE-DONE"


class NeverReplays(Scheduler):
    """Recompute-paused requests are never readmitted (starvation of a preempted request)."""

    def _admit_class(self, event, queue, step) -> bool:
        return True if event == "replay" else super()._admit_class(event, queue, step)


def test_starving_recompute_paused_requests_breaks_liveness(find_failure) -> None:
    config = dataclasses.replace(NO_HOST, no_progress_limit=1_000_000)  # let the machine, not the watchdog, see it
    # the policy check sees the skipped replay at once (ADMIT-ORDER, below); without it, liveness catches it
    machine = conformance_machine(
        adapter_with(config, scheduler_factory=NeverReplays), name="Starving", check_policy=False
    )
    assert find_failure(machine).invariant_id == "LIVE-DONE"
    checked = conformance_machine(adapter_with(config, scheduler_factory=NeverReplays), name="Starving")
    assert find_failure(checked).invariant_id == "ADMIT-ORDER"


class _StaleHostSlots(list):
    """Host block slots that ignore writes: a suspend whose copy never happens, leaving stale KV behind."""

    def __setitem__(self, index, value) -> None:
        pass


class SuspendWithoutCopy(SimExecutor):
    """The executor skips the GPU -> host copies; resumed requests read stale host blocks back."""

    def __init__(self, scheduler, vocab, **kwargs) -> None:
        super().__init__(scheduler, vocab, **kwargs)
        self.sync_host_tier()

    def sync_host_tier(self) -> None:
        size, capacity = self.scheduler.config.block_size, self.scheduler.pool.host.capacity
        self.host_stages = [_StaleHostSlots([[0] * size for _ in range(capacity)]) for _ in range(self.stages)]
        self.host = self.host_stages[0]


def test_a_suspend_that_copies_nothing_breaks_output_equivalence(find_failure) -> None:
    machine = conformance_machine(adapter_with(WITH_HOST, executor_factory=SuspendWithoutCopy), name="NoCopySuspend")
    assert find_failure(machine).invariant_id == "OUT-EQUIV"


# ------------------------------------------------------------------------------------- broken adapters
class IgnoresCancel(KVStateAdapter):
    def cancel(self, request_id) -> None:
        self.scheduler.get(request_id)  # looks the id up, then forgets to cancel


def test_a_cancel_that_does_nothing_breaks_the_cancel_edges(find_failure) -> None:
    machine = conformance_machine(lambda: IgnoresCancel(WITH_HOST, deep_checks=False), name="DeafToCancel")
    err = find_failure(machine, LifecycleViolation)
    assert "'cancel' event goes from" in str(err)


@dataclasses.dataclass(frozen=True, slots=True)
class LaxConfig(SchedulerConfig):
    """Checks only that the prompt is non-empty: requests too large to ever fit are accepted."""

    def check_submission(self, prompt, max_new_tokens, stop_token_ids) -> None:
        if not prompt:
            raise RequestRejected("prompt is empty")


class ForgetsHostCopies(KVStateAdapter):
    """Reports the host tier gone without dropping the host copies in it (nor stopping the offloads)."""

    gone = False

    def set_host_capacity(self, blocks: int) -> bool:
        self.gone = blocks == 0
        return True

    def block_usage(self) -> dict[str, int]:
        usage = super().block_usage()
        return {**usage, "host_capacity": 0, "host_free": 0} if self.gone else usage


def test_host_blocks_without_a_host_tier_break_no_host_no_offload(find_failure) -> None:
    machine = conformance_machine(lambda: ForgetsHostCopies(WITH_HOST, deep_checks=False), name="HostCopiesKept")
    assert find_failure(machine).invariant_id == "NO-HOST-NO-OFFLOAD"


def test_accepting_a_request_that_can_never_fit_breaks_refusal(find_failure) -> None:
    lax = LaxConfig(**{f.name: getattr(WITH_HOST, f.name) for f in dataclasses.fields(SchedulerConfig)})
    machine = conformance_machine(adapter_with(lax), name="LaxAdmission")
    assert find_failure(machine).invariant_id == "LIVE-REFUSE"


# ---------------------------------------------------------------------------------------- broken spec
def test_the_edge_graph_comes_from_the_spec_passed_in(find_failure) -> None:
    """Without the catch-up edge, our scheduler's replaying -> running is a path the spec does not have (suspend from
    replaying is left out too: replaying -> suspended -> running would be a path the black box cannot refute)."""
    events = tuple(
        dataclasses.replace(e, transitions=tuple(t for t in e.transitions if t.source != "replaying"))
        if e.name == "suspend"
        else e
        for e in SPEC.events
        if e.name != "catch_up"
    )
    spec = dataclasses.replace(SPEC, events=events)
    machine = conformance_machine(adapter_with(NO_HOST), spec=spec, name="NoCatchUp")
    err = find_failure(machine, LifecycleViolation)
    assert "'replaying' to 'running'" in str(err) or "to 'running', but no path" in str(err)
