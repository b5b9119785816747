"""`kvstate demo`: run a seeded workload through the real executor under memory pressure and check every output.

The GPU tier is small enough that requests are suspended to the host tier, and the host tier is too small to
take every victim, so some are recompute-paused and replayed. Every output is then compared with its
unpressured reference (the same request run alone); any difference is exit status 1.

`--inject KIND[:RATE]` (repeatable) injects seeded faults (`executor.faults`): failed copies, corrupt host copies
(caught by checksums, on unless `--no-checksums`), host-tier allocation failure or loss. The run must still pass.

torch and `executor` are imported inside `_run`, so `import kvstate` never imports torch.
"""

from __future__ import annotations

import argparse
import sys
import time

DEFAULTS = {"requests": 48, "gpu_blocks": 32, "host_blocks": 16, "block_size": 8, "chunk_size": 64, "seed": 0,
            "trace": "kvstate-trace.ndjson", "device": "auto", "dtype": "float64"}
PROMPT_LEN = (8, 96)
MAX_NEW_TOKENS = (8, 64)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run a seeded workload on the real executor under memory pressure and check output equivalence",
        description="Run a seeded workload through the real executor (paged KV cache, tiny Llama model) with a GPU "
                    "tier small enough to force suspensions and a host tier too small to take every victim, so some "
                    "are recompute-paused and replayed; then check every output against its unpressured reference. "
                    "Exit status 1 if any output differs or a block leaked.",
    )
    options = [
        ("--requests", int, "number of requests"),
        ("--gpu-blocks", int, "GPU tier blocks"),
        ("--host-blocks", int, "host tier blocks, 0 = no host tier"),
        ("--block-size", int, "tokens per block"),
        ("--chunk-size", int, "prefill chunk size in tokens"),
        ("--device", str, "auto (CUDA if available), cpu or cuda"),
        ("--seed", int, "workload, weights and sampling seed"),
        ("--trace", str, "lifecycle trace file, NDJSON (spec/TRACE.md)"),
    ]
    for flag, kind, text in options:
        key = flag[2:].replace("-", "_")
        p.add_argument(flag, type=kind, default=DEFAULTS[key], help=f"{text} (default %(default)s)")
    p.add_argument("--inject", action="append", default=[], metavar="KIND[:RATE]",
                   help="inject a fault (host_alloc, copy_to_host, copy_to_gpu, corrupt_host, host_loss) with a "
                        "probability per opportunity, or as KIND@ITERATION,...; repeat for several kinds")
    p.add_argument("--no-checksums", action="store_true",
                   help="do not checksum suspended blocks (an injected corrupt_host then garbles outputs)")
    p.add_argument("--dtype", default=DEFAULTS["dtype"], choices=("float64", "float32"),
                   help="model and cache dtype; float64 keeps greedy argmax immune to batching rounding "
                        "(default %(default)s)")
    p.set_defaults(run=_run)


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _run(args: argparse.Namespace) -> int:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's ops are microseconds long: intra-op threads only add barriers
    try:
        return _demo(args)
    finally:
        torch.set_num_threads(threads)


def _demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    from executor import Engine, EngineConfig, FaultPlan
    from executor.checks import leaked_blocks, mismatches, random_workload

    console = Console(file=sys.stdout)
    errors = Console(file=sys.stderr)
    if args.requests <= 0:
        errors.print(f"kvstate demo: error: --requests must be positive, got {args.requests}")
        return 2
    try:
        faults = FaultPlan.parse(args.inject, seed=args.seed) if args.inject else None
        config = EngineConfig(device=args.device, dtype=args.dtype, gpu_blocks=args.gpu_blocks,
                              host_blocks=args.host_blocks, block_size=args.block_size,
                              prefill_chunk_size=args.chunk_size, max_num_tokens=max(256, args.chunk_size),
                              seed=args.seed, weights_seed=args.seed, trace_path=args.trace, faults=faults,
                              verify_host_checksums=not args.no_checksums)
        engine = Engine(config)
    except (ValueError, OSError) as err:
        errors.print(f"kvstate demo: error: {err}", markup=False)
        return 2
    with engine:
        work = random_workload(args.requests, args.seed, PROMPT_LEN, MAX_NEW_TOKENS,
                               vocab=engine.model.config.vocab_size, max_tokens=args.gpu_blocks * args.block_size)
        for prompt, new in work:
            engine.add_request(prompt, new)
        host = "none" if not args.host_blocks else f"{args.host_blocks} blocks"
        if engine.scheduler.host_tier_fallback:
            host += " (allocation failed: GPU-only)"
        console.print(f"[bold]kvstate demo[/bold]: {args.requests} requests on {engine.device} "
                      f"({str(engine.model.dtype).removeprefix('torch.')}), GPU tier {args.gpu_blocks} blocks x "
                      f"{args.block_size} tokens, host tier {host}")
        started = time.perf_counter()
        peak = _run_with_progress(engine, console)
        wall = time.perf_counter() - started
        outputs = engine.outputs()
        checked = time.perf_counter()
        differ = sorted(mismatches(engine, outputs), key=str)
        check_time = time.perf_counter() - checked
        leaked = leaked_blocks(engine)

    console.print(_state_table(engine, peak))
    console.print(_summary_table(engine, wall, check_time))
    console.print(f"trace: {engine.trace.path.resolve()} ({engine.trace.lines} transitions)", soft_wrap=True)
    if leaked:
        console.print(f"[bold red]LEAK[/bold red]: {leaked} blocks still allocated after every request finished")
    if differ:
        console.print(f"[bold red]OUTPUT EQUIVALENCE: FAIL[/bold red] - {len(differ)} of {len(outputs)} outputs "
                      f"differ from their unpressured reference: {differ[:10]}")
    else:
        console.print(f"[bold green]OUTPUT EQUIVALENCE: PASS[/bold green] - all {len(outputs)} outputs equal "
                      "their unpressured reference")
    return 0 if not differ and not leaked else 1


def _run_with_progress(engine, console) -> dict[str, int]:
    """Step the engine to completion under a progress bar; returns the peak number of requests per state."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    peak = {s.name: 0 for s in engine.scheduler.spec.states}
    total = len(engine.scheduler.requests) + len(engine.scheduler.finished)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[status]}"))
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("requests done", total=total, status="")
        while engine.scheduler.has_unfinished:
            stats = engine.step()
            for state, count in stats.requests_per_state.items():
                peak[state] = max(peak.get(state, 0), count)
            progress.update(task, completed=len(engine.scheduler.finished),
                            status=f"suspended {stats.num_suspended}, paused {stats.num_recompute_paused}")
    return peak


def _state_table(engine, peak: dict[str, int]):
    from rich.table import Table

    final = engine.stats().requests_per_state
    table = Table(title="Requests per state")
    table.add_column("state")
    table.add_column("peak", justify="right")
    table.add_column("final", justify="right")
    for state in peak:
        table.add_row(state, str(peak[state]), str(final.get(state, 0)))
    return table


def _summary_table(engine, wall: float, check_time: float):
    from rich.table import Table

    totals = engine.totals
    rows = [
        ("requests", str(len(engine.scheduler.finished))),
        ("iterations", str(totals.steps)),
        ("generated tokens", str(totals.generated_tokens)),
        ("suspensions", str(totals.suspensions)),
        ("resumes", str(totals.events["resume"])),
        ("recompute-pauses", str(totals.recompute_pauses)),
        ("replays", str(totals.events["replay"])),
        ("recomputed tokens", str(totals.recomputed_tokens)),
        ("blocks migrated", str(totals.blocks_migrated)),
        ("bytes migrated", _bytes(totals.bytes_migrated)),
        ("copy calls (merged runs)", str(engine.cache.num_copies)),
        ("host tier fallback", "yes" if engine.scheduler.host_tier_fallback else "no"),
        ("faults injected", ", ".join(f"{k} {v}" for k, v in sorted(totals.faults.items())) or "none"),
        ("failed copies rolled back", str(totals.failed_copies)),
        ("corrupt host copies caught", str(totals.checksum_mismatches)),
        ("host tier lost mid-run", str(totals.host_tier_losses)),
        ("tokens/s (generated)", f"{totals.generated_tokens / wall:,.0f}" if wall > 0 else "-"),
        ("wall time", f"{wall:.2f} s"),
        ("reference check time", f"{check_time:.2f} s"),
    ]
    table = Table(title="Summary")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in rows:
        table.add_row(name, value)
    return table
