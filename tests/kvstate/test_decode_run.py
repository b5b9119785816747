"""Runs of decode-only passes (`kvstate.scheduler.DecodeRun`, issue 30): a pass that repeats the last one's decode
list instead of walking the resident requests must plan exactly what the walk plans. Each test drives twin
schedulers through the same seeded workload on the slot-level simulator: one repeats runs, the other forgets its
run before every pass (so it always walks); every output, block table and statistic must agree, step by step."""

from __future__ import annotations

import dataclasses
import random

import pytest

from kvstate.config import SchedulerConfig
from kvstate.scheduler import Scheduler
from kvstate.sim import SimExecutor, reference_output


class Twins:
    """A repeating and a walking scheduler, each under its own simulator, fed the same submissions and cancels."""

    def __init__(self, config: SchedulerConfig, micro_batches: int = 1, copy_delay: int = 0) -> None:
        self.repeating, self.walking = Scheduler(config), Scheduler(config)
        self.sims = [
            SimExecutor(s, micro_batches=micro_batches, copy_delay=copy_delay) for s in (self.repeating, self.walking)
        ]
        self.repeats = 0  # passes the repeating twin planned from a run

    def submit(self, prompt: list[int], max_new_tokens: int) -> None:
        for scheduler in (self.repeating, self.walking):
            scheduler.submit(prompt, max_new_tokens)

    def cancel(self, request_id: int) -> None:
        for scheduler in (self.repeating, self.walking):
            scheduler.cancel(request_id)

    def end_oldest_copy(self, *, failed: bool) -> None:
        """The oldest copy in flight completes (or fails) now, in both twins."""
        for sim in self.sims:
            request_id = sim.copies[0].plan.request_id
            sim.fail_copy(request_id) if failed else sim.complete_copy(request_id)

    def step(self) -> None:
        self.walking._decode_run = None  # the twin that always walks
        outputs = [sim.step().to_dict() for sim in self.sims]
        self.repeats += self.repeating._repeated is not None
        assert outputs[0] == outputs[1]
        assert dict(self.repeating.pool.gpu.blocks_of) == dict(self.walking.pool.gpu.blocks_of)
        assert self.repeating.stats() == self.walking.stats()
        self.repeating.check_invariants()

    @property
    def preemptions(self) -> int:
        return sum(r.num_suspensions + r.num_recompute_pauses for r in self.repeating.finished.values())


def drive(twins: Twins, seed: int, *, arrivals: int = 24, steps: int = 400) -> None:
    """Ragged prompts and budgets arriving during decode, a few cancels, copies that complete early or fail while
    late (with `copy_delay`), then drain; checks the tokens at the end."""
    rng = random.Random(seed)
    prompts: dict[int, list[int]] = {}
    for step in range(steps):
        if len(prompts) < arrivals and (step < 2 or rng.random() < 0.15):
            prompt = [rng.randrange(1, 50) for _ in range(rng.randint(1, 14))]
            prompts[len(prompts)] = prompt
            twins.submit(prompt, rng.randint(1, 40))
        elif twins.repeating.requests and rng.random() < 0.02:
            twins.cancel(rng.choice(sorted(twins.repeating.requests)))
        if twins.sims[0].copies and rng.random() < 0.2:
            twins.end_oldest_copy(failed=rng.random() < 0.5)
        if not twins.repeating.has_unfinished and len(prompts) == arrivals:
            break
        twins.step()
    assert not twins.repeating.has_unfinished, "the workload did not drain: raise `steps`"
    for request_id, request in twins.repeating.finished.items():
        if request.done_reason not in ("cancelled", "aborted"):
            assert request.generated == reference_output(prompts[request_id], request.max_new_tokens)


CONFIGS = {
    "roomy": SchedulerConfig(gpu_blocks=256, host_blocks=0, block_size=4, max_batch_size=32, max_num_tokens=64),
    "block_size_1": SchedulerConfig(gpu_blocks=512, host_blocks=0, block_size=1, max_batch_size=32, max_num_tokens=64),
    "pressure_host": SchedulerConfig(gpu_blocks=20, host_blocks=12, block_size=4, max_batch_size=32, max_num_tokens=32),
    "pressure_two_stages": SchedulerConfig(
        gpu_blocks=20, host_blocks=12, block_size=4, max_batch_size=32, max_num_tokens=32, pipeline_stages=2
    ),
    "pressure_no_host": SchedulerConfig(
        gpu_blocks=20, host_blocks=0, block_size=4, max_batch_size=32, max_num_tokens=32
    ),
}


@pytest.mark.parametrize("lifecycle", ["machine", "compiled"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_repeated_run_plans_what_the_walk_plans(name: str, seed: int, lifecycle: str) -> None:
    config = dataclasses.replace(CONFIGS[name], lifecycle=lifecycle)
    twins = Twins(config)
    drive(twins, seed)
    assert twins.repeats >= 10  # the fast path was taken, not only the walk
    assert (twins.preemptions > 0) == name.startswith("pressure")  # pressure configs preempt, roomy ones never


@pytest.mark.parametrize("lifecycle", ["machine", "compiled"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_repeated_run_plans_what_the_walk_plans_while_copies_complete_late_or_fail(seed: int, lifecycle: str) -> None:
    twins = Twins(dataclasses.replace(CONFIGS["pressure_host"], lifecycle=lifecycle), copy_delay=3)
    drive(twins, seed)
    assert twins.repeats >= 10
    assert twins.preemptions > 0


def test_a_run_repeats_only_once_its_pass_landed_undisturbed() -> None:
    scheduler = Scheduler(SchedulerConfig(gpu_blocks=64, host_blocks=0, block_size=4))
    sim = SimExecutor(scheduler)
    first = scheduler.submit([1, 2, 3], 20)
    scheduler.submit([4, 5], 20)
    for _ in range(3):  # the prompts, then decode-only passes
        sim.step()
    assert scheduler._decode_run is not None
    output = scheduler.schedule()  # planned from the run, not landed yet: no run to repeat twice
    assert scheduler._repeated is not None and scheduler._decode_run is None
    scheduler.complete_step(output, sim.compute(output))
    assert scheduler._decode_run is scheduler._repeated  # landed undisturbed: the run carries on
    scheduler.cancel(first.request_id)  # a transition ends it
    assert scheduler._decode_run is None
    sim.step()
    assert scheduler._repeated is None  # that pass walked


def test_a_run_is_not_begun_while_micro_batches_are_in_flight() -> None:
    config = CONFIGS["roomy"]
    twins = Twins(config, micro_batches=2)
    drive(twins, seed=3)
    assert twins.repeats == 0
    assert twins.repeating.iteration > 50
