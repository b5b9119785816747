"""Route the edges of a laid-out diagram: each drawn edge's curve and label, on nodes already placed.

Each drawn edge is one cubic Bezier through the centre of its label, chosen among candidate places near the
straight line between its ends (for a self-loop, around its state): the first feasible one by length and
crossings, in an order that draws straight edges before bent ones. Feasible means the label touches no node, no
label, no cluster title and no curve already drawn, and the curve enters no node other than its ends, no other
label and no cluster title. Edges into the same state with the same label from different states are twins: one
curve carries the label and the others join it as tails.

Invariants kept: routing is a pure function of the placed nodes, the obstacles it starts from, the edges and
their labels; unless no candidate allowed it (then `Router.route` lists the edge as not kept clean), every label
keeps `CLEARANCE` from everything else placed, and no curve passes through a label other than its own, a node other
than its ends, or a cluster title.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstate.diagrams.geometry import Box, Curve, Obstacles, Point, curve_through, length, point_on, sample
from kvstate.diagrams.ir import ANY_STATE, DrawnEdge

if TYPE_CHECKING:  # annotations only: the layout places the nodes and then routes its edges with this module
    from kvstate.diagrams.layout import PlacedNode

CLEARANCE = 5.0  # kept between a label and anything else
ARROW = 10.0  # Graphviz's arrowhead length at arrowsize 1
BEND = 30.0  # points between the middles of two curves joining the same two states
BENDS = (0, 1, -1, 2, -2, 3, -3, 4, -4)  # further bends tried, in BEND, while a label finds no room
ALONG = (0.5, 0.44, 0.56, 0.38, 0.62, 0.32, 0.68, 0.26, 0.74, 0.2, 0.8, 0.14, 0.86)  # label places along a curve (t)
GAPS = (4.0, 14.0, 28.0)  # distances tried between a curve and its label
LOOP_REACH = 24.0  # how far a self-loop reaches out of its state
PIECES = 14  # straight pieces a curve is checked as
TAIL_TRIES = 12  # label places tried for one that keeps the tails of its twins clean
JOIN_SPAN = (0.2, 0.85)  # where on its twin's curve a twin may join it (parameter t)
JOIN_LATEST = 0.62  # a twin joins no earlier than this: beside the shared label, not across it
TAIL_REACHES = (0.0, 30.0, 60.0, 90.0, 120.0, 160.0)  # how much farther along a tail may join, while blocked
LOOP_DIRECTIONS = ((1, 0), (0, -1), (0, 1), (-1, 0), (1, -1), (1, 1), (-1, -1), (-1, 1))  # preference order


@dataclass(frozen=True, slots=True)
class Route:
    """One drawn edge as laid out: the curve from its source's boundary to `tip` (on the destination's boundary; the
    curve itself ends an arrowhead's length before it), its label (`lines`) just beside the curve. A twin (`joins` is
    the index of the drawn edge it joins) has no label box and no arrowhead: its curve ends on that edge's curve,
    which carries the label both share."""

    edge: DrawnEdge
    label: Box | None
    lines: tuple[str, ...]
    curve: Curve
    tip: Point
    joins: int | None = None


def route_order(drawn: Sequence[DrawnEdge], nodes: Mapping[str, PlacedNode]) -> list[int]:
    """Straight edges (both ends on one row or one column) first, then by length; self-loops last."""

    def key(index: int) -> tuple[int, float, int]:
        edge = drawn[index]
        a, b = nodes[edge.source].box, nodes[edge.dest].box
        if edge.source == edge.dest:
            return (2, 0.0, index)
        aligned = abs(a.cy - b.cy) < 1 or abs(a.cx - b.cx) < 1
        return (0 if aligned else 1, math.dist((a.cx, a.cy), (b.cx, b.cy)), index)

    return sorted(range(len(drawn)), key=key)


def twins(drawn: Sequence[DrawnEdge], labels: Sequence[Sequence[str]]) -> dict[int, int]:
    """Drawn edge -> the earlier drawn edge it joins: edges into the same state with the same label, kind and origin
    from different states are drawn as the first one's curve, with the label, that the others join as tails."""
    first: dict[tuple, int] = {}
    joins = {}
    for index, edge in enumerate(drawn):
        if edge.source in (edge.dest, ANY_STATE):
            continue
        key = (edge.dest, tuple(labels[index]), edge.kind, edge.origin)
        joins.update({index: first[key]} if key in first else {})
        first.setdefault(key, index)
    return joins


def join_curve(edge: DrawnEdge, nodes: Mapping[str, PlacedNode], target: Curve, reach: float) -> tuple[Curve, Point]:
    """The tail of a twin: from its source's boundary into `target` at its point nearest the source (within
    `JOIN_SPAN`), meeting it along its direction; `reach` (points) moves the meeting point toward the target's
    end, for a tail that must go round something."""
    a = nodes[edge.source]
    points = [point_on(target, JOIN_SPAN[0] + (JOIN_SPAN[1] - JOIN_SPAN[0]) * i / 16) for i in range(17)]
    nearest = min(range(len(points)), key=lambda i: math.dist(points[i], (a.box.cx, a.box.cy)))
    t = JOIN_SPAN[0] + (JOIN_SPAN[1] - JOIN_SPAN[0]) * nearest / 16
    t = min(JOIN_SPAN[1], max(t, JOIN_LATEST) + reach / max(1.0, length(sample(target, 16))))
    end = point_on(target, t)
    before = point_on(target, max(0.0, t - 0.02))
    tx, ty = end[0] - before[0], end[1] - before[1]
    norm = math.hypot(tx, ty) or 1.0
    start = a.box.boundary_toward(end, round_shape=a.shape == "circle")
    span = math.dist(start, end) / 3
    first = (start[0] + (end[0] - start[0]) / 3, start[1] + (end[1] - start[1]) / 3)
    direct = ((end[0] - start[0]) / (3 * span or 1.0), (end[1] - start[1]) / (3 * span or 1.0))
    bx, by = tx / norm + direct[0], ty / norm + direct[1]  # half along the curve joined, half straight in
    blend = math.hypot(bx, by) or 1.0
    second = (end[0] - bx / blend * span, end[1] - by / blend * span)
    return (start, first, second, end), end


def spread(drawn: Sequence[DrawnEdge]) -> list[float]:
    """Per drawn edge, how far its curve's middle bends to its left (in points): the edges joining the same two
    states spread symmetrically about the straight line, so a pair in opposite directions is a lens."""
    groups: dict[frozenset[str], list[int]] = {}
    for index, edge in enumerate(drawn):
        if edge.source != edge.dest:
            groups.setdefault(frozenset((edge.source, edge.dest)), []).append(index)
    offsets = [0.0] * len(drawn)
    for members in groups.values():
        first = drawn[members[0]].source
        for rank, index in enumerate(members):
            canonical = (rank - (len(members) - 1) / 2) * BEND
            offsets[index] = canonical if drawn[index].source == first else -canonical
    return offsets


def loop_directions(drawn: Sequence[DrawnEdge], nodes: Mapping[str, PlacedNode]) -> dict[int, list[Point]]:
    """The directions (unit vectors) each self-loop may reach out in, best first: farthest (by angle) from its
    state's other edges and from the loops before it (which take their best)."""
    taken: dict[str, list[float]] = {}
    for edge in drawn:
        if edge.source != edge.dest:
            for here, there in ((edge.source, edge.dest), (edge.dest, edge.source)):
                a, b = nodes[here].box, nodes[there].box
                taken.setdefault(here, []).append(math.atan2(b.cy - a.cy, b.cx - a.cx))
    chosen = {}
    for index, edge in enumerate(drawn):
        if edge.source != edge.dest:
            continue
        used = taken.setdefault(edge.source, [])

        def clearance(direction: Point, used: list[float] = used) -> float:
            angle = math.atan2(direction[1], direction[0])
            return min((abs(math.remainder(angle - u, math.tau)) for u in used), default=math.pi)

        ranked = sorted(LOOP_DIRECTIONS, key=clearance, reverse=True)  # stable: equals keep the preference order
        chosen[index] = [(dx / math.hypot(dx, dy), dy / math.hypot(dx, dy)) for dx, dy in ranked]
        used.append(math.atan2(ranked[0][1], ranked[0][0]))
    return chosen


def attempts(
    edge: DrawnEdge, nodes: Mapping[str, PlacedNode], offset: float, loops: Sequence[Point] | None
) -> list[tuple[Point, Point | None, float]]:
    """(middle of the curve, direction of a self-loop, bend) to try for `edge`, best first: its own bend, then
    further bends (`BENDS`); for a self-loop, each direction in turn, reaching farther out."""
    if loops is None:
        return [(via_point(edge, nodes, offset + k * BEND, None), None, offset + k * BEND) for k in BENDS]
    return [(via_point(edge, nodes, reach, d), d, reach) for d in loops for reach in (0.0, BEND, 2 * BEND)]


def via_point(edge: DrawnEdge, nodes: Mapping[str, PlacedNode], bend: float, loop: Point | None) -> Point:
    """The point a curve passes through at its middle: `bend` points left of the straight line's middle, or, for a
    self-loop, `LOOP_REACH` beyond its state toward `loop` (plus `bend`)."""
    a, b = nodes[edge.source].box, nodes[edge.dest].box
    if loop is not None:
        reach = (abs(loop[0]) * a.w + abs(loop[1]) * a.h) / 2 + LOOP_REACH + abs(bend)
        return (a.cx + loop[0] * reach, a.cy + loop[1] * reach)
    dx, dy = b.cx - a.cx, b.cy - a.cy
    norm = math.hypot(dx, dy) or 1.0
    return ((a.cx + b.cx) / 2 + dy / norm * bend, (a.cy + b.cy) / 2 - dx / norm * bend)


def curve_for(edge: DrawnEdge, nodes: Mapping[str, PlacedNode], via: Point) -> tuple[Curve, Point]:
    """The curve from the source's boundary through `via` to the arrowhead's base, and the arrowhead's tip."""
    a, b = nodes[edge.source], nodes[edge.dest]
    if edge.source == edge.dest:
        angle = math.atan2(via[1] - a.box.cy, via[0] - a.box.cx)
        spread_angle = 0.5
        far = max(a.box.w, a.box.h) * 2
        out = (a.box.cx + math.cos(angle - spread_angle) * far, a.box.cy + math.sin(angle - spread_angle) * far)
        back = (a.box.cx + math.cos(angle + spread_angle) * far, a.box.cy + math.sin(angle + spread_angle) * far)
        start = a.box.boundary_toward(out, round_shape=a.shape == "circle")
        tip = b.box.boundary_toward(back, round_shape=b.shape == "circle")
    else:
        control = curve_through((a.box.cx, a.box.cy), via, (b.box.cx, b.box.cy))[1]
        start = a.box.boundary_toward(control, round_shape=a.shape == "circle")
        tip = b.box.boundary_toward(control, round_shape=b.shape == "circle")
    control = curve_through(start, via, tip)[1]
    dx, dy = tip[0] - control[0], tip[1] - control[1]
    norm = math.hypot(dx, dy) or 1.0
    base = (tip[0] - dx / norm * ARROW, tip[1] - dy / norm * ARROW)
    return curve_through(start, via, base), tip


def beside(point: Point, direction: Point, size: tuple[float, float], gap: float) -> Point:
    """The centre of a label of `size` just beside `point`, on the side the unit vector `direction` points to: the
    label lies wholly beyond the line through `point` across `direction`, `gap` points from it."""
    nx, ny = direction
    half = (abs(nx) * size[0] + abs(ny) * size[1]) / 2
    return (point[0] + nx * (half + gap), point[1] + ny * (half + gap))


def label_places(
    curve: Curve, size: tuple[float, float], side: float, loop: Point | None
) -> Iterator[tuple[Point, Box]]:
    """(point of `curve`, label box beside it) to try, best first: along the curve from its middle out, on the
    `side` (+1 left, -1 right of its direction; a self-loop: beyond its far end, `loop`) first."""
    if loop is not None:
        tip = point_on(curve, 0.5)
        for gap in GAPS:
            yield tip, Box(*beside(tip, loop, size, gap), *size)
    for t in ALONG:
        point = point_on(curve, t)
        before, after = point_on(curve, max(0.0, t - 0.02)), point_on(curve, min(1.0, t + 0.02))
        dx, dy = after[0] - before[0], after[1] - before[1]
        norm = math.hypot(dx, dy) or 1.0
        left = (dy / norm, -dx / norm)
        for sign in (side, -side):
            for gap in GAPS:
                yield point, Box(*beside(point, (left[0] * sign, left[1] * sign), size, gap), *size)


class Router:
    """Draws the edges of one layout, on nodes already placed: every curve first, then every label, in an order.

    Invariants kept: `obstacles` holds every node, title and label placed and, under the edge's index, the curve
    each edge has now; `middles[i]` is the point edge i's curve passes at its middle (no two edges share one, so
    parallel edges stay apart); `offsets[i]` how far that middle bends left of the straight line.
    """

    def __init__(
        self,
        drawn: Sequence[DrawnEdge],
        labels: Sequence[Sequence[str]],
        sizes: Sequence[tuple[float, float]],
        nodes: Mapping[str, PlacedNode],
        grown: Mapping[str, Box],
        obstacles: Obstacles,
    ) -> None:
        self.drawn, self.labels, self.sizes = drawn, labels, sizes
        self.nodes, self.grown, self.obstacles = nodes, grown, obstacles
        self.offsets = spread(drawn)
        self.loops = loop_directions(drawn, nodes)
        self.curves: dict[int, tuple[Curve, Point]] = {}
        self.middles: dict[int, Point] = {}

    def ends(self, index: int) -> set[Box]:
        edge = self.drawn[index]
        return {self.grown[edge.source], self.grown[edge.dest]}

    def place_curve(self, index: int, curve: Curve, tip: Point) -> None:
        self.obstacles.remove(index)
        self.obstacles.add_polyline(index, [*sample(curve, PIECES), tip])

    def first_curve(self, index: int) -> None:
        """Edge `index`'s curve, bent only as far as needed to cross no node and to pass a middle of its own."""
        edge = self.drawn[index]
        taken = set(self.middles.values())
        tried = [t for t in attempts(edge, self.nodes, self.offsets[index], self.loops.get(index)) if t[0] not in taken]
        via, direction, bend = next(
            (
                t
                for t in tried
                if not self.obstacles.polyline_hits(
                    sample(curve_for(edge, self.nodes, t[0])[0], PIECES), self.ends(index)
                )
            ),
            tried[0],
        )
        self.middles[index], self.offsets[index] = via, bend
        if direction is not None:
            self.loops[index] = [direction, *(d for d in self.loops[index] if d != direction)]
        self.curves[index] = curve_for(edge, self.nodes, via)
        self.place_curve(index, *self.curves[index])

    def candidates(self, index: int) -> Iterator[tuple[Curve, Point, Box]]:
        """(curve, arrowhead tip, label box) for edge `index`, best first, each label free of everything placed and
        with no other curve between it and its own: its first curve, then further bends (self-loops: other
        directions) that cross no node or label. While a candidate is out, `obstacles` holds its curve in place of
        the edge's first one, and `middles` its middle."""
        edge, size = self.drawn[index], self.sizes[index]
        first, others = self.middles[index], {v for i, v in self.middles.items() if i != index}
        alike = {i for i, e in enumerate(self.drawn) if (e.source, e.dest) == (edge.source, edge.dest)}
        side = 1.0 if self.offsets[index] >= 0 else -1.0
        for number, (via, direction, _) in enumerate(
            attempts(edge, self.nodes, self.offsets[index], self.loops.get(index))
        ):
            curve, tip = curve_for(edge, self.nodes, via) if number else self.curves[index]
            points = [*sample(curve, PIECES), tip]
            if number and (via in others or self.obstacles.polyline_hits(points, ignore=self.ends(index))):
                continue
            self.place_curve(index, curve, tip)
            self.middles[index] = via
            for anchor, box in label_places(curve, size, side, direction):
                near = (min(max(anchor[0], box.left), box.right), min(max(anchor[1], box.top), box.bottom))
                if self.obstacles.box_is_free(box.grown(CLEARANCE)) and not self.obstacles.separates(
                    anchor, near, alike
                ):
                    yield curve, tip, box
            self.place_curve(index, *self.curves[index])
            self.middles[index] = first

    def tail(self, index: int, leader: int, target: Curve) -> tuple[Route, bool]:
        """The tail of twin `index`, joining `target` (the curve of edge `leader`) clear of every node other than its
        source and of every label (placed in `obstacles`); False when no meeting point kept it clear."""
        edge = self.drawn[index]
        chosen = None
        for reach in TAIL_REACHES:
            curve, end = join_curve(edge, self.nodes, target, reach)
            if not self.obstacles.polyline_hits(sample(curve, PIECES)[:-2], ignore={self.grown[edge.source]}):
                chosen = (curve, end)
                break
        curve, end = chosen or join_curve(edge, self.nodes, target, 0.0)
        self.obstacles.remove(index)
        self.obstacles.add_polyline(index, sample(curve, PIECES))
        return Route(edge, None, tuple(self.labels[index]), curve, end, joins=leader), chosen is not None

    def label(self, index: int, followers: Sequence[int]) -> tuple[Curve, Point, Box] | None:
        """The first candidate of edge `index` whose label also keeps its twins' tails clean (of the first
        `TAIL_TRIES`); else the first candidate, and `followers` cannot join; None without any candidate."""
        first = None
        for tried, found in enumerate(self.candidates(index)):
            first = first or found
            if not followers or tried >= TAIL_TRIES:
                return first
            self.obstacles.add_box(found[2].grown(CLEARANCE), ("label", index))
            clean = all(self.tail(f, index, found[0])[1] for f in followers)
            for follower in followers:
                self.obstacles.remove(follower)
            self.obstacles.remove(("label", index))
            if clean:
                return found
        return first

    def route(self, joins: Mapping[int, int], first: Sequence[int]) -> tuple[tuple[Route, ...], list[int]]:
        """Every edge's curve and label, in drawn order, and the indices of the edges no candidate kept clean.

        First every curve; then, `first` and the rest in `route_order`, each label at its first candidate place.
        The tails of a curve's twins are drawn with it; a twin whose tail no place of the label keeps clean is drawn
        as an edge of its own instead."""
        for index in range(len(self.drawn)):
            if index not in joins:
                self.first_curve(index)
        tails: dict[int, list[int]] = {}
        for follower, leader in joins.items():
            tails.setdefault(leader, []).append(follower)
        routes: dict[int, Route] = {}
        compromised: list[int] = []
        queue = [
            i for i in [*first, *(i for i in route_order(self.drawn, self.nodes) if i not in first)] if i not in joins
        ]
        while queue:
            index = queue.pop(0)
            followers = tails.get(index, [])
            found = self.label(index, followers)
            if found is None:
                curve, tip = self.curves[index]
                loop = self.loops.get(index)
                side = 1.0 if self.offsets[index] >= 0 else -1.0
                found = (curve, tip, next(label_places(curve, self.sizes[index], side, loop[0] if loop else None))[1])
                compromised.append(index)
            curve, tip, box = found
            self.curves[index] = (curve, tip)
            self.place_curve(index, curve, tip)
            self.obstacles.add_box(box.grown(CLEARANCE), ("label", index))
            routes[index] = Route(self.drawn[index], box, tuple(self.labels[index]), curve, tip)
            for follower in followers:
                route, clean = self.tail(follower, index, curve)
                if clean:
                    routes[follower] = route
                else:  # no tail kept clean: the twin is an edge of its own
                    self.obstacles.remove(follower)
                    self.first_curve(follower)
                    queue.insert(0, follower)
        return tuple(routes[i] for i in range(len(self.drawn))), compromised
