"""Lay the lifecycle out along its story, by the roles the spec gives its states (never by their names).

The story a reader follows: the spine left to right (queued -> active -> ended), the held state below the active
state (suspend and resume as a tight pair, the offload of held blocks a loop on it), the recompute loop above it
(active -> dropped -> recomputing -> active) and the pending reset beside the pause edge, the terminal state at the
right. `STORY_CELLS` places each role in a (column, row) cell; a state without a role goes to a row of its own
below, in spec order; the pseudo-node of a bundled broadcast edge sits left of the terminal state's column, on the
lowest row.

Residencies that hold KV are clusters (a box around their states, titled inside at its bottom edge); states
without KV are in no cluster, because the story spreads them out. The edges are routed on the nodes placed here
(`kvstate.diagrams.routing`), in several orders while some edge is not kept clean; the cleanest is kept.

Invariants kept: the layout is a pure function of the diagram, its labels and the size of the legend; every
node, label and title box is disjoint from every other; no curve passes through a label other than its own, a
node other than its ends, or a cluster title, unless no candidate allowed it (then `Layout.compromised` names the
edges); laying out n states and edges costs O(n) (`kvstate.diagrams.geometry.Obstacles`); the work is bounded
whatever the diagram holds: at most `MAX_PLACED` nodes and edges, no node or label box larger than `MAX_BOX_POINTS`
on a side and no layout spanning more than `MAX_GRID_CELLS` cells of the obstacle grid, else `LayoutTooLarge`
before any edge is routed.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvstate.diagrams.geometry import Box, Curve, Obstacles, Point, curve_through, sample, union
from kvstate.diagrams.ir import ANY_STATE, Diagram, DrawnEdge
from kvstate.diagrams.metrics import FALLBACK_FONT_SLACK, text_size
from kvstate.diagrams.routing import CLEARANCE, Route, Router, twins
from kvstate.errors import KVStateError
from kvstate.roles import ACTIVE, DROPPED, ENDED, OFFLOADED, PENDING_RESET, QUEUED, RECOMPUTING
from kvstate.untrusted import shown

STORY_CELLS = {  # role -> (column, row); row 0 is the spine, negative rows are above it
    QUEUED: (0, 0),
    ACTIVE: (1, 0),
    ENDED: (3, 0),
    OFFLOADED: (1, 1),
    RECOMPUTING: (1, -1),
    PENDING_RESET: (2, -1),
    DROPPED: (2, -2),
}
INITIAL = "__initial__"  # the initial pseudo-state
CLUSTERED = ("gpu", "held")  # residencies drawn as a titled box around their states

NODE_FONT = 13.0
LABEL_FONT = 11.0
TITLE_FONT = 14.0
NODE_HEIGHT = 36.0
POINT_SIZE = 11.0
NODE_PAD = 12.0  # each side of a node's name
LABEL_PAD = 2.0  # each side of an edge label
CLUSTER_PAD = 16.0
COLUMN_LABELS = (1.8, 2.0, 2.2)  # labels side by side a column gap holds at most: the first that keeps every edge clean
COLUMN_SHARE = (0.8, 0.2)  # ... the widest label of those crossing it times a, plus b per edge crossing it
ROW_LABELS = 3.4  # labels one over the other a row gap holds at most
ROW_SHARE = (1.4, 0.35)  # ... the tallest label of those crossing it times a, plus b per edge crossing it
ORDER_TRIES = 4  # orders of labelling tried while some label finds no free place
MAX_PLACED = 2_000  # nodes and drawn edges one layout places
MAX_BOX_POINTS = 4_000.0  # the longest side of a node's or a label's box
MAX_GRID_CELLS = 250_000  # cells of the obstacle grid the whole layout spans
GRID_CELL = 160.0  # the side of one cell of the obstacle grid, in points


class LayoutTooLarge(KVStateError, ValueError):
    """A diagram has more to place, or larger boxes, than a layout takes; the message names the limit."""


@dataclass(frozen=True, slots=True)
class PlacedNode:
    """A node as laid out: `shape` is "box", "circle" or "point"; `lines` its label, one part per line."""

    name: str
    box: Box
    shape: str
    lines: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PlacedCluster:
    residency: str
    title: str
    box: Box
    title_box: Box


@dataclass(frozen=True, slots=True)
class Layout:
    """Everything a renderer draws, in points, y downwards; `bounds` holds all of it and `legend` (below the rest)."""

    nodes: Mapping[str, PlacedNode]
    initial: Curve | None
    routes: tuple[Route, ...]
    clusters: tuple[PlacedCluster, ...]
    legend: Box
    bounds: Box
    compromised: tuple[DrawnEdge, ...]


def story_cells(diagram: Diagram) -> dict[str, tuple[int, int]]:
    """The (column, row) cell of every node (and of the bundle pseudo-node when one is drawn)."""
    cells: dict[str, tuple[int, int]] = {}
    for node in diagram.nodes:  # a role's cell goes to its first state (a diff draws two specs' states)
        if node.role in STORY_CELLS and STORY_CELLS[node.role] not in cells.values():
            cells[node.name] = STORY_CELLS[node.role]
    used = set(cells.values())
    low = max((row for _, row in used), default=0)
    extra = low + 1
    column = 0
    for node in diagram.nodes:
        if node.name not in cells:
            cells[node.name] = (column, extra)
            column += 1
    if any(edge.source == ANY_STATE for edge in diagram.drawn_edges):
        terminal = [cells[n.name] for n in diagram.final_nodes]
        col = (terminal[0][0] - 1) if terminal else max(c for c, _ in cells.values()) + 1
        cell = (col, low)
        while cell in cells.values():
            cell = (cell[0] + 1, cell[1])
        cells[ANY_STATE] = cell
    return cells


def node_lines(diagram: Diagram, name: str) -> tuple[str, ...]:
    return tuple(diagram.any_state_label.split("\n")) if name == ANY_STATE else (name,)


def node_box_size(lines: Sequence[str], final: bool) -> tuple[float, float]:
    width, height = text_size(lines, NODE_FONT, slack=FALLBACK_FONT_SLACK)
    if final:
        diameter = max(width + 2 * NODE_PAD, NODE_HEIGHT * 1.5)
        return diameter, diameter
    return max(width + 2 * NODE_PAD, 60.0), max(height + 2 * NODE_PAD * 0.6, NODE_HEIGHT)


def label_box_size(lines: Sequence[str]) -> tuple[float, float]:
    width, height = text_size(lines, LABEL_FONT, slack=FALLBACK_FONT_SLACK)
    return width + 2 * LABEL_PAD, height + 2 * LABEL_PAD


@functools.lru_cache(maxsize=16)
def lay_out(diagram: Diagram, labels: tuple[tuple[str, ...], ...], legend_size: tuple[float, float]) -> Layout:
    """The layout of `diagram` with `labels` (one per drawn edge, one part per line) and a legend of that size
    (kept for the last few diagrams: a pure function, called again for every drawing of the same diagram). Column
    gaps are as narrow as `COLUMN_LABELS` allows: wider ones are tried only while some edge is not kept clean, and
    the cleanest layout is kept (the narrowest of equally clean ones)."""
    best: Layout | None = None
    for column_labels in COLUMN_LABELS:
        layout = _lay_out_with(diagram, labels, legend_size, column_labels)
        if best is None or len(layout.compromised) < len(best.compromised):
            best = layout
        if not best.compromised:
            break
    assert best is not None  # COLUMN_LABELS is not empty
    return best


def _lay_out_with(
    diagram: Diagram, labels: tuple[tuple[str, ...], ...], legend_size: tuple[float, float], column_labels: float
) -> Layout:
    """`lay_out` with column gaps that hold at most `column_labels` labels side by side."""
    drawn = diagram.drawn_edges
    cells = story_cells(diagram)
    finals = {node.name for node in diagram.final_nodes}
    sizes = {name: node_box_size(node_lines(diagram, name), name in finals) for name in cells}
    label_sizes = [label_box_size(parts) for parts in labels]
    check_sizes(cells, sizes, drawn, label_sizes)
    xs = column_positions(drawn, cells, sizes, label_sizes, column_labels)
    ys = row_positions(drawn, cells, sizes, label_sizes)
    check_extent(xs, ys)
    nodes = {
        name: PlacedNode(
            name,
            Box(xs[col], ys[row], *sizes[name]),
            "circle" if name in finals else "box",
            node_lines(diagram, name),
        )
        for name, (col, row) in cells.items()
    }
    grown = {name: placed.box.grown(CLEARANCE) for name, placed in nodes.items()}
    initial = None
    if diagram.initial in nodes:
        target = nodes[diagram.initial].box
        point = Box(target.left - 40.0, target.cy, POINT_SIZE, POINT_SIZE)
        nodes[INITIAL] = PlacedNode(INITIAL, point, "point", ())
        initial = straight((point.right, point.cy), (target.left, target.cy))
        grown[INITIAL] = point.grown(CLEARANCE)
    clusters = place_clusters(diagram, nodes)

    def fresh() -> Obstacles:
        """What edges must keep clear of before any is drawn: nodes, the initial edge, cluster titles."""
        obstacles = Obstacles(GRID_CELL)
        for box in grown.values():
            obstacles.add_box(box)
        if initial is not None:
            obstacles.add_polyline(INITIAL, [initial[0], initial[3]])
        for cluster in clusters:
            obstacles.add_box(cluster.title_box.grown(CLEARANCE))
        return obstacles

    joins = {} if diagram.all_edges else twins(drawn, labels)
    first: list[int] = []
    routes, unclean = Router(drawn, labels, label_sizes, nodes, grown, fresh()).route(joins, first)
    for _ in range(ORDER_TRIES - 1):  # edges left unclean go first next time; the cleanest try is kept
        if not unclean:
            break
        first = unclean + [i for i in first if i not in unclean]
        tried = Router(drawn, labels, label_sizes, nodes, grown, fresh()).route(joins, first)
        if len(tried[1]) < len(unclean):
            routes, unclean = tried
    compromised = [drawn[i] for i in unclean]
    everything = union(
        [n.box for n in nodes.values()]
        + [r.label for r in routes if r.label is not None]
        + [c.box for c in clusters]
        + [curve_box(r.curve) for r in routes]
    )
    legend = Box(everything.left + legend_size[0] / 2, everything.bottom + 24.0 + legend_size[1] / 2, *legend_size)
    bounds = union([everything, legend]).grown(8.0)
    return Layout(nodes, initial, routes, clusters, legend, bounds, tuple(compromised))


def check_sizes(
    cells: Mapping[str, tuple[int, int]],
    sizes: Mapping[str, tuple[float, float]],
    drawn: Sequence[DrawnEdge],
    label_sizes: Sequence[tuple[float, float]],
) -> None:
    """Raise `LayoutTooLarge` when there are more than `MAX_PLACED` nodes and edges, or a node's or a label's
    box is longer than `MAX_BOX_POINTS` on a side."""
    if len(cells) + len(drawn) > MAX_PLACED:
        raise LayoutTooLarge(
            f"the diagram has {len(cells)} nodes and {len(drawn)} edges, more than the {MAX_PLACED} a layout places"
        )
    for name, size in sizes.items():
        if max(size) > MAX_BOX_POINTS:
            raise LayoutTooLarge(
                f"state {shown(name, 24)} ({len(name)} characters) needs a box of {max(size):.0f} points, more than "
                f"the {MAX_BOX_POINTS:.0f} a layout places; shorten its name"
            )
    for edge, size in zip(drawn, label_sizes, strict=True):
        if max(size) > MAX_BOX_POINTS:
            raise LayoutTooLarge(
                f"the label of event {shown(edge.members[0].event, 24)} needs a box of {max(size):.0f} points, "
                f"more than the {MAX_BOX_POINTS:.0f} a layout places; shorten its label, guard or effect"
            )


def check_extent(xs: Mapping[int, float], ys: Mapping[int, float]) -> None:
    """Raise `LayoutTooLarge` when the columns and rows span more than `MAX_GRID_CELLS` cells of the obstacle grid
    (a curve across the whole layout is looked up in every cell it spans)."""
    width = max(xs.values()) - min(xs.values()) + 2 * MAX_BOX_POINTS
    height = max(ys.values()) - min(ys.values()) + 2 * MAX_BOX_POINTS
    spanned = math.ceil(width / GRID_CELL) * math.ceil(height / GRID_CELL)
    if spanned > MAX_GRID_CELLS:
        raise LayoutTooLarge(
            f"the layout spans {width:.0f} by {height:.0f} points ({spanned} grid cells), more than the "
            f"{MAX_GRID_CELLS} a layout routes edges across; draw fewer states or shorter labels"
        )


def column_positions(
    drawn: Sequence[DrawnEdge],
    cells: Mapping[str, tuple[int, int]],
    sizes: Mapping[str, tuple[float, float]],
    label_sizes: Sequence[tuple[float, float]],
    column_labels: float = COLUMN_LABELS[0],
) -> dict[int, float]:
    """The x of every column's centre: each gap between two columns is as wide as the widest label of the edges
    that cross it, and wider (up to `column_labels` labels) the more of them cross it."""
    return positions(drawn, cells, sizes, label_sizes, axis=0, share=COLUMN_SHARE, most=column_labels, least=40.0)


def row_positions(
    drawn: Sequence[DrawnEdge],
    cells: Mapping[str, tuple[int, int]],
    sizes: Mapping[str, tuple[float, float]],
    label_sizes: Sequence[tuple[float, float]],
) -> dict[int, float]:
    """The y of every row's centre: each gap between two rows as tall as the tallest label of the edges that cross
    it, and taller (up to `ROW_LABELS` labels) the more of them cross it."""
    return positions(drawn, cells, sizes, label_sizes, axis=1, share=ROW_SHARE, most=ROW_LABELS, least=60.0)


def positions(
    drawn: Sequence[DrawnEdge],
    cells: Mapping[str, tuple[int, int]],
    sizes: Mapping[str, tuple[float, float]],
    label_sizes: Sequence[tuple[float, float]],
    *,
    axis: int,
    share: tuple[float, float],
    most: float,
    least: float,
) -> dict[int, float]:
    """The centre of every column (`axis` 0) or row (1) of `cells`: one after the other, each gap sized by the labels
    of the edges that cross it: the largest one times `share[0]` plus `share[1]` per crossing edge, at most `most`
    times (and at least `least` points)."""
    lines = sorted({cell[axis] for cell in cells.values()})
    half = {line: max(sizes[n][axis] for n, cell in cells.items() if cell[axis] == line) / 2 for line in lines}
    largest: dict[int, float] = {}
    crowd: dict[int, float] = {}
    for edge, size in zip(drawn, label_sizes, strict=True):
        low, high = sorted((cells[edge.source][axis], cells[edge.dest][axis]))
        for gap in range(low, high):
            largest[gap] = max(largest.get(gap, 0.0), size[axis])
            crowd[gap] = crowd.get(gap, 0.0) + 1 / (high - low)
    at = {lines[0]: 0.0}
    for before, after in itertools.pairwise(lines):
        room = sum(
            largest.get(gap, 0.0) * min(most, share[0] + share[1] * crowd.get(gap, 0.0)) for gap in range(before, after)
        )
        at[after] = at[before] + half[before] + half[after] + max(room, least) + 4 * CLEARANCE
    return at


def curve_box(curve: Curve) -> Box:
    points = sample(curve, 8)
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    return Box((min(xs) + max(xs)) / 2, (min(ys) + max(ys)) / 2, max(xs) - min(xs), max(ys) - min(ys))


def straight(start: Point, end: Point) -> Curve:
    return curve_through(start, ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2), end)


def place_clusters(diagram: Diagram, nodes: Mapping[str, PlacedNode]) -> tuple[PlacedCluster, ...]:
    """A titled box around the states of each residency in `CLUSTERED`, unless it would hold another node."""
    out = []
    for cluster in diagram.clusters:
        if cluster.residency not in CLUSTERED:
            continue
        members = [nodes[node.name].box for node in cluster.nodes]
        title_w, title_h = text_size([cluster.title], TITLE_FONT, slack=FALLBACK_FONT_SLACK)
        inner = union(members).grown(CLUSTER_PAD)
        band = title_h + 6.0
        width = max(inner.w, title_w + 2 * CLUSTER_PAD)
        box = Box(inner.cx, inner.cy + band / 2, width, inner.h + band)
        members_set = {node.name for node in cluster.nodes}
        if any(box.overlaps(p.box) for name, p in nodes.items() if name not in members_set):
            continue
        title = Box(box.right - CLUSTER_PAD / 2 - title_w / 2, box.bottom - 3.0 - title_h / 2, title_w, title_h)
        out.append(PlacedCluster(cluster.residency, cluster.title, box, title))
    return tuple(out)
