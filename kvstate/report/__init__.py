"""`kvstate report`: a visual run report from a lifecycle trace (spec/TRACE.md).

`write_report(trace, out_dir)` writes `timeline.png/.svg` (one row per request, coloured by state over
iterations), `occupancy.png/.svg` (GPU and host tier blocks over iterations), `lifecycle.dot` and
`lifecycle-review.dot` and, where Graphviz `dot` is installed, `lifecycle.svg/.png` (the spec's diagram with
each edge's firing count) and `lifecycle-review.svg` (who decides each edge, which output list it feeds), and
`report.html`, one self-contained page holding all of them (diagrams inline at natural size, sanitized).
Modules: `model` (trace -> spans, occupancy, counts; pure), `colors`, `figures` (matplotlib, imported
lazily), `diagram`, `html`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvstate.diagrams import DOT_MISSING
from kvstate.report.model import TraceError, TraceSummary, load_lines, summarize
from kvstate.spec import Spec, load_spec


@dataclass
class ReportFiles:
    """What `write_report` wrote; `note` explains a skipped image (no Graphviz)."""

    out_dir: Path
    files: list[Path] = field(default_factory=list)
    html: Path | None = None
    summary: TraceSummary | None = None
    note: str = ""


def write_report(trace: str | Path, out_dir: str | Path, *, spec: Spec | None = None,
                 all_edges: bool = False) -> ReportFiles:
    """Read `trace`, write every report file into `out_dir` (created), and return what was written.

    `all_edges` draws every transition as its own arrow (default: broadcast events bundled)."""
    from kvstate.report.diagram import annotated_diagram, render, review_dot
    from kvstate.report.figures import write_figures
    from kvstate.report.html import render_html

    spec = spec or load_spec()
    summary = summarize(load_lines(trace))
    unknown = sorted({k for k in summary.edge_counts} - {(t.event, t.source, t.dest) for t in spec.transitions})
    if unknown:
        raise TraceError(f"trace {trace} has transitions the spec does not define, e.g. {unknown[:3]}; "
                         "report it against the spec that produced it (--spec)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = ReportFiles(out, summary=summary)
    figures = write_figures(summary, spec, out)
    for paths in figures.values():
        result.files += paths
    diagram, dot = annotated_diagram(spec, summary.edge_counts, all_edges=all_edges)
    review = review_dot(spec, all_edges=all_edges)
    for name, text in (("lifecycle.dot", dot), ("lifecycle-review.dot", review)):
        (out / name).write_text(text, encoding="utf-8")
        result.files.append(out / name)
    svg = render(dot, "svg")
    review_svg = None
    if svg is None:
        result.note = f"lifecycle diagram images skipped: {DOT_MISSING}"
    else:
        review_svg = render(review, "svg")
        for name, data in (("lifecycle.svg", svg), ("lifecycle.png", render(dot, "png")),
                           ("lifecycle-review.svg", review_svg)):
            (out / name).write_bytes(data)
            result.files.append(out / name)
    pngs = {name: paths[0] for name, paths in figures.items()}
    result.html = out / "report.html"
    page = render_html(summary, Path(trace).name, pngs, {"lifecycle": svg, "review": review_svg}, diagram,
                       result.note)
    result.html.write_text(page, encoding="utf-8")
    result.files.append(result.html)
    return result


__all__ = ["ReportFiles", "TraceError", "TraceSummary", "summarize", "write_report"]
