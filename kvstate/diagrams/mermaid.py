"""Render a `Diagram` as a Mermaid `stateDiagram-v2` that GitHub displays.

Invariants kept:
* every text from the spec goes through `kvstate.diagrams.escape`: states are written by `mermaid_id` (a name
  that is not a plain identifier gets a hex id) with their name in a quoted label; labels and the title
  comment by `mermaid_text` (one line; no `:`, `;`, quote, angle bracket, brace, `#`, `%` or `&`: Unicode
  look-alikes instead), so no text can add a Mermaid statement (`click`, `style`, ...);
* after the class and state declarations: `[*] --> <initial>`, then every drawn edge as one
  `source --> dest : label` line in order, then `<final> --> [*]` for every terminal state;
* residency is shown by a tag in each state's label and a `classDef` colour per residency, not by
  composite states: Mermaid cannot draw transitions between states inside different composite states;
* Mermaid cannot style single edges of a state diagram, so a label starts with its kind's mark
  (`KIND_MARKS`, words: no glyph a common font lacks): `DESTRUCTIVE_MARK` on drop edges and only on them;
* Mermaid 11 draws one self-loop per state, so a state's self-loops are one transition line whose label joins
  theirs with `LOOP_JOIN`; the pseudo-node of a bundled broadcast edge is a `<<choice>>` point (not a state box)
  and its edge's label names the states the bundle starts from;
* transitions are written in `STORY_ORDER` (by the roles of their ends, as the layout of the DOT drawing), which
  is the order Mermaid 11's layout draws without a label overprinting another label, a state or an edge
  (`tests/diagrams/test_mermaid_render.py` renders it in Chromium);
* the output is a pure function of the diagram and ends with a newline.
"""

from __future__ import annotations

from kvstate.diagrams.escape import mermaid_id, mermaid_text
from kvstate.diagrams.ir import ANY_STATE, Diagram, DrawnEdge, EdgeKind, Node
from kvstate.roles import ACTIVE, DROPPED, ENDED, OFFLOADED, PENDING_RESET, QUEUED, RECOMPUTING

DESTRUCTIVE_MARK = "(drops KV) "
KIND_MARKS = {
    EdgeKind.DROP: DESTRUCTIVE_MARK,
    EdgeKind.HOLD: "(holds KV) ",
    EdgeKind.DEFER: "(deferred) ",
    EdgeKind.TERMINATE: "",
    EdgeKind.KEEP: "",
}
LOOP_JOIN = " · "  # between the labels of a state's self-loops, drawn as one
RESIDENCY_TAGS = {"gpu": "KV on GPU", "held": "KV held, GPU then host", "none": "no KV"}
RESIDENCY_STYLES = {
    "gpu": "fill:#e8f5e9,stroke:#2e7d32,color:#1b5e20",
    "held": "fill:#e3f2fd,stroke:#1565c0,color:#0d47a1",
    "none": "fill:#f5f5f5,stroke:#616161,color:#212121",
}
ANY_STATE_ID = "s_any_state"  # `mermaid_id` never makes it: names starting `s_` are hex-encoded
BUNDLE = "bundle"  # the role of the pseudo-node a bundled broadcast edge starts from, in `STORY_ORDER`
STORY_ORDER = (  # (source role, destination role) of the transition lines, in the order they are written
    (BUNDLE, ENDED),
    (QUEUED, ACTIVE),
    (ACTIVE, OFFLOADED),
    (OFFLOADED, ACTIVE),
    (OFFLOADED, DROPPED),
    (RECOMPUTING, OFFLOADED),
    (OFFLOADED, RECOMPUTING),
    (ACTIVE, DROPPED),
    (RECOMPUTING, DROPPED),
    (ACTIVE, PENDING_RESET),
    (ACTIVE, ENDED),
    (RECOMPUTING, PENDING_RESET),
    (PENDING_RESET, DROPPED),
    (PENDING_RESET, ENDED),
    (DROPPED, RECOMPUTING),
    (RECOMPUTING, ACTIVE),
    (PENDING_RESET, PENDING_RESET),
    (OFFLOADED, OFFLOADED),
)


def node_label(node: Node) -> str:
    """`name (residency)`; a state's Mermaid description would replace its name, so the tag is in the label."""
    return f"{node.name} ({RESIDENCY_TAGS[node.residency]})"


def class_name(residency: str) -> str:
    """The Mermaid class of the states with `residency` (suffixed: a bare `none` reads like a keyword)."""
    return f"{residency}_residency"


def state_id(name: str) -> str:
    return ANY_STATE_ID if name == ANY_STATE else mermaid_id(name)


def edge_label(diagram: Diagram, edge: DrawnEdge) -> str:
    """The kind's mark and `event [guard] / effect`; a bundle from the pseudo-node names where it starts."""
    parts = list(edge.label_parts(diagram.fired))
    if edge.source == ANY_STATE:
        parts[0] += f" (from {diagram.any_state_label.replace(chr(10), ' ')})"
    return KIND_MARKS[edge.kind] + mermaid_text(" ".join(parts))


def transitions(diagram: Diagram) -> list[tuple[str, str, str]]:
    """(source id, dest id, label) of every transition line, self-loops of one state joined into one line."""
    lines: list[tuple[str, str, str]] = []
    loops: dict[str, int] = {}
    for edge in diagram.drawn_edges:
        label = edge_label(diagram, edge)
        if edge.source == edge.dest and edge.source in loops:
            source, dest, before = lines[loops[edge.source]]
            lines[loops[edge.source]] = (source, dest, before + LOOP_JOIN + label)
            continue
        if edge.source == edge.dest:
            loops[edge.source] = len(lines)
        lines.append((state_id(edge.source), state_id(edge.dest), label))
    return lines


def story_order(diagram: Diagram, lines: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """`lines` sorted by `STORY_ORDER` of the roles of their ends; lines it does not name keep their order, after."""
    role = {mermaid_id(node.name): node.role for node in diagram.nodes} | {ANY_STATE_ID: BUNDLE}
    rank = {pair: index for index, pair in enumerate(STORY_ORDER)}
    return sorted(lines, key=lambda line: rank.get((role.get(line[0], ""), role.get(line[1], "")), len(rank)))


def render_mermaid(diagram: Diagram) -> str:
    lines = [
        "stateDiagram-v2",
        (
            f"    %% {mermaid_text(diagram.title)}, spec version {diagram.version}. Generated by `kvstate diagram`;"
            " do not edit."
        ),
        "    %% Residency is a tag and a colour per state, not a composite state: Mermaid cannot",
        "    %% draw transitions between states inside different composite states.",
        (
            f"    %% Mermaid cannot style single edges here: a label starting with {DESTRUCTIVE_MARK.strip()} marks a"
            " destructive edge (the request must be replayed),"
        ),
        (
            f"    %% {KIND_MARKS[EdgeKind.HOLD].strip()} a preemption that keeps the KV until the pipeline agrees,"
            f" {KIND_MARKS[EdgeKind.DEFER].strip()} an event whose effect waits for that consensus."
        ),
    ]
    lines += [f"    classDef {class_name(c.residency)} {RESIDENCY_STYLES[c.residency]}" for c in diagram.clusters]
    lines += [f'    state "{mermaid_text(node_label(node))}" as {mermaid_id(node.name)}' for node in diagram.nodes]
    if any(edge.source == ANY_STATE for edge in diagram.drawn_edges):
        lines.append(f"    state {ANY_STATE_ID} <<choice>>")
    lines.append(f"    [*] --> {mermaid_id(diagram.initial)}")
    lines += [
        f"    {source} --> {dest} : {label}" for source, dest, label in story_order(diagram, transitions(diagram))
    ]
    lines += [f"    {mermaid_id(node.name)} --> [*]" for node in diagram.final_nodes]
    lines += [
        f"    class {','.join(mermaid_id(n.name) for n in c.nodes)} {class_name(c.residency)}" for c in diagram.clusters
    ]
    return "\n".join(lines) + "\n"
