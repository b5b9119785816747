"""The output options of the commands that run the engine (`kvstate demo`, `kvstate soak`): nothing is written
unless asked. `--trace PATH` writes the lifecycle trace (spec/TRACE.md); `--report DIR` writes a visual run report
of it (`kvstate report`), and the trace into DIR (`REPORT_TRACE`) unless `--trace` names another file; `--mkdir`
creates missing parent directories. The paths are checked before torch is imported (`kvstate.commands.args`: the
parent of each must exist, or `--mkdir`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvstate.commands.args import add_mkdir_option, output_dir, output_file

REPORT_TRACE = "trace.ndjson"  # the trace's name inside --report DIR when --trace names none


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """`--trace PATH`, `--report DIR` and `--mkdir`."""
    parser.add_argument(
        "--trace", metavar="PATH", default=None, help="write the lifecycle trace to this file, NDJSON (spec/TRACE.md)"
    )
    parser.add_argument(
        "--report",
        metavar="DIR",
        default=None,
        help=(
            "also write a visual run report of the trace (timeline, occupancy, diagram, HTML) into DIR, and the "
            f"trace as DIR/{REPORT_TRACE} unless --trace names a file"
        ),
    )
    add_mkdir_option(parser)


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse an unwritable `--trace` or `--report` (one usage error naming it); a report without `--trace` gets
    its trace path in the report's directory."""
    if args.report is not None:
        output_dir(args.report, "--report", mkdir=args.mkdir)
    if args.trace is not None:
        output_file(args.trace, "--trace", mkdir=args.mkdir)
    elif args.report is not None:
        args.trace = str(Path(args.report) / REPORT_TRACE)


def prepare_outputs(args: argparse.Namespace) -> None:
    """Create the report's directory before the run, so that a trace inside it can be opened (its parent exists:
    `check_outputs`)."""
    if args.report is not None:
        Path(args.report).mkdir(exist_ok=True)
