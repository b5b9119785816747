"""The pipeline-parallel demo: a seeded workload under memory pressure on N stages, checked against the
single-process oracle. `run_pp_demo` returns the data `kvstate demo` prints (so the command only formats it).

Invariant kept: `differ` lists every finished request whose output breaks the per-dtype rule against
`Engine.reference` of it (`executor.checks.compare_outputs`: exact in float64 and float32); `ok` is true only when
nothing differs and no block is held at the end (rank 0's pool) — of both runs when the lockstep comparison ran
(the same workload with one micro-batch in flight, right after, in the same process).

Throughput is output tokens (of finished requests) per second of rank 0's loop (process start and the oracle
check left out), so the in-flight and lockstep figures of one run compare the pipelines alone.

The demo runs locally: its ranks meet over loopback only (`executor.pipeline.launch`), and a rank that dies or
stops ends it within `timeout_s` (default `DEMO_TIMEOUT_S`) with a one-line `RankLost`, a `ConnectionError`.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from executor.pipeline.config import PipelineConfig
from executor.pipeline.launch import PipelineResult, run_pipeline
from kvstate.spec import default_spec

if TYPE_CHECKING:
    from executor.engine_config import EngineConfig

DEMO_TIMEOUT_S = 60.0  # bound of every wait on a peer rank: a dead or stopped rank fails the demo this fast


@dataclass(frozen=True)
class PipelineDemoSummary:
    """What the demo reports: the header facts, the per-state table, the summary table and the verdict."""

    header: str
    state_rows: tuple[tuple[str, int, int], ...]  # (state, peak, final)
    summary_rows: tuple[tuple[str, str], ...]  # (metric, value), as in the single-process demo
    traces: tuple[tuple[str, int], ...]  # (path, lines) per rank, when tracing
    differ: tuple[Hashable, ...]
    outputs: int
    leaked_blocks: int
    result: PipelineResult
    lockstep: PipelineResult | None = None  # the same workload with micro_batches=1, when compared

    @property
    def comparison(self) -> str | None:
        """'in flight X tokens/s vs lockstep Y tokens/s: Z x' when the lockstep run was made."""
        if self.lockstep is None:
            return None
        flight, lock = output_tokens_per_s(self.result), output_tokens_per_s(self.lockstep)
        micro = self.result.driver.micro_batches
        return (
            f"{micro} micro-batches in flight {flight:,.0f} tokens/s vs lockstep {lock:,.0f} tokens/s: "
            f"{flight / lock:.2f}x"
        )

    @property
    def ok(self) -> bool:
        return not self.differ and not self.leaked_blocks

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1


def output_tokens_per_s(result: PipelineResult) -> float:
    """Output tokens of finished requests per second of rank 0's loop."""
    driver = result.driver
    tokens = sum(len(result.outputs[rid]) for rid, reason in driver.done_reasons.items() if reason == "finished")
    return tokens / driver.wall_s if driver.wall_s > 0 else 0.0


WORKLOAD_OPTIONS = (
    "requests",
    "gpu_blocks",
    "host_blocks",
    "block_size",
    "chunk_size",
    "hidden_size",
    "seed",
    "dtype",
    "trace",
    "offload",
)


def workload_options(args: object) -> dict:
    """The `run_pp_demo` arguments of parsed command-line options that both pipeline demo commands share (`kvstate
    demo --pp` and `python -m executor.pipeline`: the same option names)."""
    return {name: getattr(args, name) for name in WORKLOAD_OPTIONS}


def run_pp_demo(  # noqa: PLR0913 - keyword-only, one per `kvstate demo --pp` flag the command and tests set
    *,
    stages: int = 2,
    requests: int = 48,
    gpu_blocks: int = 32,
    host_blocks: int = 16,
    block_size: int = 8,
    chunk_size: int = 64,
    hidden_size: int = 64,
    seed: int = 0,
    device: str = "cpu",
    dtype: str = "float64",
    trace: str | Path | None = None,
    lifecycle: str = "machine",
    offload: str | None = None,
    fail_host_tier_on_ranks: frozenset[int] = frozenset(),
    micro_batches: int | None = None,
    compare_lockstep: bool = False,
    timeout_s: float = DEMO_TIMEOUT_S,
) -> PipelineDemoSummary:
    """Run the demo workload on `stages` spawned ranks and check every output against the oracle; with
    `compare_lockstep` (and several micro-batches in flight), run it again in lockstep and check that too."""
    from executor.checks import DEMO_MAX_NEW_TOKENS, DEMO_PROMPT_LEN, demo_engine_config, random_workload

    engine_config = demo_engine_config(
        gpu_blocks=gpu_blocks,
        host_blocks=host_blocks,
        block_size=block_size,
        chunk_size=chunk_size,
        hidden_size=hidden_size,
        seed=seed,
        device=device,
        dtype=dtype,
        trace=trace,
        lifecycle=lifecycle,
        offload=offload,
    )
    config = PipelineConfig(
        engine=engine_config,
        fail_host_tier_on_ranks=fail_host_tier_on_ranks,
        timeout_s=timeout_s,
        micro_batches=micro_batches,
    )
    work = random_workload(
        requests,
        seed,
        DEMO_PROMPT_LEN,
        DEMO_MAX_NEW_TOKENS,
        vocab=engine_config.model.vocab_size,
        max_tokens=gpu_blocks * block_size,
    )
    started = time.perf_counter()
    result = run_pipeline(config, work, stages)
    wall = time.perf_counter() - started
    lockstep = None
    if compare_lockstep and config.micro_batches_for(stages) > 1:
        lockstep = run_pipeline(
            replace(config, micro_batches=1, engine=replace(engine_config, trace_path=None)), work, stages
        )
    driver = result.driver
    checked = time.perf_counter()
    differ = mismatched(engine_config, work, (run for run in (result, lockstep) if run is not None))
    check_time = time.perf_counter() - checked
    host_text = _host_tier_text(host_blocks, driver.host_tier)
    layers = ", ".join(f"rank {r.rank}: layers {list(r.layers)}" for r in result.ranks)
    header = (
        f"kvstate demo --pp {stages}: {requests} requests on {device} ({dtype}, model width {hidden_size}), "
        f"GPU tier {gpu_blocks} blocks x {block_size} tokens per stage, host tier {host_text}, offload "
        f"{(engine_config.spec or default_spec()).policy.offload}; {layers}"
    )
    rows = _rows(stages, result, wall, check_time)
    states = tuple((s, driver.peak_states.get(s, 0), driver.final_states.get(s, 0)) for s in driver.peak_states)
    traces = (
        tuple((str(_trace_path(config, r.rank).resolve()), len(r.trace)) for r in result.ranks)
        if trace is not None
        else ()
    )
    leaked = driver.leaked_blocks + (lockstep.driver.leaked_blocks if lockstep is not None else 0)
    return PipelineDemoSummary(header, states, rows, traces, differ, len(result.outputs), leaked, result, lockstep)


def _host_tier_text(host_blocks: int, host: dict) -> str:
    """The host tier as the demo's header states it: its size, and the ranks whose allocation of it failed."""
    text = "none" if not host_blocks else f"{host_blocks} blocks"
    if host["fallback"]:
        text += f" (allocation failed on ranks {host['failed_ranks']}: every rank GPU-only)"
    return text


def mismatched(engine_config: EngineConfig, work: list[tuple[list[int], int]], runs: Iterable[PipelineResult]) -> tuple:
    """Ids (ascending) of finished requests whose output in any of `runs` fails the per-dtype equality rule against
    the oracle: the same request alone on one GPU-only engine."""
    import torch

    from executor.checks import Compared, compare_outputs
    from executor.engine import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        oracle_config = replace(
            engine_config, trace_path=None, scheduler=replace(engine_config.scheduler, host_blocks=0)
        )
        with Engine(oracle_config) as oracle:
            references = {rid: oracle.reference(prompt, new, request_id=rid) for rid, (prompt, new) in enumerate(work)}
            wrong = {
                rid
                for run in runs
                for rid in compare_outputs(
                    oracle.model,
                    (
                        Compared(rid, run.outputs[rid], references[rid], work[rid][0])
                        for rid, reason in run.driver.done_reasons.items()
                        if reason == "finished"
                    ),
                ).mismatches
            }
    finally:
        torch.set_num_threads(threads)
    return tuple(rid for rid in references if rid in wrong)  # request ids in ascending order


def _rows(stages: int, result: PipelineResult, wall: float, check_time: float) -> tuple[tuple[str, str], ...]:
    """The summary table: what rank 0 counted over the run."""
    from executor.checks import format_bytes
    from executor.run_totals import copy_rows

    driver = result.driver
    totals, events, host = driver.totals, driver.totals.get("events", {}), driver.host_tier
    return (
        ("requests", str(len(driver.done_reasons))),
        ("pipeline stages", str(stages)),
        ("micro-batches in flight", str(driver.micro_batches) + (" (lockstep)" if driver.micro_batches == 1 else "")),
        ("iterations", str(totals.get("steps", 0))),
        ("generated tokens", str(totals.get("generated_tokens", 0))),
        ("suspensions", str(events.get("suspend", 0))),
        ("resumes", str(events.get("resume", 0))),
        *copy_rows(totals),
        ("recompute-pauses", str(events.get("recompute_pause", 0))),
        ("consensus rounds", str(events.get("consensus", 0))),
        ("replays", str(events.get("replay", 0))),
        ("recomputed tokens", str(totals.get("recomputed_tokens", 0))),
        ("blocks migrated", str(totals.get("blocks_migrated", 0))),
        ("bytes migrated", format_bytes(totals.get("bytes_migrated", 0))),
        ("copy calls (merged runs, all stages)", str(sum(r.copy_calls for r in result.ranks))),
        ("host tier fallback", "yes" if host["fallback"] else "no"),
        ("tokens/s (generated)", f"{totals.get('generated_tokens', 0) / wall:,.0f}" if wall > 0 else "-"),
        ("output tokens/s (rank 0's loop)", f"{output_tokens_per_s(result):,.0f}"),
        ("wall time (incl. process start)", f"{wall:.2f} s"),
        ("reference check time", f"{check_time:.2f} s"),
    )


def _trace_path(config: PipelineConfig, rank: int) -> Path:
    """The trace file of `rank`; raises when `config` writes no trace (set `EngineConfig.trace_path`)."""
    path = config.trace_path_for(rank)
    if path is None:
        raise ValueError(f"rank {rank} writes no trace: set EngineConfig.trace_path to write one per rank")
    return path
