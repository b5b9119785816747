"""OUT-EQUIV end to end: under memory pressure every request's output equals its solo, unlimited-memory reference,
for several pool shapes and explicit seeds; and the simulator does catch broken KV movement."""

from __future__ import annotations

import random

import pytest

from kvstate.config import SchedulerConfig
from kvstate.errors import InvariantViolation
from kvstate.pool import TO_HOST
from kvstate.scheduler import Scheduler
from kvstate.sim import SimExecutor, next_token, reference_output

SEEDS = [0, 1, 2, 3, 4]

CONFIGS = {
    "host_tier": dict(gpu_blocks=16, host_blocks=16, block_size=2, prefill_chunk_size=8),
    "no_host_tier": dict(gpu_blocks=16, host_blocks=0, block_size=2, prefill_chunk_size=8),
    "block_size_1": dict(gpu_blocks=24, host_blocks=12, block_size=1, prefill_chunk_size=8),
    "pipeline_stages_2": dict(gpu_blocks=16, host_blocks=8, block_size=2, prefill_chunk_size=8, pipeline_stages=2),
    "small_chunk": dict(gpu_blocks=12, host_blocks=12, block_size=4, prefill_chunk_size=3, max_num_tokens=16),
}


def submit_workload(sched: Scheduler, seed: int, n: int = 10) -> None:
    """n requests that each fit the GPU tier alone and together overflow it; some carry a stop token that their
    reference output actually produces, so stops end requests early."""
    rng = random.Random(seed)
    capacity = sched.config.gpu_token_capacity
    for i in range(n):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(1, capacity // 2))]
        max_new = rng.randint(2, capacity - len(prompt))
        stop = ()
        if rng.random() < 0.3:
            stop = (rng.choice(reference_output(prompt, max_new)),)
        sched.submit(prompt, max_new, stop_token_ids=stop, request_id=f"s{seed}r{i}")


def reference_of(request) -> list[int]:
    return reference_output(request.prompt, request.max_new_tokens, sorted(request.stop_token_ids))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_outputs_under_pressure_equal_the_reference(name: str, seed: int) -> None:
    config = SchedulerConfig(**CONFIGS[name])
    sched = Scheduler(config)
    submit_workload(sched, seed)
    outputs = SimExecutor(sched).run(max_iterations=5_000)  # checks every invariant after every step
    assert not sched.has_unfinished
    assert len(outputs) == 10
    for rid, request in sched.finished.items():
        assert request.done_reason == "finished"
        assert outputs[rid] == reference_of(request), f"{name}, seed {seed}: request {rid!r} differs"
    finished = list(sched.finished.values())
    assert sum(r.num_suspensions + r.num_recompute_pauses for r in finished) > 0, "no memory pressure"
    if config.host_blocks == 0:
        assert sum(r.num_suspensions for r in finished) == 0


def test_the_workloads_exercise_both_preemption_paths() -> None:
    suspensions = pauses = 0
    for seed in SEEDS:
        sched = Scheduler(SchedulerConfig(**CONFIGS["host_tier"]))
        submit_workload(sched, seed)
        SimExecutor(sched).run(5_000)
        suspensions += sum(r.num_suspensions for r in sched.finished.values())
        pauses += sum(r.num_recompute_pauses for r in sched.finished.values())
    assert suspensions > 0 and pauses > 0


def test_reference_output_depends_on_every_context_token_and_stops() -> None:
    variants = [[1, 2, 3], [0, 2, 3], [1, 0, 3], [1, 2, 0], [1, 2, 3, 0]]  # each position, and the length, matter
    assert len({next_token(c) for c in variants}) == len(variants)
    assert next_token([1, 2, 3]) == next_token((1, 2, 3))  # a pure function of the tokens
    out = reference_output([5, 6, 7], 8)
    assert len(out) == 8
    stopped = reference_output([5, 6, 7], 8, [out[3]])
    assert stopped == out[: out.index(out[3]) + 1]


def run_detects_corruption(sched: Scheduler, ex: SimExecutor) -> bool:
    """True when the broken run raises OUT-EQUIV or finishes with some output different from its reference."""
    try:
        ex.run(max_iterations=5_000)
    except InvariantViolation as error:
        assert error.invariant_id == "OUT-EQUIV"
        return True
    return any(r.generated != reference_of(r) for r in sched.finished.values())


@pytest.mark.parametrize("seed", SEEDS)
def test_a_migration_whose_copies_are_skipped_is_detected(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor's copies are undone right before the fences complete, so every destination block keeps what
    it held before: the same as an executor that skipped copying."""
    sched = Scheduler(SchedulerConfig(**CONFIGS["host_tier"]))
    submit_workload(sched, seed)
    ex = SimExecutor(sched)
    saved: dict = {}
    migrated = []
    plan_and_schedule, complete = sched.schedule, sched.complete_migration

    def schedule():
        out = plan_and_schedule()
        saved.clear()
        for plan in out.migrations:  # remember what the destination slots held before the executor's copies
            dest = ex.host if plan.direction == TO_HOST else ex.gpu
            saved.update({(id(dest), dst): (dest, list(dest[dst])) for _, dst in plan.pairs})
        migrated.extend(out.migrations)
        return out

    def complete_without_copying(plan):  # the sim reports each copy complete as it completes
        for (_, dst), (dest, contents) in saved.items():  # undo the copies: as if they never ran
            dest[dst] = contents
        complete(plan)

    monkeypatch.setattr(sched, "schedule", schedule)
    monkeypatch.setattr(sched, "complete_migration", complete_without_copying)
    assert run_detects_corruption(sched, ex)
    assert migrated, "the workload never migrated anything"


def test_a_gpu_block_overwritten_under_a_running_request_is_detected() -> None:
    sched = Scheduler(SchedulerConfig(gpu_blocks=8, block_size=2))
    sched.submit([1, 2, 3, 4, 5], 4, request_id="r")
    ex = SimExecutor(sched)
    ex.step()
    block = sched.pool.gpu_blocks("r")[0]
    ex.gpu[block] = [None] * 2  # the KV of r's first two tokens is lost
    with pytest.raises(InvariantViolation) as info:
        ex.run()
    assert info.value.invariant_id == "OUT-EQUIV"


def test_stale_kv_in_a_block_changes_the_output() -> None:
    sched = Scheduler(SchedulerConfig(gpu_blocks=8, block_size=2))
    sched.submit([1, 2, 3, 4, 5], 4, request_id="r")
    ex = SimExecutor(sched)
    ex.step()
    block = sched.pool.gpu_blocks("r")[0]
    ex.gpu[block] = [9, 9]  # garbled, not missing
    outputs = ex.run()
    assert outputs["r"] != reference_output([1, 2, 3, 4, 5], 4)
