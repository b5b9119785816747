"""The `pipeline` group: two pipeline stages with micro-batches in flight beside the same stages in lockstep.

The workload is `kvstate demo --pp 2`'s (192 requests under memory pressure, a model of width 256, float64; with
`--quick` 48 requests), on gloo processes on the CPU (the bench's `--device` does not apply). Each repeat runs it
once in flight (one micro-batch per stage) and once in lockstep (`micro_batches=1`), alternating which goes first
from one repeat to the next, so a slow spell of the shared machine hits both alike; the figure is the ratio of the
medians of rank 0's output tokens per second of its loop (process start left out). Every run's outputs must equal
the first in-flight run's, and that run's the oracle's (`Engine.reference` of each request, compared by
`executor.checks.compare_outputs`); the row says so. The row also says where each stage's loop went, per rank
(medians over the repeats), in flight and in lockstep, as shares of its wall time: on a core (its process's CPU
time), waiting for a message from the other stage, and the rest (ready to run while the machine's other processes
held its core, or blocked elsewhere). Beside it, the ratio the stages' CPU times allow with a free core per stage
(`free_core_ratio`): lockstep then takes the stages' CPU times one after the other, in flight the larger of them.
torch is imported inside `run`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from executor.bench.results import Row, Section

STAGES = 2
PIPELINE_RATIO_TARGET = 1.4  # in flight >= 1.4x lockstep at width 256, measured interleaved


def free_core_ratio(lockstep_cpu_s: Sequence[float], in_flight_cpu_s: Sequence[float]) -> float:
    """In flight over lockstep with a free core per stage, from each stage's CPU time (seconds, per rank) in each
    mode: lockstep passes a micro-batch through the stages one after the other, so it takes their CPU times
    together; in flight the stages overlap, so it takes the larger one's."""
    if not lockstep_cpu_s or len(lockstep_cpu_s) != len(in_flight_cpu_s) or min(in_flight_cpu_s) <= 0:
        raise ValueError(
            f"need one positive CPU time per stage in each mode, got lockstep {list(lockstep_cpu_s)} and "
            f"in flight {list(in_flight_cpu_s)}"
        )
    return sum(lockstep_cpu_s) / max(in_flight_cpu_s)


def run(*, quick: bool, seed: int = 0, lifecycle: str = "machine", progress: Callable | None = None) -> Section:
    from executor.commands.demo import DEFAULTS, PP_DEFAULTS
    from executor.pipeline.config import PipelineConfig
    from executor.pipeline.demo import mismatched, output_tokens_per_s
    from executor.pipeline.launch import run_pipeline

    say = progress or (lambda message: None)
    shape: dict[str, Any] = {**DEFAULTS, **PP_DEFAULTS, **({"requests": 48} if quick else {})}
    repeats = 1 if quick else 3
    engine, work = _workload(shape, seed, lifecycle)
    configs = {"in flight": PipelineConfig(engine=engine), "lockstep": PipelineConfig(engine=engine, micro_batches=1)}
    runs: dict[str, list] = {name: [] for name in configs}
    for repeat in range(repeats):
        order = list(configs) if repeat % 2 == 0 else list(reversed(configs))
        for name in order:
            say(f"repeat {repeat + 1}/{repeats}: {name}")
            runs[name].append(run_pipeline(configs[name], work, STAGES))
    say("checking outputs")
    first = runs["in flight"][0]
    same = all(run.outputs == first.outputs for results in runs.values() for run in results)
    wrong = mismatched(engine, work, [first])
    rates = {name: [output_tokens_per_s(run) for run in results] for name, results in runs.items()}
    flight, lock = (statistics.median(rates[name]) for name in configs)
    equal = same and not wrong
    micro = first.driver.micro_batches
    section = Section(
        "pipeline",
        data={
            "stages": STAGES,
            "micro_batches": micro,
            "requests": shape["requests"],
            "hidden_size": shape["hidden_size"],
            "repeats": repeats,
            "tokens_per_s": rates,
            "outputs_equal": equal,
            **_rank_figures(runs),
        },
    )
    section.rows.append(
        Row(
            group="pipeline",
            name=(
                f"output tokens/s, {STAGES} stages, {micro} micro-batches in flight, width {shape['hidden_size']}, "
                f"{shape['requests']} requests"
            ),
            value=flight,
            unit="tok/s",
            baseline_name="lockstep (1 micro-batch)",
            baseline=lock,
            target=f"ratio >= {PIPELINE_RATIO_TARGET}, outputs equal",
            met=flight / lock >= PIPELINE_RATIO_TARGET and equal if lock else None,
            note=(
                f"medians of {repeats} alternating runs each; "
                + ("outputs equal across runs and to the oracle" if equal else f"outputs DIFFER ({len(wrong)} wrong)")
                + _stage_note(runs)
            ),
        )
    )
    return section


def _workload(shape: dict[str, Any], seed: int, lifecycle: str) -> tuple[Any, list]:
    """The demo's engine configuration on the CPU in float64, and its seeded requests, for `shape`."""
    from executor.checks import DEMO_MAX_NEW_TOKENS, DEMO_PROMPT_LEN, demo_engine_config, random_workload

    engine = demo_engine_config(
        gpu_blocks=shape["gpu_blocks"],
        host_blocks=shape["host_blocks"],
        block_size=shape["block_size"],
        chunk_size=shape["chunk_size"],
        hidden_size=shape["hidden_size"],
        seed=seed,
        device="cpu",
        dtype="float64",  # the demo's dtype on the CPU (--dtype auto)
        trace=None,
        lifecycle=lifecycle,
    )
    work = random_workload(
        shape["requests"],
        seed,
        DEMO_PROMPT_LEN,
        DEMO_MAX_NEW_TOKENS,
        vocab=engine.model.vocab_size,
        max_tokens=shape["gpu_blocks"] * shape["block_size"],
    )
    return engine, work


def _stage_note(runs: dict[str, list]) -> str:
    """Where each stage's loop went per mode (shares of its wall time: CPU, waiting for the other stage, the
    rest), and `free_core_ratio` of the median CPU times (module docstring)."""
    cpu = {name: _per_rank(results, "cpu_s") for name, results in runs.items()}
    wait = {name: _per_rank(results, "receive_wait_s") for name, results in runs.items()}
    wall = {name: _per_rank(results, "wall_s") for name, results in runs.items()}
    shares = "; ".join(
        f"{name} "
        + ", ".join(
            f"rank {r} {c / w:.0%}/{q / w:.0%}/{max(w - c - q, 0.0) / w:.0%} of {c:.2f}/{q:.2f}/{w:.2f} s"
            for r, (c, q, w) in enumerate(zip(cpu[name], wait[name], wall[name], strict=True))
        )
        for name in runs
    )
    return (
        f"; stage loops on a core/waiting for the other stage/the rest: {shares}; "
        f"with a free core per stage these CPU times give {free_core_ratio(cpu['lockstep'], cpu['in flight']):.2f}x"
    )


def _rank_figures(runs: dict[str, list]) -> dict[str, dict[str, list[list[float]]]]:
    """`rank_cpu_s`, `rank_receive_wait_s` and `rank_wall_s`: per mode, per run, each rank's figure."""
    return {
        f"rank_{what}": {
            name: [[getattr(r, what) for r in run.ranks] for run in results] for name, results in runs.items()
        }
        for what in ("cpu_s", "receive_wait_s", "wall_s")
    }


def _per_rank(results: list, attribute: str) -> list[float]:
    """The median of `attribute` of each rank's result over the runs `results`."""
    return [statistics.median(getattr(run.ranks[r], attribute) for run in results) for r in range(STAGES)]


__all__ = ["PIPELINE_RATIO_TARGET", "free_core_ratio", "run"]
