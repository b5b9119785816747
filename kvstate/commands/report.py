"""`kvstate report TRACE [--out DIR]`: a visual report of an engine run from its lifecycle trace.

Writes a request timeline, tier occupancy, the lifecycle diagram annotated with firing counts (where Graphviz
is installed) and one self-contained HTML page. matplotlib is imported inside `_run`. While it reads the trace it says
how far it got (lines, and bytes against the file's size) and the most requests a report draws: on a terminal in
its status line, elsewhere as a line on stderr at most every `PROGRESS_EVERY_S` seconds.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable

from kvstate.commands.args import add_mkdir_option, add_spec_option, input_file, output_dir
from kvstate.extras import require
from kvstate.terminal import console, inert
from kvstate.untrusted import shown


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report",
        help="draw a run report (timeline, tier occupancy, annotated lifecycle diagram, HTML) from a trace",
        description=(
            "Read a lifecycle trace (NDJSON, spec/TRACE.md; write one with `kvstate demo --trace PATH`) and "
            "write timeline.png/.svg, occupancy.png/.svg, lifecycle.dot/.svg/.png (diagram with each edge's "
            "firing count; images need Graphviz) and report.html (self-contained)."
        ),
    )
    p.add_argument("trace", help="trace file (NDJSON)")
    p.add_argument("--out", default="kvstate-report", help="output directory (default %(default)s)")
    add_spec_option(p)
    p.add_argument(
        "--loop",
        type=iteration_span,
        default=None,
        metavar="FIRST:LAST",
        help="mark iterations FIRST..LAST as repeating forever (a counterexample's lasso; kvstate check prints it)",
    )
    p.add_argument(
        "--all-edges",
        action="store_true",
        help="draw every transition as its own arrow (default: a broadcast event is one arrow)",
    )
    add_mkdir_option(p)
    p.set_defaults(run=_run)


MAX_LOOP_ITERATION = 10**18  # a loop's last iteration at most (an iteration the figures can draw)
_ITERATION = re.compile(r"[0-9]+")  # ASCII digits only: str.isdigit also takes other scripts' digits


def iteration_span(text: str) -> tuple[int, int]:
    """`FIRST:LAST`, two iterations (ASCII digits) with FIRST <= LAST <= `MAX_LOOP_ITERATION`."""
    first, sep, last = text.partition(":")
    if not sep or not _ITERATION.fullmatch(first) or not _ITERATION.fullmatch(last):
        raise argparse.ArgumentTypeError(
            f"{shown(text, 40)} is not FIRST:LAST, two iteration numbers in ASCII digits (0-9)"
        )
    span = (MAX_LOOP_ITERATION + 1,) * 2 if max(len(first), len(last)) > 19 else (int(first), int(last))
    if span[0] > span[1] or span[1] > MAX_LOOP_ITERATION:
        raise argparse.ArgumentTypeError(
            f"{shown(text, 40)} is not FIRST:LAST with FIRST <= LAST <= {MAX_LOOP_ITERATION}"
        )
    return span


PROGRESS_EVERY_S = 5.0  # where stderr is not a terminal: a progress line at most this often


def _progress(status, trace) -> Callable[[str], None]:
    """The report's progress callback: the status line on a terminal; elsewhere (a log, a pipe) one line on stderr
    at most every `PROGRESS_EVERY_S` seconds, so a short report prints none and a long one says how far it got."""
    terminal, last = sys.stderr.isatty(), [time.monotonic()]

    def show(stage: str) -> None:
        status.update(inert(f"{trace}: {stage}"))
        now = time.monotonic()
        if not terminal and now - last[0] >= PROGRESS_EVERY_S:
            last[0] = now
            print(inert(f"kvstate report: {stage}"), file=sys.stderr, flush=True)

    return show


def _run(args: argparse.Namespace) -> int:
    trace = input_file(args.trace, "TRACE")
    out = output_dir(args.out, "--out", mkdir=args.mkdir)
    spec_path = input_file(args.spec, "--spec") if args.spec is not None else None
    require("matplotlib")  # the figures: before the trace is read

    from kvstate.report import write_report
    from kvstate.spec import load_spec

    spec = load_spec(spec_path) if spec_path is not None else None
    with console(stderr=True).status(inert(f"drawing the report of {trace} into {out}")) as status:  # a tty only
        result = write_report(
            trace,
            out,
            spec=spec,
            all_edges=args.all_edges,
            loop=args.loop,
            progress=_progress(status, trace),
        )
    s = result.summary
    print(
        f"kvstate report: {len(s.requests)} requests, {s.lines} transitions, iterations "
        f"{s.first_iteration}-{s.last_iteration}"
    )
    for path in result.files:
        print(inert(f"  {path}"))
    if result.note:
        print(inert(f"  note: {result.note}"))
    print(inert(f"open {result.html.resolve()}"))
    return 0
