"""Recompute-pause off on the shipped bounds: a victim is a request the pass can move (`cannot_be_moved`), so
VICTIM-TAIL and WORK-CONSERVE hold with a host tier too small for most requests (`no_recompute_pause_small_host`)
and with a replaying request, which cannot be suspended (`no_recompute_pause_replay`); where no request can be moved
the scheduler stalls and LIVE-DONE, SPEC.md section 6's stated exception, is all that is violated
(`no_recompute_pause_stall_prefill`). The rule is disabled in a copy of the spec (the old policy, in the scheduler
and in the per-pass check alike) or planted away in the scheduler alone by monkeypatching; never by editing library
files."""

from __future__ import annotations

import dataclasses

import pytest

import kvstate.policy as policy_module
from kvstate import load_spec
from kvstate.checker import HOLDS, VIOLATED, Bound, check_bound, select_bounds
from kvstate.policy import CANNOT_BE_MOVED

HOLDING = ["no_recompute_pause_small_host", "no_recompute_pause_replay"]
STALLING = "no_recompute_pause_stall_prefill"


def bound(name: str) -> Bound:
    return select_bounds([name])[0]


def without_the_rule():
    """The packaged spec as it was before the rule: a request the pass cannot move may be taken as a victim."""
    spec = load_spec()
    exclusions = tuple(name for name in spec.policy.victim_exclusions if name != CANNOT_BE_MOVED)
    assert exclusions != spec.policy.victim_exclusions
    return dataclasses.replace(spec, policy=dataclasses.replace(spec.policy, victim_exclusions=exclusions))


@pytest.mark.parametrize("name", HOLDING)
def test_victim_tail_and_work_conservation_hold_with_recompute_pause_off(name: str) -> None:
    assert not bound(name).recompute_pause
    report = check_bound(bound(name))
    assert report.verdict == HOLDS, report.counterexample


def test_the_holding_bounds_are_in_the_default_set() -> None:
    assert set(HOLDING) <= {b.name for b in select_bounds(None)}


@pytest.mark.parametrize("name", [STALLING, "no_recompute_pause_stall"])
def test_where_nothing_can_be_moved_only_live_done_is_violated(name: str) -> None:
    """LIVE-DONE's stated exception: both requests wait, pass after pass, reported as a lasso at its loop."""
    report = check_bound(bound(name))
    assert report.verdict == VIOLATED and report.violated_invariant == "LIVE-DONE", report.counterexample
    assert "livelock" in report.counterexample[0]


@pytest.mark.parametrize(
    ("name", "invariant"),
    [
        (STALLING, "WORK-CONSERVE"),
        ("no_recompute_pause_small_host", "VICTIM-TAIL"),
    ],
)
def test_without_the_rule_the_bounds_break_a_safety_invariant(name: str, invariant: str) -> None:
    """The old policy: a victim the pass could not move was taken, moved nowhere, and skipped its own turn."""
    report = check_bound(bound(name), spec=without_the_rule())
    assert report.verdict == VIOLATED and report.violated_invariant == invariant, report.counterexample


def test_a_scheduler_that_takes_a_victim_it_cannot_move_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule planted away in the scheduler while the spec keeps it: the step simulation catches the request left
    neither scheduled, preempted nor waiting."""
    monkeypatch.setitem(policy_module.VICTIM_EXCLUSIONS, CANNOT_BE_MOVED, lambda s, candidate, pass_: False)
    report = check_bound(bound(STALLING))
    assert report.verdict == VIOLATED and report.violated_invariant == "WORK-CONSERVE", report.counterexample
    assert "neither scheduled, preempted nor waiting" in report.counterexample[0]


def test_a_check_that_counts_a_victim_it_cannot_move_as_eligible_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule taken from the per-pass check only: the scheduler's victim, taken past a later request that the host
    tier has no room to suspend, then looks like a requester passing over a victim it could take."""
    monkeypatch.setattr(policy_module._PassCheck, "movable", lambda self, r, host_room: True)
    report = check_bound(bound("no_recompute_pause_small_host"))
    assert report.verdict == VIOLATED, "the check without the rule accepted every pass"
    assert report.violated_invariant == "VICTIM-TAIL", report.counterexample
    assert "was admitted later and is eligible" in report.counterexample[0]
