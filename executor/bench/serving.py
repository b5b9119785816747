"""The `transformers` group's serving workloads: what a serving engine sees, beside `generate` run the way a static
batcher would run it, and memory pressure beside the same requests unpressured.

`end_to_end.decode_section` is the engine's best case (equal prompts and budgets, so one decode plan serves every
step). Here, at batch 64 (`--quick`: 4, with 8-token prompts and budgets), seeded, greedy, float32, one intra-op thread:

* `ragged prompts`: prompt lengths drawn from 8 to 64 tokens, 64 new tokens each;
* `staggered budgets`: 32-token prompts, budgets drawn from 8 to 64 tokens (requests finish at different steps);
* `arrivals during decode`: half the requests at the start, the other half arriving one every other step while
  the first half decodes;
* `memory pressure`: the best case's requests with a GPU tier of half the blocks they need, and a host tier of
  none, a quarter or all of them, beside the same requests with room for all (the target applies to a full host
  tier). With a host tier, each size runs under both offload policies of the spec (`PRESSURE_RUNS`): `on_demand`
  (shipped: a suspended request's held blocks move to the host tier only when an allocation needs the room) and
  `eager` (all of them when it is suspended); without one nothing is ever offloaded, so one run stands for both.
  Each pressure row also says how many engine steps the run took, beside the unpressured run's and the fewest any
  schedule could take in that GPU tier (`fewest_steps`): a step has a fixed cost that does not shrink with its
  batch, so the ratio falls with the step count as well as with what each step costs; the blocks it offloaded
  and the resumes that needed no copy (their blocks were all still on the GPU); and what a step of the run cost
  on average beside an unpressured step, with the ratio that `fewest_steps` steps of that cost would give
  (`step_cost_ceiling`): where that is short of the target, no schedule in that GPU tier reaches the target
  until a step costs less.

The peer is `transformers`' `LlamaForCausalLM.generate` on the same weights, driven one static batch at a time,
as a server without continuous batching would: the requests present when a batch starts form it (prompts
left-padded, with an attention mask), it runs until its largest budget is spent (`min_new_tokens` = that budget:
no early stop) and each output is cut to its own budget; requests that arrive meanwhile wait for the next batch.
Both sides are timed from the first submission to the last token (prefill included), in this thread's CPU time
on the CPU, and the figure is useful tokens (each request's own budget) per second. Every engine output, the
pressured ones included, is compared with generate's for the same request. torch and transformers are imported
inside the run function.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from executor.bench.results import Row, Section
from executor.bench.timing import interleaved, median, round_ratios
from kvstate.config import SchedulerConfig
from kvstate.pool import ceil_div

BLOCK_SIZE = 16
SERVING_RATIO_TARGET = 1.15  # the decode goal, held on the serving workloads too
PRESSURE_RATIO_TARGET = 0.85  # pressured with a full host tier >= 0.85x unpressured
TOKEN_BUDGET = 2048  # tokens the engine computes per step at most (prompt chunks and decode steps together)
HOST_TIERS = {"none": 0.0, "a quarter": 0.25, "full": 1.0}  # host tier, as a share of the blocks the requests need
OFFLOADS = ("on_demand", "eager")  # the spec's offload policies, the shipped one first
# the pressure runs: (host tier, offload policy); without a host tier nothing is offloaded, so one run (None)
PRESSURE_RUNS: tuple[tuple[str, str | None], ...] = tuple(
    (tier, offload) for tier, share in HOST_TIERS.items() for offload in (OFFLOADS if share else (None,))
)


def pressure_run(tier: str, offload: str | None) -> str:
    """The name of the engine run under pressure with host tier `tier` and offload policy `offload`."""
    return f"pressure, host tier {tier}{'' if offload is None else f', offload {offload}'} engine"


@dataclass(frozen=True)
class Request:
    """One request of a workload: submitted before engine step `arrival` (0: at the start)."""

    prompt: tuple[int, ...]
    budget: int
    arrival: int = 0


@dataclass(frozen=True)
class ServingShape:
    """How large the serving workloads are: requests, the best case's prompt and budget, interleaved repeats."""

    batch: int
    prompt_len: int
    new_tokens: int
    repeats: int


FULL_SERVING = ServingShape(batch=64, prompt_len=32, new_tokens=64, repeats=7)  # 3 left the ratios +-10% apart
QUICK_SERVING = ServingShape(batch=4, prompt_len=8, new_tokens=8, repeats=1)


def workloads(shape: ServingShape, vocab: int, seed: int) -> dict[str, list[Request]]:
    """The seeded workloads by name (module docstring); `best case` is the pressure rows' requests."""
    rng = random.Random(seed)
    n, length, budget = shape.batch, shape.prompt_len, shape.new_tokens

    def prompt(size: int) -> tuple[int, ...]:
        return tuple(rng.randrange(vocab) for _ in range(size))

    return {
        "best case": [Request(prompt(length), budget) for _ in range(n)],
        "ragged prompts": [Request(prompt(rng.randint(length // 4, 2 * length)), budget) for _ in range(n)],
        "staggered budgets": [Request(prompt(length), rng.randint(budget // 8, budget)) for _ in range(n)],
        "arrivals during decode": [
            Request(prompt(length), budget, 0 if i < n // 2 else 2 * (i - n // 2) + 2) for i in range(n)
        ],
    }


def needed_blocks(requests: list[Request], block_size: int = BLOCK_SIZE) -> int:
    """The GPU blocks that hold every request at its end (prompt and whole budget)."""
    return sum(ceil_div(len(r.prompt) + r.budget, block_size) for r in requests)


def fewest_steps(requests: list[Request], gpu_blocks: int, block_size: int = BLOCK_SIZE) -> int:
    """A lower bound on the engine steps that serve `requests` (all present at the start) with a GPU tier of
    `gpu_blocks`, whatever the schedule (chunking, preemption, host tier):

    * a request takes at least `budget` steps: its prefill samples its first token, each later token is one
      decode step after the one before;
    * a step holds, for each request it computes, the GPU blocks of that request's whole context (the forward
      reads them), so a request holds at least ``ceil(P / block_size)`` block-steps for its prompt of P tokens
      (chunked, its last chunk alone holds that many) and ``ceil((P + g - 1) / block_size)`` for the step that
      samples its token g >= 2; recomputing a paused request only adds to that. A step has `gpu_blocks`, so the
      steps are at least the sum over requests divided by `gpu_blocks`, rounded up."""
    if gpu_blocks < 1:
        raise ValueError(f"gpu_blocks must be >= 1, got {gpu_blocks}")
    held = 0
    for r in requests:
        prompt = len(r.prompt)
        held += ceil_div(prompt, block_size) + sum(ceil_div(prompt + g - 1, block_size) for g in range(2, r.budget + 1))
    return max(max((r.budget for r in requests), default=0), ceil_div(held, gpu_blocks))


def step_cost_ceiling(unpressured_seconds: float, pressured_seconds: float, pressured_steps: int, fewest: int) -> float:
    """The ratio (unpressured time over pressured time) a pressured run would reach in `fewest` steps (the
    `fewest_steps` bound), each costing what a step of the measured run cost on average: ``unpressured_seconds /
    (fewest * pressured_seconds / pressured_steps)``. A schedule of fewer steps packs more tokens into each, so
    its steps cost no less: the ratio it could reach is at most this, until a step costs less."""
    if fewest < 1 or pressured_steps < fewest or pressured_seconds <= 0:
        raise ValueError(
            f"need 1 <= fewest <= pressured_steps and pressured_seconds > 0, got fewest={fewest}, "
            f"pressured_steps={pressured_steps}, pressured_seconds={pressured_seconds}"
        )
    return unpressured_seconds * pressured_steps / (fewest * pressured_seconds)


def workload_section(
    *,
    shape: ServingShape = FULL_SERVING,
    device: str = "cpu",
    seed: int = 0,
    lifecycle: str = "machine",
    progress=None,
) -> Section:
    """Useful tokens/s of the engine beside `generate` per serving workload, and under memory pressure beside the
    unpressured engine; every output compared with generate's."""
    from executor.bench.end_to_end import models

    model, hf, peer, missing = models(device, seed)
    work = workloads(shape, model.config.vocab_size, seed)
    best = work["best case"]
    need = needed_blocks(best)
    runs: dict[str, Callable[[], None]] = {}
    seconds: dict[str, list[float]] = {}
    outputs: dict[str, list[list[int]]] = {}
    clock = time.thread_time if model.device.type == "cpu" else time.perf_counter

    def timed(name: str, run: Callable[[], list[list[int]]]) -> None:
        def call() -> None:
            start = clock()
            outputs[name] = run()
            seconds.setdefault(name, []).append(clock() - start)

        runs[name] = call

    steps: dict[str, int] = {}  # engine steps of each engine run (the same in every repeat: seeded, greedy)
    copies: dict[str, dict[str, int]] = {}  # what each engine run copied and saved (`_copies`)

    def engine(name: str, requests: list[Request], *, need: int, host: int = 0, offload: str | None = None) -> None:
        timed(
            name,
            _engine_run(
                model,
                requests,
                need=need,
                host=host,
                lifecycle=lifecycle,
                offload=offload,
                record_steps=functools.partial(steps.__setitem__, name),
                record_copies=functools.partial(copies.__setitem__, name),
            ),
        )

    for name in ("ragged prompts", "staggered budgets", "arrivals during decode"):
        engine(f"{name} engine", work[name], need=needed_blocks(work[name]))
        if hf is not None:
            timed(f"{name} generate", _generate_run(hf, work[name]))
    engine("best case engine", best, need=need)
    for tier, offload in PRESSURE_RUNS:
        engine(pressure_run(tier, offload), best, need=need // 2, host=int(need * HOST_TIERS[tier]), offload=offload)
    if hf is not None:
        timed("best case generate", _generate_run(hf, best))
    if progress is not None:
        progress(f"{len(runs)} runs x {shape.repeats + 1}, interleaved")
    interleaved(runs, repeats=shape.repeats, warmup=1, seed=seed)
    rate = {name: _useful(work, name) / median(values[1:]) for name, values in seconds.items()}
    fewest = fewest_steps(best, need // 2)  # the pressure rows' GPU tier: half of what the requests need
    data = {"batch": shape.batch, "repeats": shape.repeats, "peer": peer, "missing": missing}
    data.update(gpu_blocks_needed=need, tokens_per_s=rate, engine_steps=steps, engine_copies=copies)
    section = Section("serving", data={**data, "fewest_steps_under_pressure": fewest})
    measured = _Measured(rate, outputs, seconds, steps, copies, peer)
    section.data["step_seconds"] = {name: measured.step_seconds(name) for name in steps}
    section.data["step_cost_ceiling"] = {
        pressure_run(tier, offload): measured.ceiling(pressure_run(tier, offload), fewest)
        for tier, offload in PRESSURE_RUNS
    }
    for name in ("ragged prompts", "staggered budgets", "arrivals during decode", "best case"):
        section.rows.append(_peer_row(name, work[name], measured))
    for tier, offload in PRESSURE_RUNS:
        section.rows.append(_pressure_row(tier, offload, need=need, fewest=fewest, requests=best, measured=measured))
    return section


@dataclass(frozen=True)
class _Measured:
    """What the interleaved runs gave, by run name: useful tokens/s (`rate`), the last outputs, the seconds of
    every round (the warmup first), the engine runs' step counts and copies (`_copies`); `peer` names the peer."""

    rate: dict[str, float]
    outputs: dict[str, list[list[int]]]
    seconds: dict[str, list[float]]
    steps: dict[str, int]
    copies: dict[str, dict[str, int]]
    peer: str

    def step_seconds(self, run: str) -> float:
        """The median seconds of engine run `run` (the warmup left out) over its engine steps."""
        return median(self.seconds[run][1:]) / self.steps[run]

    def ceiling(self, run: str, fewest: int) -> float:
        """`step_cost_ceiling` of pressure run `run` beside the unpressured best case."""
        unpressured = median(self.seconds["best case engine"][1:])
        return step_cost_ceiling(unpressured, median(self.seconds[run][1:]), self.steps[run], fewest)

    def spread(self, baseline: str, variant: str) -> str:
        """A note on the ratio's noise: the lowest and highest of its per-round ratios (`round_ratios`, the warmup
        round left out), or nothing when `baseline` did not run."""
        if baseline not in self.seconds:
            return ""
        ratios = round_ratios(self.seconds[baseline][1:], self.seconds[variant][1:])
        return f"; per-round ratios {min(ratios):.2f} to {max(ratios):.2f} over {len(ratios)} rounds"


def _useful(work: dict[str, list[Request]], run: str) -> int:
    """The tokens the run's requests asked for (each its own budget)."""
    name = "best case" if run.startswith("pressure") else run.rsplit(" ", 1)[0]
    return sum(r.budget for r in work[name])


def _engine_run(
    model,
    requests: list[Request],
    *,
    need: int,
    host: int = 0,
    lifecycle: str,
    offload: str | None = None,
    record_steps: Callable[[int], None],
    record_copies: Callable[[dict[str, int]], None] | None = None,
):
    """A run of the engine over `requests` (arrivals submitted before their step), GPU tier `need` blocks, the spec's
    offload policy `offload` (None: the spec's own); each run tells `record_steps` how many engine steps it took
    and `record_copies` what it copied (`_copies`)."""

    def run() -> list[list[int]]:
        from executor import Engine, EngineConfig, offload_spec

        longest = max(len(r.prompt) for r in requests)
        scheduler = SchedulerConfig(
            gpu_blocks=need,
            host_blocks=host,
            block_size=BLOCK_SIZE,
            max_batch_size=len(requests),
            max_num_tokens=max(longest, TOKEN_BUDGET),
            prefill_chunk_size=longest,
            lifecycle=lifecycle,
        )
        spec = None if offload is None else offload_spec(offload)
        config = EngineConfig(scheduler=scheduler, device=model.device.type, dtype="float32", spec=spec)
        pending = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
        ids: dict[int, Hashable] = {}
        with Engine(config, model=model) as engine:
            step = 0
            while pending or engine.scheduler.has_unfinished:
                while pending and requests[pending[0]].arrival <= step:
                    i = pending.pop(0)
                    ids[i] = engine.add_request(requests[i].prompt, requests[i].budget)
                engine.step()
                step += 1
            out = engine.outputs()
        record_steps(step)
        if record_copies is not None:
            record_copies(_copies(engine.totals))
        return [out[ids[i]] for i in range(len(requests))]

    return run


def _copies(totals) -> dict[str, int]:
    """What an engine run (its `RunTotals`) copied, and the resumes that needed no copy."""
    return {
        "blocks_migrated": totals.blocks_migrated,
        "blocks_offloaded": totals.blocks_offloaded,
        "suspensions": totals.suspensions,
        "resumes": totals.events["resume"],
        "resumed_without_copy": totals.resumed_without_copy,
    }


def _generate_run(hf, requests: list[Request]):
    """`generate` over `requests` one static batch at a time: those that arrived before a batch starts form it."""

    def run() -> list[list[int]]:
        import torch

        outputs: list[list[int]] = [[] for _ in requests]
        waiting = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
        steps = 0  # engine steps a batch's arrivals are measured in: one per generated token
        while waiting:
            batch = [i for i in waiting if requests[i].arrival <= steps] or waiting[:1]
            waiting = [i for i in waiting if i not in batch]
            width = max(len(requests[i].prompt) for i in batch)
            budget = max(requests[i].budget for i in batch)
            ids = torch.tensor([(0,) * (width - len(requests[i].prompt)) + requests[i].prompt for i in batch])
            mask = torch.tensor(
                [[0] * (width - len(requests[i].prompt)) + [1] * len(requests[i].prompt) for i in batch]
            )
            with torch.inference_mode():
                out = hf.generate(
                    ids.to(hf.device),
                    attention_mask=mask.to(hf.device),
                    max_new_tokens=budget,
                    min_new_tokens=budget,
                    do_sample=False,
                    pad_token_id=0,
                )
            for row, i in enumerate(batch):
                outputs[i] = out[row, width : width + requests[i].budget].tolist()
            steps += budget
        return outputs

    return run


def _peer_row(name: str, requests: list[Request], measured: _Measured) -> Row:
    rate, peer = measured.rate, measured.peer
    theirs = rate.get(f"{name} generate")
    agree = _agreeing(measured.outputs, f"{name} engine", f"{name} generate")
    return Row(
        group="transformers",
        name=f"serving tokens/s, {name}, batch {len(requests)}",
        value=rate[f"{name} engine"],
        unit="tok/s",
        baseline_name=f"{peer}, one static batch at a time" if theirs is not None else peer,
        baseline=theirs,
        target=f"ratio >= {SERVING_RATIO_TARGET}, outputs equal",
        met=None
        if theirs is None
        else rate[f"{name} engine"] / theirs >= SERVING_RATIO_TARGET and agree == len(requests),
        note="no peer to compare outputs with"
        if agree is None
        else f"greedy outputs equal for {agree}/{len(requests)}"
        + measured.spread(f"{name} generate", f"{name} engine"),
    )


def _pressure_row(
    tier: str, offload: str | None, *, need: int, fewest: int, requests: list[Request], measured: _Measured
) -> Row:
    """The row of the run with a GPU tier of half of `need`, host tier `tier` and offload policy `offload`;
    `fewest`: `fewest_steps` there."""
    name = pressure_run(tier, offload)
    rate, outputs, steps, copied = measured.rate, measured.outputs, measured.steps, measured.copies[name]
    full = HOST_TIERS[tier] == 1.0
    agree = _agreeing(outputs, name, "best case generate")
    unpressured = _agreeing(outputs, name, "best case engine")
    equal = unpressured == len(requests) and agree in (None, len(requests))
    versus = rate.get("best case generate")
    return Row(
        group="transformers",
        name=(
            f"serving tokens/s under pressure, GPU tier {need // 2} of {need} blocks, host tier {tier}"
            + ("" if offload is None else f", offload {offload}")
        ),
        value=rate[name],
        unit="tok/s",
        baseline_name="the same requests unpressured",
        baseline=rate["best case engine"],
        target=f"ratio >= {PRESSURE_RATIO_TARGET}, outputs equal" if full else "",
        met=rate[name] / rate["best case engine"] >= PRESSURE_RATIO_TARGET and equal if full else None,
        note=(
            f"outputs equal to unpressured for {unpressured}/{len(requests)}"
            + (
                ""
                if agree is None or versus is None
                else f", to generate for {agree}; {rate[name] / versus:.2f}x {measured.peer}"
            )
            + f"; {steps[name]} engine steps (unpressured {steps['best case engine']}; no schedule in"
            f" {need // 2} GPU blocks takes fewer than {fewest})"
            + f"; {copied['blocks_offloaded']} blocks offloaded, {copied['resumed_without_copy']} of "
            f"{copied['resumes']} resumes without a copy"
            + f"; a step took {measured.step_seconds(name) * 1e3:.2f} ms vs "
            f"{measured.step_seconds('best case engine') * 1e3:.2f} ms unpressured: at that cost {fewest} steps "
            f"give a ratio of at most {measured.ceiling(name, fewest):.2f}"
            + ("; no host tier: nothing is offloaded under either policy" if offload is None else "")
            + measured.spread("best case engine", name)
        ),
    )


def _agreeing(outputs, a: str, b: str) -> int | None:
    """How many requests' outputs of runs `a` and `b` are equal (None when `b` did not run)."""
    if b not in outputs:
        return None
    return sum(x == y for x, y in zip(outputs[a], outputs[b], strict=True))


__all__ = [
    "FULL_SERVING",
    "OFFLOADS",
    "PRESSURE_RUNS",
    "QUICK_SERVING",
    "Request",
    "ServingShape",
    "fewest_steps",
    "pressure_run",
    "step_cost_ceiling",
    "workload_section",
    "workloads",
]
