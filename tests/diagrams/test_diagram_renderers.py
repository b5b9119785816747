"""The text sources rendered from the spec: committed copies, edge coverage, styles and byte stability.

Expected edges are derived from the loaded spec, never re-typed here. With `all_edges` every transition is one
arrow; by default (the committed files) a broadcast event's edges into a terminal state are one arrow from the
"any state" pseudo-node, and every transition is still drawn by exactly one arrow.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from kvstate.diagrams import DOT_FILE, MERMAID_FILE, TABLE_FILE, TEXT_FILES, build_diagram, render_sources
from kvstate.diagrams.dot import DESTRUCTIVE_STYLE, INITIAL_NODE, KIND_KEYS, kind_meanings
from kvstate.diagrams.ir import ANY_STATE, EdgeKind, ends_requests
from kvstate.diagrams.mermaid import DESTRUCTIVE_MARK, KIND_MARKS, LOOP_JOIN
from kvstate.diagrams.table import NONE_MARK
from kvstate.spec import RESIDENCY_TIERS, Spec, load_spec

DIAGRAMS = Path(__file__).parents[2] / "diagrams"

DOT_EDGE = re.compile(
    r'^\s*"(?P<source>[^"]+)" -> "(?P<dest>[^"]+)"(?: \[label="(?P<label>(?:[^"\\]|\\.)*)"(?P<rest>.*)\])?;$'
)
MERMAID_EDGE = re.compile(r"^\s*(?P<source>\S+) --> (?P<dest>\S+)(?: : (?P<label>.*))?$")


@pytest.fixture(scope="module")
def spec() -> Spec:
    return load_spec()


@pytest.fixture(scope="module")
def sources(spec: Spec) -> dict[str, str]:
    return render_sources(spec)


@pytest.fixture(scope="module")
def all_sources(spec: Spec) -> dict[str, str]:
    return render_sources(spec, all_edges=True)


def drops_kv(spec: Spec, transition) -> bool:
    """A destructive transition into a non-terminal state without KV: the request must be replayed."""
    dest = spec.state_by_name[transition.dest]
    return transition.destructive and not dest.terminal and dest.residency == "none"


def expected_label(spec: Spec, transition) -> str:
    label = spec.event_by_name[transition.event].label
    if transition.guard is not None:
        label += f" [{transition.guard}]"
    if transition.effect is not None:
        label += f" / {transition.effect}"
    return label


def expected_edges(spec: Spec) -> Counter:
    """(source, dest, label, drops the KV) of every spec transition."""
    return Counter((t.source, t.dest, expected_label(spec, t), drops_kv(spec, t)) for t in spec.transitions)


def dot_edges(dot: str) -> Counter:
    edges = Counter()
    for line in dot.splitlines():
        match = DOT_EDGE.match(line)
        if match and match["source"] != INITIAL_NODE:
            label = match["label"].replace("\\n", " ")
            edges[(match["source"], match["dest"], label, DESTRUCTIVE_STYLE in match["rest"])] += 1
    return edges


def mermaid_edges(mermaid: str) -> Counter:
    """(source, dest, label, drops the KV) of every arrow a Mermaid transition line draws (the self-loops of one
    state share a line, their labels joined by LOOP_JOIN: Mermaid 11 draws one self-loop per state)."""
    edges = Counter()
    for line in mermaid.splitlines():
        match = MERMAID_EDGE.match(line)
        if match and "[*]" not in (match["source"], match["dest"]):
            for part in match["label"].split(LOOP_JOIN):
                label = part
                for mark in filter(None, KIND_MARKS.values()):
                    label = label.removeprefix(mark)
                edges[(match["source"], match["dest"], label, part.startswith(DESTRUCTIVE_MARK))] += 1
    return edges


def table_rows(table: str) -> Counter:
    """(from, event, guard, to, effect, destructive) of each row of the transition table."""
    section = table.split("## Transitions", 1)[1]
    rows = Counter()
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 6 or cells[0] in ("from", "---"):
            continue
        names = [None if cell == NONE_MARK else cell.strip("`") for cell in cells[:5]]
        rows[(*names, cells[5] != "no")] += 1
    return rows


@pytest.mark.parametrize("name", TEXT_FILES)
def test_committed_file_equals_what_the_packaged_spec_renders(name: str, sources: dict[str, str]) -> None:
    committed = DIAGRAMS / name
    assert committed.exists(), f"{committed} is missing; run `kvstate diagram --out diagrams` in the repository root"
    assert committed.read_bytes() == sources[name].encode("utf-8"), (
        f"{committed} is stale; run `kvstate diagram --out diagrams` in the repository root and commit the result"
    )


def test_rendering_is_byte_identical_across_loads() -> None:
    assert render_sources(load_spec()) == render_sources(load_spec())


@pytest.mark.parametrize("name", TEXT_FILES)
def test_sources_end_with_one_newline_and_have_no_trailing_spaces(name: str, sources: dict[str, str]) -> None:
    text = sources[name]
    assert text.endswith("\n") and not text.endswith("\n\n")
    assert all(line == line.rstrip() for line in text.splitlines())


def test_every_transition_is_exactly_one_dot_edge(spec: Spec, all_sources: dict[str, str]) -> None:
    assert dot_edges(all_sources[DOT_FILE]) == expected_edges(spec)
    assert max(expected_edges(spec).values()) == 1


def test_every_transition_is_exactly_one_mermaid_edge(spec: Spec, all_sources: dict[str, str]) -> None:
    assert mermaid_edges(all_sources[MERMAID_FILE]) == expected_edges(spec)


def test_bundled_drawing_draws_every_transition_exactly_once(spec: Spec, sources: dict[str, str]) -> None:
    diagram = build_diagram(spec)
    drawn = diagram.drawn_edges
    members = Counter(edge.key for arrow in drawn for edge in arrow.members)
    assert members == Counter((t.event, t.source, t.dest) for t in spec.transitions)
    assert len(drawn) < len(spec.transitions), "bundling draws fewer arrows"
    for arrow in drawn:
        assert {(e.dest, e.effect, e.kind, e.origin) for e in arrow.members} == {
            (arrow.dest, arrow.effect, arrow.kind, arrow.origin)
        }
        assert arrow.source == ANY_STATE or {e.source for e in arrow.members} == {arrow.source}
    broadcast = diagram.broadcast_events
    assert broadcast, "the spec has events enabled in every non-terminal state"
    into_terminal = {
        (t.event, t.source, t.dest)
        for t in spec.transitions
        if t.event in broadcast and spec.state_by_name[t.dest].terminal
    }
    assert into_terminal == {e.key for arrow in drawn if arrow.source == ANY_STATE for e in arrow.members}
    arrows = [line for line in sources[DOT_FILE].splitlines() if " -> " in line and INITIAL_NODE not in line]
    assert len(arrows) == len(drawn)
    assert sum(f'"{ANY_STATE}" -> ' in line for line in arrows) == len({a for a in drawn if a.source == ANY_STATE})
    mermaid_arrows = mermaid_edges(sources[MERMAID_FILE])
    assert sum(mermaid_arrows.values()) == len(drawn)


def test_every_transition_is_exactly_one_table_row(spec: Spec, sources: dict[str, str]) -> None:
    expected = Counter((t.source, t.event, t.guard, t.dest, t.effect, t.destructive) for t in spec.transitions)
    assert table_rows(sources[TABLE_FILE]) == expected


def test_only_kv_dropping_edges_carry_the_destructive_style(spec: Spec, all_sources: dict[str, str]) -> None:
    """Red dashed means "drops the KV, must be replayed": not a destructive decision that keeps the KV until the
    pipeline agrees, nor one that terminates the request."""
    destructive_lines = [line for line in all_sources[DOT_FILE].splitlines() if DESTRUCTIVE_STYLE in line]
    mermaid_marked = [line for line in all_sources[MERMAID_FILE].splitlines() if f": {DESTRUCTIVE_MARK}" in line]
    expected = sum(drops_kv(spec, t) for t in spec.transitions)
    assert 0 < expected < sum(t.destructive for t in spec.transitions) < len(spec.transitions), (
        "the spec should have KV-dropping, other destructive and non-destructive edges"
    )
    assert len(destructive_lines) == len(mermaid_marked) == expected


def test_edge_kinds_follow_residency_and_the_legend_names_each_kind_drawn(spec: Spec, sources: dict[str, str]) -> None:
    diagram = build_diagram(spec)
    for edge in diagram.edges:
        dest = spec.state_by_name[edge.dest]
        if edge.kind is EdgeKind.DROP:
            assert edge.destructive and dest.residency == "none" and not dest.terminal
        if edge.kind is EdgeKind.HOLD:
            assert edge.destructive and dest.residency != "none", "a hold keeps its KV"
        assert (edge.kind is EdgeKind.TERMINATE) == (dest.terminal and edge.source != edge.dest)
        assert (edge.kind is EdgeKind.DEFER) == (edge.source == edge.dest and ends_requests(spec, edge.event))
    loops = [e for e in diagram.edges if e.source == e.dest and not ends_requests(spec, e.event)]
    assert loops and all(e.kind is EdgeKind.KEEP for e in loops), "an offload moves the KV it keeps between tiers"
    kinds = {arrow.kind for arrow in diagram.drawn_edges}
    assert kinds == set(EdgeKind), "the packaged spec draws every kind"
    dot = sources[DOT_FILE]
    legend = dot[dot.index("label=<<") : dot.index("</table>>")]
    meanings = kind_meanings(diagram)
    for kind in kinds:
        assert KIND_KEYS[kind][1] in legend and meanings[kind].split(":")[0] in legend
    assert legend.count("drops the KV") == 1
    holders = {e.dest for e in diagram.edges if e.kind is EdgeKind.HOLD}
    assert all(f"→ {state}" in meanings[EdgeKind.HOLD] for state in holders)
    assert "never fired" not in legend, "the never-fired style is only in a drawing of a trace"


def test_dot_clusters_states_by_residency(spec: Spec, sources: dict[str, str]) -> None:
    """Each tier that holds KV is a titled cluster of exactly its states; the states without KV (the story spreads
    them from left to right) are in no cluster and are filled with the no-KV colour."""
    from kvstate.diagrams.dot import CLUSTER_COLORS

    dot = sources[DOT_FILE]
    clusters = re.findall(r"subgraph cluster_(\w+) \{(.*?)\n  \}", dot, flags=re.S)
    placed = {name: residency for residency, body in clusters for name in re.findall(r'^\s*"(\w+)" \[', body, re.M)}
    assert placed == {state.name: state.residency for state in spec.states if state.residency != "none"}
    assert all(body.lstrip().startswith("label=") for _, body in clusters), "every cluster has a title"
    for state in spec.states:
        line = next(line for line in dot.splitlines() if line.lstrip().startswith(f'"{state.name}" ['))
        assert f'fillcolor="{CLUSTER_COLORS[state.residency][0]}"' in line


def test_initial_and_terminal_states_are_drawn(spec: Spec, sources: dict[str, str]) -> None:
    dot, mermaid = sources[DOT_FILE], sources[MERMAID_FILE]
    assert f'"{INITIAL_NODE}" [shape=point' in dot
    assert f'"{INITIAL_NODE}" -> "{spec.initial}";' in dot
    assert f"    [*] --> {spec.initial}\n" in mermaid
    assert spec.terminal_states
    for state in spec.states:
        assert (f'"{state.name}" [shape=doublecircle' in dot) == state.terminal
        assert (f"    {state.name} --> [*]\n" in mermaid) == state.terminal


def test_mermaid_is_a_state_diagram_without_composites(sources: dict[str, str]) -> None:
    mermaid = sources[MERMAID_FILE]
    assert mermaid.startswith("stateDiagram-v2\n")
    assert "{" not in mermaid, "composite states cannot carry edges between their inner states"
    labels = [match["label"] or "" for line in mermaid.splitlines() if (match := MERMAID_EDGE.match(line))]
    assert not any(":" in label or ";" in label for label in labels), "`:` and `;` end a Mermaid transition label"


def test_review_view_styles_edges_by_origin_and_names_what_they_feed(spec: Spec, sources: dict[str, str]) -> None:
    from kvstate.diagrams import REVIEW_DOT_FILE
    from kvstate.diagrams.review import CONSENSUS_POINT, FEEDS_MARK, ORIGIN_STYLES, PROMOTION_GATE

    review = sources[REVIEW_DOT_FILE]
    lines = [line for line in review.splitlines() if " -> " in line and INITIAL_NODE not in line]
    diagram = build_diagram(spec)
    assert len(lines) == len(diagram.drawn_edges)
    for line, arrow in zip(lines, diagram.drawn_edges, strict=True):
        assert f'color="{ORIGIN_STYLES[arrow.origin][0]}"' in line
        for edge in arrow.members:
            event = spec.event_by_name[edge.event]
            assert event.label in line
            if event.feeds:
                assert f"{FEEDS_MARK}{event.feeds}" in line
                production = next(o.production_name for o in spec.output_lists if o.name == event.feeds)
                assert production in line.replace("\\n", " "), "production names are wrapped at spaces only"
    assert {spec.event_by_name[e].origin for e in spec.event_by_name} <= set(ORIGIN_STYLES)
    gates = [line for line in lines if PROMOTION_GATE in line]
    assert len(gates) == 1 and "host" in RESIDENCY_TIERS[spec.residency(DOT_EDGE.match(gates[0])["source"])]
    assert sum(CONSENSUS_POINT in line for line in lines) >= 1
    table = sources[TABLE_FILE].split("## Events for reviewers", 1)[1]
    for event in spec.events:
        assert f"| `{event.name}` | {event.origin} |" in table
