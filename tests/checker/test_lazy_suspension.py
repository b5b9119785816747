"""Lazy suspension in the model checker: the bounds that show which suspend rules are safe (the engine's ladder hangs
on a GPU-only bound, the shipped rule holds there and with a host tier too small for any victim), eager offload
checked by a bound field, and the checks lazy suspension added (RESUME-COPY, PROMOTE-GATE's pass clauses, a release's
copy direction taken from the request's own fences), each shown catching a planted bug. Bugs are injected (effects
class, spec copy, monkeypatch), never by editing library files."""

from __future__ import annotations

import typing
from collections import Counter

import pytest

import kvstate.checker.effects as effects_module
import kvstate.pool as pool_module
from kvstate.checker import HOLDS, VIOLATED, AbstractEffects, Bound, check_bound, select_bounds
from kvstate.checker.bounds import BoundsError
from kvstate.checker.invariants import promotion_gate_clauses
from kvstate.checker.observed import ObservedScheduler
from kvstate.checker.refinement import Refinement
from kvstate.checker.world import bound_spec
from kvstate.report import write_report
from kvstate.semantics import GUARDS
from kvstate.spec import load_spec, packaged_spec_path
from kvstate.trace import read_trace

SPEC = load_spec()
SHIPPED_RULE = 'suspend_rule = "host_takes_every_held_block"'
LOOP_MARK = "-- the following steps repeat forever --"


def ladder_spec(tmp_path):
    """A copy of the packaged spec with the production engine's ladder: suspend whatever the host tier can take."""
    text = packaged_spec_path().read_text(encoding="utf-8")
    assert SHIPPED_RULE in text
    path = tmp_path / "lifecycle.toml"
    path.write_text(text.replace(SHIPPED_RULE, 'suspend_rule = "always"'), encoding="utf-8")
    spec = load_spec(path)
    assert spec.policy.suspend_rule == "always"
    return spec


class CountingScheduler(ObservedScheduler):
    """The observed scheduler, counting (class-wide: worlds are deep copies) the transitions it takes by edge."""

    taken: typing.ClassVar[Counter] = Counter()

    def _record(self, request, transition) -> None:
        super()._record(request, transition)
        CountingScheduler.taken[transition.source, transition.event, transition.dest] += 1


def taken_by_the_scheduler(bound: Bound) -> Counter:
    CountingScheduler.taken = Counter()
    result = Refinement(bound, SPEC, scheduler_class=CountingScheduler).explore()
    assert result.verdict == HOLDS, result.message
    return CountingScheduler.taken


# ------------------------------------------------------------------------------ which suspend rules are safe
def test_the_engines_ladder_hangs_on_the_gpu_only_bound_with_a_counterexample(tmp_path):
    (bound,) = select_bounds(["gpu_only_ladder"])
    assert bound.host_blocks == 0
    report = check_bound(bound, spec=ladder_spec(tmp_path), counterexample_dir=tmp_path)
    assert report.verdict == VIOLATED and report.violated_invariant == "LIVE-DONE", report.counterexample
    assert report.abstract.verdict == HOLDS  # the spec allows the hang's steps; the policy takes them
    text = "\n".join(report.counterexample)
    assert "livelock" in text and LOOP_MARK in text  # a cycle of worlds: the detector need not fire
    loop = text.split(LOOP_MARK)[1]
    assert "running -suspend-> suspended" in loop and "suspended -resume-> running" in loop
    assert "recompute_pause" not in loop  # suspension freed nothing, and nothing else was tried
    assert report.counterexample_file is not None and report.counterexample_file.exists()
    traced = report.counterexample_trace
    assert traced is not None and traced.path.name == "kvstate-counterexample-gpu_only_ladder.ndjson"
    assert traced.loop is not None and traced.lines > 0
    edges = {(t.event, t.source, t.dest) for t in SPEC.transitions}
    lines = list(read_trace(traced.path))
    assert len(lines) == traced.lines and all((line["event"], line["from"], line["to"]) in edges for line in lines)
    assert {line["event"] for line in lines} == {"admit", "suspend", "resume"}


def test_the_ladder_counterexample_is_drawn_by_kvstate_report(tmp_path):
    (bound,) = select_bounds(["gpu_only_ladder"])
    spec = ladder_spec(tmp_path)
    traced = check_bound(bound, spec=spec, counterexample_dir=tmp_path).counterexample_trace
    assert traced is not None and traced.loop is not None
    report = write_report(traced.path, tmp_path / "report", spec=spec, loop=traced.loop)
    assert report.html.is_file() and report.summary.lines == traced.lines


def test_the_shipped_suspend_rule_holds_on_the_gpu_only_bound_and_never_suspends_there():
    (bound,) = select_bounds(["gpu_only_ladder"])
    assert check_bound(bound, counterexample_dir=None).verdict == HOLDS
    taken = taken_by_the_scheduler(bound)
    assert not any(event == "suspend" for _, event, _ in taken)  # SUSPEND-ROOM: it would free nothing
    assert any(event == "recompute_pause" for _, event, _ in taken)


def test_a_host_tier_too_small_for_any_victim_holds_and_every_victim_is_recompute_paused():
    (bound,) = select_bounds(["small_host"])
    assert 0 < bound.host_blocks < min(p for p, _ in bound.requests)  # a victim holds more blocks than that
    assert check_bound(bound, counterexample_dir=None).verdict == HOLDS
    taken = taken_by_the_scheduler(bound)
    assert not any(event in ("suspend", "offload") for _, event, _ in taken)
    assert any(event == "recompute_pause" for _, event, _ in taken)


def test_the_scheduler_promotes_on_the_promotion_bound_and_holds():
    (bound,) = select_bounds(["promotion"])
    taken = taken_by_the_scheduler(bound)
    assert taken[SPEC.role("offloaded"), "recompute_pause", SPEC.role("dropped")] > 0


# ------------------------------------------------------------------------------------------ eager offload
def test_eager_offload_is_checked_by_a_bound_field_in_place_of_the_specs_rule():
    eager = [b for b in select_bounds(None) if b.offload == "eager"]
    assert {b.name for b in eager} >= {"default_eager", "late_copies_eager", "inflight_suspend_eager"}
    for bound in eager:
        assert bound_spec(bound, SPEC).policy.offload == "eager" and SPEC.policy.offload == "on_demand"
    (default,) = select_bounds(["default"])
    assert bound_spec(default, SPEC) is SPEC
    taken = taken_by_the_scheduler(next(b for b in eager if b.name == "default_eager"))
    assert taken["suspended", "offload", "suspended"] > 0


def test_a_bound_offload_must_be_one_of_the_policys_offload_rules():
    with pytest.raises(BoundsError, match="offload"):
        Bound(name="x", requests=((1, 1),), gpu_blocks=2, offload="lazy")


# ------------------------------------------------------------------------------------------- offload copies
def test_offload_copies_complete_late_or_fail_and_a_failed_one_is_undone_by_losing_the_host_copy():
    """An offload's copy is explored like every copy: late up to copy_delay passes, or failed when issued or later;
    a failure is undone by lose_host_copy (the request replays), as the spec's undo of a failed offload says."""
    (bound,) = select_bounds(["late_copies"])
    assert bound.copy_delay and bound.env_copy_failures
    refinement = Refinement(bound, SPEC)
    after_failure: Counter = Counter()
    apply = refinement.apply

    def observed(world, action) -> None:
        apply(world, action)
        if action[0] == "fail" or (action[0] == "step" and len(action) > 1):  # a copy in flight, or one issued, fails
            after_failure.update(event for _, _, event, _ in world.scheduler.transition_log)

    refinement.apply = observed  # type: ignore[method-assign]
    assert refinement.explore().verdict == HOLDS
    assert after_failure["lose_host_copy"] > 0 and after_failure["offload"] > 0, after_failure


# ------------------------------------------------------------------------------------------- RESUME-COPY
def test_a_resume_that_places_its_onboarded_blocks_after_its_held_ones_is_caught(monkeypatch):
    """The host blocks a resume copies up hold the start of the request's KV: placed after its held GPU blocks, its
    table is out of order. RESUME-COPY catches it on the transition, before any output goes wrong."""
    (bound,) = select_bounds(["default"])
    monkeypatch.setattr(pool_module.Tier, "take_front", pool_module.Tier.take)
    report = check_bound(bound, counterexample_dir=None)
    assert report.verdict == VIOLATED and report.violated_invariant == "RESUME-COPY", report.counterexample
    assert "placed before its held GPU blocks" in report.refinement.message


class CopiesEveryBlockUp(AbstractEffects):
    """The resume before lazy suspension: every block the request holds is copied, its held GPU blocks too."""

    def lock_and_onboard(self, request, transition) -> None:
        held = request.gpu
        super().lock_and_onboard(request, transition)
        request.incoming += held


def test_a_resume_that_copies_its_held_gpu_blocks_too_is_caught_on_the_abstract_model():
    (bound,) = select_bounds(["default"])
    report = check_bound(bound, effects=CopiesEveryBlockUp, refine=False)
    assert report.verdict == VIOLATED and report.violated_invariant == "RESUME-COPY", report.counterexample
    assert "copies exactly its host blocks" in report.counterexample[0]


# ------------------------------------------------------------------------------------------ PROMOTE-GATE
def test_the_promotion_gates_pass_clauses():
    assert promotion_gate_clauses(3, 4, has_host_tier=False) is None  # an earlier pass's suspension: always
    assert promotion_gate_clauses(4, 4, has_host_tier=True) is None  # this pass's, with a host tier
    assert "same pass without a host tier" in (promotion_gate_clauses(4, 4, has_host_tier=False) or "")
    assert "outside a scheduling pass" in (promotion_gate_clauses(4, None, has_host_tier=True) or "")
    assert "in the pipeline" in (promotion_gate_clauses(3, 4, has_host_tier=True, step_in_flight=True) or "")


def test_the_abstract_promotion_check_sees_a_gate_closed_for_this_passs_suspensions(monkeypatch):
    """The abstract model counts every suspension as one of an earlier pass, so its gate is open. Were it to count
    them as this pass's, a guard that ignored the gate's host clause would promote without a host tier: the abstract
    PROMOTE-GATE check reads the same pass figures the guard does and catches it."""
    (bound,) = select_bounds(["no_host"])
    monkeypatch.setattr(effects_module.RequestState, "suspended_in_pass", effects_module.PoolState.pass_number)

    def without_the_host_clause(request, pool) -> bool:
        return pool.pass_number is not None

    report = check_bound(bound, guards={**GUARDS, "promotion_gate": without_the_host_clause}, refine=False)
    assert report.verdict == VIOLATED and report.violated_invariant == "PROMOTE-GATE", report.counterexample
    assert check_bound(bound, refine=False).verdict == HOLDS


# ------------------------------------------------------------------------------ a release during an offload
class ReleaseByTier(AbstractEffects):
    """A release that takes its copy's direction from the tiers the request holds (destinations on the GPU whenever
    it holds GPU blocks), as before suspended requests could hold blocks in both tiers."""

    def _release(self, request) -> None:
        incoming_gpu = request.incoming if request.gpu else 0
        incoming_host = request.incoming - incoming_gpu
        self.pool.gpu_free += request.gpu - incoming_gpu
        self.pool.host_free += request.host - incoming_host
        self.pool.gpu_fenced += incoming_gpu
        self.pool.host_fenced += incoming_host
        request.fenced_gpu += incoming_gpu
        request.fenced_host += incoming_host
        request.gpu = request.host = request.incoming = 0


def test_a_release_that_takes_its_copys_direction_from_the_tiers_held_is_caught():
    """A suspended request split across both tiers with an offload in flight is released: its host destinations
    must stay fenced by the offload; taken for GPU blocks, the GPU tier keeps fencing blocks it does not have (more
    destinations than held GPU blocks: a negative free count) while the host tier frees blocks still written."""
    (bound,) = select_bounds(["default"])
    report = check_bound(bound, effects=ReleaseByTier, refine=False)
    assert report.verdict == VIOLATED, "the planted release was not caught"
    assert report.violated_invariant in ("CONS-GPU", "CONS-HOST", "OWN-EXCL"), report.counterexample
    assert "offload" in "\n".join(report.counterexample)
