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

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvstate.diagrams import DOT_MISSING
from kvstate.output_files import write_whole
from kvstate.report.model import MAX_REPORT_REQUESTS, TraceError, TraceSummary, load_lines, summarize
from kvstate.spec import Spec, default_spec
from kvstate.trace import read_header


@dataclass(frozen=True, slots=True)
class ReportFiles:
    """What `write_report` wrote: every file (`html`, the page, among them); `note` explains a skipped image."""

    out_dir: Path
    files: tuple[Path, ...]
    html: Path
    summary: TraceSummary
    note: str = ""


def write_report(
    trace: str | Path,
    out_dir: str | Path,
    *,
    spec: Spec | None = None,
    all_edges: bool = False,
    loop: tuple[int, int] | None = None,
    progress: Callable[[str], None] | None = None,
) -> ReportFiles:
    """Read `trace`, write every report file into `out_dir` (created), and return what was written.

        `all_edges` draws every transition as its own arrow (default: broadcast events bundled); `loop` (first, last
        iteration) marks the part of a counterexample that repeats forever (`kvstate check` writes such traces); a
        counterexample trace's violating step is marked in red with its invariant (the trace's header, spec/TRACE.md);
        `progress` is told what is being done, stage by stage (reading the trace every `PROGRESS_LINES` lines: lines and
    bytes read against the file's size, and the caps a report keeps, `reading_progress`). Every
        stage is linear in the trace's lines. Each file is written whole or not at all (`kvstate.output_files`)."""
    from kvstate.report.diagram import annotated_diagram, render, review_dot
    from kvstate.report.figures import write_figures
    from kvstate.report.html import render_html

    spec = spec or default_spec()
    say = progress or (lambda _: None)
    try:
        violation = read_header(trace)
        lines = load_lines(trace, reading_progress(trace, say), every=PROGRESS_LINES)
        summary = summarize(lines, loop=loop, spec=spec, violation=violation)
    except TraceError as err:  # one found while summarizing: named with the trace it is in
        if err.path is not None:
            raise
        raise TraceError(err.detail, path=trace) from None
    unknown = sorted(set(summary.edge_counts) - {(t.event, t.source, t.dest) for t in spec.transitions})
    if unknown:
        raise TraceError(
            f"trace {trace} has transitions the spec does not define, e.g. {unknown[:3]}; "
            "report it against the spec that produced it (--spec)"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    say(f"drawing the timeline of {len(summary.requests)} requests and the tier occupancy")
    figures = write_figures(summary, spec, out)
    say("drawing the lifecycle diagrams")
    files = [path for paths in figures.values() for path in paths]
    diagram, dot = annotated_diagram(spec, summary.edge_counts, all_edges=all_edges)
    review = review_dot(spec, all_edges=all_edges)
    for name, text in (("lifecycle.dot", dot), ("lifecycle-review.dot", review)):
        files.append(write_whole(out / name, text))
    svg = render(dot, "svg")  # None: no Graphviz, and every image below is skipped
    images = {
        "lifecycle.svg": svg,
        "lifecycle.png": render(dot, "png") if svg is not None else None,
        "lifecycle-review.svg": render(review, "svg") if svg is not None else None,
    }
    for name, data in images.items():
        if data is not None:
            files.append(write_whole(out / name, data))
    note = "" if svg is not None else f"lifecycle diagram images skipped: {DOT_MISSING}"
    pngs = {name: paths[0] for name, paths in figures.items()}
    page = render_html(
        summary, Path(trace).name, pngs, {"lifecycle": svg, "review": images["lifecycle-review.svg"]}, diagram, note
    )
    html = out / "report.html"
    write_whole(html, page)
    say(f"wrote {html}")
    return ReportFiles(out, (*files, html), html, summary, note)


PROGRESS_LINES = 100_000  # lines read between two progress reports


def reading_progress(trace: str | Path, say: Callable[[str], None]) -> Callable[[int, int], None]:
    """A `read_trace` progress callback that tells `say` the lines and bytes read against the file's size, and the
    caps a report keeps (`MAX_REPORT_REQUESTS`; a trace past it is refused when its first request past it
    appears)."""
    try:
        total = Path(trace).stat().st_size
    except OSError:  # reading the trace then fails with its own error
        total = 0

    def tell(lines: int, read: int) -> None:
        share = f" ({100 * read // total}%)" if total else ""
        say(
            f"reading the trace: {lines:,} lines, {_megabytes(read)} of {_megabytes(total)}{share}; a report "
            f"draws at most {MAX_REPORT_REQUESTS:,} requests"
        )

    return tell


def _megabytes(count: int) -> str:
    return f"{count / 1e6:,.1f} MB"


__all__ = ["ReportFiles", "TraceError", "TraceSummary", "summarize", "write_report"]
