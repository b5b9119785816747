"""The lifecycle diagram annotated with how often each edge fired, built from the spec's diagram IR.

Each event in an edge label gains ``×N`` (N = times fired in the trace, summed over the transitions an arrow
bundles); arrows that fired get a pen width growing with log N, arrows that never fired are drawn dotted and
light, and the legend says so (`kvstate.diagrams.dot`). Drawn with Graphviz `dot`, within a time limit, when
installed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from kvstate.diagrams.dot import render_dot
from kvstate.diagrams.ir import Diagram, build_diagram
from kvstate.diagrams.review import render_review_dot
from kvstate.diagrams.svg import DOT_TIMEOUT_S, render_image
from kvstate.spec import Spec


def annotated_diagram(spec: Spec, counts: Counter, *, all_edges: bool = False) -> tuple[Diagram, str]:
    """(diagram with the trace's firing counts, its DOT source)."""
    base = build_diagram(spec, all_edges=all_edges)
    diagram = replace(base, title=f"{base.title}: transitions fired in this trace", fired=dict(counts))
    return diagram, render_dot(diagram)


def review_dot(spec: Spec, *, all_edges: bool = False) -> str:
    """The DOT source of the reviewer view (who decides each edge, which output list it feeds)."""
    return render_review_dot(build_diagram(spec, all_edges=all_edges))


def render(dot_source: str, fmt: str, timeout: float = DOT_TIMEOUT_S) -> bytes | None:
    """`dot_source` drawn as `fmt` ("svg", sanitized, or "png"), or None when Graphviz `dot` is not installed."""
    return render_image(dot_source, fmt, timeout=timeout)
