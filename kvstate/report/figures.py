"""The report's matplotlib figures (imported inside each function; Agg backend): the request timeline and the
tier occupancy. Each is saved as PNG and SVG.

Invariants kept: state names are drawn through `kvstate.diagrams.escape.mpl_text` (literally, no mathtext);
block and iteration axes have integer ticks only; the occupancy chart draws at most `MAX_COLUMNS` columns, each
the peak of `bin_size` consecutive iterations (one column per iteration when they fit), so no column is
narrower than a few pixels and nothing aliases into stripes.
"""

from __future__ import annotations

from pathlib import Path

from kvstate.diagrams.escape import mpl_text
from kvstate.pool import ceil_div
from kvstate.report.colors import COLOR_KEY, DESTRUCTIVE_HATCH_COLOR, hatched, state_colors
from kvstate.report.model import TraceSummary
from kvstate.spec import Spec

MAX_LABELLED_ROWS = 60  # beyond this, every k-th request id is labelled
MAX_COLUMNS = 250  # occupancy columns drawn at most (about 4 px each at the saved size)
HATCH = "///"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, out_dir: Path, stem: str) -> list[Path]:
    plt = _pyplot()
    paths = []
    for ext, extra in (("png", {"dpi": 110}), ("svg", {})):
        path = out_dir / f"{stem}.{ext}"
        fig.savefig(path, bbox_inches="tight", metadata={"Date": None} if ext == "svg" else {}, **extra)
        paths.append(path)
    plt.close(fig)
    return paths


def timeline(summary: TraceSummary, spec: Spec):
    """One row per request (first appearance at the top), coloured by lifecycle state over iterations."""
    from matplotlib.patches import Patch

    plt = _pyplot()
    colors = state_colors(spec)
    n = len(summary.requests)
    height = min(max(3.0, 0.22 * n + 1.6), 24.0)
    fig, ax = plt.subplots(figsize=(12, height))
    for row, rid in enumerate(summary.requests):
        for span in summary.spans[rid]:
            ax.broken_barh(
                [(span.start, span.end - span.start)],
                (row - 0.4, 0.8),
                facecolors=colors.get(span.state, "white"),
                linewidth=0,
                hatch=HATCH if hatched(spec, span.state) else None,
                edgecolor=DESTRUCTIVE_HATCH_COLOR if hatched(spec, span.state) else None,
            )
    step = max(1, ceil_div(n, MAX_LABELLED_ROWS))
    ax.set_yticks(
        range(0, n, step), [mpl_text(str(summary.requests[i])) for i in range(0, n, step)], fontsize=8 if n > 30 else 9
    )
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlim(summary.first_iteration, summary.last_iteration + 1)
    ax.set_xlabel("scheduler iteration")
    ax.set_ylabel("request id")
    ax.set_title(f"Request lifecycle over iterations ({n} requests, {summary.lines} transitions)")
    ax.grid(axis="x", alpha=0.3)
    integer_ticks(ax.xaxis)
    handles = [
        Patch(
            facecolor=c,
            label=mpl_text(s),
            hatch=HATCH if hatched(spec, s) else None,
            edgecolor=DESTRUCTIVE_HATCH_COLOR if hatched(spec, s) else c,
        )
        for s, c in colors.items()
        if any(sp.state == s for spans in summary.spans.values() for sp in spans)
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, title="state", frameon=False)
    fig.text(0.01, 0.005, f"{COLOR_KEY}; blank: not yet traced, or done", fontsize=8, color="#555555")
    return fig


def integer_ticks(axis) -> None:
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def bin_size(iterations: int) -> int:
    """Consecutive iterations per occupancy column: 1 while they fit in `MAX_COLUMNS`."""
    return max(1, ceil_div(iterations, MAX_COLUMNS))


def binned_peaks(rows: list[dict[str, int]], tier: str, k: int) -> tuple[list[int], list[int], list[int]]:
    """(first iteration, peak held, peak held + fenced) of each run of `k` rows."""
    starts, held, total = [], [], []
    for i in range(0, len(rows), k):
        chunk = rows[i : i + k]
        starts.append(chunk[0]["iteration"])
        held.append(max(r[f"{tier}_held"] for r in chunk))
        total.append(max(r[f"{tier}_held"] + r[f"{tier}_fenced"] for r in chunk))
    return starts, held, total


def occupancy(summary: TraceSummary):
    """GPU- and host-tier blocks held, fenced (copy in flight) and free after each iteration."""
    plt = _pyplot()
    rows = summary.occupancy
    has_host = any(r["host_capacity"] for r in rows)
    fig, axes = plt.subplots(2 if has_host else 1, 1, figsize=(12, 6 if has_host else 3.4), sharex=True, squeeze=False)
    k = bin_size(len(rows))
    palette = {"gpu": ("#2e7d32", "#ffb300"), "host": ("#1565c0", "#ffb300")}
    for ax, tier in zip(axes[:, 0], ("gpu", "host") if has_host else ("gpu",), strict=True):
        starts, held, total = binned_peaks(rows, tier, k)
        capacity = max(r[f"{tier}_capacity"] for r in rows)
        edges = [*starts, starts[-1] + k]  # one step polygon per series: no seams between columns
        ax.fill_between(
            edges, held + held[-1:], step="post", color=palette[tier][0], linewidth=0, label="held by requests"
        )
        ax.fill_between(
            edges,
            held + held[-1:],
            total + total[-1:],
            step="post",
            color=palette[tier][1],
            linewidth=0,
            label="fenced (copy in flight)",
        )
        ax.axhline(capacity, color="black", linewidth=1, linestyle="--", label=f"capacity {capacity}")
        ax.set_ylim(0, capacity * 1.08 if capacity else 1)
        ax.set_ylabel(f"{'GPU' if tier == 'gpu' else 'host'} tier blocks")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
        ax.grid(alpha=0.3)
        integer_ticks(ax.yaxis)
    integer_ticks(axes[-1, 0].xaxis)
    axes[-1, 0].set_xlim(rows[0]["iteration"], rows[-1]["iteration"] + 1)
    when = "after each iteration" if k == 1 else f"peak of every {k} iterations"
    axes[0, 0].set_title(f"Tier occupancy, {when}" + ("" if has_host else " (no host tier)"))
    axes[-1, 0].set_xlabel("scheduler iteration")
    return fig


def write_figures(summary: TraceSummary, spec: Spec, out_dir: Path) -> dict[str, list[Path]]:
    return {
        "timeline": save(timeline(summary, spec), out_dir, "timeline"),
        "occupancy": save(occupancy(summary), out_dir, "occupancy"),
    }
