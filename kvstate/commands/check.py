"""`kvstate check`: model-check the spec on named bounds and check the real scheduler refines it.

Exit codes: 0 every bound holds, 1 a violation was found (its counterexample is printed and written as a pytest
regression test), 2 a search was cut short by --max-states or --time-limit (incomplete, never 'holds').
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from kvstate.checker.bounds import select_bounds
from kvstate.checker.runner import run_check
from kvstate.spec import load_spec


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check", help="model-check the spec on bounded instances and the scheduler's refinement of it",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--spec", metavar="PATH", type=Path, default=None, help="spec TOML file (default: packaged)")
    parser.add_argument("--bounds-file", metavar="PATH", type=Path, default=None,
                        help="bounds TOML file (default: the packaged spec/bounds.toml)")
    parser.add_argument("--bound", metavar="NAME", action="append", default=None,
                        help="a bound to check (repeatable; default: the file's default set)")
    parser.add_argument("--max-states", metavar="N", type=int, default=None,
                        help="stop each search after N states (verdict incomplete)")
    parser.add_argument("--time-limit", metavar="S", type=float, default=None,
                        help="stop each bound's search after S seconds (verdict incomplete)")
    parser.add_argument("--counterexample-dir", metavar="DIR", type=Path, default=Path("."),
                        help="where a counterexample regression test is written (default: .)")
    parser.add_argument("--no-refinement", action="store_true", help="check the abstract model only")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    bounds = select_bounds(args.bound, args.bounds_file)
    spec = load_spec(args.spec)
    console = Console(highlight=False, soft_wrap=True)
    code, _ = run_check(bounds, spec=spec, max_states=args.max_states, time_limit=args.time_limit,
                        counterexample_dir=args.counterexample_dir, console=console,
                        show_progress=sys.stderr.isatty(), refine=not args.no_refinement)
    return code
