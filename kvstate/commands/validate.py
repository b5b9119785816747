"""`kvstate validate TRACE`: check a lifecycle trace (spec/TRACE.md) against the specification.

Exit codes: 0 the trace is valid; 1 it diverges from the spec (the first divergent line is printed: line number,
request, expected vs observed state, the rule and its invariant id); 2 the input is unusable: the trace cannot be
read, is empty, or a line is not a trace line (malformed JSON, a missing or mistyped field, a line or file over the
reader's limits: rule `format`, printed as UNUSABLE with its line), or the spec cannot be read. A last line cut
mid-write (no newline, not a whole line) is reported as torn, and the lines before it are validated as a trace.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from kvstate.commands.args import add_spec_option
from kvstate.terminal import cell, console, inert, say

if TYPE_CHECKING:  # the checker and rich are imported when the command runs: `kvstate --help` stays fast
    from rich.table import Table

    from kvstate.checker.trace import TraceReport


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "validate",
        help="check a lifecycle trace (NDJSON) against the spec",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("trace", metavar="TRACE", type=Path, help="trace file written by the engine (NDJSON)")
    add_spec_option(parser)
    parser.add_argument(
        "--require-done",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="require every request to end in a terminal state (default: on)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvstate.checker.trace import FORMAT, TraceError, validate_trace
    from kvstate.spec import load_spec

    spec = load_spec(args.spec)
    with console(stderr=True).status(inert(f"validating {args.trace}")) as status:  # on a terminal only
        report = validate_trace(
            args.trace,
            spec,
            require_done=args.require_done,
            progress=lambda lines: status.update(inert(f"validating {args.trace}: {lines} lines")),
        )
    out = console()
    if report.torn_line is not None:
        say(
            out,
            ("note", "yellow"),
            f": line {report.torn_line}, the last, is torn (the file ends mid-line: its writer stopped mid-write, "
            f"on a full disk say); the {report.lines} lines before it were validated",
        )
    if report.divergence is not None:
        unusable = report.divergence.rule == FORMAT
        verdict = "UNUSABLE" if unusable else "INVALID"
        say(
            out,
            (verdict, "bold red"),
            " (not a trace in the format of spec/TRACE.md) " if unusable else " ",
            report.source,
        )
        for line in report.divergence.describe().splitlines():
            say(out, line)
        return 2 if unusable else 1
    if report.lines == 0:
        what = "holds only a torn line" if report.torn_line is not None else "is empty"
        raise TraceError(
            f"the trace {what}, so nothing was validated; pass a trace written by a run that had at least one request",
            path=report.source,
        )
    say(out, ("VALID", "bold green"), f" {report.source}: {report.lines} lines, {report.requests} requests")
    out.print(summary(report))
    return 0


def summary(report: TraceReport) -> Table:
    """A short table: the transitions per event of a valid trace."""
    from rich.table import Table

    table = Table(show_edge=False)
    table.add_column("event")
    table.add_column("transitions", justify="right")
    for event, count in report.transitions.items():
        table.add_row(cell(event), str(count))
    return table
