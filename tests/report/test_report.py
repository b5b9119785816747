"""`kvstate report`: trace summary (spans, occupancy, edge counts), files written, self-contained HTML, errors."""

from __future__ import annotations

import json

import pytest

from kvstate import SchedulerConfig, load_spec
from kvstate.checker.trace import validate_trace
from kvstate.cli import main
from kvstate.diagrams.dot import CLUSTER_COLORS
from kvstate.report import TraceError, summarize, write_report
from kvstate.report.colors import SHADES, state_colors
from kvstate.report.diagram import annotated_diagram
from kvstate.report.model import Span


def _line(it, rid, event, src, dst, gpu_free=6, gpu_fenced=0, host_free=4, host_fenced=0, reason=None, gpu=0, host=0):
    return {
        "iteration": it,
        "request_id": rid,
        "event": event,
        "from": src,
        "to": dst,
        "gpu_blocks": gpu,
        "host_blocks": host,
        "gpu_free": gpu_free,
        "host_free": host_free,
        "gpu_fenced": gpu_fenced,
        "host_fenced": host_fenced,
        "gpu_capacity": 8,
        "host_capacity": 4,
        "generated": 0,
        "computed_tokens": 0,
        "done_reason": reason,
    }


LINES = [  # a is suspended (held on the GPU), offloaded (its copy done by iteration 5) and resumed (copied up)
    _line(1, "a", "admit", "waiting", "running", gpu_free=6, gpu=2),
    _line(1, "b", "admit", "waiting", "running", gpu_free=4, gpu=2),
    _line(3, "a", "suspend", "running", "suspended", gpu_free=4, gpu=2),
    _line(4, "a", "offload", "suspended", "suspended", gpu_free=4, gpu_fenced=2, host_free=2, host=2),
    _line(5, "a", "resume", "suspended", "running", gpu_free=4, host_free=2, host_fenced=2, gpu=2),
    _line(6, "b", "finish", "running", "done", gpu_free=6, reason="finished"),
    _line(8, "a", "finish", "running", "done", gpu_free=8, reason="finished"),
]


def _write(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_the_summarized_trace_is_valid():
    assert validate_trace([json.dumps(line) for line in LINES]).ok


def test_summary_spans_occupancy_and_counts():
    s = summarize(LINES)
    assert s.requests == ["a", "b"]
    held, offloaded = Span("suspended", 3, 4, "gpu"), Span("suspended", 4, 5, "host")  # an offload starts a span
    assert s.spans["a"] == [Span("running", 1, 3), held, offloaded, Span("running", 5, 8)]
    assert s.spans["b"] == [Span("running", 1, 6)]  # waiting had no width: admitted in the first iteration
    assert s.edge_counts[("admit", "waiting", "running")] == 2 and s.done_reasons["finished"] == 2
    assert [r["iteration"] for r in s.occupancy] == list(range(1, 9))
    at = {r["iteration"]: r for r in s.occupancy}
    assert at[3]["gpu_owned"] == 4 and at[3]["gpu_held"] == 2 and at[3]["gpu_fenced"] == 0  # held: nothing copied
    assert at[4]["gpu_fenced"] == 2 and at[4]["gpu_owned"] == 2 and at[4]["host_owned"] == 2  # the offload
    assert at[4]["gpu_held"] == 0 and at[5]["host_fenced"] == 2 and at[5]["gpu_held"] == 0
    assert at[7] == {**at[6], "iteration": 7}  # carried over an iteration without lines
    assert s.occupancy[-1]["gpu_owned"] == 0


def test_unfinished_request_runs_to_the_end_of_the_trace():
    s = summarize(LINES[:3])
    assert s.spans["b"] == [Span("running", 1, 4)]


def test_state_colours_follow_the_diagram_residency_colours():
    spec = load_spec()
    colors = state_colors(spec)
    assert set(colors) == {s.name for s in spec.states if not s.terminal}
    for state in spec.states:
        if not state.terminal:
            assert colors[state.name] in SHADES[state.residency]
    assert colors["running"] == CLUSTER_COLORS["gpu"][1] and colors["suspended"] == CLUSTER_COLORS["held"][1]
    gpu_states = [s.name for s in spec.states if s.residency == "gpu"]
    assert len({colors[s] for s in gpu_states}) == len(gpu_states)  # distinct shades within a residency


def test_held_kv_is_drawn_by_where_it_is_and_apart_from_locked_blocks():
    """The timeline shades a suspended request by where its KV is; the GPU occupancy shows held blocks apart."""
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_hex

    from kvstate.report.colors import PLACEMENT_WORDS, placement_color
    from kvstate.report.figures import occupancy, timeline

    spec = load_spec()
    summary = summarize(LINES)
    ax = timeline(summary, spec).axes[0]
    labels = {text.get_text() for text in ax.get_legend().get_texts()}
    assert {f"suspended ({PLACEMENT_WORDS['gpu']})", f"suspended ({PLACEMENT_WORDS['host']})"} <= labels
    base = state_colors(spec)["suspended"]
    faces = {to_hex(c.get_facecolor()[0]) for c in ax.collections}
    assert {placement_color(base, "gpu"), placement_color(base, "host")} <= faces
    assert placement_color(base, "gpu") != placement_color(base, "host") == base
    gpu_axes = occupancy(summary).axes[0]
    legend = [text.get_text() for text in gpu_axes.get_legend().get_texts()]
    assert "locked (computing)" in legend and "held (suspended)" in legend


def test_annotated_diagram_counts_every_edge():
    spec = load_spec()
    counts = summarize(LINES).edge_counts
    diagram, dot = annotated_diagram(spec, counts)
    assert len(diagram.edges) == len(spec.transitions)
    assert "admit ×2" in dot and "suspend ×1" in dot and "offload ×1" in dot and "cancel ×0" in dot
    assert dot.count("penwidth=") == len(counts)


def test_write_report_files_and_self_contained_html(tmp_path):
    pytest.importorskip("matplotlib")
    result = write_report(_write(tmp_path / "t.ndjson", LINES), tmp_path / "out")
    names = {p.name for p in result.files}
    assert {"timeline.png", "timeline.svg", "occupancy.png", "occupancy.svg", "lifecycle.dot", "report.html"} <= names
    for name in ("timeline.png", "occupancy.png"):
        assert (tmp_path / "out" / name).read_bytes()[:4] == b"\x89PNG"
    html = result.html.read_text()
    assert html.count("data:image/png;base64,") == 2 and "http://" not in html.replace("http://www.w3.org", "")
    if result.note:  # no Graphviz here
        assert "Graphviz" in html
    else:
        assert "<svg" in html and "lifecycle.svg" in names


def test_without_graphviz_the_diagram_is_skipped_with_a_note(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from kvstate.report import diagram

    monkeypatch.setattr(diagram, "render", lambda dot, fmt: None)
    result = write_report(_write(tmp_path / "t.ndjson", LINES), tmp_path / "out")
    assert "Graphviz" in result.note and not (tmp_path / "out" / "lifecycle.svg").exists()
    assert "Graphviz" in result.html.read_text()


def test_bad_traces_are_clear_errors(tmp_path):
    with pytest.raises(TraceError, match="does not exist"):
        write_report(tmp_path / "missing.ndjson", tmp_path)
    with pytest.raises(TraceError, match="no lines"):
        write_report(_write(tmp_path / "empty.ndjson", []), tmp_path)
    (tmp_path / "bad.ndjson").write_text("{not json\n")
    with pytest.raises(TraceError, match=r"bad.ndjson:1: not a JSON object"):
        write_report(tmp_path / "bad.ndjson", tmp_path)
    with pytest.raises(TraceError, match="missing fields"):
        write_report(_write(tmp_path / "short.ndjson", [{"iteration": 1}]), tmp_path)
    with pytest.raises(TraceError, match="does not define"):
        write_report(_write(tmp_path / "odd.ndjson", [_line(1, "a", "resume", "waiting", "done")]), tmp_path)


def test_report_command_on_a_real_engine_trace(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    pytest.importorskip("torch")
    from executor import Engine, EngineConfig
    from executor.checks import random_workload, submit_all

    trace = tmp_path / "[x] t.ndjson"  # a path that reads as Rich markup is printed as typed
    with Engine(
        EngineConfig(
            device="cpu", scheduler=SchedulerConfig(gpu_blocks=16, host_blocks=6, block_size=4), trace_path=trace
        )
    ) as engine:
        submit_all(engine, random_workload(10, 1, (4, 30), (4, 24)))
        engine.run()
        assert engine.totals.suspensions > 0
    assert main(["report", str(trace), "--out", str(tmp_path / "rep[/x]"), "--mkdir"]) == 0
    out = capsys.readouterr().out
    assert "10 requests" in out and f"open {tmp_path / 'rep[' / 'x]' / 'report.html'}" in out
    assert main(["report", str(tmp_path / "missing"), "--out", str(tmp_path / "rep")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("request_id", "needle"),
    [("\ud800", "is not Unicode text (a lone surrogate at character 0)"), ("x" * 65_000, "has 65000 characters")],
    ids=["lone-surrogate", "65000-characters"],
)
def test_a_trace_id_no_report_can_draw_is_refused_naming_line_and_field(tmp_path, capsys, request_id, needle):
    trace = _write(tmp_path / "t.ndjson", [LINES[0], {**LINES[1], "request_id": request_id}])
    with pytest.raises(TraceError) as info:
        write_report(trace, tmp_path / "out")
    assert str(info.value).startswith(f"{trace}:2: field 'request_id': ") and needle in str(info.value)
    assert main(["report", str(trace), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err


def test_request_ids_are_drawn_escaped_and_cut_short(tmp_path):
    pytest.importorskip("matplotlib")
    from kvstate.report.figures import MAX_ID_LABEL, id_label

    odd = "a\x1b[31m" + "y" * 4000
    write_report(_write(tmp_path / "t.ndjson", [{**line, "request_id": odd} for line in LINES[:1]]), tmp_path / "o")
    label = id_label(odd)
    assert len(label) <= MAX_ID_LABEL and label.startswith("a\\x1b[31m") and label.endswith("…")


@pytest.mark.parametrize(
    ("span", "needle"),
    [
        ("0:100000000000000000000", "FIRST <= LAST <= 1000000000000000000"),
        ("0:" + "9" * 5000, "(5002 characters)"),
        ("\u0663:\u0665", "ASCII digits"),  # Arabic-Indic 3:5
        ("5:3", "FIRST <= LAST"),
    ],
    ids=["1e20", "5000-digits", "arabic-indic-digits", "reversed"],
)
def test_a_loop_out_of_bounds_or_in_other_digits_is_a_usage_error(tmp_path, capsys, span, needle):
    trace = _write(tmp_path / "t.ndjson", LINES)
    assert main(["report", str(trace), "--out", str(tmp_path / "out"), "--loop", span]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err) < 400 and not (tmp_path / "out").exists()


def test_a_trace_of_more_requests_than_a_report_draws_is_refused_naming_the_file(tmp_path, capsys):
    from kvstate.report.model import MAX_REPORT_REQUESTS

    admit = LINES[0]
    trace = tmp_path / "many.ndjson"
    with trace.open("w") as out:  # one admission per request: the request past the bound is on the last line
        for rid in range(MAX_REPORT_REQUESTS + 1):
            out.write(json.dumps({**admit, "request_id": rid}) + "\n")
    with pytest.raises(TraceError) as info:
        write_report(trace, tmp_path / "out")
    message = str(info.value)
    assert message.startswith(f"{trace}: transition {MAX_REPORT_REQUESTS + 1}: request {MAX_REPORT_REQUESTS} ")
    assert f"a report draws at most {MAX_REPORT_REQUESTS}" in message and "\n" not in message
    assert not (tmp_path / "out").exists()


def test_reading_a_long_trace_says_how_far_it_got_against_the_file_size(tmp_path, capsys, monkeypatch):
    import kvstate.commands.report as report_command
    import kvstate.report as report_module
    from kvstate.report.model import MAX_REPORT_REQUESTS

    admit, finish = LINES[1], LINES[5]
    trace = tmp_path / "long.ndjson"
    with trace.open("w") as out:  # 2,500 requests, each admitted, then finished one iteration later
        for rid in range(2_500):
            out.write(json.dumps({**admit, "iteration": 2 * rid + 1, "request_id": rid}) + "\n")
            out.write(json.dumps({**finish, "iteration": 2 * rid + 2, "request_id": rid}) + "\n")
    monkeypatch.setattr(report_module, "PROGRESS_LINES", 1_000)
    monkeypatch.setattr(report_command, "PROGRESS_EVERY_S", 0.0)  # a line per report, stderr not being a terminal
    assert main(["report", str(trace), "--out", str(tmp_path / "out")]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "reading the trace" in line]
    size = f"of {trace.stat().st_size / 1e6:,.1f} MB"
    assert [line.split(" lines,")[0].rsplit(" ", 1)[1] for line in lines] == [
        "1,000",
        "2,000",
        "3,000",
        "4,000",
        "5,000",
    ]
    shares = [int(line.split("(")[1].split("%")[0]) for line in lines]
    assert shares == sorted(shares) and shares[0] > 0 and shares[-1] == 100  # the last line read is the end
    assert all(size in line and f"at most {MAX_REPORT_REQUESTS:,} requests" in line for line in lines), lines
