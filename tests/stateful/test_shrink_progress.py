"""What a person waiting on a failing run reads: a line when shrinking starts, then one every PROGRESS_EVERY_S."""

from __future__ import annotations

import io

from hypothesis import settings

from kvstate.testing.machine import STEPS_PER_EXAMPLE, machine_settings
from kvstate.testing.shrink_progress import PROGRESS_EVERY_S, STALE_AFTER_S, ShrinkProgress
from kvstate.testing.strategies import seeded_tokens


def test_the_first_failure_says_shrinking_starts_and_later_lines_say_how_far_it_got() -> None:
    stream = io.StringIO()
    progress = ShrinkProgress("Toy", stream=stream)
    progress.example_ended(None, 30, now=0.0)
    assert stream.getvalue() == ""  # passing examples before the first failure print nothing
    progress.example_ended("VICTIM-TAIL", 40, now=1.0)
    progress.example_ended(None, 12, now=2.0)
    progress.example_ended("VICTIM-TAIL", 9, now=3.0)
    assert stream.getvalue().count("\n") == 1  # no progress line before PROGRESS_EVERY_S
    progress.example_ended(None, 5, now=1.0 + PROGRESS_EVERY_S)
    first, second = stream.getvalue().splitlines()
    assert "Toy: found VICTIM-TAIL after 40 rule(s); Hypothesis now shrinks it" in first
    assert f"still shrinking after {PROGRESS_EVERY_S:.0f} s: 3 variant(s) replayed" in second
    assert "the shortest failing one has 9 rule(s)" in second


def test_a_run_idle_past_the_stale_limit_starts_over() -> None:
    stream = io.StringIO()
    progress = ShrinkProgress("Toy", stream=stream)
    progress.example_ended("LIVE-DONE", 8, now=0.0)
    progress.example_ended("OUT-EQUIV", 3, now=STALE_AFTER_S + 1)
    found = [line.split(": found ")[1].split()[0] for line in stream.getvalue().splitlines()]
    assert found == ["LIVE-DONE", "OUT-EQUIV"]


def test_prompt_tokens_come_from_one_seed() -> None:
    assert seeded_tokens(0, 4, 100) == (0, 0, 0, 0)
    assert seeded_tokens(7, 50, 3) == seeded_tokens(7, 50, 3)
    assert set(seeded_tokens(7, 50, 3)) <= {0, 1, 2} and len(set(seeded_tokens(7, 50, 3))) > 1


def test_bound_machines_run_fewer_larger_rules_unless_the_profile_sets_a_count() -> None:
    previous = settings.get_current_profile_name()
    settings.register_profile("kvstate-test-35-steps", settings(stateful_step_count=35))
    try:
        settings.load_profile("default")
        assert machine_settings().stateful_step_count == STEPS_PER_EXAMPLE and machine_settings().deadline is None
        settings.load_profile("kvstate-test-35-steps")
        assert machine_settings().stateful_step_count == 35
    finally:
        settings.load_profile(previous)
