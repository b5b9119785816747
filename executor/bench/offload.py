"""The `offload` group: the spec's two offload policies side by side on a bursty workload.

`on_demand` (shipped) moves a suspended request's held blocks to the host tier only when an allocation needs the
GPU room, exactly as many as it needs; `eager` moves all of them in the pass that suspends it (the design before
lazy suspension). The difference shows where pressure comes and goes: a steady stream of short requests that the
GPU tier holds, and every `burst_every` steps a burst of longer ones that it does not, so victims are suspended
and, a few steps later, when earlier requests finish, resumed. Under `on_demand` a resume re-locks the blocks the
bursts did not need with no copy; under `eager` every block of every victim crosses to the host and back.

Both policies run the same seeded workload on the same engine settings and weights (float32, greedy, one intra-op
thread; a host tier with room for every block), taking turns in one interleaved loop (`timing.interleaved`);
each run is timed from the first submission to the last token, in this thread's CPU time on the CPU. Per policy
the rows give decode tokens/s (generated tokens per second of the whole run: every token after a request's first
comes from a decode step) and the blocks copied between the tiers, beside the other policy's, with the resumes
that needed no copy and the longest stretch of steps with a suspended request (how quickly the pressure
resolved). Every output of both policies, in every round, is compared with the same requests run unpressured (GPU
room for all of them at once), which is the rows' target. torch is imported inside the run functions.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from executor.bench.results import Row, Section
from executor.bench.serving import Request, needed_blocks
from executor.bench.timing import interleaved, median, round_ratios
from kvstate.config import SchedulerConfig

BLOCK_SIZE = 16
OFFLOADS = ("on_demand", "eager")  # the spec's offload policies, the shipped one first


@dataclass(frozen=True)
class BurstShape:
    """A bursty workload: one request of `prompt_len` tokens and `new_tokens` new ones arrives every step for
    `steps` steps, and `burst_size` requests of `burst_prompt_len` and `burst_new_tokens` arrive together in the
    middle of every `burst_every` steps; a GPU tier of `gpu_blocks` holds the stream but not a burst on top of it;
    `repeats` interleaved rounds after a warmup."""

    steps: int
    burst_every: int
    burst_size: int
    prompt_len: int
    new_tokens: int
    burst_prompt_len: int
    burst_new_tokens: int
    gpu_blocks: int
    repeats: int


FULL_BURSTS = BurstShape(96, 24, 8, 32, 16, 48, 24, gpu_blocks=80, repeats=7)
QUICK_BURSTS = BurstShape(24, 12, 4, 16, 8, 32, 12, gpu_blocks=16, repeats=1)


def bursty_workload(shape: BurstShape, vocab: int, seed: int) -> list[Request]:
    """The seeded requests of `shape`, in arrival order (`Request.arrival`: the engine step before which each is
    submitted)."""
    rng = random.Random(seed)

    def prompt(size: int) -> tuple[int, ...]:
        return tuple(rng.randrange(vocab) for _ in range(size))

    requests = []
    for step in range(shape.steps):
        requests.append(Request(prompt(shape.prompt_len), shape.new_tokens, step))
        if step % shape.burst_every == shape.burst_every // 2:
            requests += [
                Request(prompt(shape.burst_prompt_len), shape.burst_new_tokens, step) for _ in range(shape.burst_size)
            ]
    return requests


@dataclass
class BurstRun:
    """What one engine run of the workload gave: its outputs (in request order), engine steps, the longest stretch
    of consecutive steps that ended with a suspended request, and its copy totals (`RunTotals.to_dict()`)."""

    outputs: list[list[int]]
    steps: int
    longest_pressure: int
    totals: dict


def run_engine(
    model,
    requests: list[Request],
    *,
    gpu_blocks: int,
    host_blocks: int,
    offload: str | None,
    lifecycle: str = "machine",
) -> BurstRun:
    """One engine run of `requests` (each submitted before its arrival step) with a GPU tier of `gpu_blocks`, a
    host tier of `host_blocks` and the spec's offload policy `offload` (None: the spec's own), its transitions
    fired by `lifecycle`."""
    from executor import Engine, EngineConfig, offload_spec

    longest = max(len(r.prompt) for r in requests)
    scheduler = SchedulerConfig(
        gpu_blocks=gpu_blocks,
        host_blocks=host_blocks,
        block_size=BLOCK_SIZE,
        max_batch_size=len(requests),
        max_num_tokens=max(longest, 2048),
        prefill_chunk_size=longest,
        lifecycle=lifecycle,
    )
    spec = None if offload is None else offload_spec(offload)
    config = EngineConfig(scheduler=scheduler, device=model.device.type, dtype="float32", spec=spec)
    ids: list[Hashable] = []
    step = pressure = longest_pressure = 0
    with Engine(config, model=model) as engine:
        while len(ids) < len(requests) or engine.scheduler.has_unfinished:
            while len(ids) < len(requests) and requests[len(ids)].arrival <= step:
                ids.append(engine.add_request(requests[len(ids)].prompt, requests[len(ids)].budget))
            pressure = pressure + 1 if engine.step().num_suspended else 0
            longest_pressure = max(longest_pressure, pressure)
            step += 1
        out = engine.outputs()
    return BurstRun([out[rid] for rid in ids], step, longest_pressure, engine.totals.to_dict())


def bursty_section(
    *, shape: BurstShape = FULL_BURSTS, device: str = "cpu", seed: int = 0, lifecycle: str = "machine", progress=None
) -> Section:
    """Decode tokens/s and blocks copied of each offload policy beside the other's on the bursty workload, every
    output compared with the unpressured run's."""
    import torch

    from executor import LlamaModel, ModelConfig

    dev = torch.device("cuda" if device != "cpu" and torch.cuda.is_available() else "cpu")
    model = LlamaModel.from_seed(ModelConfig(), seed, dtype=torch.float32, device=dev)
    requests = bursty_workload(shape, model.config.vocab_size, seed)
    room = needed_blocks(requests, BLOCK_SIZE)  # every request at its end, all at once: no pressure
    unpressured = run_engine(model, requests, gpu_blocks=room, host_blocks=0, offload=None, lifecycle=lifecycle)
    clock = time.thread_time if dev.type == "cpu" else time.perf_counter
    runs: dict[str, BurstRun] = {}
    seconds: dict[str, list[float]] = {offload: [] for offload in OFFLOADS}
    equal = dict.fromkeys(OFFLOADS, len(requests))  # outputs equal to the unpressured run's, in every round

    def variant(offload: str) -> Callable[[], None]:
        def call() -> None:
            start = clock()
            runs[offload] = run_engine(
                model, requests, gpu_blocks=shape.gpu_blocks, host_blocks=room, offload=offload, lifecycle=lifecycle
            )
            seconds[offload].append(clock() - start)
            same = sum(a == b for a, b in zip(runs[offload].outputs, unpressured.outputs, strict=True))
            equal[offload] = min(equal[offload], same)

        return call

    if progress is not None:
        progress(f"{len(OFFLOADS)} offload policies x {shape.repeats + 1} runs, interleaved")
    interleaved({offload: variant(offload) for offload in OFFLOADS}, repeats=shape.repeats, warmup=1, seed=seed)
    rate = {o: runs[o].totals["generated_tokens"] / median(seconds[o][1:]) for o in OFFLOADS}
    section = Section(
        "offload",
        data={
            "shape": shape.__dict__,
            "requests": len(requests),
            "host_blocks": room,
            "unpressured_steps": unpressured.steps,
            "tokens_per_s": rate,
            "runs": {
                o: {**runs[o].totals, "steps": runs[o].steps, "longest_pressure": runs[o].longest_pressure}
                for o in OFFLOADS
            },
            "outputs_equal": equal,
        },
    )
    measured = _Measured(runs, rate, seconds, equal, len(requests), shape)
    for ours, theirs in (OFFLOADS, OFFLOADS[::-1]):
        section.rows += _rows(ours, theirs, measured)
    return section


@dataclass(frozen=True)
class _Measured:
    """What the interleaved runs gave, by offload policy: the last run, decode tokens/s, the seconds of every round
    (the warmup first) and the outputs equal to the unpressured run's in every round (of `every`); `shape` ran."""

    runs: dict[str, BurstRun]
    rate: dict[str, float]
    seconds: dict[str, list[float]]
    equal: dict[str, int]
    every: int
    shape: BurstShape


def _rows(ours: str, theirs: str, measured: _Measured) -> list[Row]:
    """The decode tokens/s and blocks copied rows of policy `ours` beside policy `theirs`."""
    runs, rate, equal, every = measured.runs, measured.rate, measured.equal, measured.every
    mine, other = runs[ours].totals, runs[theirs].totals
    spread = round_ratios(measured.seconds[theirs][1:], measured.seconds[ours][1:])
    target = "outputs equal to unpressured"
    met = equal[ours] == every
    where = f"bursty workload, GPU tier {measured.shape.gpu_blocks} blocks, offload {ours}"
    copies = (
        f"{mine['blocks_offloaded']} blocks offloaded and {mine['blocks_onboarded']} onboarded ({theirs}: "
        f"{other['blocks_offloaded']} and {other['blocks_onboarded']}); {mine['resumed_without_copy']} of "
        f"{mine['events'].get('resume', 0)} resumes without a copy ({theirs}: {other['resumed_without_copy']} of "
        f"{other['events'].get('resume', 0)})"
    )
    return [
        Row(
            group="offload",
            name=f"{where}: decode tokens/s",
            value=rate[ours],
            unit="tok/s",
            baseline_name=f"offload {theirs}, same loop",
            baseline=rate[theirs],
            target=target,
            met=met,
            note=(
                f"outputs equal to unpressured for {equal[ours]}/{every}; {runs[ours].steps} engine steps, "
                f"suspended requests for at most {runs[ours].longest_pressure} steps in a row; per-round ratios "
                f"{min(spread):.2f} to {max(spread):.2f} over {len(spread)} rounds"
            ),
        ),
        Row(
            group="offload",
            name=f"{where}: blocks copied between the tiers",
            value=mine["blocks_migrated"],
            unit="blocks",
            baseline_name=f"offload {theirs}",
            baseline=other["blocks_migrated"],
            better="lower",
            target=target,
            met=met,
            note=copies,
        ),
    ]


__all__ = ["FULL_BURSTS", "OFFLOADS", "QUICK_BURSTS", "BurstRun", "BurstShape", "bursty_section", "bursty_workload"]
