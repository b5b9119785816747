"""One test per mutant of the checker (and of the scheduler) that the suite used to let through.

Each mutant is a one-line change; each test fails with it applied (monkeypatched, or shown against the rule it
would break) and passes without it. The mutation table applies each scheduler (or executor) mutant in turn and
asserts that a shipped bound reports it by the invariant it breaks, a bound of the default set (the set `kvstate check`
runs) unless it is listed as too slow for it; the same bounds hold on the unmutated scheduler.
"""

from __future__ import annotations

from dataclasses import replace
from importlib import import_module
from types import SimpleNamespace

import pytest

from kvstate import policy, policy_rules
from kvstate.checker import HOLDS, VIOLATED, check_bound, select_bounds
from kvstate.checker.observed import ObservedScheduler
from kvstate.checker.world import prompt_of
from kvstate.config import SchedulerConfig
from kvstate.errors import InvariantViolation
from kvstate.lifecycle import TransitionTable
from kvstate.output import SchedulerOutput
from kvstate.policy import PassRecord, PassSnapshot, Promotion, RequestSnapshot, Victim, Wait
from kvstate.scheduler import Scheduler, SchedulerEffects
from kvstate.semantics import GUARDS
from kvstate.sim import SimExecutor
from kvstate.spec import Transition, load_spec
from kvstate.validate import validate_spec

SPEC = load_spec()
EXPLORE = import_module("kvstate.checker.explore")
PREEMPTION = import_module("kvstate.scheduler.preemption")
SEMANTICS = import_module("kvstate.semantics")
REFINEMENT_CHECKS = import_module("kvstate.checker.refinement_checks")
RUNNING, WAITING, SUSPENDED = SPEC.role("active"), SPEC.role("queued"), SPEC.role("offloaded")


def snap(rid, state=RUNNING, *, arrival, kv=2, prefilling=False) -> RequestSnapshot:
    return RequestSnapshot(
        rid, state, arrival=arrival, admission=arrival, prefilling=prefilling, kv_tokens=kv, gpu_blocks=kv
    )


def listed(rid, state) -> SimpleNamespace:
    """What an output list holds of a request, as far as check_pass reads it."""
    return SimpleNamespace(request_id=rid, state=state)


# --------------------------------------------------------------------- check_pass: the promotion worth rule
def test_a_promotion_that_throws_away_as_much_kv_as_it_saves_is_refused():
    """Mutant: `worth >= victim's` -> `worth > victim's` in check_pass. The promoted request holds exactly the KV
    of the victim it made room for: the promotion saves nothing and must be refused (PROMOTE-GATE)."""
    before = PassSnapshot(
        (snap("r", arrival=0, kv=3), snap("v", arrival=1), snap("p", arrival=2)),
        has_host_tier=True,
        max_batch_size=8,
        max_num_tokens=64,
    )
    record = PassRecord([Victim("r", "p", "suspend"), Promotion("v", "p"), Victim("r", "v", "suspend"), Wait("r", 0)])
    out = SchedulerOutput(suspended=[listed("v", SUSPENDED)], recompute_paused=[listed("p", SPEC.role("dropped"))])
    with pytest.raises(InvariantViolation) as info:
        policy.check_pass(SPEC, before, record, out)
    assert info.value.invariant_id == "PROMOTE-GATE" and "worth 2" in str(info.value)


# ---------------------------------------------------------------------- check_pass: A1 counts waits too
def test_a_pass_that_left_a_requester_waiting_admits_no_new_request():
    """Mutant: the A1 hold of check_pass ignoring waits (`held = victims` only). A pass whose requester waited for
    room on its way and chose no victim admitted a new request: ADMIT-HOLD."""
    before = PassSnapshot(
        (snap("r", arrival=0), snap("n", WAITING, arrival=1, kv=0)),
        gpu_fenced=1,
        has_host_tier=True,
        max_batch_size=8,
        max_num_tokens=64,
    )
    record = PassRecord([Wait("r", 1)])
    out = SchedulerOutput(context=[listed("n", RUNNING)], chunk_tokens={"n": 1})
    with pytest.raises(InvariantViolation) as info:
        policy.check_pass(SPEC, before, record, out)
    assert info.value.invariant_id == "ADMIT-HOLD" and "'r'] waited" in str(info.value)


# ------------------------------------------------------------------- explore: a self-loop is no way on
def never(request, pool) -> bool:
    return False


def test_a_stuck_state_whose_only_action_is_a_self_loop_is_a_deadlock():
    """Mutant: a self-loop counted as a successor in explore.py. Admission never fits and the waiting state's only
    action (a planted self-loop of a non-environment event) returns to it: DEADLOCK, not LIVE-DONE."""
    consensus = SPEC.event_by_name["consensus"]
    loop = Transition("consensus", "waiting", "waiting", "replay_still_wanted", None, consensus.destructive)
    events = tuple(
        replace(e, transitions=(*e.transitions, loop)) if e.name == consensus.name else e for e in SPEC.events
    )
    spec = replace(SPEC, events=events)
    validate_spec(spec)
    (no_cancel,) = select_bounds(["no_cancel"])
    report = check_bound(no_cancel, spec=spec, guards={**GUARDS, "gpu_room_for_first_chunk": never}, refine=False)
    assert report.verdict == VIOLATED and report.violated_invariant == "DEADLOCK", report.counterexample
    assert EXPLORE.deadlock  # the check the mutant weakens


# ---------------------------------------------------- the scheduler: the most recent suspension first
def oldest_first(self, victim, pass_):
    """Scheduler._promote_for with one change: candidates taken oldest suspension first."""
    pass_.suspended.reverse()
    try:
        return ORIGINAL_PROMOTE(self, victim, pass_)
    finally:
        pass_.suspended.reverse()


ORIGINAL_PROMOTE = Scheduler._promote_for


def run_promoting_workload() -> int:
    """Five requests (prompts 1, 1, 3, 1, 1; 4 new tokens each) in 7 GPU blocks and 3 host blocks: in its second pass
    two requests are suspended, then both are promoted for a third. Every pass is held against the policy
    (`check_pass`, by ObservedScheduler); returns how many passes promoted after two suspensions."""
    config = SchedulerConfig(gpu_blocks=7, host_blocks=3, block_size=1, prefill_chunk_size=8)
    s = ObservedScheduler(config, SPEC, TransitionTable(SPEC, GUARDS))
    ex = SimExecutor(s)
    for rid, length in enumerate((1, 1, 3, 1, 1)):
        s.submit(prompt_of(rid, length), 4, request_id=rid)
    promoted_after_two = 0
    while s.has_unfinished:
        ex.step()
        suspensions = 0
        for decision in s.last_pass.record.decisions if s.last_pass else ():
            suspensions += isinstance(decision, Victim) and decision.event == "suspend"
            promoted_after_two += isinstance(decision, Promotion) and suspensions >= 2
    return promoted_after_two


def test_the_most_recent_suspension_of_the_pass_is_promoted_first(monkeypatch):
    """Mutant: the oldest same-pass suspension promoted first instead of the most recent (PROMOTE-GATE)."""
    assert run_promoting_workload() > 0  # the workload promotes after two suspensions, and follows the policy
    monkeypatch.setattr(Scheduler, "_promote_for", oldest_first)
    with pytest.raises(InvariantViolation) as info:
        run_promoting_workload()
    assert info.value.invariant_id == "PROMOTE-GATE" and "most recent" in str(info.value)


# --------------------------------------------------------- the scheduler: the first deferred reason wins
def overwrites_the_deferred_reason(self, request, transition) -> None:
    request.termination_reason = transition.done_reason


def test_a_deferred_finish_stays_finished_when_a_cancel_follows(monkeypatch):
    """Mutant: `done_reason` overwritten when a request whose final token was deferred during consensus is then
    cancelled (it must stay `finished`). The `stop_inflight` bound lands a stop token on a request awaiting
    consensus, then cancels it (PP-TERMINATE)."""
    (stops,) = select_bounds(["stop_inflight"])
    assert check_bound(stops, counterexample_dir=None).verdict == "holds"
    monkeypatch.setattr(SchedulerEffects, "defer_termination", overwrites_the_deferred_reason)
    report = check_bound(stops, counterexample_dir=None)
    assert report.violated_invariant == "PP-TERMINATE", report.counterexample
    assert "the first recorded reason wins" in report.refinement.message


# ------------------------------------------------- the spec: about_to_finish out of the victim exclusions
def test_removing_about_to_finish_from_the_victim_exclusions_is_caught_by_a_default_bound(monkeypatch):
    """Mutant: the scheduler's `about_to_finish` exclusion dropped while the spec's policy declares it; the default
    set catches it (VICTIM-NOT-FINAL), as no default bound did before. (The mutant was first planted in a
    spec copy; since the policy is a declared parameter, a spec copy without the exclusion declares a
    policy that allows such victims, so the mutant is planted in the scheduler that departs from its spec.)"""
    assert "about_to_finish" in load_spec().policy.victim_exclusions
    monkeypatch.setitem(policy.VICTIM_EXCLUSIONS, "about_to_finish", lambda s, candidate, pass_: False)
    (bound,) = select_bounds(["pipeline2_no_cancel"])
    assert "pipeline2_no_cancel" in [b.name for b in select_bounds(None)]
    report = check_bound(bound, counterexample_dir=None)
    assert report.violated_invariant == "VICTIM-NOT-FINAL", report.counterexample


# ------------------------------------------------ the mutation table: one-line scheduler mutants, shipped bounds
def promotes_equal_worth(promoted_kv_tokens: float, victim_kv_tokens: float) -> bool:
    """`promotion_saves_kv` with `<` -> `<=`."""
    return promoted_kv_tokens <= victim_kv_tokens


def holds_new_only_after_a_victim(self, pass_) -> None:
    """Scheduler._admit with `(pass_.preempted or pass_.waited)` -> `pass_.preempted`."""
    rules = self.policy.admission_rules
    hold_new = policy.HOLD_NEW_AFTER_PREEMPTION_OR_WAIT in rules and pass_.preempted
    for event, queue in self._admission_queues:
        if event == "admit" and hold_new:
            return
        if not queue:
            continue
        if not self._admit_class(event, queue, pass_) and policy.STOP_AT_FIRST_MISFIT in rules:
            return


def head_first(self, pass_):
    """Scheduler._pick_victim with `reversed(self.admitted)` -> `self.admitted`."""
    return next((c for c in self.admitted if self._victim_eligible(c, pass_)), None)


def capped_one_late(request, cap) -> bool:
    """`preemption_capped` with `>= cap` -> `> cap`."""
    return cap is not None and request.num_suspensions + request.num_recompute_pauses > cap


def agrees_at_once(self) -> None:
    """SimExecutor.agreed returning None (every pending recompute-pause agreed) while micro-batches are in flight."""
    return None


def gate_ignoring_the_pipeline(request, pool) -> bool:
    """The promotion gate without its clause `not request.step_in_flight`."""
    return (
        pool.pass_number is not None
        and (request.suspended_in_pass != pool.pass_number or pool.has_host_tier)
        and SEMANTICS.promotion_saves_kv(request.kv_tokens, pool.promotion_worth)
    )


def plant_promotion_worth(monkeypatch) -> None:
    monkeypatch.setattr(PREEMPTION, "promotion_saves_kv", promotes_equal_worth)
    monkeypatch.setattr(SEMANTICS, "promotion_saves_kv", promotes_equal_worth)  # the promotion gate's guard


def plant_cap(monkeypatch) -> None:
    monkeypatch.setattr(PREEMPTION, "preemption_capped", capped_one_late)
    monkeypatch.setattr(policy_rules, "preemption_capped", capped_one_late)  # the victim exclusion's


# (mutant, how it is planted, the shipped bound that kills it, the invariant `kvstate check` reports)
MUTATION_TABLE = [
    ("promotion worth `<` -> `<=`", plant_promotion_worth, "promotion_worth", "PROMOTE-GATE"),
    (
        "promotion oldest suspension first",
        lambda mp: mp.setattr(Scheduler, "_promote_for", oldest_first),
        "promotion_order",
        "PROMOTE-GATE",
    ),
    (
        "A1 hold ignoring a waiting requester",
        lambda mp: mp.setattr(Scheduler, "_admit", holds_new_only_after_a_victim),
        "hold_after_wait",
        "ADMIT-HOLD",
    ),
    ("head-first victims", lambda mp: mp.setattr(Scheduler, "_pick_victim", head_first), "promotion", "VICTIM-TAIL"),
    (
        "no final-token protection",
        lambda mp: mp.setitem(policy.VICTIM_EXCLUSIONS, "about_to_finish", lambda s, candidate, pass_: False),
        "gpu_only_ladder",
        "VICTIM-NOT-FINAL",
    ),
    ("preemption cap off by one", plant_cap, "preemption_cap", "VICTIM-CAP"),
    (
        "promotion while a step is in the pipeline",
        lambda mp: mp.setitem(GUARDS, "promotion_gate", gate_ignoring_the_pipeline),
        "promotion_in_flight",
        "PROMOTE-GATE",
    ),
    (
        "consensus without waiting for the stages",
        lambda mp: mp.setattr(SimExecutor, "agreed", agrees_at_once),
        "consensus_waits",
        "OUT-EQUIV",
    ),
]
KILLING_BOUNDS = sorted({row[2] for row in MUTATION_TABLE})
# killing bounds too slow for the default set: `kvstate check --bound NAME` runs them
OUTSIDE_DEFAULT_SET = {"consensus_waits", "promotion_in_flight"}


@pytest.mark.parametrize(("mutant", "plant", "bound", "invariant"), MUTATION_TABLE, ids=[r[0] for r in MUTATION_TABLE])
def test_a_shipped_bound_kills_the_mutant(monkeypatch, mutant, plant, bound, invariant):
    (shipped,) = select_bounds([bound])
    in_default_set = bound in [b.name for b in select_bounds(None)]  # `kvstate check` runs it by default
    assert in_default_set != (bound in OUTSIDE_DEFAULT_SET)
    plant(monkeypatch)
    report = check_bound(shipped, counterexample_dir=None)
    assert report.verdict == VIOLATED, f"{mutant}: not killed by {bound}"
    assert report.violated_invariant == invariant, report.counterexample


@pytest.mark.parametrize("bound", KILLING_BOUNDS)
def test_the_unmutated_scheduler_holds_on_the_killing_bound(bound):
    (shipped,) = select_bounds([bound])
    report = check_bound(shipped, counterexample_dir=None)
    assert report.verdict == HOLDS, report.counterexample


# ------------------------------------------- the refinement: the abstraction's state predicates are evaluated
def releases_while_awaiting_consensus(self, request, transition) -> None:
    """A planted bug: `hold_for_consensus` frees the request's GPU blocks (they must stay until consensus)."""
    self.s.pool.release(request.request_id)
    request.num_gpu_blocks = 0


def test_a_bug_only_the_state_predicates_name_is_reported_by_them(monkeypatch):
    """Mutant: the refinement's loop over the state predicates skipped. A request awaiting consensus that gave up
    its GPU blocks passes the scheduler's own checks (its pool and its records agree, and its state may hold any
    number of GPU blocks); the first check to see it is RES-STATE of the abstraction (tokens computed without blocks
    to hold them). With the loop skipped, the same run is reported as another violation (REFINES: a state the spec
    does not reach). A correct scheduler satisfies every state predicate, so no verdict of `kvstate check` shows
    this mutant: a planted bug does."""
    (bound,) = select_bounds(["pipeline2_no_cancel"])
    monkeypatch.setattr(SchedulerEffects, "hold_for_consensus", releases_while_awaiting_consensus)
    report = check_bound(bound, counterexample_dir=None)
    assert report.violated_invariant == "RES-STATE", report.counterexample
    assert report.refinement is not None and "abstraction of the scheduler state" in report.refinement.message
    monkeypatch.setattr(REFINEMENT_CHECKS, "STATE_PREDICATES", {})
    skipped = check_bound(bound, counterexample_dir=None)
    assert skipped.verdict == VIOLATED and skipped.violated_invariant != "RES-STATE", skipped.counterexample
