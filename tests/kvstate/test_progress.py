"""The no-progress detector (A4) counts real progress only: a long replay in small chunks is progress all the way,
while replay work that a pause keeps throwing away is not, so a replay livelock is reported, not looped."""

from __future__ import annotations

import random

import pytest

import kvstate.policy as policy_module
from kvstate.config import SchedulerConfig
from kvstate.scheduler import Scheduler, SchedulerStalled
from kvstate.sim import SimExecutor, reference_output

LIMIT = 3


def run_with_one_token_chunks(seed: int) -> int:
    """A pressured workload with 1-token chunks and a detector limit of 3 passes; returns the longest run of
    passes in which nothing but replay chunks was computed."""
    sched = Scheduler(
        SchedulerConfig(gpu_blocks=10, block_size=1, prefill_chunk_size=1, max_num_tokens=4, no_progress_limit=LIMIT)
    )
    rng = random.Random(seed)
    work = {}
    for i in range(5):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(4, 7))]
        work[i] = (prompt, rng.randint(2, 10 - len(prompt)))
        sched.submit(*work[i], request_id=i)
    ex, longest, current = SimExecutor(sched), 0, 0
    for _ in range(1000):
        if not sched.has_unfinished:
            break
        out = ex.step()
        only_replay = bool(out.replay) and not (out.context or out.generation)
        current = current + 1 if only_replay else 0
        longest = max(longest, current)
    assert {i: r.generated for i, r in sched.finished.items()} == {i: reference_output(*w) for i, w in work.items()}
    return longest


def test_long_replays_in_one_token_chunks_are_progress() -> None:
    longest = max(run_with_one_token_chunks(seed) for seed in range(12))
    assert longest > LIMIT, "some replay ran longer than the detector's limit with nothing else computing"


def test_a_replay_livelock_is_reported_by_the_detector(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: a waiting requester is a victim again (the two-stage livelock comes back)."""
    monkeypatch.setitem(policy_module.VICTIM_EXCLUSIONS, "waiting_this_pass", lambda s, candidate, step: False)
    sched = Scheduler(
        SchedulerConfig(
            gpu_blocks=9, block_size=2, max_batch_size=3, max_num_tokens=10, prefill_chunk_size=4, pipeline_stages=2
        )
    )
    rng = random.Random(0)
    for i, (p, m) in enumerate([(8, 10), (6, 1), (6, 2), (9, 4), (9, 3)]):
        sched.submit([rng.randrange(1000) for _ in range(p)], m, request_id=i)
    with pytest.raises(SchedulerStalled, match="no request made progress") as info:
        SimExecutor(sched).run(2_000)
    assert sched.config.enable_recompute_pause
    message = str(info.value)
    assert "enable recompute-pause" not in message  # it is on: enabling it is no fix
    assert "recompute-pause is on" in message and "defect" in message


def test_a_stall_with_recompute_pause_off_names_it_as_the_lost_guarantee() -> None:
    sched = Scheduler(
        SchedulerConfig(gpu_blocks=6, host_blocks=1, block_size=2, enable_recompute_pause=False, no_progress_limit=20)
    )
    rng = random.Random(0)
    for i in range(5):
        sched.submit([rng.randrange(100) for _ in range(rng.randint(2, 6))], rng.randint(2, 6), request_id=i)
    with pytest.raises(SchedulerStalled) as info:
        SimExecutor(sched).run(2_000)
    message = str(info.value)
    assert not sched.pool.in_flight and "complete_migrations" not in message
    assert "recompute-pause is off" in message and "LIVE-DONE" in message and "enable recompute-pause" in message
