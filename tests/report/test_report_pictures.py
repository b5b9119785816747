"""The report's pictures are readable: diagrams at natural size, bundled edges with summed counts, a
legend and a colour key that match what is drawn, occupancy without aliasing and with integer ticks."""

from __future__ import annotations

import re
import shutil
from collections import Counter
from html.parser import HTMLParser
from xml.etree import ElementTree

import pytest

from kvstate import load_spec
from kvstate.diagrams.dot import EDGE_FONT_SIZE, NEVER_FIRED_STYLE
from kvstate.diagrams.ir import ANY_STATE
from kvstate.report.colors import COLOR_KEY, DESTRUCTIVE_HATCH_COLOR, SHADES, hatched, state_colors
from kvstate.report.diagram import annotated_diagram
from kvstate.report.html import MIN_LABEL_PX, PX_PER_PT, STYLE

HAS_DOT = shutil.which("dot") is not None


class DiagramBoxes(HTMLParser):
    """The inline SVG of every `.diagram` box, as text."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.page = page
        self.svgs: list[str] = []
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        if tag == "div" and ("class", "diagram") in attrs:
            line, column = self.getpos()
            offset = sum(len(text) for text in self.page.splitlines(keepends=True)[: line - 1]) + column
            start = self.page.index("<svg", offset)
            self.svgs.append(self.page[start : self.page.index("</svg>", start) + len("</svg>")])


@pytest.mark.skipif(not HAS_DOT, reason="Graphviz `dot` is not installed")
def test_diagrams_are_inline_at_natural_size_with_legible_labels(small_report) -> None:
    page = small_report.html.read_text()
    svgs = DiagramBoxes(page).svgs
    assert len(svgs) == 2, "the lifecycle diagram and the reviewer view"
    for svg in svgs:
        root = ElementTree.fromstring(svg)
        width, height = (float(root.get(a).removesuffix("pt")) for a in ("width", "height"))
        box = [float(v) for v in root.get("viewBox").split()]
        assert abs(width - box[2]) < 1 and abs(height - box[3]) < 1, "1 user unit = 1 pt: natural size"
        sizes = [float(e.get("font-size")) for e in root.iter() if e.get("font-size")]
        assert min(sizes) * PX_PER_PT >= MIN_LABEL_PX
    assert EDGE_FONT_SIZE * PX_PER_PT >= MIN_LABEL_PX
    assert re.search(r"\.diagram svg\{[^}]*max-width:none", STYLE), "the page never shrinks a diagram"
    assert re.search(r"\.diagram\{[^}]*overflow:auto", STYLE), "a diagram wider than the page scrolls"
    assert page.count('data-zoom="fit"') == 2 and page.count('data-zoom="natural"') == 2


def test_bundled_counts_sum_over_the_states_they_bundle_and_never_fired_is_in_the_legend() -> None:
    spec = load_spec()
    diagram, _ = annotated_diagram(spec, Counter())
    bundle = next(arrow for arrow in diagram.drawn_edges if arrow.source == ANY_STATE)
    event = bundle.members[0]
    twice = [e for e in bundle.members if e.event == event.event][:2]
    assert len(twice) == 2, "a bundle holds one event from several states"
    counts = Counter({e.key: 3 for e in twice})
    diagram, dot = annotated_diagram(spec, counts)
    assert f"{event.event_label} ×6" in dot
    assert dot.count(NEVER_FIRED_STYLE) == len(diagram.drawn_edges) - 1
    assert "never fired in this trace" in dot
    all_diagram, all_dot = annotated_diagram(spec, counts, all_edges=True)
    assert len(all_diagram.drawn_edges) == len(spec.transitions) and f"{event.event_label} ×3" in all_dot


def test_header_colour_key_matches_the_colours_drawn(small_report) -> None:
    spec = load_spec()
    colors = state_colors(spec)
    dropped = [s for s in colors if hatched(spec, s)]
    assert len(dropped) == 1
    assert spec.state_by_name[dropped[0]].residency == "none" and colors[dropped[0]] in SHADES["none"]
    assert "grey hatched red" in COLOR_KEY and DESTRUCTIVE_HATCH_COLOR.startswith("#c")
    for state, color in colors.items():
        red, green, blue = (int(color[i : i + 2], 16) for i in (1, 3, 5))
        hue = {"gpu": green > max(red, blue), "held": blue > max(red, green), "none": red == green == blue}
        assert hue[spec.state_by_name[state].residency], f"{state} is drawn {color}, not its residency's hue"
    assert COLOR_KEY in small_report.html.read_text().replace("&#x27;", "'")


def test_occupancy_has_integer_ticks_and_bins_long_runs():
    pytest.importorskip("matplotlib")
    from kvstate.report.figures import MAX_COLUMNS, bin_size, binned_peaks, occupancy
    from kvstate.report.model import TraceSummary

    assert bin_size(MAX_COLUMNS) == 1 and bin_size(MAX_COLUMNS + 1) == 2 and bin_size(10 * MAX_COLUMNS) == 10
    rows = [
        {
            "iteration": i,
            "gpu_owned": i % 5,
            "gpu_held": (i % 5) // 2,
            "gpu_fenced": 3 if i == 6 else 0,
            "gpu_capacity": 7,
            "host_owned": 0,
            "host_fenced": 0,
            "host_capacity": 3,
        }
        for i in range(1, 1001)
    ]
    starts, held, total = binned_peaks(rows, "gpu", 4)
    assert starts[:3] == [1, 5, 9] and held[:2] == [4, 3] and total[:2] == [4, 4], "a fenced peak stays visible"
    assert max(total) == 4 and len(starts) == 250
    summary = TraceSummary(occupancy=rows)
    fig = occupancy(summary)
    for ax in fig.axes:
        assert all(float(t).is_integer() for t in ax.get_yticks()), "block counts are whole blocks"
        assert all(float(t).is_integer() for t in ax.get_xticks())
    assert "peak of every 4 iterations" in fig.axes[0].get_title()
