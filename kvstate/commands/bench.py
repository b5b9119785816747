"""`kvstate bench`: measure migration bandwidth, lifecycle/scheduler overhead and end-to-end throughput, each as
a ratio to a baseline measured side by side in the same run; print a table, optionally write JSON and PNGs.

Options and output paths are checked first; torch, transformers and matplotlib are imported only then (via
`kvstate.bench`), so `import kvstate` never imports them and a usage error takes well under a second. The
groups run one after another under a progress display; the table fits the terminal's width.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

from kvstate.bench import GROUPS
from kvstate.commands.args import (
    UsageError, add_lifecycle_option, device_name, non_negative_int, output_dir, output_file,
)

TORCH_GROUPS = ("migration", "end-to-end", "lifecycle")  # the groups of `kvstate.bench.run_all` that run on a torch device


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmark copies, scheduler overhead and end-to-end throughput against limits and peers",
        description="Measure every figure as a ratio to a baseline run side by side in the same loop (variants "
                    "interleaved, repeated, medians): migration copies vs one contiguous copy, the compiled "
                    "lifecycle table vs the transitions machine, schedule() vs a nano-vllm-style peer, the engine "
                    "vs transformers' generate, and host tier sizes vs recompute only.",
    )
    p.add_argument("--quick", action="store_true", help="CI-sized runs (seconds, not minutes; noisier)")
    p.add_argument("--json", metavar="PATH", help="write every figure and its raw data as JSON")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots")
    p.add_argument("--only", action="append", choices=GROUPS,
                   help="run only this group (repeatable; default: all)")
    p.add_argument("--device", type=device_name, default=None,
                   help="auto (CUDA if available), cpu, cuda or cuda:N for the migration and end-to-end groups "
                        "(default auto)")
    add_lifecycle_option(p, "every group but `lifecycle` (which runs both side by side)")
    p.add_argument("--seed", type=non_negative_int("seed"), default=0,
                   help="seed of every workload and shuffle (default %(default)s)")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    groups = tuple(g for g in GROUPS if g in args.only) if args.only else GROUPS
    if args.device is not None and not set(groups) & set(TORCH_GROUPS):
        raise UsageError(f"--device does not apply to --only {' '.join(groups)} (pure Python); drop --device")
    json_path = output_file(args.json, "--json") if args.json else None
    plots_dir = output_dir(args.plots, "--plots") if args.plots else None

    from rich.console import Console

    from kvstate.bench import run_all
    from kvstate.bench.table import document, render_table, write_json

    device = _resolve(args.device or "auto") if set(groups) & set(TORCH_GROUPS) else "none (pure Python)"
    console = Console(file=sys.stdout)
    started = time.perf_counter()
    sections = _run_groups(console, groups, quick=args.quick, device=device, seed=args.seed, run_all=run_all,
                           lifecycle=args.lifecycle)
    wall = time.perf_counter() - started
    meta = {"command": "kvstate bench" + (" --quick" if args.quick else ""), "quick": args.quick, "seed": args.seed,
            "device": device, "groups": list(groups), "python": platform.python_version(),
            "machine": platform.machine(), "wall_s": round(wall, 1), **_versions()}
    console.print(render_table(sections, f"kvstate bench{' --quick' if args.quick else ''} on {device}: ratios "
                                         "measured side by side in one run (medians of interleaved repeats)"))
    console.print(f"{meta['torch']}, {meta['cpu_threads']} cpu threads for torch = 1; wall time {wall:.1f} s; "
                  "↑/↓: which direction of the ratio is better")
    if json_path is not None:
        console.print(f"json: {write_json(document(sections, meta), json_path)}", soft_wrap=True)
    if plots_dir is not None:
        from kvstate.bench.plots import write_plots

        for path in write_plots(sections, plots_dir):
            console.print(f"plot: {path}", soft_wrap=True)
    return 0


def _resolve(device: str) -> str:
    """The device the torch groups will run on (`cpu`, `cuda`, `cuda:N`); a usage error when it is not usable."""
    from executor import resolve_device

    try:
        return str(resolve_device(device))
    except ValueError as err:
        raise UsageError(f"--device {device}: {err}") from None


def _run_groups(console, groups: tuple[str, ...], *, run_all, **options) -> list:
    """Run each group in turn (`kvstate.bench.run_all`) under a spinner that names it and shows elapsed time."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    sections = []
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        for n, group in enumerate(groups, 1):
            task = progress.add_task(f"group {n}/{len(groups)}: {group} on {options['device']}", total=None)
            try:
                sections += run_all(groups=(group,), **options)
            except ValueError as err:
                raise UsageError(str(err)) from None
            progress.remove_task(task)
    return sections


def _versions() -> dict:
    import os

    versions = {"cpu_threads": os.cpu_count()}
    try:
        import torch

        versions["torch"] = f"torch {torch.__version__}"
    except ImportError:  # pragma: no cover
        versions["torch"] = "torch not installed"
    return versions
