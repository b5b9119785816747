"""Runs of decode-only passes (`kvstate.scheduler.decode_run`): a pass that repeats the last one's decode list
instead of walking the resident requests must plan exactly what the walk plans.

`DecodeRunMachine` steps two schedulers side by side under the slot-level simulator, fed the same submissions,
cancels and copy completions and failures: one repeats runs (the fast path), the other always walks (the reference
path, `WalkingScheduler`). Every output, block table and statistic must agree after every step, so a difference
shrinks to a short step list. The tests below run it on each configuration and check that the runs covered what
they must: the fast path taken, preemptions under pressure and none where everything fits.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import ClassVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvstate.config import SchedulerConfig
from kvstate.scheduler import DecodeRun, Scheduler, SchedulingPass
from kvstate.sim import SimExecutor, reference_output

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
MAX_PROMPT, MAX_NEW_TOKENS, MAX_REQUESTS = 14, 40, 24


class WalkingScheduler(Scheduler):
    """The reference path: every pass walks the resident requests; a run is never repeated."""

    def _repeat_decodes(self, run: DecodeRun, pass_: SchedulingPass) -> bool:
        return False


class DecodeRunMachine(RuleBasedStateMachine):
    """A repeating scheduler and a walking one, each under its own simulator, stepped side by side.

    Invariants checked after every step: equal outputs, equal GPU block tables, equal statistics, the repeating
    scheduler's invariants; with several micro-batches in flight no run is ever repeated; in a configuration whose
    GPU tier holds every request's worst case (`roomy`: submissions are held to that) nothing is preempted.
    `totals` counts the passes, those planned from a run and the preemptions, over every run, per configuration
    name and per configuration name and copy delay.
    """

    config_name: ClassVar[str] = "roomy"
    micro_batches: ClassVar[int] = 1
    totals: ClassVar[Counter[str]] = Counter()

    def __init__(self) -> None:
        super().__init__()
        self.config = CONFIGS[self.config_name]
        self.prompts: dict[int, list[int]] = {}

    @initialize(lifecycle=st.sampled_from(["machine", "compiled"]), copy_delay=st.sampled_from([0, 3]))
    def start(self, lifecycle: str, copy_delay: int) -> None:
        config = dataclasses.replace(self.config, lifecycle=lifecycle)
        self.repeating, self.walking = Scheduler(config), WalkingScheduler(config)
        self.copy_delay = copy_delay
        self.sims = [
            SimExecutor(s, micro_batches=self.micro_batches, copy_delay=copy_delay)
            for s in (self.repeating, self.walking)
        ]

    @property
    def roomy(self) -> bool:
        return not self.config_name.startswith("pressure")

    def _fits_beside_the_others(self, tokens: int) -> bool:
        blocks = self.repeating.pool.blocks_for_tokens
        held = sum(blocks(len(r.prompt) + r.max_new_tokens) for r in self.repeating.requests.values())
        return held + blocks(tokens) <= self.config.gpu_blocks

    @precondition(lambda self: len(self.prompts) < MAX_REQUESTS)
    @rule(
        prompt=st.lists(st.integers(1, 49), min_size=1, max_size=MAX_PROMPT),
        max_new_tokens=st.integers(1, MAX_NEW_TOKENS),
    )
    def submit(self, prompt: list[int], max_new_tokens: int) -> None:
        if self.roomy and not self._fits_beside_the_others(len(prompt) + max_new_tokens):
            return
        self.prompts[len(self.prompts)] = prompt
        for scheduler in (self.repeating, self.walking):
            scheduler.submit(prompt, max_new_tokens)

    @precondition(lambda self: bool(self.repeating.requests))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.repeating.requests)), label="request_id")
        for scheduler in (self.repeating, self.walking):
            scheduler.cancel(request_id)

    @precondition(lambda self: bool(self.sims[0].copies))
    @rule(failed=st.booleans())
    def end_oldest_copy(self, failed: bool) -> None:
        """The oldest copy in flight completes (or fails) now, in both."""
        for sim in self.sims:
            request_id = sim.copies[0].plan.request_id
            sim.fail_copy(request_id) if failed else sim.complete_copy(request_id)

    @rule(passes=st.integers(1, 12))
    def step(self, passes: int) -> None:
        for _ in range(passes):
            if not self.repeating.has_unfinished:
                return
            self._step_both()

    def _step_both(self) -> None:
        outputs = [sim.step().to_dict() for sim in self.sims]
        assert outputs[0] == outputs[1]
        assert dict(self.repeating.pool.gpu.blocks_of) == dict(self.walking.pool.gpu.blocks_of)
        assert self.repeating.stats() == self.walking.stats()
        self.repeating.check_invariants()
        repeated = self.repeating._repeated is not None
        assert not (repeated and self.micro_batches > 1), "a run was repeated while micro-batches were in flight"
        stats = self.repeating.stats()
        for key in (self.config_name, f"{self.config_name}/delay {self.copy_delay}"):
            self.totals[f"{key}/passes"] += 1
            self.totals[f"{key}/repeats"] += repeated
            self.totals[f"{key}/preemptions"] += stats.preemptions
        assert not (self.roomy and stats.preemptions), "a request was preempted though every request fits"

    def teardown(self) -> None:
        """Drain both; every request that ended by finishing produced its reference output."""
        if not hasattr(self, "repeating"):
            return
        for _ in range(2_000):
            if not self.repeating.has_unfinished:
                break
            self._step_both()
        assert not self.repeating.has_unfinished, "the workload did not drain in 2,000 passes"
        for request_id, request in self.repeating.finished.items():
            if request.done_reason not in ("cancelled", "aborted"):
                assert request.generated == reference_output(self.prompts[request_id], request.max_new_tokens)


def machine_for(name: str, micro_batches: int = 1) -> type[DecodeRunMachine]:
    """`DecodeRunMachine` on configuration `name`, with fresh totals."""
    namespace = {"config_name": name, "micro_batches": micro_batches, "totals": Counter()}
    return type(f"DecodeRunMachine_{name}_{micro_batches}", (DecodeRunMachine,), namespace)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_repeated_run_plans_what_the_walk_plans(name: str) -> None:
    machine = machine_for(name)
    run_state_machine_as_test(machine, settings=settings(stateful_step_count=30, derandomize=True))
    assert machine.totals[f"{name}/repeats"] >= 10  # the fast path was taken, not only the walk
    assert (machine.totals[f"{name}/preemptions"] > 0) == name.startswith("pressure")
    if name == "pressure_host":  # copies that complete late or fail: the fast path and preemptions there too
        assert machine.totals[f"{name}/delay 3/repeats"] >= 10
        assert machine.totals[f"{name}/delay 3/preemptions"] > 0


def test_a_run_is_not_begun_while_micro_batches_are_in_flight() -> None:
    machine = machine_for("roomy", micro_batches=2)
    run_state_machine_as_test(machine, settings=settings(stateful_step_count=30, derandomize=True))
    assert machine.totals["roomy/repeats"] == 0
    assert machine.totals["roomy/passes"] > 50


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
