"""Livelocks found as lassos: the refinement identifies worlds without the no-progress counter (A4), so a loop of
passes without progress closes a cycle of worlds and is reported at its loop, with a short drawn counterexample; the
detector's stall stays a verdict of its own, found exactly when the counter would reach it.

Planted livelocks are spec copies (the production engine's suspend ladder; the policy before P1), never edits of
library files."""

from __future__ import annotations

import pytest

import kvstate.checker.refinement as refinement_module
import kvstate.checker.world as world_module
from kvstate.checker import HOLDS, VIOLATED, Bound, check_bound, select_bounds
from kvstate.checker.refinement import Refinement
from kvstate.checker.world import fingerprint, scheduler_config
from kvstate.checker.world_graph import NoProgressCounts
from kvstate.errors import InvariantViolation
from kvstate.report import write_report
from kvstate.spec import load_spec, packaged_spec_path

LOOP_MARK = "-- the following steps repeat forever --"


def spec_with(tmp_path, rule: str, planted: str):
    """A copy of the packaged spec with the policy rule `rule` replaced by `planted`."""
    text = packaged_spec_path().read_text(encoding="utf-8")
    assert rule in text
    path = tmp_path / "lifecycle.toml"
    path.write_text(text.replace(rule, planted), encoding="utf-8")
    return load_spec(path)


def ladder_spec(tmp_path):
    """The production engine's ladder: suspend whatever the host tier can take (on a GPU-only bound: nothing)."""
    return spec_with(tmp_path, 'suspend_rule = "host_takes_every_held_block"', 'suspend_rule = "always"')


def before_p1_spec(tmp_path):
    """The policy before P1: a requester without an eligible victim preempts itself."""
    return spec_with(tmp_path, 'no_eligible_victim = "wait_for_chunk_in_flight"', 'no_eligible_victim = "preempt_self"')


def loop_of(result) -> list[tuple[tuple, list[str]]]:
    assert result.loop_start is not None, result.message
    return result.path[result.loop_start :]


def fired_in(loop) -> list[str]:
    return [transition for _, fired in loop for transition in fired]


# ------------------------------------------------------------------------------------------ lassos at their loop
def test_the_ladder_livelock_is_a_two_pass_lasso_that_the_report_draws(tmp_path):
    (bound,) = select_bounds(["gpu_only_ladder"])
    spec = ladder_spec(tmp_path)
    report = check_bound(bound, spec=spec, counterexample_dir=tmp_path)
    result = report.refinement
    assert report.verdict == VIOLATED and report.violated_invariant == "LIVE-DONE", report.counterexample
    assert result.message.startswith("livelock"), result.message  # a cycle of worlds, not the detector's stall
    loop = loop_of(result)
    assert [action for action, _ in loop] == [("step",), ("step",)]
    fired = fired_in(loop)
    for rid in (0, 1):
        assert f"{rid}: running -suspend-> suspended" in fired and f"{rid}: suspended -resume-> running" in fired
    assert LOOP_MARK in "\n".join(report.counterexample)
    traced = report.counterexample_trace
    assert traced is not None and traced.loop is not None
    assert traced.loop[1] - traced.loop[0] + 1 == len(loop)  # the loop's passes, as iterations of the trace
    drawn = write_report(traced.path, tmp_path / "report", spec=spec, loop=traced.loop)
    assert drawn.html.is_file() and drawn.summary.loop == traced.loop and drawn.summary.lines == traced.lines


def test_the_two_micro_batch_livelock_is_an_eight_pass_lasso_found_before_the_detector_would_fire(tmp_path):
    """Before P1 two requests pause each other forever with two micro-batches in flight: the counterexample is a
    lasso whose loop is the eight passes that repeat, and all of it is shorter than the detector's limit."""
    (mb2,) = select_bounds(["mb2_livelock"])
    report = check_bound(mb2, spec=before_p1_spec(tmp_path), counterexample_dir=tmp_path)
    result = report.refinement
    assert report.violated_invariant == "LIVE-DONE" and result.message.startswith("livelock"), result.message
    loop = loop_of(result)
    assert len(loop) == 8 and all(action == ("step",) for action, _ in loop)
    assert len(result.path) < scheduler_config(mb2).no_progress_limit
    fired = fired_in(loop)
    for rid in (0, 1):
        for event in ("replaying -recompute_pause-> awaiting_consensus", "recompute_paused -replay-> replaying"):
            assert f"{rid}: {event}" in fired, fired
    traced = report.counterexample_trace
    assert traced is not None and traced.loop is not None and traced.loop[1] - traced.loop[0] + 1 == len(loop)


def test_going_round_the_lasso_returns_to_its_world_and_the_detector_stops_it(tmp_path):
    """The lasso is a run of the real scheduler: its loop comes back to the world it starts from, and going round
    it again and again, the no-progress detector (A4) stops it, as the quotient's soundness argument says."""
    (mb2,) = select_bounds(["mb2_livelock"])
    refinement = Refinement(mb2, before_p1_spec(tmp_path))
    result = refinement.explore()
    loop = [action for action, _ in loop_of(result)]
    world = refinement.initial()
    for action, _ in result.path[: result.loop_start]:
        refinement.apply(world, action)
    at_loop = fingerprint(world)
    for action in loop:
        refinement.apply(world, action)
    assert fingerprint(world) == at_loop
    with pytest.raises(InvariantViolation, match="no request made progress"):
        for _ in range(scheduler_config(mb2).no_progress_limit):
            for action in loop:
                refinement.apply(world, action)


# --------------------------------------------------------------------------------- the stall, a verdict apart
def late_copies_at(limit: int) -> Bound:
    (late,) = select_bounds(["late_copies"])
    return Bound.from_dict({**late.to_dict(), "no_progress_limit": limit}, f"late_copies_limit_{limit}")


def with_the_counter(world) -> tuple:
    """The fingerprint with the no-progress counter, as it was: the worlds with their counters."""
    return (fingerprint(world), world.scheduler.idle_iterations)


@pytest.mark.parametrize("limit", [2, 3, 4, 5])
def test_the_stall_verdict_is_that_of_the_worlds_with_their_counters(monkeypatch, limit):
    """At every limit the quotient search reaches the verdict of the search that keeps the counter in the
    fingerprint: a stall (a run without progress longer than the limit, not a loop) is found exactly when it is
    reachable."""
    bound = late_copies_at(limit)
    quotient = Refinement(bound).explore()
    monkeypatch.setattr(refinement_module, "fingerprint", with_the_counter)
    product = Refinement(bound).explore()
    assert quotient.verdict == product.verdict, (quotient.message, product.message)
    assert quotient.states <= product.states
    if quotient.verdict == VIOLATED:
        assert "no request made progress" in quotient.message and quotient.loop_start is None


def test_keeping_only_the_first_count_a_world_is_reached_with_misses_a_stall(monkeypatch):
    """The search expands a world again when a larger no-progress count reaches it; without that, a stall that a
    longer run without progress reaches is missed (planted: a world's count never rises)."""
    bound = late_copies_at(4)
    assert Refinement(bound).explore().verdict == VIOLATED
    monkeypatch.setattr(NoProgressCounts, "raised", lambda self, *args: None)
    assert Refinement(bound).explore().verdict == HOLDS


def test_the_fingerprint_leaves_the_no_progress_counter_out():
    (bound,) = select_bounds(["progress_detector"])
    refinement = Refinement(bound)
    world = refinement.initial()
    refinement.apply(world, ("submit", 0))
    refinement.apply(world, ("step",))
    other = refinement.clone(world)
    other.scheduler._idle_iterations += 1
    assert fingerprint(other) == fingerprint(world)
    assert world_module.fingerprint is fingerprint
