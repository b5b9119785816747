"""`kvstate check` on the default bounds, verdicts, exit codes, and the counterexample regression file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvstate.checker import HOLDS, INCOMPLETE, Bound, check_bound, plan_invariants, run_check, select_bounds
from kvstate.checker.explore import tarjan
from kvstate.cli import main
from kvstate.spec import load_spec, packaged_spec_path

SPEC = load_spec()


@pytest.fixture(scope="module")
def default_reports():
    code, reports = run_check(select_bounds(None), counterexample_dir=None)
    return code, reports


def test_default_bounds_hold(default_reports):
    code, reports = default_reports
    assert code == 0
    assert {r.bound.name for r in reports} >= {"default", "no_host", "pipeline2"}
    for report in reports:
        assert report.verdict == HOLDS, report.counterexample
        assert report.refinement.verdict == HOLDS
        if not report.bound.abstract_model:  # too large to enumerate (pipeline_livelock): refinement only
            continue
        assert report.abstract.verdict == HOLDS
        assert report.refinement.abstract_checked  # every scheduler state mapped into the model's reachable set
        assert report.abstract.states > 100 and report.abstract.edges > report.abstract.states


def test_coverage_lists_every_transition(default_reports):
    _, reports = default_reports
    taken_anywhere = set()
    for report in (r for r in reports if r.bound.abstract_model):
        taken = set(report.abstract.taken)
        never = set(report.abstract.never_enabled)
        assert taken | never == set(SPEC.transitions) and not taken & never
        taken_anywhere |= taken
    assert taken_anywhere == set(SPEC.transitions)  # every spec edge is exercised by some default bound


def test_no_host_bound_never_offloads(default_reports):
    """Without a host tier the spec lets a request be suspended (its blocks stay held on the GPU: it frees nothing,
    which the shipped policy's suspend rule keeps out), but never offloaded (NO-HOST-NO-OFFLOAD)."""
    _, reports = default_reports
    no_host = next(r for r in reports if r.bound.name == "no_host")
    assert any(t.event == "offload" for t in no_host.abstract.never_enabled)
    assert not any(t.event == "suspend" for t in no_host.abstract.never_enabled)


def test_cli_exit_code_holds(capsys, tmp_path):
    assert main(["check", "--bound", "no_host", "--counterexample-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "bound no_host" in out and "verdict: holds" in out and "states/s" in out and "coverage" in out


def test_cli_incomplete_with_tiny_max_states(capsys, tmp_path):
    assert main(["check", "--max-states", "10", "--counterexample-dir", str(tmp_path)]) == 3
    out = capsys.readouterr().out
    assert "incomplete" in out and "verdict: holds" not in out


def test_time_limit_gives_incomplete():
    report = check_bound(select_bounds(["default"])[0], time_limit=1e-9)
    assert report.verdict == INCOMPLETE


def test_unknown_bound_is_a_clear_error(capsys):
    assert main(["check", "--bound", "nope"]) == 2
    assert "unknown bound" in capsys.readouterr().err


def test_state_invariant_without_predicate_refuses(tmp_path, capsys):
    text = packaged_spec_path().read_text() + (
        '\n[[invariants]]\nid = "NEW-STATE-RULE"\nscope = "state"\nstatement = "Something new."\n'
    )
    path = tmp_path / "spec.toml"
    path.write_text(text)
    assert main(["check", "--spec", str(path), "--bound", "no_host"]) == 2
    err = capsys.readouterr().err
    assert "NEW-STATE-RULE" in err and "no predicate" in err


def test_invariant_plan_covers_every_state_invariant():
    plan = plan_invariants(SPEC)
    assert set(plan.state) == {i.id for i in SPEC.invariants if i.scope == "state"}
    assert "GEN-APPEND" in plan.step and "OUT-EQUIV" in plan.refinement and "LIVE-DONE" in plan.liveness
    assert all(SPEC_SCOPE[i] in ("pass", "run", "liveness", "step") for i in plan.left)


SPEC_SCOPE = {i.id: i.scope for i in SPEC.invariants}


def test_bound_that_cannot_fit_is_refused():
    from kvstate.checker import BoundsError

    with pytest.raises(BoundsError, match="LIVE-REFUSE"):
        Bound(name="x", requests=((4, 4),), gpu_blocks=2, block_size=1)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"recompute_pause": "no"}, "recompute_pause must be true or false"),
        ({"capacity_policy": "lazy"}, "capacity_policy must be one of"),
        ({"recompute_pause": False, "host_blocks": 0}, "the scheduler refuses its configuration: enable_recompute"),
    ],
)
def test_scheduler_settings_of_a_bound_are_checked(fields, message):
    from kvstate.checker import BoundsError

    with pytest.raises(BoundsError, match=f"bound 'x': {message}"):
        Bound(name="x", requests=((1, 1),), gpu_blocks=2, **fields)
    settings = Bound(name="x", requests=((1, 1),), gpu_blocks=2, host_blocks=0, capacity_policy="guaranteed_no_evict")
    assert settings.scheduler_config().capacity_policy == "guaranteed_no_evict"
    assert Bound.from_dict(settings.to_dict()) == settings


def test_tarjan_iterative_deep_chain():
    n = 50_000  # far beyond the recursion limit
    succ = [[i + 1] for i in range(n - 1)] + [[0]]
    comp = tarjan(n, succ)
    assert len(set(comp)) == 1
    comp = tarjan(n, [[i + 1] for i in range(n - 1)] + [[]])
    assert len(set(comp)) == n


def spec_with_resume_to_done(tmp_path: Path) -> Path:
    text = packaged_spec_path().read_text()
    edited = text.replace(
        '{ source = ["suspended"], dest = "running", guard = "gpu_room_for_offloaded_blocks"',
        '{ source = ["suspended"], dest = "done", guard = "gpu_room_for_offloaded_blocks"',
    )
    assert edited != text
    path = tmp_path / "lifecycle.toml"
    path.write_text(edited)
    return path


def test_counterexample_file_is_a_failing_pytest(tmp_path, capsys):
    spec_path = spec_with_resume_to_done(tmp_path)
    out_dir = tmp_path / "cex"
    assert main(["check", "--spec", str(spec_path), "--bound", "default", "--counterexample-dir", str(out_dir)]) == 1
    out = capsys.readouterr().out
    assert "counterexample" in out and "1. " in out and "RES-STATE" in out
    written = out_dir / "kvstate-counterexample-default.py"
    source = written.read_text()
    compile(source, str(written), "exec")
    assert "def test_" in source and "replay_abstract" in source
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(written)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert run.returncode == 1, run.stdout + run.stderr  # the regression test fails while the bug is there
    assert "RES-STATE" in run.stdout


def test_an_admit_guard_that_ignores_room_is_reported_as_own_excl_naming_the_edge(tmp_path):
    """A spec copy whose admit edge is guarded by `single_stage` (true in one stage, whatever the room): the
    refinement's scheduler asks the GPU tier for blocks it does not have. The checker reports that as the
    invariant an allocation beyond capacity breaks, naming the edge and its guard, never as a raw pool error."""
    spec_path = packaged_spec_path()
    admit = next(t for t in load_spec(spec_path).transitions if t.event == "admit")
    text = Path(spec_path).read_text()
    old = f'guard = "{admit.guard}", effect = "{admit.effect}"'
    assert text.count(old) == 2  # admit, and replay's readmission: mutate the first only
    mutant = tmp_path / "lifecycle.toml"
    mutant.write_text(text.replace(old, f'guard = "single_stage", effect = "{admit.effect}"', 1))
    (bound,) = select_bounds(["preemption_cap"])
    report = check_bound(bound, spec=load_spec(mutant), counterexample_dir=None)
    result = report.refinement
    assert report.verdict == "violated" and result is not None and result.violation_id == "OWN-EXCL"
    assert "PoolError" not in result.message and f"took edge {admit.source} -admit-> {admit.dest}" in result.message
    assert "guard 'single_stage'" in result.message and f"effect '{admit.effect}'" in result.message
    assert result.path  # the counterexample's actions
