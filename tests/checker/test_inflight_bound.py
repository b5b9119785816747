"""Several micro-batches in flight, in the model checker and the pure stepping driver: the `pipeline2_inflight` bound
drives the real scheduler with two outputs in flight, and the refinement reaches worlds in which a request preempted
while its decode step is in flight receives that token suspended (in its held blocks) or awaiting consensus (a
deferred finish); the sim keeps outputs equal to the reference with stop tokens, and never schedules a request
twice."""

from __future__ import annotations

import random
import typing
from collections import Counter

import pytest

from kvstate import load_spec
from kvstate.checker.bounds import Bound, BoundsError, load_bounds
from kvstate.checker.explore import HOLDS
from kvstate.checker.observed import ObservedScheduler
from kvstate.checker.refinement import Refinement
from kvstate.config import SchedulerConfig
from kvstate.scheduler import Scheduler
from kvstate.sim import SimExecutor, reference_output

SPEC = load_spec()
PENDING = "awaiting_consensus"


class LandingScheduler(ObservedScheduler):
    """The observed scheduler, counting (class-wide: worlds are deep copies) the tokens that land on a request
    preempted while its decode step was in flight, by the state it is in when the token lands, and (`tails`) by the
    tier that holds the tail of its table then, where the step wrote its KV."""

    landed: typing.ClassVar[Counter] = Counter()
    tails: typing.ClassVar[Counter] = Counter()

    def _land_preempted(self, request, state, sampled) -> bool:
        kept = super()._land_preempted(request, state, sampled)
        LandingScheduler.landed[state, kept] += 1
        if state == self._offloaded:  # a suspended request holds its KV; a reset or ended one holds none
            LandingScheduler.tails["gpu" if self.pool.gpu_blocks(request.request_id) else "host"] += 1
        return kept


def test_the_in_flight_bound_is_in_the_default_set_with_two_micro_batches():
    bounds, default = load_bounds()
    bound = bounds["pipeline2_inflight"]
    assert "pipeline2_inflight" in default
    assert (bound.micro_batches, bound.pipeline_stages) == (2, 2)


def _landings(bound: Bound) -> Counter:
    LandingScheduler.landed, LandingScheduler.tails = Counter(), Counter()
    result = Refinement(bound, SPEC, scheduler_class=LandingScheduler).explore()
    assert result.verdict == HOLDS, result.message
    return LandingScheduler.landed


def test_the_refinement_holds_with_two_micro_batches_and_lands_tokens_on_preempted_requests():
    """Budget-only requests (the abstract model has no stop tokens) never have a final step preempted
    (VICTIM-NOT-FINAL), so here the landed tokens are not final: the deferred finish itself is shown with stop tokens
    by the sim test below and the pipeline tests (tests/distributed/test_pipeline_in_flight.py)."""
    bounds, _ = load_bounds()
    bound = bounds["pipeline2_inflight"]
    landed = _landings(bound)
    assert landed[PENDING, True] > 0, landed  # kept while awaiting consensus: the replay prompt includes it
    lockstep = Bound.from_dict({**bound.to_dict(), "micro_batches": 1}, "lockstep")
    assert not _landings(lockstep)  # nothing is in flight between passes


def test_a_request_suspended_with_its_decode_step_in_flight_keeps_the_token_that_lands():
    bounds, _ = load_bounds()
    landed = _landings(bounds["pipeline2_inflight_suspend"])
    assert landed["suspended", True] > 0, landed  # its blocks are held where the step wrote them


@pytest.mark.parametrize(("name", "tail"), [("inflight_suspend", "gpu"), ("inflight_suspend_eager", "gpu")])
def test_a_token_landing_on_a_suspended_request_lands_where_its_table_ends(name, tail):
    """Nothing of a request with a step in flight is offloaded, on demand or eagerly (the later stages of that step
    still write its KV): the token lands with its KV in the held GPU blocks."""
    bounds, default = load_bounds()
    assert name in default
    landed = _landings(bounds[name])
    assert landed["suspended", True] > 0, landed
    assert set(LandingScheduler.tails) == {tail}, LandingScheduler.tails


def test_micro_batches_need_several_stages():
    with pytest.raises(BoundsError, match="micro_batches"):
        Bound(name="x", requests=((2, 2),), gpu_blocks=4, micro_batches=2)
    with pytest.raises(BoundsError, match="micro_batches"):
        Bound(name="x", requests=((2, 2),), gpu_blocks=4, pipeline_stages=2, micro_batches=0)


def _stop_workload(seed: int, vocab: int) -> list[tuple[list[int], int, list[int]]]:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(vocab) for _ in range(rng.randrange(4, 30))],
            rng.randrange(8, 24),
            [rng.randrange(vocab) for _ in range(3)],
        )
        for _ in range(30)
    ]


def _step_checking_one_micro_batch_per_request(sim: SimExecutor) -> None:
    """One step; then no request is in two of the outputs still in flight."""
    sim.step()
    seen: set = set()
    for step, _ in sim.pipeline:  # (kvstate.scheduler.Step, sampled tokens) carried out, not landed
        twice = seen & set(step.output.chunk_tokens)
        assert not twice, f"requests {sorted(twice)} are in two micro-batches in flight"
        seen |= set(step.output.chunk_tokens)
    assert seen == set(sim.scheduler.in_flight)


@pytest.mark.parametrize("micro_batches", [2, 3])
def test_the_sim_with_outputs_in_flight_keeps_outputs_equal_to_the_reference(micro_batches):
    vocab, deferred = 50, 0
    for seed in range(5):  # seeds 1 (three micro-batches) and 4 (two) finish a request while it awaits consensus
        log: list[tuple] = []
        record = log.append
        config = SchedulerConfig(
            gpu_blocks=32,
            host_blocks=6,
            block_size=4,
            prefill_chunk_size=16,
            max_num_tokens=64,
            pipeline_stages=micro_batches,
        )
        scheduler = Scheduler(config, on_transition=lambda r, t, record=record: record((t.source, t.event, t.dest)))
        sim = SimExecutor(scheduler, vocab=vocab, micro_batches=micro_batches)
        work = _stop_workload(seed, vocab)
        for rid, (prompt, new, stops) in enumerate(work):
            scheduler.submit(prompt, new, stop_token_ids=stops, request_id=rid)
        while scheduler.has_unfinished:
            _step_checking_one_micro_batch_per_request(sim)
        while sim.pipeline:
            sim.land()
        assert set(scheduler.finished) == set(range(len(work)))
        for rid, (prompt, new, stops) in enumerate(work):
            assert scheduler.finished[rid].generated == reference_output(prompt, new, stops, vocab), rid
        assert not scheduler.in_flight and scheduler.pool.usage()["gpu_free"] == config.gpu_blocks
        deferred += Counter(log)[(PENDING, "finish", PENDING)]
    assert deferred > 0, "the workload must make requests finish while they await consensus"
