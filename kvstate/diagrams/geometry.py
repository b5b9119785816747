"""Plane geometry for laying diagrams out: boxes, cubic Bezier curves through a point, and a spatial index.

Coordinates are points with y growing downwards (as on a page); `kvstate.diagrams.dot` flips them for Graphviz.

Invariants kept: every value is immutable and every function pure; `Obstacles` answers "does this box or polyline
touch anything placed" by looking only at the buckets the query covers, so laying out n objects costs O(n) queries
of constant size (a spec with thousands of states is laid out in linear time).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

Point = tuple[float, float]


@dataclass(frozen=True, slots=True)
class Box:
    """An axis-aligned rectangle by its centre and size."""

    cx: float
    cy: float
    w: float
    h: float

    @property
    def left(self) -> float:
        return self.cx - self.w / 2

    @property
    def right(self) -> float:
        return self.cx + self.w / 2

    @property
    def top(self) -> float:
        return self.cy - self.h / 2

    @property
    def bottom(self) -> float:
        return self.cy + self.h / 2

    def grown(self, margin: float) -> Box:
        return Box(self.cx, self.cy, self.w + 2 * margin, self.h + 2 * margin)

    def overlaps(self, other: Box) -> bool:
        return abs(self.cx - other.cx) * 2 < self.w + other.w and abs(self.cy - other.cy) * 2 < self.h + other.h

    def contains(self, point: Point) -> bool:
        x, y = point
        return self.left < x < self.right and self.top < y < self.bottom

    def crossed_by(self, a: Point, b: Point) -> bool:
        """Whether the segment a-b has a point strictly inside the box (Liang-Barsky clipping)."""
        (x0, y0), (x1, y1) = a, b
        left, right = self.cx - self.w / 2, self.cx + self.w / 2
        top, bottom = self.cy - self.h / 2, self.cy + self.h / 2
        if max(x0, x1) <= left or min(x0, x1) >= right or max(y0, y1) <= top or min(y0, y1) >= bottom:
            return False
        dx, dy = x1 - x0, y1 - y0
        low, high = 0.0, 1.0
        for p, q in ((-dx, x0 - left), (dx, right - x0), (-dy, y0 - top), (dy, bottom - y0)):
            if p == 0:
                if q <= 0:
                    return False
                continue
            t = q / p
            if p < 0:
                low = max(low, t)
            else:
                high = min(high, t)
            if low >= high:
                return False
        return True

    def boundary_toward(self, point: Point, *, round_shape: bool = False) -> Point:
        """Where the ray from the centre toward `point` leaves the box (or the inscribed ellipse, `round_shape`)."""
        dx, dy = point[0] - self.cx, point[1] - self.cy
        if dx == 0 and dy == 0:
            return (self.cx, self.cy)
        if round_shape:
            scale = 1 / math.hypot(dx / (self.w / 2), dy / (self.h / 2))
        else:
            scale = min(
                (self.w / 2) / abs(dx) if dx else math.inf,
                (self.h / 2) / abs(dy) if dy else math.inf,
            )
        return (self.cx + dx * scale, self.cy + dy * scale)


def union(boxes: Iterable[Box]) -> Box:
    boxes = list(boxes)
    left, right = min(b.left for b in boxes), max(b.right for b in boxes)
    top, bottom = min(b.top for b in boxes), max(b.bottom for b in boxes)
    return Box((left + right) / 2, (top + bottom) / 2, right - left, bottom - top)


Curve = tuple[Point, Point, Point, Point]  # a cubic Bezier: start, two control points, end


def curve_through(start: Point, via: Point, end: Point) -> Curve:
    """The cubic Bezier from `start` to `end` that passes through `via` at its middle (t = 1/2), with both control
    points at one place: a straight line when `via` is the midpoint, a symmetric arc otherwise."""
    control = ((8 * via[0] - start[0] - end[0]) / 6, (8 * via[1] - start[1] - end[1]) / 6)
    return (start, control, control, end)


def point_on(curve: Curve, t: float) -> Point:
    (x0, y0), (x1, y1), (x2, y2), (x3, y3) = curve
    u = 1 - t
    a, b, c, d = u * u * u, 3 * u * u * t, 3 * u * t * t, t * t * t
    return (a * x0 + b * x1 + c * x2 + d * x3, a * y0 + b * y1 + c * y2 + d * y3)


def sample(curve: Curve, pieces: int = 16) -> tuple[Point, ...]:
    """`pieces + 1` points along `curve`, evenly in t, ends included."""
    return tuple(point_on(curve, i / pieces) for i in range(pieces + 1))


def length(points: Sequence[Point]) -> float:
    return sum(math.dist(a, b) for a, b in itertools.pairwise(points))


def segments_cross(a: Point, b: Point, c: Point, d: Point) -> bool:
    """Whether the segments a-b and c-d properly cross."""

    def side(p: Point, q: Point, r: Point) -> float:
        return (q[0] - p[0]) * (r[1] - p[1]) - (q[1] - p[1]) * (r[0] - p[0])

    return side(a, b, c) * side(a, b, d) < 0 and side(c, d, a) * side(c, d, b) < 0


def segment_box(a: Point, b: Point) -> Box:
    return Box((a[0] + b[0]) / 2, (a[1] + b[1]) / 2, abs(a[0] - b[0]), abs(a[1] - b[1]))


class Obstacles:
    """Boxes and polylines placed so far, bucketed on a square grid of `cell` points for local queries. Each is added
    under an owner key, and everything of one owner can be taken out again (`remove`)."""

    def __init__(self, cell: float = 160.0) -> None:
        self.cell = cell
        self._boxes: dict[tuple[int, int], dict[object, list[Box]]] = {}
        self._segments: dict[tuple[int, int], dict[object, list[tuple[Point, Point]]]] = {}
        self._cells_of: dict[object, list[tuple[int, int]]] = {}

    def _cells(self, box: Box) -> Iterator[tuple[int, int]]:
        c = self.cell
        for i in range(math.floor(box.left / c), math.floor(box.right / c) + 1):
            for j in range(math.floor(box.top / c), math.floor(box.bottom / c) + 1):
                yield (i, j)

    def add_box(self, box: Box, owner: object = None) -> None:
        cells = self._cells_of.setdefault(owner, [])
        for key in self._cells(box):
            self._boxes.setdefault(key, {}).setdefault(owner, []).append(box)
            cells.append(key)

    def _boxes_in(self, key: tuple[int, int]) -> Iterator[Box]:
        for boxes in self._boxes.get(key, {}).values():
            yield from boxes

    def add_polyline(self, owner: object, points: Sequence[Point]) -> None:
        cells = self._cells_of.setdefault(owner, [])
        for a, b in itertools.pairwise(points):
            for key in self._cells(segment_box(a, b)):
                self._segments.setdefault(key, {}).setdefault(owner, []).append((a, b))
                cells.append(key)

    def remove(self, owner: object) -> None:
        """Take out every box and polyline added under `owner`."""
        for key in self._cells_of.pop(owner, []):
            self._segments.get(key, {}).pop(owner, None)
            self._boxes.get(key, {}).pop(owner, None)

    def _segments_near(self, box: Box) -> Iterator[tuple[Point, Point]]:
        for key in self._cells(box):
            for segments in self._segments.get(key, {}).values():
                yield from segments

    def box_is_free(self, box: Box) -> bool:
        """No placed box overlaps `box` and no placed polyline enters it."""
        if any(box.overlaps(other) for key in self._cells(box) for other in self._boxes_in(key)):
            return False
        return not any(box.crossed_by(a, b) for a, b in self._segments_near(box))

    def polyline_hits(self, points: Sequence[Point], ignore: Iterable[Box] = ()) -> bool:
        """Whether the polyline enters a placed box other than those in `ignore`."""
        skip = set(ignore)
        for a, b in itertools.pairwise(points):
            near = segment_box(a, b)
            for key in self._cells(near):
                for other in self._boxes_in(key):
                    if other not in skip and other.crossed_by(a, b):
                        return True
        return False

    def separates(self, a: Point, b: Point, owners: Iterable[object]) -> bool:
        """Whether a polyline of an owner not in `owners` crosses the segment a-b."""
        skip = set(owners)
        for key in self._cells(segment_box(a, b)):
            for other, segments in self._segments.get(key, {}).items():
                if other not in skip and any(segments_cross(a, b, c, d) for c, d in segments):
                    return True
        return False
