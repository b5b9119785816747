"""`kvstate check --simulate`: seeded random walks over the scheduler refinement's actions, shrunk counterexamples."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstate.checker import HOLDS, VIOLATED, Bound, select_bounds
from kvstate.checker.replay import replay_refinement
from kvstate.checker.simulate import SimulationScope, simulate_bound, walk_seed
from kvstate.cli import main
from kvstate.errors import InvariantViolation
from kvstate.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
BOUNDS = ROOT / "spec" / "bounds.toml"  # this tree's bounds (an installed copy may be older)
SHRINK_SECONDS = 20.0


def bound(name: str) -> Bound:
    (chosen,) = select_bounds([name], BOUNDS)
    return chosen


def policy_before_p1(tmp_path):
    """The spec with the policy before P1: a requester without an eligible victim preempts itself."""
    text = (ROOT / "spec" / "lifecycle.toml").read_text(encoding="utf-8")
    rule = 'no_eligible_victim = "wait_for_chunk_in_flight"'
    assert rule in text
    path = tmp_path / "lifecycle.toml"
    path.write_text(text.replace(rule, 'no_eligible_victim = "preempt_self"'), encoding="utf-8")
    return load_spec(path)


def assert_still_violates(result, spec_path: Path | None = None) -> None:
    """The shrunk counterexample, replayed as its regression test replays it, violates the same invariant."""
    violation = result.violation
    with pytest.raises(InvariantViolation) as raised:
        path = None if spec_path is None else str(spec_path)
        replay_refinement(result.bound, list(violation.shrunk), invariant=violation.invariant, spec_path=path)
    assert raised.value.invariant_id == violation.invariant


def cap_without_head_exception(directory: Path) -> Path:
    """The spec with the preemption cap protecting a capped request from every requester, the head of the pass
    included: the rule under which two capped micro-batches livelock."""
    text = (ROOT / "spec" / "lifecycle.toml").read_text(encoding="utf-8")
    rule = '"preemption_cap_reached_except_for_head"'
    assert rule in text
    path = directory / "lifecycle.toml"
    path.write_text(text.replace(rule, '"preemption_cap_reached"'), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def old_cap_spec(tmp_path_factory) -> Path:
    return cap_without_head_exception(tmp_path_factory.mktemp("old_cap"))


@pytest.fixture(scope="module")
def cap_livelock(old_cap_spec):
    """mb2_cap_large under the cap without the head's exception: its livelock, as the walks find it."""
    return simulate_bound(
        bound("mb2_cap_large"),
        SimulationScope(2000, seed=0),
        spec=load_spec(old_cap_spec),
        shrink_seconds=SHRINK_SECONDS,
    )


def test_walk_seeds_are_derived_from_the_seed_and_the_walk_alone():
    seeds = [walk_seed(0, k) for k in range(50)]
    assert len(set(seeds)) == 50 and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [walk_seed(0, k) for k in range(50)]
    assert walk_seed(1, 0) != seeds[0]


def test_the_same_seed_gives_the_same_walks_and_verdict():
    no_cancel = bound("no_cancel")
    first, again = (simulate_bound(no_cancel, SimulationScope(15, depth=300, seed=11)) for _ in range(2))
    other = simulate_bound(no_cancel, SimulationScope(15, depth=300, seed=12))
    assert first.verdict == again.verdict == HOLDS
    summary = lambda r: (r.walks, r.final_walks, r.cut_walks, r.steps, r.distinct)  # noqa: E731
    assert summary(first) == summary(again)
    assert first.walks == 15 == first.final_walks + first.cut_walks
    assert first.steps > 15 and first.distinct > 15
    assert other.verdict == HOLDS and other.walks == 15


def test_a_planted_livelock_is_found_shrunk_and_replays(tmp_path):
    """The policy before P1 livelocks two micro-batches in flight (exhaustively: mb2_livelock); the walks find it
    and the counterexample they give still violates LIVE-DONE when replayed."""
    result = simulate_bound(
        bound("mb2_livelock"),
        SimulationScope(300, seed=0),
        spec=policy_before_p1(tmp_path),
        shrink_seconds=SHRINK_SECONDS,
        counterexample_dir=tmp_path,
    )
    violation = result.violation
    assert result.verdict == VIOLATED and violation is not None and violation.invariant == "LIVE-DONE"
    assert len(violation.shrunk) <= len(violation.found)
    assert_still_violates(result, tmp_path / "lifecycle.toml")
    assert result.counterexample_file is not None and result.counterexample_file.exists()
    assert result.counterexample_trace is not None and result.counterexample_trace.lines > 0


def test_the_cap_livelock_is_found_on_the_large_bound(cap_livelock):
    assert cap_livelock.verdict == VIOLATED
    assert cap_livelock.violation.invariant == "LIVE-DONE"
    assert cap_livelock.counterexample is not None and cap_livelock.counterexample.loop_start is not None


def test_shrinking_reduces_the_counterexample_and_it_still_violates(cap_livelock, old_cap_spec):
    violation = cap_livelock.violation
    assert len(violation.shrunk) < len(violation.found)
    assert_still_violates(cap_livelock, old_cap_spec)
    assert [action for action, _ in cap_livelock.counterexample.path] == list(violation.shrunk)


def test_the_shipped_cap_rule_walks_the_large_bound_without_a_livelock():
    """The same walks under the packaged spec, whose cap spares the head of the pass, find no violation."""
    result = simulate_bound(bound("mb2_cap_large"), SimulationScope(40, depth=600, seed=0))
    assert result.verdict == HOLDS and result.walks == 40


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--simulate", "0"], "--simulate must be a positive integer, got 0"),
        (["--simulate", "3", "--sweep", "ci"], "--sweep does not apply to --simulate"),
        (["--simulate", "3", "--max-states", "10"], "--max-states does not apply to --simulate"),
        (["--simulate", "3", "--engine", "tlc"], "--engine tlc does not apply to --simulate"),
        (["--simulate", "3", "--liveness"], "--liveness applies to --engine tlc only"),
        (["--seed", "3"], "--seed applies to --simulate only"),
        (["--depth", "3"], "--depth applies to --simulate only"),
        (["--simulate", "3", "--bound", "no_such_bound"], "unknown bound(s) ['no_such_bound']"),
    ],
)
def test_unusable_input_exits_2_with_one_clear_line(capsys, tmp_path, argv, says):
    code = main(["check", "--bounds-file", str(BOUNDS), "--counterexample-dir", str(tmp_path), *argv])
    assert code == 2
    assert says in capsys.readouterr().err


def test_a_holding_bound_exits_0_and_prints_what_holds_covers(capsys, tmp_path):
    argv = ["--bound", "no_cancel", "--simulate", "8", "--seed", "5", "--depth", "400"]
    code = main(["check", "--bounds-file", str(BOUNDS), "--counterexample-dir", str(tmp_path), *argv])
    out = capsys.readouterr()
    assert code == 0
    assert "holds within scope: 8 random walk(s) of at most 400 actions, seed 5" in out.out
    assert "verdict: holds (1 bound(s)" in out.out
    assert not list(tmp_path.iterdir())  # no counterexample written
