"""A spec is a file someone sends you for review: its texts must come out of every renderer inert.

Each payload is planted in a copy of the packaged spec (a state renamed everywhere it is used, the spec's name,
a state's meaning, an event's label) and each test asserts, for one output format, that the payload added no
statement, tag, link or comment breakout, and that the hostile text is still shown, literally.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import replace
from html.parser import HTMLParser
from xml.etree import ElementTree

import pytest

from kvstate.diagrams import build_diagram, render_dot, render_mermaid, render_review_dot, render_svg, render_table
from kvstate.diagrams.escape import (
    UnsafeSvgError,
    dot_string,
    html_text,
    md_code,
    md_text,
    mermaid_id,
    mermaid_text,
    one_line,
    safe_svg,
)
from kvstate.diagrams.ir import Diagram
from kvstate.errors import KVStateError
from kvstate.spec import RESIDENCIES, Spec, load_spec

MERMAID_CLICK = 'done\n click done "javascript:alert(1)"'
SCRIPT = "<script>alert(1)</script>"
TRIPLE_QUOTE = 'x"""\nimport os; os.system("echo pwned")\n"""'
DOT_BREAKOUT = 'kvstate\ndigraph evil { a [URL="javascript:alert(document.domain)"] }'
MD_LINK = "[click](javascript:alert(1)) ![img](javascript:alert(2)) <b>bold</b> | cell"
NEWLINES = "line\r\nbreak\u2028sep\x85nel"
STATE_PAYLOADS = [MERMAID_CLICK, SCRIPT, TRIPLE_QUOTE, DOT_BREAKOUT, MD_LINK, NEWLINES]
HAS_DOT = shutil.which("dot") is not None


def rename_state(spec: Spec, old: str, new: str) -> Spec:
    """`spec` with state `old` renamed to `new` wherever it is used (the shape checks are not re-run)."""
    name = {old: new}.get
    states = tuple(replace(s, name=name(s.name, s.name)) for s in spec.states)
    events = tuple(
        replace(
            e,
            transitions=tuple(
                replace(t, source=name(t.source, t.source), dest=name(t.dest, t.dest)) for t in e.transitions
            ),
        )
        for e in spec.events
    )
    return replace(spec, states=states, events=events, initial=name(spec.initial, spec.initial))


def hostile(payload: str) -> Spec:
    """The packaged spec with `payload` as a terminal state's name, the spec's name, a meaning and a label."""
    spec = load_spec()
    terminal = spec.terminal_states[0]
    spec = rename_state(spec, terminal, payload)
    states = tuple(replace(s, meaning=payload) if i == 0 else s for i, s in enumerate(spec.states))
    events = tuple(replace(e, label=payload) if i == 0 else e for i, e in enumerate(spec.events))
    return replace(spec, name=payload, states=states, events=events)


@pytest.fixture(
    params=STATE_PAYLOADS, ids=["mermaid-click", "script", "triple-quote", "dot-breakout", "md-link", "newlines"]
)
def payload(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=[False, True], ids=["bundled", "all-edges"])
def diagram(request: pytest.FixtureRequest, payload: str) -> Diagram:
    return build_diagram(hostile(payload), all_edges=request.param)


# ------------------------------------------------------------------------------------------------------ DOT

DOT_STATEMENT = re.compile(
    r"^(// .*"  # the one comment, first line
    r"|digraph lifecycle \{|\}"
    r'|  bb="[\d.,]+";|  fontname="Helvetica"; fontsize=\d+;|  lp="[\d.,]+";'
    r"|  (rankdir|newrank|nodesep|ranksep|fontname|labelloc|label)=.*;"
    r"|  (node|edge) \[.*\];"
    rf"|  subgraph cluster_({'|'.join(RESIDENCIES)}) \{{|  \}}"
    r'|    label=".*";|    fontsize=1\d; bb="[\d.,]+"; lp="[\d.,]+";|    style=.*;'
    r'|\s+"(?:[^"\\]|\\.)*" \[.*\];'  # a node
    r'|  "(?:[^"\\]|\\.)*" -> "(?:[^"\\]|\\.)*"( \[.*\])?;'  # an edge
    r"|)$"
)


@pytest.mark.parametrize("render", [render_dot, render_review_dot], ids=["lifecycle", "review"])
def test_dot_has_only_its_own_statements(diagram: Diagram, render) -> None:
    dot = render(diagram)
    lines = dot.splitlines()
    assert lines[0].startswith("// ") and not any(line.lstrip().startswith("//") for line in lines[1:])
    assert [line for line in lines if not DOT_STATEMENT.match(line)] == []
    assert sum(line.startswith("digraph ") for line in lines) == 1


@pytest.mark.skipif(not HAS_DOT, reason="Graphviz `dot` is not installed")
def test_graphviz_reads_the_names_back_exactly_and_draws_no_link(payload: str) -> None:
    diagram = build_diagram(hostile(payload), all_edges=True)
    dot = render_dot(diagram)
    raw = subprocess.run(["dot", "-Tjson"], input=dot.encode(), capture_output=True, timeout=60, check=True)
    graph = json.loads(raw.stdout)
    names = {obj["name"] for obj in graph["objects"] if "nodes" not in obj}  # nodes, not clusters
    # the DOT scanner unescapes only \" in a quoted ID; \n stays and is drawn as a line break by the \N label
    assert {dot_string(node.name)[1:-1].replace('\\"', '"') for node in diagram.nodes} <= names
    assert len(graph["edges"]) == len(diagram.edges) + 1  # + the initial pseudo-state's edge
    assert not any("URL" in obj or "href" in obj for obj in graph["objects"] + graph["edges"])
    svg = subprocess.run(["dot", "-Tsvg"], input=dot.encode(), capture_output=True, timeout=60, check=True).stdout
    assert b"href" not in svg, "escaping alone must keep Graphviz from drawing a link (tooltips are `<a xlink:title>`)"


@pytest.mark.skipif(not HAS_DOT, reason="Graphviz `dot` is not installed")
def test_rendered_svg_has_no_link_and_shows_the_payload(payload: str) -> None:
    svg = render_svg(render_dot(build_diagram(hostile(payload)))).decode()
    assert "<a" not in svg and "href" not in svg and "<script" not in svg
    texts = {element.text.strip() for element in ElementTree.fromstring(svg).iter() if element.text}
    assert one_line(payload.split("\n", maxsplit=1)[0]).strip() in texts, "the hostile name is still shown, literally"


def test_dot_string_escapes_every_way_out() -> None:
    assert dot_string('a"b') == '"a\\"b"'
    assert dot_string("a\\") == '"a\\\\"'  # a trailing backslash cannot escape the closing quote
    assert dot_string("a\nb") == '"a\\nb"'
    assert dot_string("a\\N\\G") == '"a\\\\N\\\\G"'  # no Graphviz escString substitution
    assert "\r" not in dot_string("a\r\u2028b") and "\u2028" not in dot_string("a\r\u2028b")


# -------------------------------------------------------------------------------------------------- Mermaid

MERMAID_STATEMENT = re.compile(
    r"^(stateDiagram-v2"
    r"|    %% .*"
    r"|    classDef \w+ [\w:#,]+"
    r'|    state "[^"\n]*" as \w+'
    r"|    state \w+ <<choice>>"
    r"|    (\w+|\[\*\]) --> (\w+|\[\*\])( : [^\n:;]*)?"
    r"|    class [\w,]+ \w+)$"
)


def test_mermaid_has_only_its_own_statements(diagram: Diagram) -> None:
    mermaid = render_mermaid(diagram)
    assert [line for line in mermaid.splitlines() if not MERMAID_STATEMENT.match(line)] == []
    assert not re.search(r"^\s*(click|style|linkStyle|callback|href)\b", mermaid, re.M)
    assert "javascript:" not in mermaid and "<script" not in mermaid


def test_mermaid_keeps_each_hostile_state_apart(payload: str) -> None:
    diagram = build_diagram(hostile(payload))
    ids = [mermaid_id(node.name) for node in diagram.nodes]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"[A-Za-z]\w*", i) for i in ids)
    assert mermaid_id("click") != "click" and mermaid_id("s_x") != "s_x" and mermaid_id("running") == "running"
    assert mermaid_text('a:b;c"d#e%f<g>') == "a\u2236b\uff1bc\u201dd\uff03e\uff05f\u2039g\u203a"


# ------------------------------------------------------------------------------------------------- Markdown


def test_transitions_md_has_no_raw_html_or_link(diagram: Diagram) -> None:
    markdown_it = pytest.importorskip("markdown_it")
    table = render_table(diagram)
    html = markdown_it.MarkdownIt("commonmark").enable("table").render(table)
    assert "<script" not in html and "<b>" not in html and "<a " not in html and "<img" not in html
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    widths = {line.replace("\\|", "").count("|") for line in rows[:2]}
    assert all(line.replace("\\|", "").count("|") in (5, 6, 7) for line in rows), "a `|` split a row"
    assert widths == {5}


def test_md_escapes() -> None:
    assert md_code("a`b") == "`` a`b ``"
    assert md_code("x|y") == "`x\\|y`"
    assert md_text("<b>[x](javascript:y)</b>") == "\\<b\\>\\[x\\](javascript:y)\\</b\\>"
    assert "\n" not in md_text("a\nb") and "\n" not in md_code("a\nb")


# ---------------------------------------------------------------------------------------------------- SVG

HOSTILE_SVG = """<?xml version="1.0"?>
<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink" width="10pt" height="10pt"
 viewBox="0 0 10 10" onload="alert(1)">
<script>alert(2)</script>
<g id="graph0" class="graph"><title>t</title>
<a xlink:href="javascript:alert(3)" href="javascript:alert(4)"><text x="1" y="2" font-size="11">kept</text></a>
<foreignObject><body xmlns="http://www.w3.org/1999/xhtml"><script>alert(5)</script></body></foreignObject>
<polygon fill="url(javascript:alert(6))" stroke="black" points="0,0 1,1"/>
<image href="data:image/svg+xml;base64,AAAA"/><use xlink:href="#graph0"/>
</g></svg>"""


def test_safe_svg_keeps_the_drawing_and_drops_every_active_part() -> None:
    clean = safe_svg(HOSTILE_SVG)
    assert "kept" in clean and "<polygon" in clean and 'viewBox="0 0 10 10"' in clean
    for bad in ("javascript", "alert", "onload", "<script", "<a", "href", "foreignObject", "<image", "<use", 'id="'):
        assert bad not in clean, bad


def test_safe_svg_refuses_entities_and_non_svg() -> None:
    with pytest.raises(UnsafeSvgError, match="entities"):
        safe_svg('<!DOCTYPE svg [<!ENTITY a "aaaa">]><svg xmlns="http://www.w3.org/2000/svg">&a;</svg>')
    with pytest.raises(UnsafeSvgError, match="expected an <svg>"):
        safe_svg("<html/>")
    with pytest.raises(UnsafeSvgError, match="well-formed"):
        safe_svg("<svg")


# ------------------------------------------------------------------------------------------------ HTML report


class TagCollector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, list[tuple[str, str | None]]]] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, attrs))
        self._in_script = tag == "script"

    def handle_endtag(self, tag):
        self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.scripts.append(data)


def every_payload() -> Spec:
    """The packaged spec with every payload at once: each non-initial state renamed to one, the spec's name one."""
    spec = load_spec()
    others = [s.name for s in spec.states if s.name != spec.initial]
    for state, payload in zip(others[: len(STATE_PAYLOADS)], STATE_PAYLOADS, strict=True):
        spec = rename_state(spec, state, payload)
    return replace(spec, name=DOT_BREAKOUT)


def test_report_of_a_hostile_spec_is_inert(tmp_path, spec_trace_lines) -> None:
    """One report holding every payload (a report takes seconds: matplotlib draws its figures)."""
    pytest.importorskip("matplotlib")
    from kvstate.report import write_report
    from kvstate.report.html import ZOOM_SCRIPT

    spec = every_payload()
    trace = tmp_path / "t.ndjson"
    trace.write_text("".join(json.dumps(line) + "\n" for line in spec_trace_lines(spec, request_id=SCRIPT)))
    result = write_report(trace, tmp_path / "out", spec=spec)
    page = result.html.read_text()
    parser = TagCollector()
    parser.feed(page)
    assert parser.scripts == [ZOOM_SCRIPT], "the zoom is the page's only script"
    assert html_text(SCRIPT) in page, "the hostile name is still shown, as text"
    for tag, attrs in parser.tags:
        for name, value in attrs:
            assert not name.startswith("on"), (tag, name)
            assert name not in ("href", "xlink:href", "src") or (value or "").startswith("data:image/png;base64,")
    for name in ("lifecycle.svg", "lifecycle-review.svg"):
        if (tmp_path / "out" / name).exists():
            svg = (tmp_path / "out" / name).read_text()
            assert "<a" not in svg and "href" not in svg and "<script" not in svg


# ---------------------------------------------------------------------------------------------- dot time limit


@pytest.mark.skipif(not HAS_DOT, reason="Graphviz `dot` is not installed")
def test_dot_is_stopped_at_its_time_limit_with_a_clear_error() -> None:
    """The drawings carry their own layout, which Graphviz draws at once; a source whose edges Graphviz must route
    itself (12,000 edges among 400 placed nodes: the spline router takes far more than a second) is stopped."""
    lines = ["digraph lifecycle {", "  splines=true;"]
    lines += [f'  "s{i}" [pos="{(i % 20) * 80},{(i // 20) * 60}", width=0.5, height=0.3];' for i in range(400)]
    lines += [f'  "s{i}" -> "s{(i * 7 + k) % 400}";' for i in range(400) for k in range(1, 31)]
    with pytest.raises(KVStateError, match=r"did not finish drawing the diagram within 1 s.*--dot-timeout"):
        render_svg("\n".join([*lines, "}"]) + "\n", timeout=1)
