"""`kvstate check`: model-check the spec on named bounds and check the real scheduler refines it.

Exit codes:
  0  holds: every bound was searched completely and no invariant or refinement check failed
  1  violated: a counterexample was found (printed, and written as a pytest regression test)
  2  unusable input: a bad option, an unreadable or invalid spec or bounds file (a field of the wrong type or out of
     its range, a sweep of more than 100,000 configurations), an unknown bound
  3  incomplete: a search was cut short by --max-states or --time-limit (never reported as 'holds')

`--simulate N` takes N seeded random walks per bound over the scheduler refinement's actions instead (bounds too
large to exhaust): 0 then means no walk of that scope violated a check (the scope is printed), 1 a violation (shrunk,
and written as above), 3 that --time-limit stopped the walks first.

Both limits have defaults, so a bounds file far larger than the packaged one (whose largest search has about 51,000
states) ends as 'incomplete' instead of filling the memory or running for days: 1,000,000 states per search and
3,600 s per bound. Pass larger values to search further.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

from kvstate.commands import check_tlc
from kvstate.commands.args import (
    MAX_SEED,
    MAX_STATES,
    UsageError,
    add_mkdir_option,
    add_spec_option,
    input_file,
    non_negative_int,
    output_dir,
    positive_float,
    positive_int,
)
from kvstate.extras import MissingExtra, require
from kvstate.terminal import inert

if TYPE_CHECKING:  # rich is imported only where a bar is drawn
    from rich.progress import Progress, TaskID

DEFAULT_MAX_STATES = 1_000_000  # states of one search: what bounds its memory
DEFAULT_TIME_LIMIT_S = 3600.0  # seconds per bound
MAX_WORKERS = 256  # processes of one sweep
MAX_WALKS = 10**9  # walks of one simulation per bound
MAX_DEPTH = 10**7  # actions of one walk
DEFAULT_SEED = 0  # kvstate.checker.simulate.DEFAULT_SEED (not imported here: the checker loads after the checks)
DEFAULT_DEPTH = 2000  # kvstate.checker.simulate.DEFAULT_DEPTH
PROGRESS_EVERY_S = 5.0  # a simulation's progress line on stderr, at most this often


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check",
        help="model-check the spec on bounded instances and the scheduler's refinement of it",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_spec_option(parser)
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
        type=positive_int(maximum=MAX_STATES),
        default=DEFAULT_MAX_STATES,
        help="stop each search after N states (verdict incomplete; default %(default)s, which bounds its memory)",
    )
    parser.add_argument(
        "--time-limit",
        metavar="S",
        type=positive_float,
        default=DEFAULT_TIME_LIMIT_S,
        help="stop each bound's search after S seconds (verdict incomplete; default %(default)g)",
    )
    parser.add_argument(
        "--counterexample-dir",
        metavar="DIR",
        default=".",
        help="where a counterexample regression test is written (default: .)",
    )
    _add_sweep_options(parser)
    _add_simulation_options(parser)
    parser.add_argument("--no-refinement", action="store_true", help="check the abstract model only")
    check_tlc.register_options(parser)
    parser.add_argument(
        "--diff",
        metavar="OLD_SPEC",
        default=None,
        help="also check OLD_SPEC on the same bounds and say which invariants' verdicts changed",
    )
    add_mkdir_option(parser)
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also list, per bound, the transitions it never enables, its progress-free cycles and the abstract "
        "model's weakly fair lasso (information, not warnings)",
    )
    parser.set_defaults(run=run)


def _add_sweep_options(parser: argparse.ArgumentParser) -> None:
    """--sweep and where its configurations run (--workers, --cluster, --connect-timeout)."""
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
        type=positive_int(maximum=MAX_WORKERS),
        default=None,
        help=f"processes of a local Dask cluster a sweep runs on, at most {MAX_WORKERS}; 1 runs it in this process "
        "(default: the CPUs this process may use; in this process where Dask is not installed)",
    )
    parser.add_argument(
        "--cluster",
        metavar="ADDRESS",
        default=None,
        help="run a sweep's configurations on the running Dask cluster whose scheduler is at tcp://HOST:PORT "
        "(its workers need this kvstate installed); excludes --workers",
    )
    parser.add_argument(
        "--connect-timeout",
        metavar="S",
        type=positive_float,
        default=None,
        help="seconds --cluster waits for the scheduler to answer and for a first worker (default 10)",
    )


def _add_simulation_options(parser: argparse.ArgumentParser) -> None:
    """--simulate and its walks' --seed and --depth."""
    parser.add_argument(
        "--simulate",
        metavar="N",
        type=positive_int(maximum=MAX_WALKS),
        default=None,
        help="instead of the exhaustive search, take N seeded random walks per bound over the scheduler "
        "refinement's actions, each action checked as the search checks it (for bounds too large to exhaust); "
        "a violation is shrunk and written as the search writes its counterexamples",
    )
    parser.add_argument(
        "--seed",
        metavar="S",
        type=non_negative_int(maximum=MAX_SEED),
        default=None,
        help=f"with --simulate: the seed every walk's seed is derived from (default {DEFAULT_SEED})",
    )
    parser.add_argument(
        "--depth",
        metavar="D",
        type=positive_int(maximum=MAX_DEPTH),
        default=None,
        help=f"with --simulate: actions per walk, at most (default {DEFAULT_DEPTH})",
    )


def run(args: argparse.Namespace) -> int:
    refuse_simulation_options(args)
    if args.simulate is not None:
        return _simulate(args)
    if args.engine == "tlc" and args.sweep is not None:
        raise UsageError("--sweep does not apply to --engine tlc: TLC cross-checks the abstract model of bounds")
    if args.engine == "tlc":  # the cross-check with TLC: kvstate.commands.check_tlc
        return check_tlc.run(args, max_states_given=args.max_states != DEFAULT_MAX_STATES)
    check_tlc.refuse_tlc_options(args)
    spec_path = input_file(args.spec, "--spec") if args.spec is not None else None
    bounds_path = input_file(args.bounds_file, "--bounds-file") if args.bounds_file is not None else None
    counterexample_dir = output_dir(args.counterexample_dir, "--counterexample-dir", mkdir=args.mkdir)
    if args.sweep is not None and (args.bound or args.diff is not None):
        raise UsageError(
            "--sweep excludes --bound and --diff: a sweep names its own bounds and checks one spec; give one of them"
        )
    _refuse_runner_options(args)

    from kvstate.checker.bounds import select_bounds
    from kvstate.checker.runner import run_check
    from kvstate.spec import load_spec
    from kvstate.terminal import console as make_console

    console = make_console()
    if args.sweep is not None:
        return _sweep(args, spec_path, bounds_path, counterexample_dir, console)
    old_path = input_file(args.diff, "--diff") if args.diff is not None else None
    bounds = select_bounds(args.bound, bounds_path)
    spec = load_spec(spec_path)
    code, reports = run_check(
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
    draw_counterexamples(reports, spec, console)
    if old_path is not None:
        from kvstate.checker.verdict_diff import changed_verdicts, verdict_lines

        old = load_spec(old_path)
        quiet = make_console()
        quiet.file = io.StringIO()
        _, old_reports = run_check(
            bounds,
            spec=old,
            max_states=args.max_states,
            time_limit=args.time_limit,
            counterexample_dir=None,
            console=quiet,
            refine=not args.no_refinement,
        )
        for line in verdict_lines(changed_verdicts(old_reports, old, reports, spec), str(old_path)):
            console.print(inert(line))
    return code


def refuse_simulation_options(args: argparse.Namespace) -> None:
    """--seed and --depth need --simulate; --simulate takes no option of the exhaustive search (one line, exit 2)."""
    if args.simulate is None:
        for option, value in (("--seed", args.seed), ("--depth", args.depth)):
            if value is not None:
                raise UsageError(f"{option} applies to --simulate only; add --simulate N or drop it")
        return
    refused = (
        ("--engine tlc", args.engine == "tlc"),
        ("--sweep", args.sweep is not None),
        ("--diff", args.diff is not None),
        ("--no-refinement", args.no_refinement),
        ("--max-states", args.max_states != DEFAULT_MAX_STATES),
        ("--verbose", args.verbose),
    )
    for option, given in refused:
        if given:
            raise UsageError(
                f"{option} does not apply to --simulate (random walks over the scheduler refinement, bounded by "
                "--simulate N, --depth and --time-limit); drop it"
            )


def _simulate(args: argparse.Namespace) -> int:
    """`kvstate check --simulate N`: random walks over each bound's refinement (kvstate.checker.simulate)."""
    check_tlc.refuse_tlc_options(args)
    spec_path = input_file(args.spec, "--spec") if args.spec is not None else None
    bounds_path = input_file(args.bounds_file, "--bounds-file") if args.bounds_file is not None else None
    counterexample_dir = output_dir(args.counterexample_dir, "--counterexample-dir", mkdir=args.mkdir)

    from kvstate.checker.bounds import select_bounds
    from kvstate.checker.simulate import SimulationScope, run_simulation
    from kvstate.spec import load_spec
    from kvstate.terminal import console as make_console
    from kvstate.terminal import say

    bounds = select_bounds(args.bound, bounds_path)
    spec = load_spec(spec_path)
    console = make_console()
    scope = SimulationScope(
        args.simulate,
        depth=args.depth if args.depth is not None else DEFAULT_DEPTH,
        seed=args.seed if args.seed is not None else DEFAULT_SEED,
    )
    code, results = run_simulation(
        bounds,
        scope,
        spec=spec,
        time_limit=args.time_limit,
        counterexample_dir=counterexample_dir,
        say=lambda text: say(console, text),
        progress=_progress_printer(),
    )
    draw_counterexamples(results, spec, console)
    return code


def _progress_printer():
    """A simulation's progress callback: one line on stderr at most every `PROGRESS_EVERY_S` seconds per bound
    (walks done, actions, distinct worlds, rate), and one when a walk violates a check."""
    import time

    last: dict[str, float] = {}

    def show(result) -> None:
        now, name = time.monotonic(), result.bound.name
        if result.seconds_to_violation is None and now - last.setdefault(name, now) < PROGRESS_EVERY_S:
            return
        last[name] = now
        line = (
            f"kvstate check --simulate: bound {name}: {result.walks}/{result.scope.walks} walks, {result.steps} "
            f"actions, {result.distinct} distinct worlds, {result.seconds:.0f} s ({result.rate:.0f} actions/s)"
        )
        print(inert(line), file=sys.stderr, flush=True)

    return show


def draw_counterexamples(reports, spec, console) -> None:
    """Draw every counterexample written as a trace (`kvstate report`, its loop marked) and print a link to it."""
    for report in reports:
        trace = report.counterexample_trace
        if trace is None:
            continue
        from kvstate.report import write_report

        out = trace.path.with_name(f"{trace.path.stem}-report")
        try:
            require("matplotlib")  # the report's figures; without it the trace is still written
            drawn = write_report(trace.path, out, spec=spec, loop=trace.loop)
        except (ValueError, OSError, MissingExtra) as err:
            console.print(inert(f"  counterexample not drawn ({err}); draw it with: {trace.report_command(out)}"))
            continue
        console.print(inert(f"  counterexample drawn: {drawn.html.resolve().as_uri()}"))


def _refuse_runner_options(args: argparse.Namespace) -> None:
    """--cluster and --connect-timeout apply to a sweep, without --workers; each needs Dask where it needs it."""
    from kvstate.checker.sweep_runners import CLUSTER_EXTRA, dask_available

    if args.sweep is None and (args.cluster is not None or args.connect_timeout is not None):
        raise UsageError("--cluster and --connect-timeout apply to --sweep NAME only")
    if args.connect_timeout is not None and args.cluster is None:
        raise UsageError("--connect-timeout applies to --cluster only")
    if args.cluster is not None and args.workers is not None:
        raise UsageError("--cluster excludes --workers: the cluster's own workers check the configurations")
    needs_dask = (
        "--cluster" if args.cluster is not None else f"--workers {args.workers}" if (args.workers or 1) > 1 else None
    )
    if args.sweep is not None and needs_dask and not dask_available():
        raise UsageError(f"{needs_dask} needs Dask, which is not installed: {CLUSTER_EXTRA} (or pass --workers 1)")


def _runner(args: argparse.Namespace, say) -> AbstractContextManager:
    """Where the sweep runs: the cluster at --cluster; a local Dask cluster of --workers processes; this process
    for one worker, or by default where Dask is not installed."""
    from kvstate.checker.sweep_runners import (
        CLUSTER_EXTRA,
        DEFAULT_CONNECT_TIMEOUT_S,
        InProcessRunner,
        cluster_runner,
        dask_available,
        local_dask_runner,
    )

    if args.cluster is not None:
        return cluster_runner(args.cluster, args.connect_timeout or DEFAULT_CONNECT_TIMEOUT_S)
    workers = args.workers or min(MAX_WORKERS, max(1, len(os.sched_getaffinity(0))))
    if workers > 1 and args.workers is None and not dask_available():
        say(f"kvstate check: Dask is not installed ({CLUSTER_EXTRA}): the sweep runs in this process")
        workers = 1
    return nullcontext(InProcessRunner()) if workers == 1 else local_dask_runner(workers)


def _sweep(args: argparse.Namespace, spec_path, bounds_path, counterexample_dir, console) -> int:
    """`kvstate check --sweep NAME`: every configuration of the sweep, then its summary table."""
    from kvstate.checker.runner import EXIT_CODES
    from kvstate.checker.sweep import run_sweep, select_sweep

    sweep = select_sweep(args.sweep, bounds_path)  # refused when it spans too many configurations
    bounds = sweep.bounds()
    total = len(bounds)
    say = lambda text: console.print(inert(text))  # noqa: E731 - inert: names from the bounds file are plain text
    say(f"kvstate check: sweep {sweep.name} of {bounds_path or 'the packaged bounds'}: {total} configurations")
    with _runner(args, say) as runner, SweepProgress(total) as progress:
        report = run_sweep(
            sweep,
            spec_path=None if spec_path is None else str(spec_path),
            runner=runner,
            max_states=args.max_states,
            counterexample_dir=counterexample_dir,
            progress=progress.update,
            bounds=bounds,
        )
    for line in report.lines():
        say(line)
    code = EXIT_CODES[report.verdict]
    say(f"verdict: {report.verdict} ({len(report.outcomes)} configurations, exit {code})")
    return code


class SweepProgress:
    """A sweep's progress on stderr: configurations done of all, and the rate. On a terminal, a bar; otherwise a
    line at each tenth done, so a log shows it without a line per configuration."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.start = time.monotonic()
        self.tenths = 0  # tenths of the sweep already reported
        self.bar: Progress | None = None
        self.task: TaskID | None = None

    def __enter__(self) -> SweepProgress:
        if sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            from kvstate.terminal import console

            self.bar = Progress(
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("configurations, {task.fields[rate]}"),
                TimeElapsedColumn(),
                console=console(stderr=True),
                transient=True,
            )
            self.bar.__enter__()
            self.task = self.bar.add_task("configurations", total=self.total, rate="")
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def update(self, done: int, total: int) -> None:
        rate = f"{done / max(time.monotonic() - self.start, 1e-9):.1f}/s"
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, completed=done, rate=rate)
        elif done * 10 // total > self.tenths:
            self.tenths = done * 10 // total
            print(f"kvstate check: {done}/{total} configurations, {rate}", file=sys.stderr, flush=True)
