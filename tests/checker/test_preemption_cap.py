"""The preemption cap (A3) on the shipped bounds: with its exception for the head of the pass (VICTIM-CAP) LIVE-DONE
holds where the cap without it livelocks (`mb2_cap`), the cap still protects capped requests from every other
requester (`preemption_cap`); with recompute-pause off LIVE-DONE holds on one bound and, as SPEC.md section 6 states,
not on another (`no_recompute_pause_stall`).
Rules are disabled in a copy of the spec (the checker must then find the livelock) or planted into the scheduler by
monkeypatching (its step simulation must then name VICTIM-CAP); never by editing library files."""

from __future__ import annotations

import dataclasses

import pytest

import kvstate.policy as policy_module
from kvstate import load_spec
from kvstate.checker import HOLDS, VIOLATED, Bound, check_bound, select_bounds
from kvstate.policy import CAP_SPARES_HEAD, PREEMPTION_CAP_REACHED


def bound(name: str) -> Bound:
    return select_bounds([name])[0]


def cap_without_its_exception():
    """The packaged spec with the cap of A3 as it was: capped requests are no victims of any requester."""
    spec = load_spec()
    exclusions = tuple(
        PREEMPTION_CAP_REACHED if name == CAP_SPARES_HEAD else name for name in spec.policy.victim_exclusions
    )
    assert exclusions != spec.policy.victim_exclusions
    return dataclasses.replace(spec, policy=dataclasses.replace(spec.policy, victim_exclusions=exclusions))


@pytest.mark.parametrize("name", ["mb2_cap", "cap_three", "preemption_cap", "no_recompute_pause"])
def test_the_cap_and_recompute_pause_bounds_hold(name: str) -> None:
    assert check_bound(bound(name)).verdict == HOLDS


def test_the_cap_bounds_are_in_the_default_set() -> None:
    names = {b.name for b in select_bounds(None)}
    assert {"mb2_cap", "cap_three", "preemption_cap", "no_recompute_pause"} <= names


def test_without_the_exception_for_the_head_mb2_cap_livelocks() -> None:
    """Both requests capped, neither may take the other's blocks, and each preempts itself in turn, forever."""
    report = check_bound(bound("mb2_cap"), spec=cap_without_its_exception())
    assert report.verdict == VIOLATED and report.violated_invariant == "LIVE-DONE", report.counterexample
    assert any("recompute_pause" in line for line in report.counterexample)


def test_a_head_that_treats_capped_requests_as_protected_breaks_victim_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exception planted away in the scheduler while the spec keeps it: the step simulation catches the pass in
    which the head preempts itself although the capped request could give way."""
    monkeypatch.setitem(
        policy_module.VICTIM_EXCLUSIONS, CAP_SPARES_HEAD, policy_module.VICTIM_EXCLUSIONS[PREEMPTION_CAP_REACHED]
    )
    report = check_bound(bound("mb2_cap"))
    assert report.verdict == VIOLATED and report.violated_invariant == "VICTIM-CAP", report.counterexample
    assert "head of the pass" in report.counterexample[0]


def test_the_preemption_cap_bound_exercises_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cap planted away in the scheduler (no request is protected by it): on `preemption_cap` a requester other
    than the head takes a capped request, which the policy forbids, so the bound really checks that the cap caps."""
    monkeypatch.setitem(policy_module.VICTIM_EXCLUSIONS, CAP_SPARES_HEAD, lambda s, candidate, pass_: False)
    report = check_bound(bound("preemption_cap"))
    assert report.verdict == VIOLATED and report.violated_invariant == "VICTIM-CAP", report.counterexample
    assert "not the head of the pass" in report.counterexample[0]


def test_without_recompute_pause_a_host_tier_too_small_for_any_victim_stalls() -> None:
    """LIVE-DONE's stated exception (SPEC.md section 6), on the configuration that shows it: two requests of four
    one-token blocks, a host tier of one block and no recompute-pause; no victim can be suspended, so both stall."""
    stall = bound("no_recompute_pause_stall")
    assert not stall.recompute_pause and stall.name not in {b.name for b in select_bounds(None)}
    report = check_bound(stall)
    assert report.verdict == VIOLATED and report.violated_invariant == "LIVE-DONE", report.counterexample
    assert "livelock" in report.counterexample[0]  # a loop of passes without progress, found as a lasso
