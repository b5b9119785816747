"""The lifecycle diagram annotated with how often each edge fired, built from the spec's diagram IR.

Each edge's event label gains ``×N`` (N = times fired in the trace); edges that fired get a pen width growing
with log N, edges that never fired are drawn dotted and light. Rendered with Graphviz `dot` when installed.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

from kvstate.diagrams.dot import edge_line, render_dot
from kvstate.diagrams.ir import Diagram, build_diagram
from kvstate.spec import Spec


def annotated_diagram(spec: Spec, counts: Counter) -> tuple[Diagram, str]:
    """(diagram with counted labels, its DOT source with pen widths by count)."""
    base = build_diagram(spec)
    edges = tuple(replace(e, event_label=f"{e.event_label} ×{counts.get((e.event, e.source, e.dest), 0)}")
                  for e in base.edges)
    diagram = replace(base, title=f"{base.title}: transitions fired in this trace", edges=edges)
    dot = render_dot(diagram)
    for edge, original in zip(edges, base.edges):
        n = counts.get((original.event, original.source, original.dest), 0)
        line = edge_line(edge)
        extra = f", penwidth={1 + math.log10(n) * 1.5:.2f}" if n else ', style=dotted, color="#bdbdbd", fontcolor="#9e9e9e"'
        dot = dot.replace(line, line[:-2] + extra + "];", 1)
    return diagram, dot


def render(dot_source: str, fmt: str) -> bytes | None:
    """`dot_source` drawn as `fmt` ("svg" or "png"), or None when Graphviz `dot` is not installed."""
    import graphviz

    try:
        return graphviz.pipe("dot", fmt, dot_source.encode("utf-8"))
    except graphviz.ExecutableNotFound:
        return None
