"""The diagrams are laid out along the lifecycle's story, by roles, and Graphviz draws them without overlaps.

The story: the spine queued -> active -> ended left to right, the host tier below the active state,
the recompute loop above it, the pending reset beside the pause edge, the terminal state rightmost. The overlap
test reads the SVG Graphviz draws (not the layout's own numbers): every text of an edge label, measured in DejaVu
Sans (wider than the Helvetica the layout counts with), must keep clear of every edge (curves and arrowheads),
every node, every cluster title and every other label; cluster titles must keep clear of every edge.
"""

from __future__ import annotations

import re
import shutil
from collections import Counter
from dataclasses import dataclass, replace
from xml.etree import ElementTree

import pytest

from kvstate.diagrams import build_diagram, render_dot, render_review_dot, render_svg
from kvstate.diagrams.dot import LIFECYCLE_VIEW, legend_size
from kvstate.diagrams.ir import ANY_STATE
from kvstate.diagrams.layout import INITIAL, lay_out, story_cells
from kvstate.diagrams.review import REVIEW_VIEW
from kvstate.report.diagram import annotated_diagram
from kvstate.roles import ACTIVE, DROPPED, ENDED, OFFLOADED, PENDING_RESET, QUEUED, RECOMPUTING
from kvstate.spec import load_spec

HAS_DOT = shutil.which("dot") is not None
SPEC = load_spec()


def layouts():
    diagram = build_diagram(SPEC)
    for name, view in (("lifecycle", LIFECYCLE_VIEW), ("review", REVIEW_VIEW)):
        labels = tuple(tuple(p) for p in view.edge_labels(diagram, diagram.drawn_edges))
        yield name, lay_out(diagram, labels, legend_size(diagram.title, view.legend_rows(diagram)))


@pytest.mark.parametrize(("name", "layout"), list(layouts()), ids=["lifecycle", "review"])
def test_states_sit_where_their_roles_put_them(name, layout) -> None:
    """Positions come from roles: the spine on one row left to right, the host tier below the active state, the
    recompute loop above it, the pending reset beside the pause edge (between the active state and the dropped
    one, above the spine), the ended state rightmost."""
    at = {role: layout.nodes[SPEC.role(role)].box for role in (QUEUED, ACTIVE, OFFLOADED, PENDING_RESET, DROPPED)}
    at[RECOMPUTING] = layout.nodes[SPEC.role(RECOMPUTING)].box
    at[ENDED] = layout.nodes[SPEC.role(ENDED)].box
    spine = [at[QUEUED], at[ACTIVE], at[ENDED]]
    assert len({round(b.cy) for b in spine}) == 1 and at[QUEUED].cx < at[ACTIVE].cx < at[ENDED].cx
    assert at[OFFLOADED].cy > at[ACTIVE].cy and abs(at[OFFLOADED].cx - at[ACTIVE].cx) < 1, "host tier below"
    assert at[RECOMPUTING].cy < at[ACTIVE].cy and at[DROPPED].cy < at[RECOMPUTING].cy, "the loop above"
    assert at[ACTIVE].cx < at[PENDING_RESET].cx <= at[DROPPED].cx and at[DROPPED].cy < at[PENDING_RESET].cy
    assert at[PENDING_RESET].cy < at[ACTIVE].cy
    assert max(n.box.right for n in layout.nodes.values()) <= at[ENDED].right, "the ended state is rightmost"
    assert layout.compromised == (), f"{name}: edges no candidate kept clear: {layout.compromised}"


def test_layout_follows_roles_not_names() -> None:
    """States renamed (and listed in another order) are laid out in the same cells: the layout reads roles."""
    base = build_diagram(SPEC)
    new = {node.name: f"x{i}" for i, node in enumerate(base.nodes)}
    renamed = replace(
        base,
        initial=new[base.initial],
        nodes=tuple(replace(n, name=new[n.name]) for n in reversed(base.nodes)),
        edges=tuple(replace(e, source=new[e.source], dest=new[e.dest]) for e in base.edges),
    )
    original, moved = story_cells(base), story_cells(renamed)
    assert {old: original[old] for old in new} == {old: moved[name] for old, name in new.items()}


def test_layout_is_linear_in_the_number_of_states(chain) -> None:
    """Every query the layout makes looks at a bounded neighbourhood (`Obstacles`): twice the states, about twice
    the box tests, not four times."""
    from kvstate.diagrams import geometry

    counts = []
    for states in (100, 200):
        calls = Counter()
        original = geometry.Box.overlaps

        def counting(self, other, original=original, calls=calls):
            calls["overlaps"] += 1
            return original(self, other)

        geometry.Box.overlaps = counting
        try:
            render_dot(chain(states))
        finally:
            geometry.Box.overlaps = original
        counts.append(calls["overlaps"])
    assert counts[1] < 2.6 * counts[0], counts


# --------------------------------------------------------------------------------------------- the SVG drawn


@dataclass(frozen=True)
class Rect:
    left: float
    top: float
    right: float
    bottom: float
    what: str

    def overlaps(self, other: Rect) -> bool:
        return (
            self.left < other.right and other.left < self.right and self.top < other.bottom and other.top < self.bottom
        )

    def holds(self, point: tuple[float, float], margin: float = 0.5) -> bool:
        x, y = point
        return self.left + margin < x < self.right - margin and self.top + margin < y < self.bottom - margin


NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def measure():
    """A function (text, size) -> width in DejaVu Sans, matplotlib's own font (wider than Helvetica)."""
    pytest.importorskip("matplotlib")
    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font

    font = FT2Font(font_manager.findfont(font_manager.FontProperties(family="DejaVu Sans")))

    def width(text: str, size: float) -> float:
        font.set_size(size, 72)
        font.set_text(text)
        return font.get_width_height()[0] / 64

    return width


def text_rect(element, width, what: str) -> Rect:
    x, y, size = float(element.get("x")), float(element.get("y")), float(element.get("font-size"))
    w = width(element.text or "", size)
    left = {"middle": x - w / 2, "end": x - w}.get(element.get("text-anchor", "start"), x)
    return Rect(left, y - 0.76 * size, left + w, y + 0.24 * size, what)


def path_points(d: str) -> list[tuple[float, float]]:
    """Points along an SVG path of M/C commands (as Graphviz writes them), 24 per cubic segment."""
    values = [float(v) for v in NUMBER.findall(d)]
    points = list(zip(values[0::2], values[1::2], strict=True))
    out = [points[0]]
    for i in range(1, len(points) - 2, 3):
        (x0, y0), (x1, y1), (x2, y2), (x3, y3) = points[i - 1], points[i], points[i + 1], points[i + 2]
        for k in range(1, 25):
            t = k / 24
            u = 1 - t
            out.append(
                (
                    u**3 * x0 + 3 * u * u * t * x1 + 3 * u * t * t * x2 + t**3 * x3,
                    u**3 * y0 + 3 * u * u * t * y1 + 3 * u * t * t * y2 + t**3 * y3,
                )
            )
    return out


def polygon_points(points: str) -> list[tuple[float, float]]:
    corners = [tuple(map(float, pair.split(","))) for pair in points.split()]
    out = []
    for a, b in zip(corners, corners[1:] + corners[:1], strict=True):
        out += [(a[0] + (b[0] - a[0]) * k / 8, a[1] + (b[1] - a[1]) * k / 8) for k in range(8)]
    return out


def bounds(points: list[tuple[float, float]], what: str) -> Rect:
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    return Rect(min(xs), min(ys), max(xs), max(ys), what)


@dataclass
class Drawing:
    labels: list[Rect]  # one per text line of an edge label
    titles: list[Rect]  # cluster titles
    nodes: list[Rect]
    strokes: list[tuple[str, list[tuple[float, float]]]]  # (edge, points along its curve and arrowhead)


def local(element) -> str:
    return element.tag.rsplit("}", 1)[-1]


def outline(group) -> list[tuple[float, float]]:
    """Points along every path, polygon and ellipse in `group` (tooltips wrap parts in a <g> of their own)."""
    points = []
    for element in group.iter():
        if element.tag == "path":
            points += path_points(element.get("d"))
        elif element.tag == "polygon":
            points += polygon_points(element.get("points"))
        elif element.tag == "ellipse":
            cx, cy, rx, ry = (float(element.get(k)) for k in ("cx", "cy", "rx", "ry"))
            points += [(cx - rx, cy - ry), (cx + rx, cy + ry)]
    return points


def read_svg(svg: str) -> Drawing:
    width = measure()
    root = ElementTree.fromstring(svg)
    for element in root.iter():
        element.tag = local(element)
    drawing = Drawing([], [], [], [])
    for group in root.iter("g"):
        kind, title = group.get("class"), group.findtext("title") or ""
        if kind == "edge":
            texts = [t for t in group.iter("text") if (t.text or "").strip()]
            drawing.labels += [text_rect(t, width, f"label of {title}: {t.text}") for t in texts]
            drawing.strokes.append((title, outline(group)))
        elif kind == "cluster":
            drawing.titles += [text_rect(t, width, f"title {t.text}") for t in group.iter("text")]
        elif kind == "node" and (shapes := outline(group)):
            drawing.nodes.append(bounds(shapes, f"node {title}"))
    return drawing


def overlaps(drawing: Drawing) -> list[str]:
    found = []
    for i, label in enumerate(drawing.labels):
        found += [f"{label.what} overlaps {other.what}" for other in drawing.labels[i + 1 :] if label.overlaps(other)]
        found += [
            f"{label.what} overlaps {other.what}" for other in drawing.nodes + drawing.titles if label.overlaps(other)
        ]
        found += [
            f"{label.what} is crossed by edge {edge}"
            for edge, points in drawing.strokes
            if any(label.holds(p) for p in points)
        ]
    for title in drawing.titles:
        found += [
            f"{title.what} is crossed by edge {edge}"
            for edge, points in drawing.strokes
            if any(title.holds(p) for p in points)
        ]
    return found


def drawings():
    diagram = build_diagram(SPEC)
    fired = dict.fromkeys([(e.event, e.source, e.dest) for e in diagram.edges][::2], 3)
    annotated, annotated_dot = annotated_diagram(SPEC, Counter(fired))
    assert annotated.fired is not None
    return {
        "lifecycle": render_dot(diagram),
        "review": render_review_dot(diagram),
        "report (fired counts)": annotated_dot,
    }


@pytest.mark.skipif(not HAS_DOT, reason="Graphviz `dot` is not installed")
@pytest.mark.parametrize("name", ["lifecycle", "review", "report (fired counts)"])
def test_no_label_overlaps_an_edge_a_node_a_title_or_another_label(name: str) -> None:
    svg = render_svg(drawings()[name]).decode()
    drawing = read_svg(svg)
    expected_labels = sum(
        len([line for line in text.split("\\n") if line])
        for text in re.findall(r'-> "[^"]+" \[label="((?:[^"\\]|\\.)*)"', drawings()[name])
    )
    assert len(drawing.labels) == expected_labels, "every label line is drawn as one text"
    assert len(drawing.titles) == 2 and len(drawing.strokes) >= len(build_diagram(SPEC).drawn_edges)
    assert overlaps(drawing) == []


def test_the_overlap_check_sees_an_overlap() -> None:
    """The check is not vacuous: a label moved onto a node, and an edge drawn through a label, are reported."""
    svg = render_svg(drawings()["lifecycle"]).decode() if HAS_DOT else None
    if svg is None:
        pytest.skip("Graphviz `dot` is not installed")
    drawing = read_svg(svg)
    node = drawing.nodes[1]
    moved = replace(drawing.labels[0], left=node.left, top=node.top, right=node.left + 40, bottom=node.top + 10)
    assert any("overlaps node" in p for p in overlaps(replace(drawing, labels=[moved, *drawing.labels[1:]])))
    label = drawing.labels[0]
    through = (
        "planted",
        [
            (label.left - 5, (label.top + label.bottom) / 2),
            ((label.left + label.right) / 2, (label.top + label.bottom) / 2),
        ],
    )
    assert any("crossed by edge planted" in p for p in overlaps(replace(drawing, strokes=[*drawing.strokes, through])))


def test_the_bundle_pseudo_node_and_every_state_are_placed() -> None:
    layout = dict(layouts())["lifecycle"]
    assert set(layout.nodes) == {s.name for s in SPEC.states} | {ANY_STATE, INITIAL}


# --------------------------------------------------------------------------------------------- bounded work


def renamed(diagram, old: str, new: str):
    """`diagram` with node `old` renamed to `new` in its nodes and edges (no spec check runs on a diagram)."""
    name = {old: new}.get
    return replace(
        diagram,
        initial=name(diagram.initial, diagram.initial),
        nodes=tuple(replace(n, name=name(n.name, n.name)) for n in diagram.nodes),
        edges=tuple(replace(e, source=name(e.source, e.source), dest=name(e.dest, e.dest)) for e in diagram.edges),
    )


def test_a_huge_state_name_is_refused_before_any_edge_is_routed() -> None:
    """A name that passed no loader (a `Spec` built in code) still cannot make the layout's work explode."""
    from kvstate.diagrams.layout import MAX_BOX_POINTS, LayoutTooLarge

    base = build_diagram(SPEC)
    terminal = base.final_nodes[0].name
    with pytest.raises(LayoutTooLarge) as info:
        render_dot(renamed(base, terminal, "d" * 1_000))
    message = str(info.value)
    assert "1000 characters" in message and f"the {MAX_BOX_POINTS:.0f} a layout places" in message
    assert len(message) < 300 and "\n" not in message


def test_a_huge_label_is_refused_before_any_edge_is_routed() -> None:
    from kvstate.diagrams.layout import LayoutTooLarge

    base = build_diagram(SPEC)
    long_label = replace(base, edges=tuple(replace(e, event_label="x" * 1_000) for e in base.edges))
    with pytest.raises(LayoutTooLarge, match="shorten its label"):
        render_dot(long_label)


def test_more_nodes_than_a_layout_places_are_refused(chain) -> None:
    from kvstate.diagrams.layout import MAX_PLACED, LayoutTooLarge

    render_dot(chain(MAX_PLACED // 4))  # well within: laid out
    with pytest.raises(LayoutTooLarge, match=f"more than the {MAX_PLACED} a layout places"):
        render_dot(chain(MAX_PLACED))
