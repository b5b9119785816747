"""Liveness that can fail: planted livelocks and deadlocks on the abstract model, each caught with its id, and the
checks themselves shown to matter (disabling the deadlock or the bottom-SCC check changes what a test sees).

Environment events (the spec's `origin = "environment"`: cancel, abort, lose_host_copy) are never a way out of a
loop under fairness, so each plant is caught on a bound with cancellation as well as on one without. Plants are
made on in-memory copies of the packaged spec (validated, so the checker and not the loader catches them) and by
injected guards, never by editing library files.
"""

from __future__ import annotations

from dataclasses import replace
from importlib import import_module

import pytest

from kvstate.checker import HOLDS, VIOLATED, AbstractEffects, Bound, check_bound, replay_refinement, select_bounds
from kvstate.semantics import GUARDS
from kvstate.spec import Spec, load_spec
from kvstate.validate import validate_spec

BOUNDS = {b.name: b for b in select_bounds(["no_host", "no_cancel"])}
WITH_AND_WITHOUT_CANCEL = pytest.mark.parametrize("bound", ["no_host", "no_cancel"])  # cancel: yes, no
LOOP_MARK = "-- the following steps repeat forever --"
EXPLORE = import_module("kvstate.checker.explore")  # the module (the package exports a function of that name)


def never(request, pool) -> bool:
    return False


def edit_event(spec: Spec, event: str, **changes) -> Spec:
    """A copy of `spec` with `changes` applied to every transition of `event`; validated (a well-formed spec)."""
    assert event in spec.event_by_name, f"the packaged spec has no event {event!r}"
    events = tuple(
        replace(e, transitions=tuple(replace(t, **changes) for t in e.transitions)) if e.name == event else e
        for e in spec.events
    )
    return replace(spec, events=events)


def valid(spec: Spec) -> Spec:
    validate_spec(spec)
    return spec


def live_done(report) -> str:
    assert report.verdict == VIOLATED, "the planted livelock was not caught"
    assert report.violated_invariant == "LIVE-DONE", report.counterexample
    text = "\n".join(report.counterexample)
    assert LOOP_MARK in text, text  # a lasso: prefix, then the loop that repeats
    return text


def catch_up_self_loop() -> Spec:
    """catch_up leads back to its own source: a caught-up replay never runs again."""
    spec = load_spec()
    (source,) = {t.source for t in spec.event_by_name["catch_up"].transitions}
    return valid(edit_event(spec, "catch_up", dest=source))


class MovesNothing(AbstractEffects):
    """Suspend, offload and resume move no blocks: the victim keeps its GPU blocks."""

    def hold_blocks(self, request, transition) -> None:
        pass

    def offload_held_blocks(self, request, transition) -> None:
        pass

    def lock_and_onboard(self, request, transition) -> None:
        pass


def suspend_that_frees_nothing() -> tuple[Spec, dict]:
    """A preemption that frees nothing: the suspended state gets the running state's residency, suspend, offload and
    resume move no blocks (`MovesNothing`) and recompute-pause never happens, so two requests that fill the GPU tier
    can only suspend and resume each other forever."""
    spec = load_spec()
    suspend = spec.event_by_name["suspend"].transitions[0]
    states = tuple(
        replace(s, residency=spec.residency(suspend.source)) if s.name == suspend.dest else s for s in spec.states
    )
    spec = valid(replace(spec, states=states))
    guards = {**GUARDS, **{t.guard: never for t in spec.event_by_name["recompute_pause"].transitions if t.guard}}
    return spec, guards


@WITH_AND_WITHOUT_CANCEL
def test_catch_up_self_loop_is_a_livelock(bound):
    text = live_done(check_bound(BOUNDS[bound], spec=catch_up_self_loop(), refine=False))
    assert "catch_up" in text


@pytest.mark.parametrize("cancel", [True, False])
def test_suspend_resume_ping_pong_is_a_livelock(cancel):
    spec, guards = suspend_that_frees_nothing()
    # two requests fill the GPU tier and both need a block to decode; a whole (replay) prompt per chunk, so a
    # request whose host copy the environment drops replays in one go instead of deadlocking the other
    bound = Bound(
        name="ping_pong",
        requests=((2, 2), (2, 2)),
        gpu_blocks=4,
        host_blocks=4,
        block_size=1,
        chunk_size=4,
        cancel=cancel,
    )
    text = live_done(check_bound(bound, spec=spec, guards=guards, effects=MovesNothing, refine=False))
    loop = text.split(LOOP_MARK)[1]
    assert "takes event suspend" in loop and "takes event resume" in loop and "computes" not in loop


def test_the_unplanted_spec_holds_on_the_same_bounds():
    """The plants above are what the checker catches: the packaged spec holds on the very same bounds."""
    for bound in BOUNDS.values():
        assert check_bound(bound, refine=False).verdict == HOLDS


# ------------------------------------------------------------------------------------------ deadlock check
def admission_that_never_fits() -> dict:
    """A guard injection under which no request is ever admitted: every arrived request waits forever, and only an
    environment event (cancel, abort) could end it."""
    return {**GUARDS, "gpu_room_for_first_chunk": never}


@WITH_AND_WITHOUT_CANCEL
def test_planted_deadlock_is_reported_as_deadlock(bound):
    report = check_bound(BOUNDS[bound], guards=admission_that_never_fits(), refine=False)
    assert report.verdict == VIOLATED
    assert report.violated_invariant == "DEADLOCK", report.counterexample


def test_without_the_deadlock_check_the_planted_deadlock_is_not_reported_as_deadlock(monkeypatch):
    """Disabling the deadlock check makes test_planted_deadlock_is_reported_as_deadlock fail (the bottom-SCC check
    still sees the stuck state, as LIVE-DONE)."""
    monkeypatch.setattr(EXPLORE, "deadlock", lambda *args: None)
    report = check_bound(BOUNDS["no_host"], guards=admission_that_never_fits(), refine=False)
    assert report.violated_invariant != "DEADLOCK"
    assert report.violated_invariant == "LIVE-DONE"


# --------------------------------------------------------------------------------------- bottom-SCC check
def replay_never_completes() -> dict:
    return {**GUARDS, "replay_complete": never}


@WITH_AND_WITHOUT_CANCEL
def test_replay_that_never_completes_is_a_livelock(bound):
    live_done(check_bound(BOUNDS[bound], guards=replay_never_completes(), refine=False))


def test_without_the_bottom_scc_check_the_livelock_is_reported_as_holding(monkeypatch):
    """Disabling the bottom-SCC check makes test_replay_that_never_completes_is_a_livelock fail."""
    monkeypatch.setattr(EXPLORE, "non_final_bottom_scc", lambda sccs: None)
    assert check_bound(BOUNDS["no_cancel"], guards=replay_never_completes(), refine=False).verdict == HOLDS


# -------------------------------------------------------------------------------------------------- bounds
def test_the_default_set_has_bounds_without_cancellation():
    assert [b.name for b in select_bounds(None) if not b.cancel]


@pytest.mark.parametrize("name", ["max_batch_size", "max_num_tokens"])
@pytest.mark.parametrize("value", [0, -1, True, 2.5])
def test_bound_budgets_must_be_positive_integers(name, value):
    with pytest.raises(ValueError, match=name):
        Bound(name="b", requests=((1, 1),), gpu_blocks=2, **{name: value})


def test_pipeline_livelock_bound_holds():
    """With two pipeline stages, batch 3 and 10 tokens per pass, requests 0, 3 and 4 of this bound cycled
    replay -> recompute-pause -> consensus forever on the scheduler of 8a505f5 (`kvstate check --bound
    pipeline_livelock`: LIVE-DONE, a 5-step loop). The refinement explores every arrival order."""
    (bound,) = select_bounds(["pipeline_livelock"])
    assert (bound.pipeline_stages, bound.max_batch_size, bound.max_num_tokens) == (2, 3, 10)
    report = check_bound(bound, counterexample_dir=None)
    assert report.verdict == HOLDS, "\n".join(report.counterexample)


# The lasso `kvstate check --bound pipeline_livelock` printed on the scheduler of 8a505f5 (the 5-step loop starts
# after the 25th action); the regression file it wrote holds the same actions.
LIVELOCK_8A505F5 = [
    ("submit", 0),
    ("submit", 1),
    ("submit", 2),
    *[("step",)] * 9,
    ("submit", 3),
    ("submit", 4),
    *[("step",)] * 16,
]


def test_the_8a505f5_pipeline_livelock_path_now_finishes():
    """Replayed on the real scheduler with every refinement check, then stepped on: every request finishes
    (replay_refinement raises LIVE-DONE when requests are still unfinished 1000 steps later)."""
    (bound,) = select_bounds(["pipeline_livelock"])
    replay_refinement(bound, LIVELOCK_8A505F5, invariant="LIVE-DONE")
