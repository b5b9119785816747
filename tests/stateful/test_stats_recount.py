"""The statistics the scheduler keeps on each transition (`kvstate.scheduler.StateTally`: per-state counts, KV and
replay token sums, blocks held) equal a recount of its requests after every rule of a conformance machine: the
adapter's deep checks run `Scheduler.check_invariants`, which recounts (STATS-COUNT), so each machine of
`test_conformance` holds it in its configuration. A planted drift shows that a machine catches a tally that
follows its requests wrongly. (Steps that land on preempted requests, with micro-batches in flight, are
`tests/kvstate/test_stats.py`'s.)"""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvstate.config import SchedulerConfig
from kvstate.errors import InvariantViolation
from kvstate.scheduler import Scheduler, StateTally, figures
from kvstate.testing import KVStateAdapter, conformance_machine

# the conformance suite's default configuration: suspensions, recompute-pauses and replays within a few rules
CONFIG = SchedulerConfig(gpu_blocks=16, host_blocks=16, block_size=4, prefill_chunk_size=6, max_num_tokens=32)


class TakesFiguresAfterTheEffect(StateTally):
    """Planted: what a request takes out of the state it leaves is read after the edge's effect changed it."""

    def moved(self, request, old, before) -> None:
        super().moved(request, old, None if before is None else figures(request))


class DriftingScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tally = TakesFiguresAfterTheEffect(self.tally.counts, self.tally.held)


def test_a_conformance_machine_finds_a_tally_that_drifts_from_the_recount() -> None:
    machine = conformance_machine(
        lambda: KVStateAdapter(CONFIG, scheduler_factory=DriftingScheduler), name="DriftingMachine"
    )
    with pytest.raises(InvariantViolation) as caught:
        run_state_machine_as_test(
            machine,
            settings=settings(
                stateful_step_count=50,
                derandomize=True,
                database=None,
                max_examples=50,
                phases=[Phase.generate],  # the raw failing case names the invariant; shrinking would take minutes
            ),
        )
    assert caught.value.invariant_id == "STATS-COUNT"
