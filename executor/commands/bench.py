"""`kvstate bench`: measure migration bandwidth, lifecycle/scheduler overhead and end-to-end throughput, each as
a ratio to a baseline measured side by side in the same run; print a table and a summary line of the targets
met and not met, optionally write JSON and PNGs. `--peers` runs the groups measured beside real peers (vLLM's v1
scheduler, nano-vllm's scheduler from a checkout, transformers' `generate`) and the pipeline beside lockstep;
`--only` runs exactly the groups it names; `--strict` exits 1 when a target is not met.

Options and output paths are checked first; torch, vLLM, transformers and matplotlib are imported only then (via
`executor.bench`), so `import kvstate` never imports them and a usage error takes well under a second. The
groups run one after another under a progress display that says what a long group is doing; the table fits
the terminal's width.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable

from executor.bench import GROUPS, PEER_GROUPS, TORCH_GROUPS
from kvstate.commands.args import (
    MAX_REQUESTS,
    MAX_SEED,
    UsageError,
    add_lifecycle_option,
    add_mkdir_option,
    check_cuda_driver,
    device_name,
    non_negative_int,
    output_dir,
    output_file,
    positive_int,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmark copies, scheduler overhead and end-to-end throughput against limits and peers",
        description=(
            "Measure every figure as a ratio to a baseline run side by side in the same loop (variants "
            "interleaved, repeated, medians): migration copies vs one contiguous copy, the compiled "
            "lifecycle table vs the transitions machine, our scheduler's step vs its targets, host tier sizes "
            "vs recompute only, the spec's two offload policies (on_demand, eager) on a bursty workload, and with "
            "--peers our scheduler beside vLLM 0.33's v1 Scheduler and nano-vllm's "
            "scheduler (steady decode and recompute-only pressure at 256/1,024/4,096 requests; pressure also with "
            "caches warm and with caches evicted before each step), the engine "
            "beside transformers' generate (decode at batch 1, 8, 32, 64; ragged prompts, staggered budgets, "
            "arrivals during decode and memory pressure at batch 64, under both offload policies) and two pipeline "
            "stages with "
            "micro-batches in flight beside lockstep. A peer that is not installed (scripts/install-peers; "
            "nano-vllm: --nano-vllm) leaves its rows saying so; everything else runs. The last line counts the "
            "targets met and not met; with --strict a target not met exits 1."
        ),
    )
    p.add_argument("--quick", action="store_true", help="CI-sized runs (seconds, not minutes; noisier)")
    p.add_argument("--json", metavar="PATH", help="write every figure and its raw data as JSON")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots")
    p.add_argument(
        "--only",
        action="append",
        choices=GROUPS,
        help="run exactly this group (repeatable; default: all, or with --peers the peer groups)",
    )
    p.add_argument(
        "--peers",
        action="store_true",
        help=f"run the groups measured beside real peers ({', '.join(PEER_GROUPS)}); with --only, only those named",
    )
    p.add_argument(
        "--nano-vllm",
        metavar="DIR",
        default=None,
        help=(
            "a checkout of nano-vllm (git clone https://github.com/GeeeekExplorer/nano-vllm; needs pip install "
            "xxhash) for the nano-vllm group, which runs its real engine/ scheduler beside ours"
        ),
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 when any target is not met (default: report it in the summary line and exit 0)",
    )
    _add_workload_options(p)
    add_mkdir_option(p)
    p.set_defaults(run=_run)


def _add_workload_options(p: argparse.ArgumentParser) -> None:
    """The options that size the groups' workloads and choose where and how they run."""
    p.add_argument(
        "--sizes",
        type=_positive_ints("--sizes"),
        default=None,
        metavar="N,N,...",
        help=(
            "running requests of the scheduler groups (overhead, pressure, vllm; default 256,1024,4096, "
            "with --quick 256,1024)"
        ),
    )
    p.add_argument(
        "--batches",
        type=_positive_ints("--batches"),
        default=None,
        metavar="N,N,...",
        help="batch sizes of the transformers and smollm2 groups (default 1,8,32,64, with --quick 1,8)",
    )
    p.add_argument(
        "--device",
        type=device_name,
        default=None,
        help=(
            f"auto (CUDA if available), cpu, cuda or cuda:N for the groups that run torch "
            f"({', '.join(TORCH_GROUPS)}; default auto)"
        ),
    )
    add_lifecycle_option(
        p, "every group but `lifecycle` and the pressure rows of `overhead` and `vllm` (which run both side by side)"
    )
    p.add_argument(
        "--seed",
        type=non_negative_int(maximum=MAX_SEED),
        default=0,
        help="seed of every workload and shuffle (default %(default)s)",
    )


def _run(args: argparse.Namespace) -> int:
    groups = _groups(args.only, peers=args.peers)
    if args.nano_vllm is not None:
        if "nano-vllm" not in groups:
            raise UsageError(f"--nano-vllm applies to the nano-vllm group, not to {' '.join(groups)}; drop it")
        if not os.path.isdir(args.nano_vllm):
            raise UsageError(
                f"--nano-vllm {args.nano_vllm}: not a directory; git clone https://github.com/GeeeekExplorer/nano-vllm "
                "and pass the checkout's directory"
            )
    if args.device is not None and not set(groups) & set(TORCH_GROUPS):
        raise UsageError(f"--device does not apply to --only {' '.join(groups)} (pure Python); drop --device")
    json_path = output_file(args.json, "--json", mkdir=args.mkdir) if args.json else None
    plots_dir = output_dir(args.plots, "--plots", mkdir=args.mkdir) if args.plots else None
    check_cuda_driver(args.device)

    from executor.bench import run_all
    from executor.bench.table import document, render_table, summary, summary_line, write_json
    from kvstate.terminal import console as make_console

    device = _resolve(args.device or "auto") if set(groups) & set(TORCH_GROUPS) else "none (pure Python)"
    console = make_console()  # no markup; piped, the table is not wrapped
    started = time.perf_counter()
    sections = _run_groups(
        console,
        groups,
        quick=args.quick,
        device=device,
        seed=args.seed,
        run_all=run_all,
        lifecycle=args.lifecycle,
        sizes=args.sizes,
        batches=args.batches,
        nano_vllm=args.nano_vllm,
    )
    wall = time.perf_counter() - started
    command = " ".join(
        ["kvstate bench"]
        + (["--quick"] if args.quick else [])
        + (["--peers"] if args.peers else [])
        + [f"--only {g}" for g in args.only or ()]
    )
    meta = {
        "command": command,
        "quick": args.quick,
        "seed": args.seed,
        "sizes": args.sizes,
        "batches": args.batches,
        "nano_vllm": args.nano_vllm,
        "device": device,
        "groups": list(groups),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "wall_s": round(wall, 1),
        **_versions(),
    }
    console.print(
        render_table(
            sections, f"{command} on {device}: ratios measured side by side in one run (medians of interleaved repeats)"
        )
    )
    console.print(
        f"{meta['torch']}, {meta['cpu_threads']} cpu threads for torch = 1; wall time {wall:.1f} s; "
        "↑/↓: which direction of the ratio is better"
    )
    if json_path is not None:
        console.print(f"json: {write_json(document(sections, meta), json_path)}", soft_wrap=True)
    if plots_dir is not None:
        from executor.bench.plots import write_plots

        for path in write_plots(sections, plots_dir):
            console.print(f"plot: {path}", soft_wrap=True)
    console.print(summary_line(sections), soft_wrap=True, markup=False)
    return 1 if args.strict and summary(sections)[1] else 0


def _groups(only: list[str] | None, *, peers: bool) -> tuple[str, ...]:
    """The groups to run, in the order of `GROUPS`: exactly those of `--only`; else with `--peers` the peer
    groups; else all. With both, every `--only` group must be a peer group."""
    if only:
        if peers and set(only) - set(PEER_GROUPS):
            raise UsageError(
                f"--only {' '.join(sorted(set(only) - set(PEER_GROUPS)))} is not a peer group "
                f"({', '.join(PEER_GROUPS)}); drop --peers or that --only"
            )
        return tuple(g for g in GROUPS if g in only)
    return PEER_GROUPS if peers else GROUPS


def _positive_ints(option: str) -> Callable[[str], tuple[int, ...]]:
    """argparse type: a comma-separated list of positive integers, e.g. `32,64`."""
    one = positive_int(option, maximum=MAX_REQUESTS)

    def parse(text: str) -> tuple[int, ...]:
        return tuple(one(part.strip()) for part in text.split(","))

    return parse


def _resolve(device: str) -> str:
    """The device the torch groups will run on (`cpu`, `cuda`, `cuda:N`); a usage error when it is not usable."""
    from executor import resolve_device

    try:
        return str(resolve_device(device))
    except ValueError as err:
        raise UsageError(f"--device {device}: {err}") from None


def _run_groups(console, groups: tuple[str, ...], *, run_all, **options) -> list:
    """Run each group in turn (`executor.bench.run_all`) under a spinner that names it, says what a long group is
    doing (its `progress` lines) and shows elapsed time."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    sections = []
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        for n, group in enumerate(groups, 1):
            title = f"group {n}/{len(groups)}: {group} on {options['device']}"
            task = progress.add_task(title, total=None)

            def say(message: str, task=task, title=title) -> None:
                progress.update(task, description=f"{title}: {message}")

            try:
                sections += run_all(groups=(group,), progress=say, **options)
            except ValueError as err:
                raise UsageError(str(err)) from None
            progress.remove_task(task)
    return sections


def _versions() -> dict[str, int | str | None]:
    import os
    from importlib import metadata

    versions: dict[str, int | str | None] = {"cpu_threads": os.cpu_count()}
    for peer in ("vllm", "transformers"):
        try:
            versions[peer] = metadata.version(peer)
        except metadata.PackageNotFoundError:
            versions[peer] = "not installed"
    try:
        import torch

        versions["torch"] = f"torch {torch.__version__}"
    except ImportError:  # pragma: no cover
        versions["torch"] = "torch not installed"
    return versions
