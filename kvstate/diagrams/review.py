"""The reviewer view of the lifecycle: who decides each edge, which output list it feeds, the production terms.

Drawn from the same `Diagram` as the lifecycle view (same nodes, same bundling) but each edge is styled by its
event's `origin` as the spec states it (a scheduler decision, an executor report, an environment event) instead
of by what it does to the KV, and labelled with the scheduler-output list it feeds and that list's production
name. Two places a reviewer of a preemption change looks for are called out on their edges, derived from the
spec's structure, never from names: the promotion gate (a scheduler decision that drops the KV of a state whose
residency lets it sit in the host tier: a suspended request's held blocks, on either tier) and the
consensus point (the edges out of a state that keeps its KV after a preemption decision).

Invariants kept: every text from the spec goes through `kvstate.diagrams.escape` (via `render_dot`); the output
is a pure function of the diagram and ends with a newline.
"""

from __future__ import annotations

from kvstate.diagrams.dot import LegendRow, View, common_legend_rows, render_dot
from kvstate.diagrams.ir import Diagram, DrawnEdge, EdgeKind
from kvstate.spec import RESIDENCY_TIERS

ORIGIN_STYLES = {  # origin -> (colour, DOT style, legend sample, meaning)
    "scheduler": ("#1565c0", "bold", "——— blue, bold", "scheduler decision: a policy choice in a scheduling pass"),
    "executor": (
        "#2e7d32",
        "solid",
        "——— green",
        "executor report: a forward pass produced a token, or every pipeline stage agreed",
    ),
    "environment": (
        "#e65100",
        "dashed",
        "- - - orange dashed",
        "environment event: client cancel, engine abort, host copy lost (no fairness, not progress)",
    ),
}
OTHER_ORIGIN = ("#37474f", "solid", "——— grey", "other origin")
PROMOTION_GATE = "promotion gate"
FEEDS_MARK = "feeds "  # before the output list an edge's requests are listed in
WRAP_AT = 18  # characters of a production name on one line of a label (it keeps the drawing narrow)
CONSENSUS_POINT = "consensus point"


def callouts(diagram: Diagram) -> dict[DrawnEdge, tuple[str, ...]]:
    """Per drawn edge: `PROMOTION_GATE` on a scheduler decision that drops the KV of a state whose residency reaches
    the host tier (held); `CONSENSUS_POINT` on an edge (not a self-loop) leaving a state that keeps its KV after a
    preemption decision."""
    host = {node.name for node in diagram.nodes if "host" in RESIDENCY_TIERS.get(node.residency, ())}
    holders = {e.dest for e in diagram.edges if e.kind is EdgeKind.HOLD}
    marks: dict[DrawnEdge, tuple[str, ...]] = {}
    for edge in diagram.drawn_edges:
        gate = edge.origin == "scheduler" and edge.kind is EdgeKind.DROP and edge.source in host
        consensus = edge.source in holders and edge.kind is not EdgeKind.DEFER
        marks[edge] = (PROMOTION_GATE,) * gate + (CONSENSUS_POINT,) * consensus
    return marks


def feeds_part(edge: DrawnEdge) -> tuple[str, ...]:
    """`feeds list`, then `(production name)` on its own lines, for each output list the members feed."""
    fed = dict.fromkeys((e.feeds, e.feeds_production_name) for e in edge.members if e.feeds)
    return tuple(
        part
        for name, production in fed
        for part in (f"{FEEDS_MARK}{name}", *(wrapped(f"({production})") if production else ()))
    )


def wrapped(text: str, width: int = WRAP_AT) -> tuple[str, ...]:
    """`text` on lines of at most about `width` characters, broken at spaces only (a word is never cut)."""
    lines: list[str] = []
    for word in text.split(" "):
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return tuple(lines)


def review_edge_labels(diagram: Diagram, drawn: tuple[DrawnEdge, ...]) -> list[tuple[str, ...]]:
    marks = callouts(diagram)
    return [
        tuple(f"[{mark}]" for mark in marks[edge]) + edge.head_parts(diagram.fired) + feeds_part(edge) for edge in drawn
    ]


def review_edge_attributes(diagram: Diagram, edge: DrawnEdge) -> list[str]:
    color, style, _, _ = ORIGIN_STYLES.get(edge.origin, OTHER_ORIGIN)
    return [f'color="{color}", fontcolor="{color}", style={style}']


def review_legend_rows(diagram: Diagram) -> list[LegendRow]:
    origins = dict.fromkeys(edge.origin for edge in diagram.drawn_edges)
    rows = [
        LegendRow(sample, meaning, color)
        for color, _, sample, meaning in (ORIGIN_STYLES.get(origin, OTHER_ORIGIN) for origin in origins)
    ]
    rows += [
        LegendRow(
            f"{FEEDS_MARK}list (production name)",
            "the scheduler-output list a request taking the edge is listed in, and the production engine's name for it",
        ),
        LegendRow(
            f"[{PROMOTION_GATE}]", "a suspended request's held KV (GPU or host) given up to make room for a victim"
        ),
        LegendRow(
            f"[{CONSENSUS_POINT}]", "the deferred reset of a multi-stage recompute-pause, once every stage agrees"
        ),
        LegendRow("event [guard]", "edge label; each edge's effect is in the lifecycle view and transitions.md"),
    ]
    return rows + common_legend_rows(diagram)


REVIEW_VIEW = View(
    ": who decides each edge, which output list it feeds",
    review_edge_labels,
    review_edge_attributes,
    review_legend_rows,
)


def render_review_dot(diagram: Diagram) -> str:
    """The DOT source of the reviewer view of `diagram`."""
    return render_dot(diagram, REVIEW_VIEW)
