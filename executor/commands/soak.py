"""`kvstate soak`: thousands of requests with seeded random arrivals, lengths and cancellations, under heavy memory
pressure and injected faults, on the real executor; then every output is compared with its unpressured reference.

What a soak checks (the run fails, exit status 1, on any breach):
* every request reaches `done`, as `finished` or (when the soak cancelled it) `cancelled` — none `aborted`;
* every finished output equals its reference, and every cancelled output is a prefix of it (OUT-EQUIV, by the
  per-dtype rule of `executor.checks.compare_outputs`: exact in float64 and float32; in bfloat16 and float16 a
  divergence at a near-tie of the reference is accepted and counted); the references are computed in batches on
  one unpressured engine (`Engine.batched_reference_outputs`);
* no block of either tier is held and no copy is in flight at the end;
* `Scheduler.check_invariants(output)` holds around every iteration (the engine's `check_invariants`).

The command runs the faults as a matrix (`executor.commands.soak_matrix.run_matrix`): a fault that ends the host
tier runs in a mix of its own, and the summary counts every path and fault kind per mix against a floor. A mix
other than the main one writes its trace next to `--trace`, its name before the suffix; `--report` draws the main
mix's. `run_soak(SoakSettings(...))` runs one mix, the library entry (tests call it); torch and the engine are
imported inside it, so building the command line imports no torch. Every random choice derives from
`SoakSettings.seed`. As with `kvstate demo`, nothing is written unless asked (`--trace PATH`, `--report DIR`:
`executor.commands.outputs`).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from executor.commands.inject import check_fault_plan
from executor.commands.outputs import add_output_options, check_outputs, prepare_outputs
from executor.commands.soak_matrix import MatrixReport, fault_mixes, run_matrix, summary_columns
from executor.commands.workload import add_offload_option, option_key
from executor.run_totals import copy_rows
from kvstate.commands.args import (
    MAX_BLOCK_SIZE,
    MAX_BLOCKS,
    MAX_REQUESTS,
    MAX_SEED,
    MAX_TOKENS,
    BoundedInt,
    add_device_option,
    add_dtype_option,
    add_lifecycle_option,
    check_cuda_driver,
    dtype_setting,
    non_negative_int,
    positive_int,
)
from kvstate.config import SchedulerConfig
from kvstate.errors import KVStateError
from kvstate.policy import VOCABULARY
from kvstate.spec import default_spec
from kvstate.stats import IterationStats

if TYPE_CHECKING:  # annotations only: importing this command imports no torch
    from executor import Engine, EngineConfig

DEFAULT_FAULTS = ("copy_to_host:0.05", "copy_to_gpu:0.05", "corrupt_host:0.05")
# The command's faults: the copy faults, and the faults that end the host tier, each in a mix of its own
# (`executor.commands.soak_matrix`).
DEFAULT_INJECT = (*DEFAULT_FAULTS, "host_loss", "host_alloc")


class SoakError(KVStateError, ValueError):
    """A soak setting is out of range; the message names it and the accepted range."""


@dataclass(frozen=True, slots=True)
class SoakSettings:
    """One soak: workload, pools, arrival and cancellation rates, injected faults (`--inject` forms), seed."""

    requests: int = 2000
    seed: int = 0
    gpu_blocks: int = 48
    host_blocks: int = 24
    block_size: int = 4
    chunk_size: int = 32
    max_num_tokens: int = 128
    prompt_len: tuple[int, int] = (4, 60)
    new_tokens: tuple[int, int] = (4, 40)
    arrival_rate: float = 2.0  # mean arrivals per iteration (exponential gaps)
    cancel_rate: float = 0.05  # share of requests the soak cancels, at a random time after arrival
    faults: tuple[str, ...] = DEFAULT_FAULTS
    checksums: bool = True
    device: str = "cpu"
    dtype: str = "float64"
    reference_batch: int = 256
    lifecycle: str = "machine"
    trace: str | None = None  # the lifecycle trace file (spec/TRACE.md), None: no trace
    offload: str | None = None  # the spec's offload policy to run (executor.offload_spec), None: the spec's own

    def __post_init__(self) -> None:
        for name in ("requests", "gpu_blocks", "block_size", "chunk_size", "max_num_tokens", "reference_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise SoakError(f"--{name.replace('_', '-')} must be positive, got {value!r}")
        if isinstance(self.host_blocks, bool) or not isinstance(self.host_blocks, int) or self.host_blocks < 0:
            raise SoakError(f"--host-blocks must be an integer >= 0 (0 = no host tier), got {self.host_blocks!r}")
        if not self.arrival_rate > 0:
            raise SoakError(f"--arrival-rate must be > 0 requests per iteration, got {self.arrival_rate!r}")
        if not 0.0 <= self.cancel_rate <= 1.0:
            raise SoakError(f"--cancel-rate must be in [0, 1], got {self.cancel_rate!r}")
        if self.offload is not None and self.offload not in VOCABULARY["offload"]:
            raise SoakError(f"--offload must be one of {', '.join(VOCABULARY['offload'])}, got {self.offload!r}")
        for name in ("prompt_len", "new_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise SoakError(f"{name} must be a range 1 <= low <= high, got {(lo, hi)!r}")


@dataclass(frozen=True)
class SoakReport:
    """What a soak observed. `ok` is true when nothing was lost, leaked or different."""

    settings: SoakSettings
    requests: int
    finished: int
    cancelled: int
    aborted: int
    unfinished: int
    iterations: int
    generated_tokens: int
    suspensions: int
    resumes: int
    recompute_pauses: int
    replays: int
    faults: dict[str, int]
    failed_copies: int
    checksum_mismatches: int
    host_tier_losses: int
    host_tier_fallback: bool
    compared: int
    mismatches: tuple = ()
    accepted: tuple = ()  # divergences at a near-tie of the reference, accepted in low precision (executor.checks)
    leaked_blocks: int = 0
    run_seconds: float = 0.0
    reference_seconds: float = 0.0
    events: dict[str, int] = field(default_factory=dict)
    trace_lines: int = 0  # lines written to `settings.trace`
    offload: str = ""  # the offload policy the engine ran
    blocks_offloaded: int = 0
    blocks_onboarded: int = 0
    resumed_without_copy: int = 0
    blocks_relocked: int = 0

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.leaked_blocks and not self.unfinished and not self.aborted

    def rows(self) -> list[tuple[str, str]]:
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())) or "none"
        return [
            ("requests", str(self.requests)),
            ("finished", str(self.finished)),
            ("cancelled", str(self.cancelled)),
            ("aborted / unfinished", f"{self.aborted} / {self.unfinished}"),
            ("iterations", str(self.iterations)),
            ("generated tokens", str(self.generated_tokens)),
            ("offload policy", self.offload),
            ("suspensions", str(self.suspensions)),
            ("resumes", str(self.resumes)),
            *copy_rows(self._copies()),
            ("recompute-pauses", str(self.recompute_pauses)),
            ("replays", str(self.replays)),
            ("faults injected", faults),
            ("failed copies rolled back", str(self.failed_copies)),
            ("corrupt host copies caught", str(self.checksum_mismatches)),
            ("host tier lost / fallback", f"{self.host_tier_losses} / {'yes' if self.host_tier_fallback else 'no'}"),
            ("outputs compared", str(self.compared)),
            ("mismatches", str(len(self.mismatches))),
            ("accepted near-tie divergences", str(len(self.accepted))),
            ("leaked blocks", str(self.leaked_blocks)),
            ("run time", f"{self.run_seconds:.1f} s"),
            ("reference time", f"{self.reference_seconds:.1f} s"),
        ]

    def _copies(self) -> dict:
        """The copy totals `copy_rows` reads, by their `RunTotals` names."""
        names = ("blocks_offloaded", "blocks_onboarded", "resumed_without_copy", "blocks_relocked", "events")
        return {name: getattr(self, name) for name in names}


def _schedule(settings: SoakSettings) -> tuple[list[float], dict[int, float]]:
    """Arrival times (exponential gaps) and, for the requests to cancel, cancel times after their arrival."""
    rng = random.Random(f"soak-arrivals-{settings.seed}")
    clock, arrivals, cancels = 0.0, [], {}
    for index in range(settings.requests):
        arrivals.append(clock)
        if rng.random() < settings.cancel_rate:
            cancels[index] = clock + rng.uniform(0, 80)
        clock += rng.expovariate(settings.arrival_rate)
    return arrivals, cancels


def _engine_config(settings: SoakSettings) -> EngineConfig:
    """The engine a soak runs: invariants checked around every step, the settings' faults injected."""
    from executor import EngineConfig, FaultPlan, offload_spec

    scheduler = SchedulerConfig(
        gpu_blocks=settings.gpu_blocks,
        host_blocks=settings.host_blocks,
        block_size=settings.block_size,
        prefill_chunk_size=settings.chunk_size,
        max_num_tokens=max(settings.max_num_tokens, settings.chunk_size),
        lifecycle=settings.lifecycle,
    )
    return EngineConfig(
        scheduler=scheduler,
        device=settings.device,
        dtype=settings.dtype,
        seed=settings.seed,
        weights_seed=settings.seed,
        trace_path=settings.trace,
        check_invariants=True,
        faults=FaultPlan.parse(settings.faults, seed=settings.seed),
        verify_host_checksums=settings.checksums,
        spec=None if settings.offload is None else offload_spec(settings.offload),
    )


def _drive(
    engine: Engine,
    work: list[tuple[list[int], int]],
    settings: SoakSettings,
    on_progress: Callable[[int, int, IterationStats | None], None] | None,
) -> tuple[list[Hashable], set[Hashable]]:
    """Submit `work` at its arrival times, cancel at the cancellation times, and step until every request ended;
    returns the submitted ids (request id = index in `work`) and the ids the soak cancelled."""
    arrivals, cancel_at = _schedule(settings)
    cancel_queue = sorted((t, i) for i, t in cancel_at.items())
    ids: list[Hashable] = []
    soak_cancelled: set[Hashable] = set()
    clock, next_arrival, next_cancel = 0, 0, 0
    while next_arrival < len(work) or engine.scheduler.has_unfinished:
        if not engine.scheduler.has_unfinished and arrivals[next_arrival] > clock:
            clock = int(arrivals[next_arrival])  # idle: skip to the next arrival
        while next_arrival < len(work) and arrivals[next_arrival] <= clock:
            prompt, new = work[next_arrival]
            ids.append(engine.add_request(prompt, new, request_id=next_arrival))
            next_arrival += 1
        while next_cancel < len(cancel_queue) and cancel_queue[next_cancel][0] <= clock:
            rid = cancel_queue[next_cancel][1]
            next_cancel += 1
            if rid in engine.scheduler.requests:  # still active: cancel it wherever it is
                engine.cancel(rid)
                soak_cancelled.add(rid)
        stats = engine.step() if engine.scheduler.has_unfinished else None
        clock += 1
        if on_progress is not None:
            on_progress(len(engine.scheduler.finished), len(work), stats)
    return ids, soak_cancelled


def run_soak(
    settings: SoakSettings, on_progress: Callable[[int, int, IterationStats | None], None] | None = None
) -> SoakReport:
    """Run one soak to the end and compare every output; `on_progress(done, total, stats)` after each iteration."""
    import warnings

    from executor import Engine, HostTierFallbackWarning
    from executor.checks import Compared, compare_outputs, leaked_blocks, random_workload

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HostTierFallbackWarning)  # counted in the report instead
        engine = Engine(_engine_config(settings))
        work = random_workload(
            settings.requests,
            settings.seed,
            settings.prompt_len,
            settings.new_tokens,
            vocab=engine.model.config.vocab_size,
            max_tokens=settings.gpu_blocks * settings.block_size,
        )
        started = time.perf_counter()
        with engine:
            ids, soak_cancelled = _drive(engine, work, settings, on_progress)
            run_seconds = time.perf_counter() - started
        checked = time.perf_counter()
        references = engine.batched_reference_outputs(ids, batch_size=settings.reference_batch)
        reference_seconds = time.perf_counter() - checked

    finished = engine.scheduler.finished
    prompts: dict[Hashable, list[int]] = {rid: prompt for rid, (prompt, _) in enumerate(work)}  # id = index
    reasons = [r.done_reason for r in finished.values()]
    comparison = compare_outputs(
        engine.model,
        (
            Compared(rid, request.generated, references[rid], prompts[rid], partial=request.done_reason != "finished")
            for rid, request in finished.items()
        ),
    )
    mismatches = list(comparison.mismatches)
    mismatches += [
        rid
        for rid, request in finished.items()
        if request.done_reason == "cancelled" and rid not in soak_cancelled and rid not in mismatches
    ]
    totals = engine.totals
    return SoakReport(
        settings=settings,
        requests=len(work),
        finished=reasons.count("finished"),
        cancelled=reasons.count("cancelled"),
        aborted=reasons.count("aborted"),
        unfinished=len(work) - len(finished),
        iterations=totals.steps,
        generated_tokens=totals.generated_tokens,
        suspensions=totals.suspensions,
        resumes=totals.events["resume"],
        recompute_pauses=totals.recompute_pauses,
        replays=totals.events["replay"],
        faults=dict(totals.faults),
        failed_copies=totals.failed_copies,
        checksum_mismatches=totals.checksum_mismatches,
        host_tier_losses=totals.host_tier_losses,
        host_tier_fallback=engine.scheduler.host_tier_fallback,
        compared=len(finished),
        mismatches=tuple(sorted(mismatches)),
        accepted=comparison.accepted,
        leaked_blocks=leaked_blocks(engine),
        run_seconds=run_seconds,
        reference_seconds=reference_seconds,
        events=dict(totals.events),
        trace_lines=engine.trace.lines if engine.trace is not None else 0,
        offload=engine.scheduler.policy.offload,
        blocks_offloaded=totals.blocks_offloaded,
        blocks_onboarded=totals.blocks_onboarded,
        resumed_without_copy=totals.resumed_without_copy,
        blocks_relocked=totals.blocks_relocked,
    )


# ------------------------------------------------------------------------------------------ command line
def register(subparsers: argparse._SubParsersAction) -> None:
    defaults = SoakSettings()
    p = subparsers.add_parser(
        "soak",
        help="thousands of seeded requests under memory pressure and injected faults; check nothing is lost",
        description=(
            "Run a seeded soak on the real executor: random arrivals, lengths and cancellations, a GPU tier "
            "far smaller than the demand, injected faults (failed copies, corrupt host copies, ...), and "
            "the scheduler's invariants checked around every iteration. Then compare every output with its "
            "unpressured reference. A fault that ends the host tier runs in a mix of its own; the summary "
            "counts every path and fault kind per mix and names those that ran fewer times than their floor. "
            "Exit status 1 on any mismatch, leaked block or unfinished request."
        ),
    )
    options = [
        ("--requests", BoundedInt(1, MAX_REQUESTS, "positive", "--requests"), "number of requests"),
        (
            "--seed",
            non_negative_int(maximum=MAX_SEED),
            "seed of the workload, arrivals, cancellations, faults, weights and sampling",
        ),
        ("--gpu-blocks", positive_int(maximum=MAX_BLOCKS), "GPU tier blocks"),
        ("--host-blocks", non_negative_int(maximum=MAX_BLOCKS), "host tier blocks, 0 = no host tier"),
        ("--block-size", positive_int(maximum=MAX_BLOCK_SIZE), "tokens per block"),
        ("--chunk-size", positive_int(maximum=MAX_TOKENS), "prefill chunk size in tokens"),
        ("--arrival-rate", float, "mean request arrivals per iteration"),
        ("--cancel-rate", float, "share of requests cancelled at a random time after arrival"),
    ]
    for flag, kind, text in options:
        p.add_argument(
            flag, type=kind, default=getattr(defaults, option_key(flag)), help=f"{text} (default %(default)s)"
        )
    p.add_argument(
        "--inject",
        action="append",
        metavar="KIND[:RATE]",
        help=(
            "inject a fault kind (host_alloc, copy_to_host, copy_to_gpu, corrupt_host, host_loss), with "
            "a probability or as KIND@ITERATION,...; repeat for several; 'none' for no faults "
            f"(default: {' '.join(DEFAULT_INJECT)}); host_loss and host_alloc each run in a mix of their own, "
            "on a share of the requests, so that the host tier stays up for the rest"
        ),
    )
    p.add_argument(
        "--no-checksums",
        action="store_true",
        help="do not checksum offloaded blocks (corrupt_host faults then garble outputs)",
    )
    add_offload_option(p)
    add_device_option(p)
    add_dtype_option(
        p,
        "; outputs are compared exactly in float64 and float32, and in lower precision up to near-ties of the "
        "reference (executor.checks.GAP_TOLERANCE)",
    )
    add_lifecycle_option(p, "the engine")
    add_output_options(p)
    p.set_defaults(run=_run)


def settings_from_args(args: argparse.Namespace) -> SoakSettings:
    injected = DEFAULT_INJECT if args.inject is None else tuple(i for i in args.inject if i != "none")
    names = {f.name for f in fields(SoakSettings)}
    values = {k: v for k, v in vars(args).items() if k in names and k not in ("faults", "dtype")}
    return SoakSettings(**values, faults=injected, checksums=not args.no_checksums)


def _run(args: argparse.Namespace) -> int:
    check_outputs(args)
    settings = settings_from_args(args)  # every setting and --inject checked before torch is imported
    check_fault_plan(settings.faults, settings.seed)
    check_cuda_driver(settings.device)
    import torch

    from executor import resolve_device, resolve_dtype

    try:
        device = resolve_device(settings.device)
    except ValueError as err:
        raise SoakError(f"--device {settings.device}: {err}") from None
    settings = replace(settings, dtype=str(resolve_dtype(dtype_setting(args.dtype), device)).removeprefix("torch."))
    prepare_outputs(args)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's ops are microseconds long: intra-op threads only add barriers
    try:
        return _soak(settings, args.report)
    finally:
        torch.set_num_threads(threads)


def _soak(settings: SoakSettings, report_dir: str | None = None) -> int:
    from kvstate.terminal import console, inert

    out = console()
    _say_settings(out, settings)
    try:
        matrix = _run_with_progress(out, settings)
    except ValueError as err:
        print(inert(f"kvstate soak: error: {err}"), file=sys.stderr)
        return 2
    _print_tables(out, matrix)
    _say_traces(out, matrix, report_dir)
    return _say_verdict(out, matrix)


def _say_settings(out, settings: SoakSettings) -> None:
    from kvstate.terminal import say

    host = f"{settings.host_blocks} blocks" if settings.host_blocks else "none"
    say(
        out,
        ("kvstate soak", "bold"),
        f": {settings.requests} requests, seed {settings.seed}, GPU tier {settings.gpu_blocks} blocks x "
        f"{settings.block_size} tokens, host tier {host}, faults: {' '.join(settings.faults) or 'none'}, checksums "
        f"{'on' if settings.checksums else 'off'}, offload {settings.offload or default_spec().policy.offload}",
    )
    mixes = fault_mixes(settings)
    if len(mixes) > 1:
        say(
            out,
            "mixes: "
            + "; ".join(
                f"{m.name}: {m.settings.requests} requests, {' '.join(m.settings.faults) or 'none'}" for m in mixes
            ),
        )


def _run_with_progress(out, settings: SoakSettings) -> MatrixReport:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("requests done"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
    )
    mixes = fault_mixes(settings)
    before = {m.name: sum(x.settings.requests for x in mixes[:i]) for i, m in enumerate(mixes)}  # requests run before
    with Progress(*columns, console=out) as progress:
        task = progress.add_task("soak", total=settings.requests, status="")

        def update(mix: str, done: int, total: int, stats: IterationStats | None) -> None:
            status = (
                f"mix {mix}"
                if stats is None
                else f"mix {mix}, iteration {stats.iteration}, now {stats.num_suspended} suspended, "
                f"{stats.num_recompute_paused} paused"
            )
            finished[0] = before[mix] + done
            progress.update(task, completed=finished[0], status=status)

        finished = [0]
        try:
            return run_matrix(settings, run_soak, update)
        except KeyboardInterrupt as err:
            err.add_note(f"{finished[0]} of {settings.requests} requests had finished; nothing was checked")
            raise


def _print_tables(out, matrix: MatrixReport) -> None:
    from rich.table import Table

    from kvstate.terminal import cell

    heads, rows = summary_columns(matrix)
    table = Table(title="Soak summary")
    table.add_column("metric")
    for head in heads if len(heads) > 1 else ["value"]:
        table.add_column(cell(head), justify="right")
    for name, values in rows:
        table.add_row(cell(name), *map(cell, values))
    out.print(table)
    paths = Table(title="Paths exercised (floor: the fewest runs that count as exercised)")
    paths.add_column("path or fault")
    for head in heads:
        paths.add_column(cell(head), justify="right")
    for head in ("total", "floor", ""):
        paths.add_column(head, justify="right")
    for count in matrix.paths():
        flag = "BARELY EXERCISED" if count.barely else ("ok" if count.floor else "not asked for")
        paths.add_row(cell(count.path), *map(str, count.per_mix), str(count.total), str(count.floor), flag)
    out.print(paths)


def _say_traces(out, matrix: MatrixReport, report_dir: str | None) -> None:
    from kvstate.terminal import say

    for mix, report in matrix.runs:
        if mix.settings.trace is not None:
            say(out, f"trace ({mix.name}): {Path(mix.settings.trace).resolve()} ({report.trace_lines} transitions)")
    main = matrix.runs[0][0].settings.trace
    if main is not None and report_dir is not None:
        from kvstate.report import write_report

        say(out, f"report: {write_report(main, report_dir).html.resolve()}")


def _say_verdict(out, matrix: MatrixReport) -> int:
    from kvstate.terminal import say

    barely = matrix.barely_exercised()
    if barely:
        say(out, ("paths barely exercised", "bold yellow"), f" (below their floor): {', '.join(barely)}")
    else:
        say(out, "every path and fault asked for ran at least its floor")
    reports = matrix.reports
    compared = sum(r.compared for r in reports)
    if matrix.ok:
        accepted = sum(len(r.accepted) for r in reports)
        dtype = matrix.settings.dtype
        near = f" ({accepted} diverge at a near-tie of the reference: accepted in {dtype})" if accepted else ""
        say(out, ("SOAK: PASS", "bold green"), f" - {compared} outputs equal their references{near}, no block leaked")
        return 0
    mismatches = [rid for r in reports for rid in r.mismatches]
    say(
        out,
        ("SOAK: FAIL", "bold red"),
        f" - {len(mismatches)} mismatches {mismatches[:10]}, {sum(r.leaked_blocks for r in reports)} leaked "
        f"blocks, {sum(r.unfinished for r in reports)} unfinished, {sum(r.aborted for r in reports)} aborted",
    )
    return 1
