"""`kvstate validate TRACE`: check a lifecycle trace (spec/TRACE.md) against the specification.

Exit codes: 0 the trace is valid, 1 it diverges from the spec (the first divergent line is printed: line number,
request, expected vs observed state, the rule and its invariant id), 2 the trace or spec cannot be read.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvstate.checker.trace import TraceReport, validate_trace
from kvstate.spec import load_spec


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "validate", help="check a lifecycle trace (NDJSON) against the spec",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("trace", metavar="TRACE", type=Path, help="trace file written by the engine (NDJSON)")
    parser.add_argument("--spec", metavar="PATH", type=Path, default=None, help="spec TOML file (default: packaged)")
    parser.add_argument("--require-done", action=argparse.BooleanOptionalAction, default=True,
                        help="require every request to end in a terminal state (default: on)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    report = validate_trace(args.trace, spec, require_done=args.require_done)
    console = Console(highlight=False, soft_wrap=True)
    if report.divergence is not None:
        console.print(f"[bold red]INVALID[/] {report.source}")
        console.print(report.divergence.describe(), markup=False)
        return 1
    console.print(summary(report))
    return 0


def summary(report: TraceReport) -> Table:
    """A short table: lines, requests and transitions per event of a valid trace."""
    table = Table(title=f"VALID {report.source}: {report.lines} lines, {report.requests} requests",
                  title_justify="left", show_edge=False)
    table.add_column("event")
    table.add_column("transitions", justify="right")
    for event, count in report.transitions.items():
        table.add_row(event, str(count))
    return table
