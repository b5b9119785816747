"""The text sources rendered from the spec: committed copies, edge coverage, styles and byte stability.

Expected edges are derived from the loaded spec, never re-typed here.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from kvstate.diagrams import DOT_FILE, MERMAID_FILE, TABLE_FILE, TEXT_FILES, render_sources
from kvstate.diagrams.dot import DESTRUCTIVE_STYLE, INITIAL_NODE
from kvstate.diagrams.mermaid import DESTRUCTIVE_MARK
from kvstate.diagrams.table import NONE_MARK
from kvstate.spec import Spec, load_spec

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


def expected_label(spec: Spec, transition) -> str:
    label = spec.event_by_name[transition.event].label
    if transition.guard is not None:
        label += f" [{transition.guard}]"
    if transition.effect is not None:
        label += f" / {transition.effect}"
    return label


def expected_edges(spec: Spec) -> Counter:
    """(source, dest, label, destructive) of every spec transition."""
    return Counter((t.source, t.dest, expected_label(spec, t), t.destructive) for t in spec.transitions)


def dot_edges(dot: str) -> Counter:
    edges = Counter()
    for line in dot.splitlines():
        match = DOT_EDGE.match(line)
        if match and match["source"] != INITIAL_NODE:
            label = match["label"].replace("\\n", " ")
            edges[(match["source"], match["dest"], label, DESTRUCTIVE_STYLE in match["rest"])] += 1
    return edges


def mermaid_edges(mermaid: str) -> Counter:
    edges = Counter()
    for line in mermaid.splitlines():
        match = MERMAID_EDGE.match(line)
        if match and "[*]" not in (match["source"], match["dest"]):
            label = match["label"]
            destructive = label.startswith(DESTRUCTIVE_MARK)
            edges[(match["source"], match["dest"], label.removeprefix(DESTRUCTIVE_MARK), destructive)] += 1
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


def test_every_transition_is_exactly_one_dot_edge(spec: Spec, sources: dict[str, str]) -> None:
    assert dot_edges(sources[DOT_FILE]) == expected_edges(spec)
    assert max(expected_edges(spec).values()) == 1


def test_every_transition_is_exactly_one_mermaid_edge(spec: Spec, sources: dict[str, str]) -> None:
    assert mermaid_edges(sources[MERMAID_FILE]) == expected_edges(spec)


def test_every_transition_is_exactly_one_table_row(spec: Spec, sources: dict[str, str]) -> None:
    expected = Counter((t.source, t.event, t.guard, t.dest, t.effect, t.destructive) for t in spec.transitions)
    assert table_rows(sources[TABLE_FILE]) == expected


def test_only_destructive_edges_carry_the_destructive_style(spec: Spec, sources: dict[str, str]) -> None:
    destructive_lines = [line for line in sources[DOT_FILE].splitlines() if DESTRUCTIVE_STYLE in line]
    mermaid_marked = [line for line in sources[MERMAID_FILE].splitlines() if f": {DESTRUCTIVE_MARK}" in line]
    expected = sum(t.destructive for t in spec.transitions)
    assert 0 < expected < len(spec.transitions), "the spec should have destructive and non-destructive edges"
    assert len(destructive_lines) == len(mermaid_marked) == expected


def test_dot_clusters_states_by_residency(spec: Spec, sources: dict[str, str]) -> None:
    clusters = re.findall(r"subgraph cluster_(\w+) \{(.*?)\n  \}", sources[DOT_FILE], flags=re.S)
    placed = {name: residency for residency, body in clusters for name in re.findall(r'^\s*"(\w+)" \[', body, re.M)}
    assert placed == {state.name: state.residency for state in spec.states}
    assert all(body.lstrip().startswith("label=") for _, body in clusters), "every cluster has a title"


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
