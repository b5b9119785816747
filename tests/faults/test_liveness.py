"""Liveness safeguards on workloads built to thrash: the preemption cap (A3), the no-progress detector (A4), and
the refusal of configurations that could stall (LIVE-DONE).

What the cap guarantees (spec §6 A3, `Scheduler._victim_eligible`): a request preempted `cap` times is no longer an
eligible victim of another request, except of the head of the pass (the request the pass serves first, VICTIM-CAP),
so no request is preempted by a requester other than the head more than `cap` times. It may still preempt itself
when nothing else can give way, and the head may still take it, so its total count is not bounded by the cap; the
tests assert the bound that holds and that every request still finishes with its reference output.
"""

from __future__ import annotations

import random
import warnings
from collections import Counter

import pytest

from executor import FaultPlan, HostTierFallbackWarning, HostTierLossRefused
from executor.checks import leaked_blocks, random_workload, submit_all
from kvstate.config import ConfigError, SchedulerConfig
from kvstate.errors import PoolError
from kvstate.scheduler import Scheduler, SchedulerStalled
from kvstate.sim import SimExecutor, reference_output


class RecordingScheduler(Scheduler):
    """Records, per request, how often the shortage of another request than the head of the pass made it a victim,
    how often the head's did, how often it gave way itself, and how often it was promoted from suspended to
    recompute-paused in the pass that suspended it (test instrumentation over the private preemption hooks)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.by_others: Counter = Counter()
        self.by_head: Counter = Counter()
        self.by_itself: Counter = Counter()
        self.promoted: Counter = Counter()
        self._requester = None

    def _fire(self, request, event, pass_):
        if event == "recompute_pause" and request.state == "suspended":
            self.promoted[request.request_id] += 1
        return super()._fire(request, event, pass_)

    def _make_room(self, request, need, step):
        self.head_of_pass(step)  # as the pass began, before any victim of it changes state
        self._requester = request
        try:
            return super()._make_room(request, need, step)
        finally:
            self._requester = None

    def _preempt(self, victim, step):
        before = victim.state
        super()._preempt(victim, step)
        if victim.state == before:
            return
        if victim is self._requester:
            self.by_itself[victim.request_id] += 1
        elif self._requester is self.head_of_pass(step):
            self.by_head[victim.request_id] += 1
        else:
            self.by_others[victim.request_id] += 1


def _thrash(cap: int | None, seed: int, host_blocks: int) -> RecordingScheduler:
    """Twelve long requests on a GPU tier that holds about two of them."""
    sched = RecordingScheduler(
        SchedulerConfig(
            gpu_blocks=12,
            host_blocks=host_blocks,
            block_size=2,
            prefill_chunk_size=8,
            max_num_tokens=32,
            max_preemptions_per_request=cap,
        )
    )
    rng = random.Random(seed)
    for _ in range(12):
        p = rng.randint(4, 14)
        sched.submit([rng.randrange(1000) for _ in range(p)], rng.randint(4, 24 - p))
    ex = SimExecutor(sched)  # checks every invariant after every step
    ex.run(20_000)
    assert not sched.has_unfinished, "LIVE-DONE: a request never finished"
    for request in sched.finished.values():
        assert request.generated == reference_output(request.prompt, request.max_new_tokens)
    for rid, request in sched.finished.items():
        counted = sched.by_others[rid] + sched.by_head[rid] + sched.by_itself[rid] + sched.promoted[rid]
        assert request.num_suspensions + request.num_recompute_pauses == counted
    return sched


# the workloads' seeds: without a cap, requesters other than the head preempt some request twice in a few of them
SEEDS = range(24)


@pytest.mark.parametrize("host_blocks", [0, 6])
@pytest.mark.parametrize("cap", [1, 2])
def test_the_cap_bounds_preemptions_by_requesters_other_than_the_head_and_everyone_finishes(cap, host_blocks):
    worst_total = 0
    for seed in SEEDS:
        sched = _thrash(cap, seed, host_blocks)
        assert max(sched.by_others.values(), default=0) <= cap
        most = max(r.num_suspensions + r.num_recompute_pauses for r in sched.finished.values())
        worst_total = max(worst_total, most)
    assert worst_total > 0  # the workload really thrashes


@pytest.mark.parametrize("host_blocks", [0, 6])
def test_without_the_cap_other_requests_preempt_a_request_more_often(host_blocks):
    """Control: the same workloads exceed the cap's bound when there is no cap, so the bound above is real."""
    assert any(max(_thrash(None, seed, host_blocks).by_others.values(), default=0) > 1 for seed in SEEDS)


def test_thrashing_on_the_real_executor_with_a_cap_finishes_every_request(make_engine):
    engine = make_engine(
        gpu_blocks=12, host_blocks=0, block_size=4, prefill_chunk_size=16, max_preemptions_per_request=1
    )
    submit_all(engine, random_workload(16, 5, (16, 30), (8, 16), max_tokens=48))
    outputs = engine.run()
    assert engine.totals.recompute_pauses > 16  # thrash: more preemptions than requests
    assert all(r.done_reason == "finished" for r in engine.scheduler.finished.values())
    assert outputs == engine.batched_reference_outputs()
    assert leaked_blocks(engine) == 0


# ------------------------------------------------------------------------------------ no-progress detector
def test_the_detector_names_requests_and_pool_state_instead_of_hanging():
    limit = 5
    sched = Scheduler(SchedulerConfig(gpu_blocks=6, host_blocks=8, block_size=1, no_progress_limit=limit))
    for rid, prompt, new in [("a", [1, 2, 4], 3), ("b", [3], 4), ("c", [5, 6], 3)]:
        sched.submit(prompt, new, request_id=rid)
    passes = 0
    with pytest.raises(SchedulerStalled) as info:
        for _ in range(500):  # bounded: a hang would fail here, not time out
            out = sched.schedule()
            passes += 1
            sched.complete_step(out, {r.request_id: 7 for r in out.scheduled})  # copies never reported complete
    message = str(info.value)
    stalled = list(sched.requests.values())
    assert stalled and passes < 100
    for request in stalled:
        assert f"{request.request_id!r}:{request.state}" in message
    usage = sched.pool.usage()
    assert f"'gpu_fenced': {usage['gpu_fenced']}" in message and f"'gpu_capacity': {usage['gpu_capacity']}" in message
    assert usage["gpu_fenced"] > 0 and "complete_migrations" in message


# ------------------------------------------------------------------------------- configurations that stall
def test_no_recompute_pause_and_no_host_tier_is_refused():
    with pytest.raises(ConfigError, match=r"no way to evict a victim.*enable recompute-pause"):
        SchedulerConfig(gpu_blocks=8, host_blocks=0, enable_recompute_pause=False)
    # never preempts, or can still suspend: accepted
    SchedulerConfig(gpu_blocks=8, host_blocks=0, enable_recompute_pause=False, capacity_policy="guaranteed_no_evict")
    SchedulerConfig(gpu_blocks=8, host_blocks=4, enable_recompute_pause=False)


def test_without_recompute_pause_a_full_host_tier_stalls_and_the_detector_says_so():
    """Known limit: with recompute-pause disabled, a host tier that fills up leaves victims that can be neither
    suspended nor paused. The detector turns that into an error naming the requests and the full host tier."""
    sched = Scheduler(
        SchedulerConfig(gpu_blocks=8, host_blocks=4, block_size=2, enable_recompute_pause=False, no_progress_limit=8)
    )
    rng = random.Random(20)
    for _ in range(8):
        sched.submit([rng.randrange(1000) for _ in range(rng.randint(2, 8))], rng.randint(4, 12))
    with pytest.raises(SchedulerStalled, match=r"'host_free': 2.*enable recompute-pause"):
        SimExecutor(sched).run(2_000)
    assert sched.suspended and sched.has_unfinished


def test_without_recompute_pause_a_host_tier_smaller_than_the_victims_stalls_at_once():
    """LIVE-DONE's exception (SPEC.md section 6): each request needs 4 blocks, the host tier holds 1, so no victim can
    be suspended and neither request can be evicted; the configuration is accepted and the detector reports it."""
    config = SchedulerConfig(
        gpu_blocks=4, host_blocks=1, block_size=1, prefill_chunk_size=2, enable_recompute_pause=False
    )
    sched = Scheduler(config)
    sched.submit([1, 2], 2)
    sched.submit([3, 4], 2)
    with pytest.raises(SchedulerStalled, match=r"0:running, 1:running.*'host_free': 1"):
        SimExecutor(sched).run(500)
    assert sched.iteration == config.no_progress_limit + 1 and not sched.suspended


def test_without_recompute_pause_even_a_host_tier_as_large_as_the_gpu_tier_may_stall():
    """No host size rules the exception out: requests suspended earlier fill the host tier (each request here fits it
    whole), and then no victim can be suspended."""
    sched = Scheduler(
        SchedulerConfig(gpu_blocks=8, host_blocks=8, block_size=2, enable_recompute_pause=False, no_progress_limit=8)
    )
    rng = random.Random(13)
    for _ in range(8):
        prompt = rng.randint(1, 6)
        sched.submit([rng.randrange(1000) for _ in range(prompt)], rng.randint(1, 16 - prompt))
    assert all(len(r.prompt) + r.max_new_tokens <= 16 for r in sched.requests.values())  # each fits the host tier
    with pytest.raises(SchedulerStalled, match="enable recompute-pause"):
        SimExecutor(sched).run(2_000)
    assert sched.suspended and sched.has_unfinished


def test_removing_the_host_tier_is_refused_without_recompute_pause_and_changes_nothing():
    sched = Scheduler(SchedulerConfig(gpu_blocks=12, host_blocks=64, block_size=2, enable_recompute_pause=False))
    rng = random.Random(0)
    for _ in range(8):
        sched.submit([rng.randrange(1000) for _ in range(rng.randint(2, 8))], rng.randint(4, 12))
    ex = SimExecutor(sched)
    while not sched.suspended:
        ex.step()
    before = ({r.request_id: r.state for r in sched.requests.values()}, sched.pool.usage(), sched.host_tier_fallback)
    with pytest.raises(PoolError, match=r"enable_recompute_pause=False.*would stall"):
        sched.set_host_capacity(0)
    assert (
        {r.request_id: r.state for r in sched.requests.values()},
        sched.pool.usage(),
        sched.host_tier_fallback,
    ) == before
    ex.run(5_000)
    assert not sched.has_unfinished


def test_the_engine_refuses_a_fallback_it_could_not_serve(make_engine):
    with pytest.raises(ConfigError, match="host_blocks=0"):
        make_engine(gpu_blocks=8, host_blocks=0, enable_recompute_pause=False)
    with pytest.raises(ConfigError, match=r"could not allocate|simulated failure.*enable recompute-pause"):
        make_engine(gpu_blocks=8, host_blocks=8, enable_recompute_pause=False, faults=FaultPlan.of(0, host_alloc=1.0))


def test_the_engine_refuses_to_lose_its_host_tier_without_recompute_pause_and_keeps_serving(make_engine):
    engine = make_engine(gpu_blocks=16, host_blocks=96, block_size=4, enable_recompute_pause=False)
    submit_all(engine, random_workload(10, 1, (4, 30), (4, 24)))
    while not engine.scheduler.suspended:
        engine.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error", HostTierFallbackWarning)  # no fallback may be announced
        with pytest.raises(HostTierLossRefused, match="enable recompute-pause"):
            engine.lose_host_tier("test")
    assert engine.cache.host_cache is not None and engine.scheduler.pool.has_host_tier
    outputs = engine.run()
    assert outputs == engine.batched_reference_outputs() and leaked_blocks(engine) == 0
