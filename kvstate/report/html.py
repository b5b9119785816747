"""One self-contained HTML page: PNG figures embedded as base64, the lifecycle diagrams as inline SVG.

Invariants kept:
* every text from the trace or the spec is written through `kvstate.diagrams.escape.html_text`; every SVG
  through `safe_svg` (no link, script or event handler survives);
* a diagram opens fitted to its box's width (the viewport's), but never smaller than `MIN_SCALE` of its natural
  size (Graphviz points, `PX_PER_PT` px each), so an edge label of `kvstate.diagrams.dot.EDGE_FONT_SIZE` pt stays
  at least `MIN_LABEL_PX` px; it sits in a scrollable box with zoom buttons; the page's only script is that zoom,
  inline (nothing is fetched);
* no table has an empty row: the overview has no header row;
* a counterexample trace's violation (its header) is a red box above the overview, and the lines of its violating
  step a table whose out-of-range block counts are red cells;
* the colour key in the header is `kvstate.report.colors.COLOR_KEY`, the same words the timeline prints.
"""

from __future__ import annotations

import base64
from pathlib import Path

from kvstate.diagrams.dot import EDGE_FONT_SIZE
from kvstate.diagrams.escape import html_text, safe_svg
from kvstate.diagrams.ir import Diagram
from kvstate.report.colors import COLOR_KEY
from kvstate.report.model import TraceSummary

PX_PER_PT = 4 / 3
MIN_LABEL_PX = 11
MIN_SCALE = MIN_LABEL_PX * 1.005 / (EDGE_FONT_SIZE * PX_PER_PT)  # the smallest zoom a diagram opens at

STYLE = """body{font-family:Helvetica,Arial,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#212121}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em}table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:3px 10px;text-align:left;vertical-align:top}td.n{text-align:right}
img.figure{max-width:100%;height:auto}.note{color:#555;font-size:.9em}
.diagram{overflow:auto;max-height:85vh;border:1px solid #ccc;background:#fff;
 width:calc(100vw - 1.5em);position:relative;left:50%;transform:translateX(-50%)}
.diagram svg{display:block;max-width:none}
.zoom{margin:.4em 0}.zoom button{font-size:.9em;margin-right:.3em;padding:2px 10px}
.violation{border:2px solid #c62828;background:#ffebee;padding:.6em 1em;color:#b71c1c}
td.bad{color:#fff;background:#c62828;font-weight:bold}
.violating td,.violating th{padding:3px 5px;font-size:.85em}"""

ZOOM_SCRIPT = """document.querySelectorAll('.zoom').forEach(function (bar) {
  var box = document.getElementById(bar.getAttribute('data-target'));
  var svg = box.querySelector('svg');
  var box0 = svg.viewBox.baseVal, legible = parseFloat(bar.getAttribute('data-min-scale'));
  var scale = Math.max(legible, Math.min(1, box.clientWidth / (box0.width * 4 / 3)));
  function apply() {
    svg.setAttribute('width', (box0.width * scale).toFixed(1) + 'pt');
    svg.setAttribute('height', (box0.height * scale).toFixed(1) + 'pt');
  }
  apply();
  bar.addEventListener('click', function (event) {
    var action = event.target.getAttribute('data-zoom');
    if (!action) { return; }
    if (action === 'fit') { scale = box.clientWidth / (box0.width * 4 / 3); }
    else if (action === 'natural') { scale = 1; }
    else { scale *= parseFloat(action); }
    apply();
  });
});"""


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img class="figure" alt="{html_text(alt)}" src="data:image/png;base64,{data}">'


def _cell(value) -> str:
    if isinstance(value, int):
        return f'<td class="n">{value}</td>'
    return f"<td>{html_text(str(value))}</td>"


def _table(header: tuple[str, ...] | None, rows: list[tuple]) -> str:
    """A table; without `header`, no header row (never an empty one)."""
    head = "" if header is None else "<tr>" + "".join(f"<th>{html_text(h)}</th>" for h in header) + "</tr>"
    body = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def _diagram(svg: bytes, name: str, title: str) -> str:
    """`svg` sanitized, at natural size in a scroll box, with zoom buttons."""
    buttons = "".join(
        f'<button type="button" data-zoom="{z}">{label}</button>'
        for z, label in (("0.8", "−"), ("1.25", "+"), ("natural", "100 %"), ("fit", "fit width"))
    )
    return (
        f'<div class="zoom" data-target="diagram-{name}" data-min-scale="{MIN_SCALE:.4f}">zoom: {buttons}'
        '<span class="note"> (opens fitted to the width, as small as labels stay legible; scroll the box to pan)'
        "</span></div>"
        f'<div class="diagram" id="diagram-{name}" role="img" aria-label="{html_text(title)}">'
        f"{safe_svg(svg)}</div>"
    )


def violation_section(summary: TraceSummary) -> list[str]:
    """A counterexample's red box (the invariant, the violating step, the checker's message) and the lines of its
    violating step, each block count below 0 in a red cell; nothing for another trace."""
    violation = summary.violation
    if violation is None:
        return []
    where = f"at step {violation.step}" if violation.step is not None else "by a loop that repeats forever"
    box = (
        f'<div class="violation"><strong>Counterexample: invariant {html_text(violation.invariant)} violated '
        f"{where}</strong>: {html_text(violation.message)}</div>"
    )
    if not summary.violating_lines:
        return [box]
    fields = tuple(summary.violating_lines[0])
    head = "<tr>" + "".join(f"<th>{html_text(f)}</th>" for f in fields) + "</tr>"
    rows = []
    for line in summary.violating_lines:
        bad = summary.out_of_range(line)
        cells = [
            f'<td class="n bad">{line[f]}</td>' if f in bad else _cell("null" if line[f] is None else line[f])
            for f in fields
        ]
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return [
        box,
        f"<h2>The violating step ({violation.step}): its trace lines, counts out of range in red</h2>",
        f'<div class="violating" style="overflow-x:auto"><table>{head}{"".join(rows)}</table></div>',
    ]


def reviewer_rows(diagram: Diagram) -> list[tuple]:
    """Per event: who decides it, its edges, the output list it feeds and the production engine's terms."""
    rows = []
    for first in diagram.event_edges:
        edges = [e for e in diagram.edges if e.event == first.event]
        moves = "; ".join(f"{e.source} → {e.dest}" + (f" [{e.guard}]" if e.guard else "") for e in edges)
        feeds = (
            f"{first.feeds} ({first.feeds_production_name})" if first.feeds_production_name else (first.feeds or "—")
        )
        rows.append((first.event_label, first.origin, moves, feeds, first.production_name or "—"))
    return rows


def render_html(
    summary: TraceSummary,
    trace_name: str,
    pngs: dict[str, Path],
    svgs: dict[str, bytes | None],
    diagram: Diagram,
    note: str = "",
) -> str:
    """The page. `svgs` holds the drawings "lifecycle" (annotated with counts) and "review" (None: skipped)."""
    peak_gpu = max(r["gpu_owned"] + r["gpu_fenced"] for r in summary.occupancy)
    peak_held = max(r["gpu_held"] for r in summary.occupancy)
    peak_host = max(r["host_owned"] + r["host_fenced"] for r in summary.occupancy)
    last = summary.occupancy[-1]
    overview = [
        ("trace", trace_name),
        ("requests", len(summary.requests)),
        ("transitions", summary.lines),
        ("iterations", f"{summary.first_iteration}–{summary.last_iteration}"),
        ("GPU tier", f"{last['gpu_capacity']} blocks, peak in use {peak_gpu}, by suspended requests {peak_held}"),
        ("host tier", f"{last['host_capacity']} blocks, peak in use {peak_host}" if last["host_capacity"] else "none"),
    ]
    overview += [(f"done: {reason}", n) for reason, n in sorted(summary.done_reasons.items())]
    events = sorted(summary.edge_counts.items(), key=lambda kv: -kv[1])
    skipped = f'<p class="note">{html_text(note)}</p>'
    lifecycle_svg, review_svg = svgs.get("lifecycle"), svgs.get("review")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>kvstate report: {html_text(trace_name)}</title><style>{STYLE}</style></head><body>",
        f"<h1>kvstate run report: {html_text(trace_name)}</h1>",
        (
            '<p class="note">Generated by <code>kvstate report</code> from a lifecycle trace (spec/TRACE.md). '
            f"State colours follow the lifecycle diagram: {html_text(COLOR_KEY)}.</p>"
        ),
        *violation_section(summary),
        "<h2>Overview</h2>",
        _table(None, overview),
        "<h2>Timeline</h2>",
        _img(pngs["timeline"], "request timeline"),
        "<h2>Tier occupancy</h2>",
        _img(pngs["occupancy"], "tier occupancy"),
        "<h2>Lifecycle diagram, edges annotated with how often they fired</h2>",
        _diagram(lifecycle_svg, "lifecycle", "lifecycle diagram") if lifecycle_svg else skipped,
        "<h2>Reviewer view: who decides each edge, which output list it feeds</h2>",
        _diagram(review_svg, "review", "reviewer view") if review_svg else skipped,
        _table(
            ("event", "decided by", "edges", "feeds output list (production name)", "production engine's term"),
            reviewer_rows(diagram),
        ),
        "<h2>Transitions fired</h2>",
        _table(("event", "from", "to", "count"), [(*k, n) for k, n in events]),
        f"<script>{ZOOM_SCRIPT}</script>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"
