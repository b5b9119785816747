"""The scheduler refinement explores what executors may do: copies completing late or failing,
micro-batches in flight, and the two bugs that exploration found, fixed.

Planted bugs are monkeypatched into the library (never by editing its files); "removing an exploration" is a
monkeypatch of the checker back to what it explored before (copies completing within their step and moving their
slots when issued, no copy failures, one micro-batch), and each row shows a planted bug that only the exploration
catches.
"""

from __future__ import annotations

import pytest

import kvstate.checker.refinement as refinement_module
import kvstate.pool as pool_module
from kvstate.checker import HOLDS, VIOLATED, Bound, check_bound, select_bounds
from kvstate.checker.refinement import Refinement
from kvstate.checker.world import fingerprint
from kvstate.output import FailedMigration
from kvstate.scheduler import Scheduler, Step
from kvstate.sim import SimExecutor
from kvstate.spec import load_spec, packaged_spec_path
from tests.planted import old_release

# two requests of 2 + 2 tokens in a GPU tier of 4 blocks with a host tier of 2: suspend, resume and replay in a few
# steps, a few dozen worlds
TINY = {
    "requests": [[2, 2], [2, 2]],
    "gpu_blocks": 4,
    "host_blocks": 2,
    "block_size": 1,
    "chunk_size": 2,
    "env_cancels": 1,
    "env_host_losses": 1,
    "abstract_model": False,
}


def bound(name: str = "tiny", **changes) -> Bound:
    return Bound.from_dict({**TINY, **changes}, name)


def old_policy_spec(tmp_path):
    """The packaged spec with the policy before P1: a requester without an eligible victim preempts itself."""
    text = packaged_spec_path().read_text(encoding="utf-8")
    rule = 'no_eligible_victim = "wait_for_chunk_in_flight"'
    assert rule in text
    path = tmp_path / "lifecycle.toml"
    path.write_text(text.replace(rule, 'no_eligible_victim = "preempt_self"'), encoding="utf-8")
    return load_spec(path)


# ------------------------------------------------------------------------------------------- the two bugs
def test_the_mb2_livelock_bound_holds_and_the_policy_before_p1_livelocks_on_it(tmp_path):
    (mb2,) = select_bounds(["mb2_livelock"])
    assert (mb2.micro_batches, mb2.requests, mb2.gpu_blocks) == (2, ((5, 1), (5, 1)), 3)
    assert check_bound(mb2, counterexample_dir=None).verdict == HOLDS
    report = check_bound(mb2, spec=old_policy_spec(tmp_path), counterexample_dir=tmp_path)
    assert report.verdict == VIOLATED and report.violated_invariant == "LIVE-DONE", report.counterexample
    text = "\n".join(report.counterexample)
    assert "-- the following steps repeat forever --" in text and "recompute_pause" in text
    assert report.counterexample_file is not None and report.counterexample_file.exists()


# -------------------------------------------------------------------------------------- planted bugs
def schedules_while_copying(self):
    """Resident requests whose resume copy is still in flight are scheduled (the forward reads KV not back yet)."""
    return self.in_flight


def fails_without_undoing(self, output, plan):
    """A failed copy is withdrawn, but its request is not moved: it keeps an unusable host copy."""
    request = self.requests.get(plan.request_id)
    self._end_copy(plan)
    return FailedMigration(plan, request, "lose_host_copy")


ORIGINAL_OFFLOAD = pool_module.TieredBlockPool.offload


def offload_freeing_sources(self, owner, count):
    """The fence bug: an offload's GPU source blocks are freed at once instead of staying fenced."""
    plan = ORIGINAL_OFFLOAD(self, owner, count)
    self.gpu.unfence(self.gpu.fenced_by(plan.plan_id))
    return plan


class CopiesWithinTheStep(SimExecutor):
    """The executor timing the refinement once explored: every copy moves its slots when issued and is
    reported complete before the forward pass."""

    def step(self, fail=()):
        scheduler = self.scheduler
        while scheduler.must_land(len(self.pipeline)):
            self.land()
        if scheduler.pool.pipeline_stages > 1:
            scheduler.reach_consensus(self.agreed())
        step = self.last_step = Step.begin(scheduler)
        for plan in step.to_issue():
            step.issued(plan, self.copy(plan))
        for plan, _ in step.to_wait():
            step.waited(plan)
        step.complete_migrations()
        self.pipeline.append((step, self.compute(step.output)))
        if self.micro_batches == 1:
            self.land()
        return step.output


PLANTS = {
    "double release": (pool_module.TieredBlockPool, "release", old_release),
    "scheduled while its copy is in flight": (Scheduler, "not_ready", schedules_while_copying),
    "failed copy not undone": (Scheduler, "fail_migration", fails_without_undoing),
    "offload frees its sources": (pool_module.TieredBlockPool, "offload", offload_freeing_sources),
}


def check_planted(monkeypatch, plant: str, b: Bound, spec=None):
    cls, name, replacement = PLANTS[plant]
    monkeypatch.setattr(cls, name, replacement)
    return check_bound(b, spec=spec, counterexample_dir=None)


# ---------------------------------------------------------------------------------------- mutation table
# (exploration, planted bug, bound with it, bound without it, invariant that catches it)
MUTATION_TABLE = [
    ("copies completing late", "double release", {"copy_delay": 1}, {"copy_delay": 0}, "SPEC-EDGE"),
    (
        "copies completing late",
        "scheduled while its copy is in flight",
        {"copy_delay": 1},
        {"copy_delay": 0},
        "OUT-EQUIV",
    ),
    ("failed copies", "failed copy not undone", {"env_copy_failures": 1}, {"env_copy_failures": 0}, "OUT-STATE"),
]


@pytest.mark.parametrize(("exploration", "plant", "with_it", "without", "invariant"), MUTATION_TABLE)
def test_each_exploration_catches_a_planted_bug_that_passes_without_it(
    monkeypatch, exploration, plant, with_it, without, invariant
):
    caught = check_planted(monkeypatch, plant, bound(**with_it))
    assert caught.verdict == VIOLATED and caught.violated_invariant == invariant, caught.counterexample
    assert check_planted(monkeypatch, plant, bound(**without)).verdict == HOLDS, f"{exploration} is not what caught it"


def test_micro_batches_in_flight_catch_the_policy_before_p1(tmp_path):
    """Removing micro-batches from the exploration (one output in flight) lets the policy before P1 through."""
    (mb2,) = select_bounds(["mb2_livelock"])
    spec = old_policy_spec(tmp_path)
    assert check_bound(mb2, spec=spec, counterexample_dir=None).violated_invariant == "LIVE-DONE"
    one = Bound.from_dict({**mb2.to_dict(), "micro_batches": 1}, "one_micro_batch")
    assert check_bound(one, spec=spec, counterexample_dir=None).verdict == HOLDS


def test_the_planted_fence_bug_is_caught_on_a_default_bound_and_passed_the_timing_of_before(monkeypatch):
    """A suspend's GPU sources freed at once passed `kvstate check --bound default`, whose executor copied
    every block when issued and completed it before the forward pass. Since suspension is lazy the copy is an
    offload's, and on `blocks2` (a block freed early is taken by the next allocation of the pass) copies that move
    their slots when they complete (after the forward pass) catch it; with the timing of before it still passes."""
    (blocks2,) = select_bounds(["blocks2"])
    report = check_planted(monkeypatch, "offload frees its sources", blocks2)
    assert report.verdict == VIOLATED and report.violated_invariant == "OUT-EQUIV", report.counterexample
    monkeypatch.setattr(refinement_module, "SimExecutor", CopiesWithinTheStep)
    assert check_bound(blocks2, counterexample_dir=None).verdict == HOLDS


def test_with_a_copy_in_flight_across_steps_the_step_refinement_sees_the_fence_bug_too(monkeypatch):
    """With copies a pass late, the abstraction shows the copy's fenced sources: the step refinement finds the
    offload that freed them (REFINES) before any output goes wrong."""
    report = check_planted(monkeypatch, "offload frees its sources", bound(copy_delay=1))
    assert report.violated_invariant == "REFINES", report.counterexample


def test_the_unplanted_scheduler_holds_on_every_timing_of_the_tiny_bound():
    report = check_bound(bound(copy_delay=1, env_copy_failures=1, env_aborts=1), counterexample_dir=None)
    assert report.verdict == HOLDS, report.counterexample


# ------------------------------------------------------------------------------- exploration, directly
def test_the_refinement_offers_every_executor_choice():
    """Between two steps with a copy in flight: complete it early, fail it, and (several micro-batches) land the
    oldest output early; a step may fail the k-th copy it issues."""
    r = Refinement(bound(copy_delay=1, env_copy_failures=1, pipeline_stages=2, micro_batches=2))
    world = r.initial()
    kinds: set = set()
    for action in [("submit", 0), ("submit", 1), *[("step",)] * 6]:
        r.apply(world, action)
        kinds |= {a[0] if a[0] != "step" or len(a) == 1 else "step-fail" for a in r.environment.actions(world)}
    assert {"step", "step-fail", "complete", "fail", "land", "cancel"} <= kinds, kinds


def test_the_fingerprint_includes_what_the_no_progress_detector_reads():
    """What decides whether a pass makes progress and the detector's allowance; not its counter, which the search
    keeps apart (the largest per world: tests/checker/test_lasso.py)."""
    r = Refinement(bound())
    world = r.initial()
    r.apply(world, ("submit", 0))
    r.apply(world, ("step",))
    other = r.clone(world)
    other.scheduler._idle_iterations += 1
    assert fingerprint(other) == fingerprint(world)
    other = r.clone(world)
    other.scheduler.get(0).replay_high_water += 1
    assert fingerprint(other) != fingerprint(world)
    other = r.clone(world)
    other.scheduler.get(0).num_recompute_pauses += 1  # the detector's allowance for replays reads it
    assert fingerprint(other) != fingerprint(world)


def test_the_fingerprint_includes_the_order_held_blocks_are_offloaded_in():
    """The least recently held request's blocks move first: two worlds that differ only in that order differ."""
    r = Refinement(bound())
    world = r.initial()
    r.apply(world, ("submit", 0))
    one, other = r.clone(world), r.clone(world)
    one.scheduler.pool._held = {0: None, 1: None}
    other.scheduler.pool._held = {1: None, 0: None}
    assert fingerprint(one) != fingerprint(other)


def test_the_fingerprint_includes_whether_the_preemption_cap_is_reached():
    r = Refinement(bound(max_preemptions=1))
    world = r.initial()
    r.apply(world, ("submit", 0))
    r.apply(world, ("step",))
    other = r.clone(world)
    other.scheduler.get(0).num_suspensions += 1
    assert fingerprint(other) != fingerprint(world)
    once, twice = r.clone(other), r.clone(other)
    twice.scheduler.get(0).num_suspensions += 1  # past the cap: the scheduler reads only that it is reached
    assert fingerprint(twice) == fingerprint(once)


def test_a3_stop_tokens_and_a4_each_appear_in_a_default_bound():
    bounds = select_bounds(None)
    assert any(b.max_preemptions is not None for b in bounds)
    assert any(b.no_progress_limit is not None for b in bounds)
    assert any(b.stop_tokens for b in bounds)
    assert any(b.copy_delay for b in bounds) and any(b.env_copy_failures for b in bounds)


def test_the_no_progress_detector_bound_is_calibrated():
    """At its limit the detector never stops a legitimate run of `progress_detector`; one pass less and it does
    (a requester waits two passes for the room a copy a pass late frees): the limit is what the bound shows."""
    (detector,) = select_bounds(["progress_detector"])
    assert check_bound(detector, counterexample_dir=None).verdict == HOLDS
    lower = Bound.from_dict({**detector.to_dict(), "no_progress_limit": detector.no_progress_limit - 1}, "lower")
    report = check_bound(lower, counterexample_dir=None)
    assert report.violated_invariant == "LIVE-DONE" and "no request made progress" in report.refinement.message


@pytest.mark.parametrize(
    ("key", "value"),
    [("copy_delay", -1), ("env_copy_failures", True), ("env_aborts", 1.5), ("stop_at", [0]), ("stop_at", [2, 0])],
)
def test_bad_timing_keys_are_refused_with_the_key_named(key, value):
    with pytest.raises(ValueError, match=key):
        Bound.from_dict({**TINY, key: value}, "bad")
