"""`kvstate check`: model-check the spec on named bounds and check the real scheduler refines it.

Exit codes:
  0  holds: every bound was searched completely and no invariant or refinement check failed
  1  violated: a counterexample was found (printed, and written as a pytest regression test)
  2  unusable input: a bad option, an unreadable or invalid spec or bounds file, an unknown bound
  3  incomplete: a search was cut short by --max-states or --time-limit (never reported as 'holds')
"""

from __future__ import annotations

import argparse
import os
import sys

from kvstate.commands.args import UsageError, input_file, output_dir, positive_float, positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check",
        help="model-check the spec on bounded instances and the scheduler's refinement of it",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--spec", metavar="PATH", default=None, help="spec TOML file (default: packaged)")
    parser.add_argument(
        "--bounds-file", metavar="PATH", default=None, help="bounds TOML file (default: the packaged spec/bounds.toml)"
    )
    parser.add_argument(
        "--bound",
        metavar="NAME",
        action="append",
        default=None,
        help="a bound to check (repeatable; default: the file's default set)",
    )
    parser.add_argument(
        "--max-states",
        metavar="N",
        type=positive_int(),
        default=None,
        help="stop each search after N states (verdict incomplete)",
    )
    parser.add_argument(
        "--time-limit",
        metavar="S",
        type=positive_float,
        default=None,
        help="stop each bound's search after S seconds (verdict incomplete)",
    )
    parser.add_argument(
        "--counterexample-dir",
        metavar="DIR",
        default=".",
        help="where a counterexample regression test is written (default: .)",
    )
    parser.add_argument(
        "--sweep",
        metavar="NAME",
        default=None,
        help="check every configuration of the sweep NAME of the bounds file ([sweeps.NAME]) instead of bounds, "
        "with a progress bar and a summary table of configurations x verdicts",
    )
    parser.add_argument(
        "--workers",
        metavar="N",
        type=positive_int(),
        default=None,
        help="processes a sweep runs on (default: the CPUs this process may use)",
    )
    parser.add_argument("--no-refinement", action="store_true", help="check the abstract model only")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also list, per bound, the transitions it never enables, its progress-free cycles and the abstract "
        "model's weakly fair lasso (information, not warnings)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec_path = input_file(args.spec, "--spec") if args.spec is not None else None
    bounds_path = input_file(args.bounds_file, "--bounds-file") if args.bounds_file is not None else None
    counterexample_dir = output_dir(args.counterexample_dir, "--counterexample-dir")
    if args.sweep is not None and args.bound:
        raise UsageError("--sweep and --bound exclude each other: a sweep names its own bounds; give one of them")

    from rich.console import Console

    from kvstate.checker.bounds import select_bounds
    from kvstate.checker.runner import run_check
    from kvstate.spec import load_spec

    console = Console(highlight=False, soft_wrap=True)
    if args.sweep is not None:
        return _sweep(args, spec_path, bounds_path, counterexample_dir, console)
    bounds = select_bounds(args.bound, bounds_path)
    spec = load_spec(spec_path)
    code, _ = run_check(
        bounds,
        spec=spec,
        max_states=args.max_states,
        time_limit=args.time_limit,
        counterexample_dir=counterexample_dir,
        console=console,
        show_progress=sys.stderr.isatty(),
        refine=not args.no_refinement,
        verbose=args.verbose,
    )
    return code


def _sweep(args: argparse.Namespace, spec_path, bounds_path, counterexample_dir, console) -> int:
    """`kvstate check --sweep NAME`: every configuration of the sweep, then its summary table."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from kvstate.checker.runner import EXIT_CODES
    from kvstate.checker.sweep import run_sweep, select_sweep

    sweep = select_sweep(args.sweep, bounds_path)
    workers = args.workers or max(1, len(os.sched_getaffinity(0)))
    total = len(sweep.bounds())
    say = lambda text: console.print(text, markup=False, highlight=False)  # noqa: E731 - file names hold brackets
    say(f"kvstate check: sweep {sweep.name} of {bounds_path or 'the packaged bounds'}: {total} configurations")
    with Progress(
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not sys.stderr.isatty(),
    ) as bar:
        task = bar.add_task("configurations", total=total)
        report = run_sweep(
            sweep,
            spec_path=None if spec_path is None else str(spec_path),
            workers=workers,
            max_states=args.max_states,
            counterexample_dir=counterexample_dir,
            progress=lambda done, _: bar.update(task, completed=done),
        )
    for line in report.lines():
        say(line)
    code = EXIT_CODES[report.verdict]
    say(f"verdict: {report.verdict} ({len(report.outcomes)} configurations, exit {code})")
    return code
