"""`kvstate bench`: measure migration bandwidth, lifecycle/scheduler overhead and end-to-end throughput, each as
a ratio to a baseline measured side by side in the same run; print a table, optionally write JSON and PNGs.

torch, transformers and matplotlib are imported inside `_run` (via `kvstate.bench`), so `import kvstate` never
imports them.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

TABLE_WIDTH = 180


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
    p.add_argument("--plots", metavar="DIR", help="write PNG plots (needs matplotlib)")
    p.add_argument("--only", action="append", choices=("migration", "overhead", "end-to-end"),
                   help="run only this group (repeatable; default: all)")
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu or cuda (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of every workload and shuffle (default %(default)s)")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvstate.bench import GROUPS, run_all
    from kvstate.bench.table import document, render_table, write_json

    console = Console(file=sys.stdout)
    if console.width < TABLE_WIDTH:
        console = Console(file=sys.stdout, width=TABLE_WIDTH)  # a pipe or a narrow terminal: keep rows on one line
    groups = tuple(args.only) if args.only else GROUPS
    started = time.perf_counter()
    try:
        sections = run_all(quick=args.quick, device=args.device, seed=args.seed, groups=groups)
    except ValueError as err:
        print(f"kvstate bench: error: {err}", file=sys.stderr)
        return 2
    wall = time.perf_counter() - started
    meta = {"command": "kvstate bench" + (" --quick" if args.quick else ""), "quick": args.quick, "seed": args.seed,
            "device": args.device, "groups": list(groups), "python": platform.python_version(),
            "machine": platform.machine(), "wall_s": round(wall, 1), **_versions()}
    console.print(render_table(sections, f"kvstate bench{' --quick' if args.quick else ''}: ratios measured side "
                                         "by side in one run (medians of interleaved repeats)"))
    console.print(f"{meta['torch']}, {meta['cpu_threads']} cpu threads for torch = 1; wall time {wall:.1f} s; "
                  "↑/↓: which direction of the ratio is better")
    if args.json:
        console.print(f"json: {write_json(document(sections, meta), args.json)}", soft_wrap=True)
    if args.plots:
        from kvstate.bench.plots import write_plots

        for path in write_plots(sections, args.plots):
            console.print(f"plot: {path}", soft_wrap=True)
    return 0


def _versions() -> dict:
    import os

    versions = {"cpu_threads": os.cpu_count()}
    try:
        import torch

        versions["torch"] = f"torch {torch.__version__}"
    except ImportError:  # pragma: no cover
        versions["torch"] = "torch not installed"
    return versions
