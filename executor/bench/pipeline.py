"""The `pipeline` group: two pipeline stages with micro-batches in flight beside the same stages in lockstep.

The workload is `kvstate demo --pp 2`'s (192 requests under memory pressure, a model of width 256, float64; with
`--quick` 48 requests), on gloo processes on the CPU (the bench's `--device` does not apply). Each repeat runs it
once in flight (one micro-batch per stage) and once in lockstep (`micro_batches=1`), alternating which goes first
from one repeat to the next, so a slow spell of the shared machine hits both alike; the figure is the ratio of the
medians of rank 0's output tokens per second of its loop (process start left out). Every run's outputs must equal
the first in-flight run's, and that run's the oracle's (`Engine.reference` of each request, compared by
`executor.checks.compare_outputs`); the row says so. torch is imported inside `run`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from executor.bench.results import Row, Section

STAGES = 2
PIPELINE_RATIO_TARGET = 1.4  # in flight >= 1.4x lockstep at width 256, measured interleaved


def run(*, quick: bool, seed: int = 0, lifecycle: str = "machine", progress: Callable | None = None) -> Section:
    from executor.checks import DEMO_MAX_NEW_TOKENS, DEMO_PROMPT_LEN, demo_engine_config, random_workload
    from executor.commands.demo import DEFAULTS, PP_DEFAULTS
    from executor.pipeline.config import PipelineConfig
    from executor.pipeline.demo import mismatched, output_tokens_per_s
    from executor.pipeline.launch import run_pipeline

    say = progress or (lambda message: None)
    shape: dict[str, Any] = {**DEFAULTS, **PP_DEFAULTS, **({"requests": 48} if quick else {})}
    repeats = 1 if quick else 3
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
            ),
        )
    )
    return section


__all__ = ["PIPELINE_RATIO_TARGET", "run"]
