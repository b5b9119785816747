"""`kvstate export tla`: the spec as a TLA+ module and a TLC model per bound, written into a directory.

Writes `KVStateLifecycle.tla` (the lifecycle: states, one action per event with its guard, the TLA+ meaning of every
guard and effect, the invariants, the fairness SPEC.md states) and, per bound of the bounds file (all of them, or
those named with --bound), `MC_<bound>.tla` with `MC_<bound>.cfg` (the safety check, with symmetry over requests of
equal parameters where the bound has them) and `MC_<bound>_liveness.cfg` (LIVE_DONE, no symmetry). Run TLC on one:
`java -cp tla2tools.jar tlc2.TLC -deadlock -config MC_default.cfg MC_default` in that directory.
"""

from __future__ import annotations

import argparse

from kvstate.commands.args import add_mkdir_option, add_spec_option, input_file, output_dir
from kvstate.terminal import inert


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write the spec in another formalism: TLA+ (a module and a TLC model per bound)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("format", choices=["tla"], help="tla: a TLA+ module and TLC models")
    add_spec_option(parser)
    parser.add_argument(
        "--bounds-file", metavar="PATH", default=None, help="bounds TOML file (default: the packaged spec/bounds.toml)"
    )
    parser.add_argument(
        "--bound", metavar="NAME", action="append", default=None, help="a bound to write (repeatable; default: all)"
    )
    parser.add_argument("--out", metavar="DIR", default="tla", help="output directory (default: %(default)s)")
    parser.add_argument(
        "--no-symmetry", action="store_true", help="write the models without symmetry sets (every permutation counts)"
    )
    add_mkdir_option(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec_path = input_file(args.spec, "--spec") if args.spec is not None else None
    bounds_path = input_file(args.bounds_file, "--bounds-file") if args.bounds_file is not None else None
    out = output_dir(args.out, "--out", mkdir=args.mkdir)

    from kvstate.checker.bounds import load_bounds, select_bounds
    from kvstate.spec import load_spec
    from kvstate.tla.models import export

    bounds = select_bounds(args.bound, bounds_path) if args.bound else list(load_bounds(bounds_path)[0].values())
    module, models = export(load_spec(spec_path), bounds, out, symmetry=not args.no_symmetry)
    print(inert(f"kvstate export tla: wrote {module}"))
    for model in models:
        symmetry = "symmetry over equal requests" if model.symmetric else "no symmetry"
        print(inert(f"  {out / model.name}.tla with {model.name}.cfg ({symmetry}) and {model.name}_liveness.cfg"))
    for bound in bounds:
        if not bound.abstract_model:
            print(inert(f"  bound {bound.name} not written: abstract_model = false (too large to enumerate)"))
    return 0
