"""Diagrams generated from the specification: one intermediate representation, several renderers.

`render_sources(spec)` gives the byte-stable text sources (DOT, Mermaid, markdown table) keyed by the
file name they are committed under, always in `TEXT_FILES` order; `render_svg` draws the DOT source.
"""

from __future__ import annotations

from kvstate.diagrams.dot import render_dot
from kvstate.diagrams.ir import Diagram, build_diagram
from kvstate.diagrams.mermaid import render_mermaid
from kvstate.diagrams.svg import DOT_MISSING, render_svg
from kvstate.diagrams.table import render_table
from kvstate.spec import Spec

DOT_FILE = "lifecycle.dot"
MERMAID_FILE = "lifecycle.mmd"
TABLE_FILE = "transitions.md"
SVG_FILE = "lifecycle.svg"
TEXT_FILES = (DOT_FILE, MERMAID_FILE, TABLE_FILE)


def render_sources(spec: Spec) -> dict[str, str]:
    """The text sources of `spec`'s diagrams, keyed by file name in `TEXT_FILES` order."""
    diagram = build_diagram(spec)
    return {DOT_FILE: render_dot(diagram), MERMAID_FILE: render_mermaid(diagram), TABLE_FILE: render_table(diagram)}


__all__ = [
    "DOT_FILE",
    "DOT_MISSING",
    "MERMAID_FILE",
    "SVG_FILE",
    "TABLE_FILE",
    "TEXT_FILES",
    "Diagram",
    "build_diagram",
    "render_dot",
    "render_mermaid",
    "render_sources",
    "render_svg",
    "render_table",
]
