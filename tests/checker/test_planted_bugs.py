"""Deliberately wrong guards, effects, specs and scheduler code: the checker must catch each with a
counterexample naming the invariant. Bugs are injected (guards mapping, effects class, spec copy, monkeypatch),
never by editing library files."""

from __future__ import annotations

import pytest

from kvstate.checker import VIOLATED, AbstractEffects, Bound, check_bound, select_bounds
from kvstate.scheduler import Scheduler
from kvstate.scheduler.held_blocks import HeldBlocks
from kvstate.semantics import GUARDS
from kvstate.spec import load_spec, packaged_spec_path

BOUNDS = {b.name: b for b in select_bounds(["default", "no_host", "pipeline2"])}


def caught(report, *invariants: str) -> str:
    assert report.verdict == VIOLATED, "the planted bug was not caught"
    assert report.violated_invariant in invariants, report.counterexample
    assert report.counterexample and report.counterexample[0].startswith("counterexample")
    assert any(line.startswith("1. ") for line in report.counterexample)
    return "\n".join(report.counterexample)


def always(request, pool) -> bool:
    return True


class OffloadsWhatIsAsked(AbstractEffects):
    """The offload moves every block the allocation asks for, whether the host tier has room for them or not."""

    def offload_held_blocks(self, request, transition):
        moved = min(request.gpu, self.pool.offload_limit)
        self.pool.gpu_fenced += moved
        self.pool.host_free -= moved
        request.gpu -= moved
        request.host += moved
        request.fenced_gpu, request.incoming = moved, moved


@pytest.mark.parametrize("bound", ["default", "no_host"])
def test_offload_without_host_room(bound):
    """Held blocks moved to the host tier without room there (the guard and the effect both ignore it): the move
    that suspension was before lazy suspension made it an offload."""

    def ignores_host_room(request, pool) -> bool:  # the guard without its host tier and host room clauses
        return not request.copy_in_flight and request.num_gpu_blocks >= 1 and pool.offload_limit >= 1

    guards = {**GUARDS, "host_room_for_held_blocks": ignores_host_room}
    text = caught(
        check_bound(BOUNDS[bound], guards=guards, effects=OffloadsWhatIsAsked, refine=False),
        "OWN-EXCL",
        "CONS-HOST",
        "HOST-CAP",
        "NO-HOST-NO-OFFLOAD",
    )
    assert "offload" in text


def test_recompute_pause_that_keeps_its_blocks():
    class KeepsBlocks(AbstractEffects):
        def release_kv_and_reset(self, request, transition):
            request.prefill = request.prompt_len + request.generated
            request.computed = 0  # forgets to free its blocks

    text = caught(check_bound(BOUNDS["no_host"], effects=KeepsBlocks, refine=False), "RES-STATE", "RESET-CLEARED")
    assert "recompute_pause" in text


def test_replay_that_forgets_generated_tokens():
    class Forgets(AbstractEffects):
        def release_kv_and_reset(self, request, transition):
            super().release_kv_and_reset(request, transition)
            request.prefill = request.prompt_len  # replay prompt without the generated tokens

    text = caught(check_bound(BOUNDS["no_host"], effects=Forgets, refine=False), "RESET-PROMPT")
    assert "replay prompt" in text


def test_resume_that_ignores_gpu_room():
    def ignores_gpu_room(request, pool) -> bool:  # the guard without its GPU room clause
        return not request.copy_in_flight and pool.resume_gate_open

    guards = {**GUARDS, "gpu_room_for_offloaded_blocks": ignores_gpu_room}
    text = caught(check_bound(BOUNDS["default"], guards=guards, refine=False), "OWN-EXCL", "CONS-GPU")
    assert "resume" in text


def test_victim_chosen_twice(monkeypatch):
    """Scheduler._victim_eligible without its `victims` test picks a victim that could not be preempted again."""

    def ignores_victims(self, candidate, step):
        cap = self.config.max_preemptions_per_request
        return (
            candidate.request_id not in step.output.chunk_tokens
            and not candidate.about_to_finish
            and (cap is None or candidate.num_suspensions + candidate.num_recompute_pauses < cap)
        )

    # recompute-pause disabled and a host tier too small for any victim: a victim can be neither suspended
    # nor paused, so only the victims set keeps it from being chosen again
    bound = Bound(
        name="victims",
        requests=((2, 3), (2, 3)),
        gpu_blocks=5,
        host_blocks=1,
        block_size=1,
        chunk_size=2,
        recompute_pause=False,
        env_cancels=0,
    )
    monkeypatch.setattr(Scheduler, "_victim_eligible", ignores_victims)
    text = caught(check_bound(bound), "VICTIM-ONCE")
    assert "scheduler refinement" in text


def test_spec_edit_resume_to_done(tmp_path):
    text = packaged_spec_path().read_text()
    edited = text.replace(
        '{ source = ["suspended"], dest = "running", guard = "gpu_room_for_offloaded_blocks"',
        '{ source = ["suspended"], dest = "done", guard = "gpu_room_for_offloaded_blocks"',
    )
    path = tmp_path / "lifecycle.toml"
    path.write_text(edited)
    report = check_bound(BOUNDS["default"], spec=load_spec(path), counterexample_dir=tmp_path)
    text = caught(report, "RES-STATE")
    assert "resume: suspended -> done" in text
    assert report.counterexample_file is not None and report.counterexample_file.exists()


def test_consensus_that_replays_a_cancelled_request():
    guards = {**GUARDS, "replay_still_wanted": always, "termination_requested": lambda request, pool: False}
    caught(check_bound(BOUNDS["pipeline2"], guards=guards, refine=False), "RESET-TERMINATED", "PP-TERMINATE")


def test_correct_model_holds_on_the_same_bounds():
    for bound in BOUNDS.values():
        assert check_bound(bound, refine=False).verdict == "holds"


def test_blocks_offloaded_before_every_stage_retired_the_step_are_caught(monkeypatch):
    """Eager offload without its wait for the victim's step in flight: the victim's GPU blocks move to the host tier
    and are released while the later stages of its decode step still write them, so the host copy lacks that KV
    and the resumed request's later stage reads what its first stage did not (OUT-EQUIV)."""
    eager = HeldBlocks._offload_for_eagerly

    def ignores_step_in_flight(self, victim, requester, pass_):
        in_flight, self.in_flight = self.in_flight, {}
        try:
            eager(self, victim, requester, pass_)
        finally:
            self.in_flight = in_flight

    (bound,) = select_bounds(["inflight_suspend_eager"])
    assert bound.pipeline_stages >= 2 and bound.micro_batches >= 2
    assert check_bound(bound).verdict == "holds"
    monkeypatch.setattr(HeldBlocks, "_offload_for_eagerly", ignores_step_in_flight)
    text = caught(check_bound(bound), "OUT-EQUIV")
    assert "pipeline stage 1 reads" in text and "offload" in text


def test_a_pass_planned_with_every_micro_batch_in_flight_is_refused(monkeypatch):
    """`must_land` one output late: the executor refuses to carry out more micro-batches than it keeps."""
    monkeypatch.setattr(Scheduler, "must_land", lambda self, n: n > 0 and n > self.micro_batches)
    (bound,) = select_bounds(["stop_inflight"])
    text = caught(check_bound(bound), "SPEC-EDGE")
    assert "MicroBatchesExceeded" in text and "micro-batch(es) are in flight" in text
