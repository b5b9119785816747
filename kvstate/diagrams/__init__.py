"""Diagrams generated from the specification: one intermediate representation, several renderers.

`render_sources(spec)` gives the byte-stable text sources (the lifecycle DOT, Mermaid, the markdown table and
the reviewer view's DOT) keyed by the file name they are committed under, always in `TEXT_FILES` order;
`SVG_FILES` names the drawing of each DOT source, which `render_svg` makes. By default a broadcast event's edges
into a terminal state are drawn as one arrow; `all_edges=True` draws every transition (the table always lists
every transition). Every text from the spec is written through `kvstate.diagrams.escape`.
"""

from __future__ import annotations

from kvstate.diagrams.dot import render_dot
from kvstate.diagrams.ir import Diagram, build_diagram
from kvstate.diagrams.mermaid import render_mermaid
from kvstate.diagrams.review import render_review_dot
from kvstate.diagrams.svg import DOT_MISSING, DOT_TIMEOUT_S, render_image, render_svg
from kvstate.diagrams.table import render_table
from kvstate.spec import Spec

DOT_FILE = "lifecycle.dot"
MERMAID_FILE = "lifecycle.mmd"
TABLE_FILE = "transitions.md"
REVIEW_DOT_FILE = "lifecycle-review.dot"
SVG_FILE = "lifecycle.svg"
REVIEW_SVG_FILE = "lifecycle-review.svg"
TEXT_FILES = (DOT_FILE, MERMAID_FILE, TABLE_FILE, REVIEW_DOT_FILE)
SVG_FILES = {DOT_FILE: SVG_FILE, REVIEW_DOT_FILE: REVIEW_SVG_FILE}  # DOT source -> its drawing


def render_sources(spec: Spec, *, all_edges: bool = False) -> dict[str, str]:
    """The text sources of `spec`'s diagrams, keyed by file name in `TEXT_FILES` order."""
    diagram = build_diagram(spec, all_edges=all_edges)
    return {
        DOT_FILE: render_dot(diagram),
        MERMAID_FILE: render_mermaid(diagram),
        TABLE_FILE: render_table(diagram),
        REVIEW_DOT_FILE: render_review_dot(diagram),
    }


__all__ = [
    "DOT_FILE",
    "DOT_MISSING",
    "DOT_TIMEOUT_S",
    "MERMAID_FILE",
    "REVIEW_DOT_FILE",
    "REVIEW_SVG_FILE",
    "SVG_FILE",
    "SVG_FILES",
    "TABLE_FILE",
    "TEXT_FILES",
    "Diagram",
    "build_diagram",
    "render_dot",
    "render_image",
    "render_mermaid",
    "render_review_dot",
    "render_sources",
    "render_svg",
    "render_table",
]
