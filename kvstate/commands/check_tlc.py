"""`kvstate check --engine tlc`: the options it adds to `kvstate check` and the run they select.

With `--engine tlc` the command cross-checks the abstract model: TLC (the field's standard model checker) and our
checker enumerate it for each bound, and the command prints both results side by side (`kvstate.tla.crosscheck`).
Exit codes as for `kvstate check`: 0 both engines agree and every invariant holds; 1 the engines disagree (counts,
depth, verdict, invariant or counterexample length: both numbers printed) or agree that an invariant is violated;
2 unusable input, or no Java or tla2tools.jar (one line says what to install); 3 a search was cut by --time-limit.
"""

from __future__ import annotations

import argparse

from kvstate.commands.args import UsageError, input_file, output_dir
from kvstate.terminal import inert

ENGINES = ("kvstate", "tlc")


def register_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default=ENGINES[0],
        help="kvstate: our checker (default); tlc: run TLC on the exported TLA+ beside our checker and compare "
        "distinct states, depth and verdicts per bound (abstract model only; needs Java and tla2tools.jar)",
    )
    parser.add_argument(
        "--no-symmetry",
        action="store_true",
        help="with --engine tlc: both engines without the symmetry reduction over requests of equal parameters",
    )
    parser.add_argument(
        "--liveness",
        action="store_true",
        help="with --engine tlc: also run TLC's LIVE_DONE check (per-action weak fairness, no symmetry); printed "
        "beside ours, not compared (the engines judge different liveness properties)",
    )


def refuse_tlc_options(args: argparse.Namespace) -> None:
    """The options of --engine tlc are refused with our engine (one line, exit 2)."""
    for option, given in (("--no-symmetry", args.no_symmetry), ("--liveness", args.liveness)):
        if given:
            raise UsageError(f"{option} applies to --engine tlc only; add --engine tlc or drop it")


def run(args: argparse.Namespace, *, max_states_given: bool) -> int:
    """`kvstate check --engine tlc` (the other options of `kvstate check` as they apply to the cross-check;
    `max_states_given`: --max-states was set to other than its default, which TLC has no counterpart of)."""
    for option, given in (("--max-states", max_states_given), ("--no-refinement", args.no_refinement)):
        if given:
            raise UsageError(f"{option} does not apply to --engine tlc (it compares the abstract model); drop it")
    spec_path = input_file(args.spec, "--spec") if args.spec is not None else None
    bounds_path = input_file(args.bounds_file, "--bounds-file") if args.bounds_file is not None else None
    counterexample_dir = output_dir(args.counterexample_dir, "--counterexample-dir", mkdir=args.mkdir)

    from kvstate.checker.bounds import select_bounds
    from kvstate.spec import load_spec
    from kvstate.tla.crosscheck import Options, cross_check
    from kvstate.tla.tlc import find_tools

    bounds = select_bounds(args.bound, bounds_path)
    spec = load_spec(spec_path)
    tools = find_tools()  # before any work: without Java or the jar, one line and exit 2
    options = Options(
        symmetry=not args.no_symmetry,
        liveness=args.liveness,
        time_limit=args.time_limit,
        counterexample_dir=counterexample_dir,
    )
    code, _ = cross_check(bounds, spec, options, say=lambda line: print(inert(line), flush=True), tools=tools)
    return code
