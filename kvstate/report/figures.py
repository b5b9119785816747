"""The report's matplotlib figures (imported inside each function; Agg backend): the request timeline and the
tier occupancy. Each is saved as PNG and SVG.

Invariants kept: state names are drawn through `kvstate.diagrams.escape.mpl_text` (literally, no mathtext);
block and iteration axes have integer ticks only; the occupancy chart draws at most `MAX_COLUMNS` columns, each
the peak of `bin_size` consecutive iterations (one column per iteration when they fit), so no column is
narrower than a few pixels and nothing aliases into stripes; the timeline draws one collection per state (per
state and placement for a held state: on the GPU, split, offloaded) however many requests the trace has (linear in
spans: no artist per request, no autoscaling per span), and the time spent queued (the `queued` role) in a light
tint, so the states that hold KV stand out; the GPU tier's occupancy shows the blocks suspended requests hold
there apart from those computing requests lock; both figures are
`FIGURE_WIDTH` wide with their axes at the same `AXES_LEFT`/`AXES_RIGHT`, and are saved without cropping, so at
the same display width their iteration axes line up; a counterexample's violating step is shaded red in both,
named by its invariant, and the occupancy axis reaches above the capacity when that step owns more than it.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from kvstate.diagrams.escape import mpl_text
from kvstate.output_files import whole_file
from kvstate.pool import ceil_div
from kvstate.report.colors import (
    COLOR_KEY,
    DESTRUCTIVE_HATCH_COLOR,
    PLACEMENT_WORDS,
    PLACEMENTS,
    SHADES,
    hatched,
    placement_color,
    state_colors,
)
from kvstate.report.model import TraceSummary
from kvstate.roles import QUEUED
from kvstate.spec import Spec
from kvstate.terminal import inert

HELD_COLOR = SHADES["held"][0]  # the held residency's hue: blocks suspended requests hold
LOCKED_COLOR = SHADES["gpu"][0]  # the GPU residency's hue: blocks computing requests lock
FENCED_COLOR = "#ffb300"

MAX_LABELLED_ROWS = 60  # beyond this, every k-th request id is labelled
MAX_ID_LABEL = 32  # characters of a request id drawn as a row label
MAX_COLUMNS = 250  # occupancy columns drawn at most (about 4 px each at the saved size)
HATCH = "///"
FIGURE_WIDTH = 12.0  # inches, both figures
AXES_LEFT, AXES_RIGHT = 0.09, 0.80  # the axes' edges as fractions of the figure width, both figures
KEY_WIDTH = 150  # characters of the colour key on one line below the timeline (the figure holds about 180)
QUEUED_COLOR = "#f0f0f0"  # time spent queued: a light tint, not a bar as heavy as the states that hold KV


def id_label(request_id: object) -> str:
    """A request id as a row label: control characters and lone surrogates escaped (as `inert` writes them; a
    font cannot draw a surrogate), cut to `MAX_ID_LABEL` characters, drawn literally (`mpl_text`)."""
    text = inert(str(request_id))
    return mpl_text(text if len(text) <= MAX_ID_LABEL else text[: MAX_ID_LABEL - 1] + "…")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, out_dir: Path, stem: str) -> list[Path]:
    """`fig` written as `stem`.png and `stem`.svg, each whole or not at all (`whole_file`), then closed."""
    plt = _pyplot()
    paths = []
    try:
        for ext, extra in (("png", {"dpi": 110}), ("svg", {})):
            path = out_dir / f"{stem}.{ext}"
            with whole_file(path) as temporary:  # uncropped: axes line up
                fig.savefig(temporary, format=ext, metadata={"Date": None} if ext == "svg" else {}, **extra)
            paths.append(path)
    finally:
        plt.close(fig)
    return paths


def timeline(summary: TraceSummary, spec: Spec):
    """One row per request (first appearance at the top), coloured by lifecycle state over iterations (a held
    state's shade by where its KV is): one collection of rectangles per state and placement."""
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    plt = _pyplot()
    colors = state_colors(spec)
    queued = spec.state_by_role.get(QUEUED)
    if queued in colors:
        colors[queued] = QUEUED_COLOR
    n = len(summary.requests)
    height = min(max(3.0, 0.22 * n + 1.6), 24.0)
    fig = plt.figure(figsize=(FIGURE_WIDTH, height))
    ax = fig.add_axes((AXES_LEFT, 0.9 / height, AXES_RIGHT - AXES_LEFT, 1 - 1.5 / height))
    boxes: dict[tuple[str, str], list] = {}
    for row, rid in enumerate(summary.requests):
        for span in summary.spans[rid]:
            top, bottom = row - 0.4, row + 0.4
            boxes.setdefault((span.state, span.placement), []).append(
                ((span.start, top), (span.end, top), (span.end, bottom), (span.start, bottom))
            )
    for (state, where), rectangles in boxes.items():
        ax.add_collection(
            PolyCollection(
                rectangles,
                facecolors=placement_color(colors[state], where) if state in colors else "white",
                linewidths=0,
                hatch=HATCH if hatched(spec, state) else None,
                edgecolors=DESTRUCTIVE_HATCH_COLOR if hatched(spec, state) else "none",
            )
        )
    step = max(1, ceil_div(n, MAX_LABELLED_ROWS))
    ax.set_yticks(
        range(0, n, step), [id_label(summary.requests[i]) for i in range(0, n, step)], fontsize=8 if n > 30 else 9
    )
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlim(summary.first_iteration, summary.last_iteration + 1)
    mark_loop(ax, summary)
    mark_violation(ax, summary)
    ax.set_xlabel("scheduler iteration")
    ax.set_ylabel("request id")
    title = f"Request lifecycle over iterations ({n} requests, {summary.lines} transitions)"
    ax.set_title(title, pad=title_pad(summary))
    ax.grid(axis="x", alpha=0.3)
    integer_ticks(ax.xaxis)
    said = {"": "", **{where: f" ({words})" for where, words in PLACEMENT_WORDS.items()}}
    handles = [
        Patch(
            facecolor=placement_color(c, where),
            label=mpl_text(s + (" (light: queued)" if s == queued else said[where])),
            hatch=HATCH if hatched(spec, s) else None,
            edgecolor=DESTRUCTIVE_HATCH_COLOR if hatched(spec, s) else "#bdbdbd" if s == queued else c,
        )
        for s, c in colors.items()
        for where in ("", *PLACEMENTS)
        if (s, where) in boxes
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, title="state", frameon=False)
    key = textwrap.fill(f"{COLOR_KEY}; blank: not yet traced, or done", KEY_WIDTH)
    fig.text(0.01, 0.005, key, fontsize=8, color="#555555")
    return fig


LOOP_COLOR = "#ffe0b2"
LOOP_EDGE = "#e65100"


def mark_loop(ax, summary: TraceSummary) -> None:
    """Shade a counterexample's iterations that repeat forever, and say so at the top of the axes."""
    if summary.loop is None:
        return
    first, last = summary.loop
    ax.axvspan(first, last + 1, facecolor=LOOP_COLOR, edgecolor=LOOP_EDGE, linestyle="--", alpha=0.45, zorder=0)
    ax.text(
        (first + last + 1) / 2,
        1.0,
        "repeats forever (the lasso's loop)",
        transform=ax.get_xaxis_transform(),
        ha="center",
        va="bottom",
        fontsize=9,
        color=LOOP_EDGE,
    )


VIOLATION_COLOR = DESTRUCTIVE_HATCH_COLOR  # red: the step that violates an invariant


def mark_violation(ax, summary: TraceSummary) -> None:
    """Shade a counterexample's violating step in red and name the invariant it violates at the top of the axes."""
    violation = summary.violation
    if violation is None or violation.step is None:
        return
    step = violation.step
    ax.axvspan(step, step + 1, facecolor=VIOLATION_COLOR, alpha=0.18, linewidth=0, zorder=0)  # behind the bars
    ax.axvspan(step, step + 1, fill=False, edgecolor=VIOLATION_COLOR, linewidth=2, zorder=4)  # outlined above them
    ax.text(
        step + 0.5,
        1.0,
        mpl_text(f"{violation.invariant} violated (step {step})"),
        transform=ax.get_xaxis_transform(),
        ha="right" if step > (summary.first_iteration + summary.last_iteration) / 2 else "left",
        va="bottom",
        fontsize=9,
        fontweight="bold",
        color=VIOLATION_COLOR,
    )


def title_pad(summary: TraceSummary) -> float:
    """Points between an axes' top and its title: room for a loop's or a violation's label when there is one."""
    marked = summary.loop is not None or (summary.violation is not None and summary.violation.step is not None)
    return 18.0 if marked else 6.0


def integer_ticks(axis) -> None:
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def bin_size(iterations: int) -> int:
    """Consecutive iterations per occupancy column: 1 while they fit in `MAX_COLUMNS`."""
    return max(1, ceil_div(iterations, MAX_COLUMNS))


def binned_peaks(rows: list[dict[str, int]], tier: str, k: int) -> tuple[list[int], list[int], list[int]]:
    """(first iteration, peak owned, peak owned + fenced) of each run of `k` rows."""
    starts, owned = binned(rows, k, lambda r: r[f"{tier}_owned"])
    return starts, owned, binned(rows, k, lambda r: r[f"{tier}_owned"] + r[f"{tier}_fenced"])[1]


def binned(rows: list[dict[str, int]], k: int, value) -> tuple[list[int], list[int]]:
    """(first iteration, peak of `value(row)`) of each run of `k` rows."""
    starts, peaks = [], []
    for i in range(0, len(rows), k):
        chunk = rows[i : i + k]
        starts.append(chunk[0]["iteration"])
        peaks.append(max(value(r) for r in chunk))
    return starts, peaks


def occupancy(summary: TraceSummary):
    """GPU- and host-tier blocks owned by requests (on the GPU: locked by computing requests, held by suspended
    ones), fenced (copy in flight) and free after each iteration."""
    plt = _pyplot()
    rows = summary.occupancy
    has_host = any(r["host_capacity"] for r in rows)
    height = 6 if has_host else 3.4
    fig, axes = plt.subplots(2 if has_host else 1, 1, figsize=(FIGURE_WIDTH, height), sharex=True, squeeze=False)
    fig.subplots_adjust(left=AXES_LEFT, right=AXES_RIGHT, bottom=0.6 / height, top=1 - 0.45 / height)
    k = bin_size(len(rows))
    for ax, tier in zip(axes[:, 0], ("gpu", "host") if has_host else ("gpu",), strict=True):
        starts, owned, total = binned_peaks(rows, tier, k)
        capacity = max(r[f"{tier}_capacity"] for r in rows)
        edges = [*starts, starts[-1] + k]  # one step polygon per series: no seams between columns
        if tier == "gpu":  # locked by computing requests at the bottom, held by suspended ones above them
            locked = binned(rows, k, lambda r: r["gpu_owned"] - r["gpu_held"])[1]
            layers = [([0] * len(owned), locked, LOCKED_COLOR, "locked (computing)")]
            layers.append((locked, owned, placement_color(HELD_COLOR, "gpu"), "held (suspended)"))
        else:
            layers = [([0] * len(owned), owned, HELD_COLOR, "held (suspended)")]
        layers.append((owned, total, FENCED_COLOR, "fenced (copy in flight)"))
        for low, high, color, label in layers:
            ax.fill_between(edges, low + low[-1:], high + high[-1:], step="post", color=color, linewidth=0, label=label)
        ax.axhline(capacity, color="black", linewidth=1, linestyle="--", label=f"capacity {capacity}")
        top = max(capacity, *total)  # a counterexample's violating step may own more than the capacity
        ax.set_ylim(0, top * 1.08 if top else 1)
        ax.set_ylabel(f"{'GPU' if tier == 'gpu' else 'host'} tier blocks")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
        ax.grid(alpha=0.3)
        integer_ticks(ax.yaxis)
    integer_ticks(axes[-1, 0].xaxis)
    axes[-1, 0].set_xlim(rows[0]["iteration"], rows[-1]["iteration"] + 1)
    for ax in axes[:, 0]:
        mark_loop(ax, summary)
        mark_violation(ax, summary)
    when = "after each iteration" if k == 1 else f"peak of every {k} iterations"
    axes[0, 0].set_title(f"Tier occupancy, {when}" + ("" if has_host else " (no host tier)"), pad=title_pad(summary))
    axes[-1, 0].set_xlabel("scheduler iteration")
    return fig


def write_figures(summary: TraceSummary, spec: Spec, out_dir: Path) -> dict[str, list[Path]]:
    return {
        "timeline": save(timeline(summary, spec), out_dir, "timeline"),
        "occupancy": save(occupancy(summary), out_dir, "occupancy"),
    }
