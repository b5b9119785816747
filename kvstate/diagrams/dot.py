"""Render a `Diagram` as Graphviz DOT, laid out by `kvstate.diagrams.layout` along the lifecycle's story.

The DOT source carries every position (nodes, edge curves, labels, cluster boxes, the legend), so it is
byte-stable on every machine and Graphviz only draws it: `dot -Kneato -n2` (`kvstate.diagrams.svg`). Plain `dot`
reads it too, but lays it out again and loses the story.

Invariants kept:
* every text from the spec goes through `kvstate.diagrams.escape` (`dot_string`, `dot_comment`, `dot_html`);
* one `subgraph cluster_<residency>` per residency the layout boxes (`layout.CLUSTERED`), titled with the
  cluster's title; every other state is filled with its residency's colour;
* the initial pseudo-state is the point node `INITIAL_NODE`, with one unlabelled edge to the initial state;
  a bundle of broadcast edges starts from the dashed pseudo-node `ANY_STATE`, drawn only when used;
* terminal states are `doublecircle` nodes;
* every drawn edge (`Diagram.drawn_edges`) is one DOT edge line, in order, labelled `event [guard] / effect` with
  one part per line and styled by its `EdgeKind` (`KIND_STYLES`): drop edges, and only they, carry
  `DESTRUCTIVE_STYLE`; with firing counts, never-fired edges carry `NEVER_FIRED_STYLE` and the others a pen width
  growing with log N;
* the legend is the graph's HTML label, built from the kinds actually drawn, so it adds no nodes or edges;
* every character drawn is ASCII or in `COMMON_GLYPHS` (fonts such as Liberation Sans and Arial have them all)
  when the spec's own texts are;
* the output is a pure function of the diagram and ends with a newline.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvstate.diagrams.escape import dot_comment, dot_html, dot_string
from kvstate.diagrams.geometry import Box, Curve, Point
from kvstate.diagrams.ir import ANY_STATE, Diagram, DrawnEdge, EdgeKind
from kvstate.diagrams.layout import Layout, PlacedNode, lay_out
from kvstate.diagrams.metrics import FALLBACK_FONT_SLACK, text_width
from kvstate.diagrams.routing import Route, twins

INITIAL_NODE = "__initial__"
INITIAL_STYLE = 'shape=point, width=0.15, style=filled, fillcolor=black, label="", tooltip="initial pseudo-state"'
ANY_STATE_STYLE = 'shape=box, style="dashed,rounded", color="#757575", fontcolor="#424242", fontsize=12'
DESTRUCTIVE_COLOR = "red3"
DESTRUCTIVE_STYLE = f'color={DESTRUCTIVE_COLOR}, fontcolor={DESTRUCTIVE_COLOR}, style="dashed,bold"'
HOLD_COLOR = "#e65100"
TERMINATE_COLOR = "#4a148c"
DEFER_COLOR = "#8e24aa"
KEEP_COLOR = "#37474f"
NEVER_FIRED_COLOR = "#bdbdbd"
NEVER_FIRED_STYLE = f'style=dotted, color="{NEVER_FIRED_COLOR}", fontcolor="#9e9e9e"'
KIND_STYLES = {
    EdgeKind.DROP: DESTRUCTIVE_STYLE,
    EdgeKind.HOLD: f'color="{HOLD_COLOR}", fontcolor="{HOLD_COLOR}", style=dashed',
    EdgeKind.TERMINATE: f'color="{TERMINATE_COLOR}", fontcolor="{TERMINATE_COLOR}"',
    EdgeKind.DEFER: f'color="{DEFER_COLOR}", fontcolor="{DEFER_COLOR}", style=dashed',
    EdgeKind.KEEP: "",
}
KIND_KEYS = {  # the legend's sample of each kind: colour, then a drawing of the line
    EdgeKind.DROP: (DESTRUCTIVE_COLOR, "- - - red dashed, bold"),
    EdgeKind.HOLD: (HOLD_COLOR, "- - - orange dashed"),
    EdgeKind.TERMINATE: (TERMINATE_COLOR, "——— purple"),
    EdgeKind.DEFER: (DEFER_COLOR, "- - - violet loop"),
    EdgeKind.KEEP: (KEEP_COLOR, "——— grey"),
}
COMMON_GLYPHS = frozenset("×–—→←·…”−\u2039\u203a")  # the non-ASCII characters the diagrams may draw

CLUSTER_COLORS = {  # residency -> (state fill, stroke)
    "gpu": ("#e8f5e9", "#2e7d32"),
    "held": ("#e3f2fd", "#1565c0"),
    "none": ("#f5f5f5", "#616161"),
}
CLUSTER_TINTS = {"gpu": "#f3faf3", "held": "#f1f7fd", "none": "#fafafa"}  # the background of a residency's box
EDGE_FONT_SIZE = 11  # points; drawn at natural size (1 pt = 4/3 px) that is ~15 px, above the 11 px floor
LEGEND_FONT_SIZE = 12
LEGEND_TITLE_SIZE = 16
LEGEND_CELL = 8.0  # points a legend cell adds around its text (padding, spacing)
LEGEND_ROW = LEGEND_FONT_SIZE * 1.2 + 6.0


@dataclass(frozen=True, slots=True)
class LegendRow:
    """One row of a legend: `key` (bold; in `color` when given) and what it means."""

    key: str
    meaning: str
    color: str | None = None


@dataclass(frozen=True, slots=True)
class View:
    """How one drawing of a `Diagram` labels and styles its edges and what its legend says.

    `edge_labels` gives each drawn edge's label parts, in order (one part per line), `edge_attributes` one edge's
    DOT attributes after the label, `legend_rows` the legend; `subtitle` follows the diagram's title.
    """

    subtitle: str
    edge_labels: Callable[[Diagram, tuple[DrawnEdge, ...]], Sequence[Sequence[str]]]
    edge_attributes: Callable[[Diagram, DrawnEdge], list[str]]
    legend_rows: Callable[[Diagram], list[LegendRow]]


def render_dot(diagram: Diagram, view: View | None = None) -> str:
    """The DOT source of `diagram` drawn as `view` (default `LIFECYCLE_VIEW`), every position included."""
    view = view or LIFECYCLE_VIEW
    drawn = diagram.drawn_edges
    labels = tuple(tuple(parts) for parts in view.edge_labels(diagram, drawn))
    title = f"{diagram.title}{view.subtitle}, spec version {diagram.version}"
    rows = view.legend_rows(diagram)
    layout = lay_out(diagram, labels, legend_size(title, rows))
    place = Placer(layout.bounds)
    lines = [
        dot_comment(
            f"{diagram.title}, spec version {diagram.version}. Generated by `kvstate diagram`; do not edit. "
            "Laid out by kvstate along the lifecycle's story: draw it with dot -Kneato -n2 -Tsvg"
        ),
        "digraph lifecycle {",
        f'  bb="0,0,{place.num(layout.bounds.w)},{place.num(layout.bounds.h)}";',
        f'  fontname="Helvetica"; fontsize={LEGEND_FONT_SIZE};',
        '  node [fontname="Helvetica", fontsize=13, shape=box, style="rounded,filled", fixedsize=true];',
        f'  edge [fontname="Helvetica", fontsize={EDGE_FONT_SIZE}, color="{KEEP_COLOR}", fontcolor="{KEEP_COLOR}"];',
        f"  label={legend(title, rows)};",
        f'  lp="{place.point((layout.legend.cx, layout.legend.cy))}";',
        "",
        f"  {dot_string(INITIAL_NODE)} [{INITIAL_STYLE}, {place.node(layout.nodes[INITIAL_NODE].box)}];",
    ]
    residency = {node.name: node.residency for node in diagram.nodes}
    clustered = {node.name for c in diagram.clusters for node in c.nodes if c.residency in clustered_tiers(layout)}
    for cluster in layout.clusters:
        fill, stroke = CLUSTER_COLORS[cluster.residency]
        members = [node for c in diagram.clusters if c.residency == cluster.residency for node in c.nodes]
        lines += [
            "",
            f"  subgraph cluster_{cluster.residency} {{",
            f"    label={dot_string(cluster.title)};",
            (
                f'    fontsize=14; bb="{place.box(cluster.box)}"; '
                f'lp="{place.point((cluster.title_box.cx, cluster.title_box.cy))}";'
            ),
            (
                f'    style="rounded,filled"; fillcolor="{CLUSTER_TINTS[cluster.residency]}"; color="{stroke}"; '
                f'fontcolor="{stroke}";'
            ),
        ]
        lines += [f"    {node_line(node, layout.nodes[node.name], place, fill, stroke)}" for node in members]
        lines.append("  }")
    loose = [node for node in diagram.nodes if node.name not in clustered]
    if loose:
        lines.append("")
    for node in loose:
        fill, stroke = CLUSTER_COLORS[residency[node.name]]
        lines.append(f"  {node_line(node, layout.nodes[node.name], place, fill, stroke)}")
    if ANY_STATE in layout.nodes:
        any_state = layout.nodes[ANY_STATE]
        lines += [
            "",
            (
                f"  {dot_string(ANY_STATE)} [{ANY_STATE_STYLE}, label={dot_string(diagram.any_state_label)}, "
                f"{place.node(any_state.box)}];"
            ),
        ]
    lines += ["", f"  {dot_string(INITIAL_NODE)} -> {dot_string(diagram.initial)};"]
    lines += [f"  {edge_line(route, place, view.edge_attributes(diagram, route.edge))}" for route in layout.routes]
    lines.append("}")
    return "\n".join(lines) + "\n"


def clustered_tiers(layout: Layout) -> set[str]:
    return {cluster.residency for cluster in layout.clusters}


class Placer:
    """Writes layout coordinates (points, y downwards) as Graphviz's (points, y upwards from the bottom-left)."""

    def __init__(self, bounds: Box) -> None:
        self.bounds = bounds

    @staticmethod
    def num(value: float) -> str:
        return f"{value:.1f}"

    def point(self, point: Point) -> str:
        return f"{self.num(point[0] - self.bounds.left)},{self.num(self.bounds.bottom - point[1])}"

    def box(self, box: Box) -> str:
        low = self.point((box.left, box.bottom))
        high = self.point((box.right, box.top))
        return f"{low},{high}"

    def node(self, box: Box) -> str:
        return f'pos="{self.point((box.cx, box.cy))}", width={box.w / 72:.3f}, height={box.h / 72:.3f}'

    def curve(self, curve: Curve, tip: Point | None = None) -> str:
        """A Graphviz spline; with `tip`, an arrowhead from the curve's end to it."""
        head = "" if tip is None else f"e,{self.point(tip)} "
        return head + " ".join(self.point(p) for p in curve)


def node_line(node, placed: PlacedNode, place: Placer, fill: str, stroke: str) -> str:
    shape = "doublecircle" if node.final else "box"
    return (
        f'{dot_string(node.name)} [shape={shape}, color="{stroke}", fillcolor="{fill}", '
        f"tooltip={dot_string(node.meaning)}, {place.node(placed.box)}];"
    )


def edge_line(route: Route, place: Placer, attributes: Sequence[str]) -> str:
    """One DOT edge; a twin (no label box of its own) is a tail without arrowhead, its label a tooltip."""
    edge = route.edge
    text = "\n".join(route.lines)
    if route.label is None:
        where = ['label=""', f"tooltip={dot_string(text)}", "arrowhead=none", f'pos="{place.curve(route.curve)}"']
    else:
        where = [
            f"label={dot_string(text)}",
            f'lp="{place.point((route.label.cx, route.label.cy))}"',
            f'pos="{place.curve(route.curve, route.tip)}"',
        ]
    attrs = ", ".join([*where, *(a for a in attributes if a)])
    return f"{dot_string(edge.source)} -> {dot_string(edge.dest)} [{attrs}];"


def lifecycle_edge_labels(diagram: Diagram, drawn: tuple[DrawnEdge, ...]) -> list[Sequence[str]]:
    """Each edge's label; with firing counts, twins (`routing.twins`: drawn as one labelled curve) share one label
    whose counts are summed over them, as a bundle's are."""
    labels: list[Sequence[str]] = [edge.label_parts(diagram.fired) for edge in drawn]
    if diagram.fired is None or diagram.all_edges:
        return labels
    groups: dict[int, list[int]] = {}
    for follower, leader in twins(drawn, [edge.label_parts() for edge in drawn]).items():
        groups.setdefault(leader, [leader]).append(follower)
    for members in groups.values():
        together = replace(drawn[members[0]], members=tuple(m for i in members for m in drawn[i].members))
        for index in members:
            labels[index] = together.label_parts(diagram.fired)
    return labels


def lifecycle_edge_attributes(diagram: Diagram, edge: DrawnEdge) -> list[str]:
    """The kind's style; with firing counts, the never-fired style or a pen width growing with log N."""
    count = diagram.count(edge)
    if count == 0:
        return [NEVER_FIRED_STYLE]
    return [KIND_STYLES[edge.kind]] + ([f"penwidth={1 + math.log10(count) * 1.5:.2f}"] if count else [])


def exits(diagram: Diagram, states: Sequence[str]) -> str:
    """The labels of the events leaving `states` for another state, comma-separated, spec order."""
    labels = dict.fromkeys(e.event_label for e in diagram.edges if e.source in states and e.dest != e.source)
    return ", ".join(labels)


def kind_meanings(diagram: Diagram) -> dict[EdgeKind, str]:
    """What each kind drawn in `diagram` means, with the states and events taken from the diagram."""
    drawn = diagram.drawn_edges
    holders = list(dict.fromkeys(e.dest for e in drawn if e.kind is EdgeKind.HOLD))
    loopers = list(dict.fromkeys(e.source for e in drawn if e.kind is EdgeKind.DEFER))
    terminal_events = {e.event for e in diagram.edges if e.kind is EdgeKind.TERMINATE}
    deferred_ends = all(m.event in terminal_events for e in drawn if e.kind is EdgeKind.DEFER for m in e.members)
    return {
        EdgeKind.DROP: "destructive: drops the KV; the request must be replayed",
        EdgeKind.HOLD: (
            f"preemption decided, KV kept: → {', '.join(holders)} holds its blocks until {exits(diagram, holders)}"
        ),
        EdgeKind.TERMINATE: "ends the request and frees its KV",
        EdgeKind.DEFER: (
            f"deferred {'termination' if deferred_ends else 'event'}: recorded in "
            f"{', '.join(loopers)}, carried out at {exits(diagram, loopers)}"
        ),
        EdgeKind.KEEP: "keeps the KV (on the GPU, or moved between tiers)",
    }


def lifecycle_legend_rows(diagram: Diagram) -> list[LegendRow]:
    drawn = diagram.drawn_edges
    meanings = kind_meanings(diagram)
    kinds = [kind for kind in EdgeKind if any(e.kind is kind for e in drawn)]
    rows = [LegendRow(KIND_KEYS[kind][1], meanings[kind], KIND_KEYS[kind][0]) for kind in kinds]
    if diagram.fired is not None:
        rows.append(LegendRow("· · · light dotted", "never fired in this trace", NEVER_FIRED_COLOR))
        rows.append(LegendRow("×N, pen width", "times fired in this trace; the pen widens with log N"))
    rows.append(
        LegendRow("event [guard] / effect", "edge label; no brackets: always enabled; no effect: state change only")
    )
    return rows + common_legend_rows(diagram)


def common_legend_rows(diagram: Diagram) -> list[LegendRow]:
    rows = [
        LegendRow("black dot / double circle", "initial / terminal state"),
        LegendRow(
            "box, fill colour",
            "where the request's KV lives in that state: green GPU tier; blue held, on the GPU until offloaded, "
            "then in the host tier; grey none",
        ),
    ]
    if any(edge.source == ANY_STATE for edge in diagram.drawn_edges):
        rows.append(
            LegendRow(
                "dashed box",
                "one arrow for the same event from every state it names; kvstate diagram --all-edges draws each",
            )
        )
    return rows


LIFECYCLE_VIEW = View("", lifecycle_edge_labels, lifecycle_edge_attributes, lifecycle_legend_rows)


def legend(title: str, rows: Sequence[LegendRow]) -> str:
    """The title and key of the drawing, as a DOT HTML label."""
    cells = [
        (
            f'<tr><td colspan="2" align="left"><font point-size="{LEGEND_TITLE_SIZE}"><b>{dot_html(title)}</b></font>'
            "</td></tr>"
        )
    ]
    for row in rows:
        key = f"<b>{dot_html(row.key)}</b>" if row.key else ""  # Graphviz refuses an empty <b></b>
        if key and row.color is not None:
            key = f'<font color="{row.color}">{key}</font>'
        cells.append(f'<tr><td align="left">{key}</td><td align="left">{dot_html(row.meaning)}</td></tr>')
    return '<<table border="0" cellspacing="2" cellborder="0">' + "".join(cells) + "</table>>"


def legend_size(title: str, rows: Sequence[LegendRow]) -> tuple[float, float]:
    """A size in points that holds `legend(title, rows)` as Graphviz draws it (with a wider fallback font)."""
    slack = FALLBACK_FONT_SLACK
    keys = max((text_width(row.key, LEGEND_FONT_SIZE, bold=True) for row in rows), default=0.0)
    meanings = max((text_width(row.meaning, LEGEND_FONT_SIZE) for row in rows), default=0.0)
    title_width = text_width(title, LEGEND_TITLE_SIZE, bold=True)
    width = max((keys + meanings) * slack + 2 * LEGEND_CELL, title_width * slack + LEGEND_CELL)
    height = LEGEND_TITLE_SIZE * 1.2 + 6.0 + len(rows) * LEGEND_ROW + LEGEND_CELL
    return width, height
