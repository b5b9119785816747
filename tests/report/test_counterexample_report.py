"""A counterexample `kvstate check` writes is drawn by `kvstate report`, its violating step marked, even when that
step carries block counts out of range; the trace reader stays strict for every other line and trace."""

from __future__ import annotations

import json

import pytest

from kvstate import load_spec
from kvstate.checker.bounds import select_bounds
from kvstate.checker.runner import check_bound
from kvstate.cli import main
from kvstate.report import TraceError, write_report
from kvstate.spec import packaged_spec_path
from kvstate.trace import BLOCK_COUNT_FIELDS, counterexample_header, read_header, read_trace


def swapped_guards_spec(tmp_path):
    """A copy of the packaged spec with the guards of the suspend transition and of resume to running swapped (in
    the exclusivity group of resume's two guards too, so that the copy is well formed)."""
    spec = load_spec()
    suspend = spec.event_by_name["suspend"].transitions[0]  # one TOML entry, one edge per source state
    resume = spec.event_by_name["resume"].transitions[0]
    text = packaged_spec_path().read_text(encoding="utf-8")
    for guard in (suspend.guard, resume.guard):
        assert text.count(f'guard = "{guard}"') == 1  # each used once: swapping the texts swaps the transitions
    text = text.replace(f'guard = "{suspend.guard}"', "GUARD-A").replace(f'guard = "{resume.guard}"', "GUARD-B")
    text = text.replace("GUARD-A", f'guard = "{resume.guard}"').replace("GUARD-B", f'guard = "{suspend.guard}"')
    assert text.count(f'guards = ["{resume.guard}", ') == 1  # the exclusivity group of resume's guards
    text = text.replace(f'guards = ["{resume.guard}", ', f'guards = ["{suspend.guard}", ')
    path = tmp_path / "swapped.toml"
    path.write_text(text, encoding="utf-8")
    swapped = load_spec(path)
    assert swapped.event_by_name["suspend"].transitions[0].guard == resume.guard
    return path


@pytest.fixture(scope="module")
def capacity_counterexample(tmp_path_factory):
    """`kvstate check --spec SWAPPED --bound default`: (exit code, output, bound report, spec path, directory)."""
    tmp = tmp_path_factory.mktemp("swapped")
    spec_path = swapped_guards_spec(tmp)
    (bound,) = select_bounds(["default"])
    report = check_bound(bound, spec=load_spec(spec_path), counterexample_dir=tmp / "api")
    return report, spec_path, tmp


def test_a_capacity_counterexample_is_drawn_by_the_check(capacity_counterexample, capsys):
    pytest.importorskip("matplotlib")
    _, spec_path, tmp = capacity_counterexample
    code = main(["check", "--spec", str(spec_path), "--bound", "default", "--counterexample-dir", str(tmp / "cli")])
    out = capsys.readouterr().out
    assert code == 1
    assert "counterexample drawn" in out and "not drawn" not in out
    assert (tmp / "cli" / "kvstate-counterexample-default-report" / "report.html").is_file()


def test_the_trace_names_the_violation_and_carries_the_out_of_range_step(capacity_counterexample):
    report, _, _ = capacity_counterexample
    traced = report.counterexample_trace
    header = read_header(traced.path)
    assert header is not None and header.invariant == report.violated_invariant
    lines = list(read_trace(traced.path))
    assert len(lines) == traced.lines
    assert header.step == max(line["iteration"] for line in lines)
    last = [line for line in lines if line["iteration"] == header.step]
    assert any(line[f] < 0 for line in last for f in BLOCK_COUNT_FIELDS)  # the capacity violation itself
    assert all(line[f] >= 0 for line in lines if line not in last for f in BLOCK_COUNT_FIELDS)


def test_the_report_marks_the_violating_step_and_its_out_of_range_counts(capacity_counterexample, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    report, spec_path, _ = capacity_counterexample
    traced = report.counterexample_trace
    assert main(["report", str(traced.path), "--out", str(tmp_path / "r"), "--spec", str(spec_path)]) == 0
    page = (tmp_path / "r" / "report.html").read_text(encoding="utf-8")
    assert f"invariant {report.violated_invariant} violated at step" in page
    assert page.count('class="n bad"') >= 1
    drawn = write_report(traced.path, tmp_path / "api", spec=load_spec(spec_path))
    summary = drawn.summary
    assert summary.violation is not None and summary.violation.invariant == report.violated_invariant
    assert summary.violating_lines and any(summary.out_of_range(line) for line in summary.violating_lines)
    over = [row for row in summary.occupancy if row["gpu_owned"] > row["gpu_capacity"]]
    assert over and all(row["iteration"] == summary.violation.step for row in over)
    assert f"{report.violated_invariant} violated (step {summary.violation.step})" in (
        tmp_path / "api" / "timeline.svg"
    ).read_text(encoding="utf-8")


# ------------------------------------------------------------------------------------- the reader stays strict
def _lines(spec_trace_lines, **changes):
    lines = [dict(line) for line in spec_trace_lines(load_spec())]
    lines[-1].update(changes)
    return lines


def _write(path, lines, header=None):
    rows = ([header] if header is not None else []) + lines
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_a_normal_trace_with_a_count_below_zero_is_still_refused(tmp_path, spec_trace_lines):
    path = _write(tmp_path / "t.ndjson", _lines(spec_trace_lines, gpu_free=-1))
    with pytest.raises(TraceError, match="gpu_free"):
        list(read_trace(path))


def test_a_counterexample_may_go_out_of_range_only_at_its_violating_step(tmp_path, spec_trace_lines):
    lines = _lines(spec_trace_lines, host_free=-1)
    step = lines[-1]["iteration"]
    ok = _write(tmp_path / "ok.ndjson", lines, counterexample_header("CONS-HOST", step, "host free -1"))
    assert list(read_trace(ok))[-1]["host_free"] == -1
    early = [dict(line) for line in lines]
    early[0]["gpu_free"] = -1
    assert early[0]["iteration"] < step
    with pytest.raises(TraceError, match="only at its violating step") as err:
        list(read_trace(_write(tmp_path / "early.ndjson", early, counterexample_header("CONS-HOST", step, ""))))
    assert err.value.line == 2 and err.value.field == "gpu_free"
    before = counterexample_header("CONS-HOST", step - 1, "")
    with pytest.raises(TraceError, match="after the violating step"):
        list(read_trace(_write(tmp_path / "after.ndjson", lines, before)))
    lasso = counterexample_header("LIVE-DONE", None, "a loop")  # no violating step: nothing out of range
    with pytest.raises(TraceError, match="host_free"):
        list(read_trace(_write(tmp_path / "lasso.ndjson", lines, lasso)))


def test_a_header_anywhere_but_the_first_line_or_malformed_is_refused(tmp_path, spec_trace_lines):
    lines = [dict(line) for line in spec_trace_lines(load_spec())]
    header = counterexample_header("CONS-HOST", lines[-1]["iteration"], "m")
    with pytest.raises(TraceError):
        list(read_trace(_write(tmp_path / "late.ndjson", [lines[0], header, *lines[1:]])))
    with pytest.raises(TraceError, match="step"):
        read_header(_write(tmp_path / "bad.ndjson", lines, {**header, "step": -3}))
    with pytest.raises(TraceError, match="exactly the keys"):
        read_header(_write(tmp_path / "keys.ndjson", lines, {**header, "extra": 1}))
