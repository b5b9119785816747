"""Scheduling-policy bugs planted in the real scheduler: the model checker's step simulation (every pass checked
against the spec's `[policy]` by `kvstate.policy.check_pass`) must catch each, naming the invariant. Bugs are
planted by monkeypatching the scheduler (never by editing library files); each test also runs the same bound on
the unpatched scheduler, which holds."""

from __future__ import annotations

import pytest

import kvstate.policy as policy_module
import kvstate.scheduler.preemption as preemption_module
import kvstate.semantics
from kvstate.checker import HOLDS, VIOLATED, Bound, check_bound
from kvstate.scheduler import Scheduler

# four requests and a tight GPU tier: enough contention for every rule to matter; only the scheduler refinement
# runs (its step simulation is what these tests plant into), so each bound takes seconds
BOUNDS = {
    "policy": Bound.from_dict(
        {
            "requests": [[2, 3], [2, 3], [2, 3], [1, 3]],
            "gpu_blocks": 6,
            "host_blocks": 3,
            "block_size": 1,
            "chunk_size": 2,
            "env_cancels": 0,
            "env_host_losses": 0,
            "abstract_model": False,
        },
        name="policy",
    ),
    "worth": Bound.from_dict(
        {
            "requests": [[2, 3], [1, 2], [1, 2], [4, 2]],
            "gpu_blocks": 7,
            "host_blocks": 2,
            "block_size": 1,
            "chunk_size": 2,
            "env_cancels": 0,
            "env_host_losses": 0,
            "abstract_model": False,
        },
        name="worth",
    ),
    # two requests suspended in one pass, both promoted for a third (the workload of test_mutants.py): promotions
    # happen here, also of requests suspended in an earlier pass once the candidates are planted
    "promotion": Bound.from_dict(
        {
            "requests": [[1, 4], [1, 4], [3, 4], [1, 4], [1, 4]],
            "gpu_blocks": 7,
            "host_blocks": 3,
            "block_size": 1,
            "chunk_size": 8,
            "cancel": False,
            "env_cancels": 0,
            "env_host_losses": 0,
            "abstract_model": False,
        },
        name="promotion",
    ),
}


def caught(bound_name: str, *invariants: str) -> str:
    report = check_bound(BOUNDS[bound_name])
    assert report.verdict == VIOLATED, f"the planted bug was not caught on bound {bound_name}"
    assert report.violated_invariant in invariants, report.counterexample
    return "\n".join(report.counterexample)


@pytest.mark.parametrize("bound", sorted(BOUNDS))
def test_the_unpatched_scheduler_follows_the_policy(bound: str) -> None:
    assert check_bound(BOUNDS[bound]).verdict == HOLDS


def test_head_first_victims_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def head_first(self, step):
        return next((c for c in self.admitted if self._victim_eligible(c, step)), None)

    monkeypatch.setattr(Scheduler, "_pick_victim", head_first)
    assert "tail-first" in caught("policy", "VICTIM-TAIL")


def test_a_victim_about_to_finish_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(policy_module.VICTIM_EXCLUSIONS, "about_to_finish", lambda s, candidate, step: False)
    assert "final token" in caught("policy", "VICTIM-NOT-FINAL")


def test_promoting_a_request_suspended_in_an_earlier_pass_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Candidates taken from every suspended request (not only this pass's): the spec's promotion gate lets a
    request suspended in an earlier pass through (the engine's gate does), so the policy check refuses the promotion
    (PROMOTE-GATE: the policy's candidates are this pass's suspensions)."""
    original = Scheduler._promote_for

    def from_every_pass(self, victim, step):
        # listed as this pass's suspensions (a promotion takes its request off the pass's suspended list), those
        # without a copy in flight (a promotion withdraws only the copies its pass planned); the rest unlisted again
        earlier = [r for r in self.suspended if r not in step.suspended and not r.copy_in_flight]
        step.suspended[:0] = earlier
        step.output.suspended[:0] = earlier
        try:
            return original(self, victim, step)
        finally:
            for r in earlier:
                for listed in (step.suspended, step.output.suspended):
                    if r in listed:
                        listed.remove(r)

    monkeypatch.setattr(Scheduler, "_promote_for", from_every_pass)
    text = caught("promotion", "PROMOTE-GATE", "SPEC-EDGE")
    assert "same pass" in text


def test_promotion_without_the_worth_rule_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preemption_module, "promotion_saves_kv", lambda promoted, victim: True)
    monkeypatch.setattr(kvstate.semantics, "promotion_saves_kv", lambda promoted, victim: True)
    assert "worth" in caught("worth", "PROMOTE-GATE")


def test_admitting_new_requests_in_a_preempting_pass_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_hold(self, step):
        for event, queue in self._admission_queues:
            if not self._admit_class(event, queue, step):
                return

    monkeypatch.setattr(Scheduler, "_admit", no_hold)
    assert "A1" in caught("policy", "ADMIT-HOLD")


def test_skipping_a_readmission_that_does_not_fit_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def skipping(self, step):
        hold_new = step.preempted or step.waited
        for event, queue in self._admission_queues:
            if not (event == "admit" and hold_new):
                self._admit_class(event, queue, step)

    monkeypatch.setattr(Scheduler, "_admit", skipping)
    assert "does not fit" in caught("policy", "ADMIT-ORDER")


def test_room_on_its_way_counted_by_every_requester_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The collapse: waiting requesters do not reserve the room they count on, so later ones wait for the same
    blocks instead of taking a victim."""

    def unreserved_wait(self, request, reserved, step):
        step.waited = True
        step.waiting.add(id(request))
        step.record.decisions.append(policy_module.Wait(request.request_id, reserved))

    monkeypatch.setattr(Scheduler, "_wait", unreserved_wait)
    assert "reserved" in caught("policy", "WORK-CONSERVE")
