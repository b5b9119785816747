"""Scheduler workloads, and drivers that step a scheduler through one, timing each step's phases.

A `Workload` is `size` requests with staggered prompt lengths (1 to 16 tokens, so block boundaries fall on
different steps) that never finish while measured, blocks of 16 tokens, a token budget of 16 per request and
whole-prompt prefill chunks (vLLM's default: no per-request prefill cap):

* `steady`: the GPU tier holds every request for the whole run: every step decodes every request, nobody is
  preempted, no lifecycle event fires.
* `pressure`: the GPU tier holds about 4/3 blocks per request, so once prompts grow past one block nearly every
  step preempts by recompute (the victim's KV is dropped) and every pass offers the head of the paused queue
  readmission. As the resident requests grow the GPU tier holds fewer of them: the regime is not stationary (each
  measured step decodes no more requests than the one before) and readmissions rarely find room. Figures of
  different drivers are comparable only over the same steps of their workloads; a driver stepped on measures a
  lighter regime.

`OursDriver` steps `kvstate.Scheduler` as the executor does: `schedule()`, `planned_chunks()` (what the forward
reads), `complete_migrations()` and `complete_step()`. A driver's `step()` appends the seconds of `schedule()`
alone and of the whole step to `schedule_s` and `step_s`, and the requests scheduled and preempted to `scheduled`
and `preempted`; the model's reply (one sampled token per request that finished its chunk) is built outside the
timed calls. Times are the calling thread's CPU time (`CLOCK`, `time.thread_time`): these machines are shared,
and wall time under contention would measure the neighbours. `executor.bench.vllm_peer.VLLMDriver` keeps the same
contract for vLLM's scheduler. `measure` runs drivers in one interleaved loop and returns a `Figures` per driver.

A step's time depends on what its caches still hold: a step that follows a step of the same driver finds its
requests, its code and the interpreter's own data cached; one that follows other drivers' steps (the interleaved
loop) finds part of them evicted, how much depending on which other drivers share the loop; in a serving engine
the forward pass between two steps evicts them too. `measure(cache=...)` measures the same drivers in one of three
states (`CACHE_STATES`): `interleaved` (the loop above, what the targets are held against), `warm` (each driver's
steps back to back) and `cold` (every cache level evicted before each step, untimed: `evict_caches`). Measured on
new drivers of the same workloads (`peers` does), warm and cold show how much of a ratio is work and how much is
memory traffic.
"""

from __future__ import annotations

import functools
import random
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from executor.bench.timing import interleaved
from kvstate.config import SchedulerConfig
from kvstate.output import planned_chunks
from kvstate.pool import ceil_div
from kvstate.scheduler import Scheduler

BLOCK_SIZE = 16
REGIMES = ("steady", "pressure")
SETTLE_STEPS = {"steady": 3, "pressure": 2 * BLOCK_SIZE + 3}  # steps taken before measuring: the regime is reached
MAX_NEW_TOKENS = 1000  # nobody finishes while measured (capped to what fits one request alone)
TOKEN = 1  # the token every sampled position produces (no stop tokens: it never ends a request)
CLOCK = time.thread_time  # CPU seconds of this thread
CACHE_STATES = ("interleaved", "warm", "cold")  # what a measured step finds in the caches (module docstring)
EVICT_MIN_BYTES = 64 << 20  # written before each cold step: at least this, and 4x the largest cache found
EVICT_MAX_BYTES = 1 << 30
CACHE_INFO = Path("/sys/devices/system/cpu/cpu0/cache")  # Linux: one indexN/size per cache level of CPU 0


@dataclass(frozen=True)
class Workload:
    """`size` decoding requests in `regime`; `steps`: how many steps will be measured after settling."""

    size: int
    regime: str
    steps: int

    def __post_init__(self) -> None:
        if self.regime not in REGIMES:
            raise ValueError(f"regime must be one of {REGIMES}, got {self.regime!r}")
        if self.size < 1 or self.steps < 0:
            raise ValueError(f"size must be >= 1 and steps >= 0, got size={self.size}, steps={self.steps}")

    @property
    def prompts(self) -> list[list[int]]:
        return [list(range(1 + i % BLOCK_SIZE)) for i in range(self.size)]

    @property
    def gpu_blocks(self) -> int:
        if self.regime == "pressure":
            return self.size * 2 // 3 * 2
        longest = BLOCK_SIZE + SETTLE_STEPS["steady"] + self.steps + 1  # tokens of the longest request at the end
        return self.size * ceil_div(longest, BLOCK_SIZE)

    @property
    def max_new_tokens(self) -> int:
        return min(MAX_NEW_TOKENS, (self.gpu_blocks - 1) * BLOCK_SIZE - BLOCK_SIZE)

    @property
    def token_budget(self) -> int:
        return self.size * BLOCK_SIZE


class Driver:
    """What `measure` steps: settled into its workload's regime, it records every `step()`'s phases.

    Invariant: the four sample lists have one entry per recorded step, in step order (`record`)."""

    workload: Workload
    schedule_s: list[float]
    step_s: list[float]
    scheduled: list[int]
    preempted: list[int]

    def step(self) -> None:
        raise NotImplementedError

    def settle(self) -> None:
        """Start with no samples and step into the workload's regime (those steps are not measured)."""
        self.schedule_s, self.step_s, self.scheduled, self.preempted = [], [], [], []
        for _ in range(SETTLE_STEPS[self.workload.regime]):
            self.step()
        self.clear()

    def record(self, schedule_s: float, step_s: float, scheduled: int, preempted: int) -> None:
        self.schedule_s.append(schedule_s)
        self.step_s.append(step_s)
        self.scheduled.append(scheduled)
        self.preempted.append(preempted)

    def clear(self) -> None:
        for samples in (self.schedule_s, self.step_s, self.scheduled, self.preempted):
            samples.clear()


@dataclass(frozen=True)
class Figures:
    """Medians of one driver's measured steps (µs), and the work they did (means per step)."""

    size: int
    schedule_us: float
    step_us: float
    scheduled_per_step: float
    preempted_per_step: float

    @property
    def schedule_us_per_request(self) -> float:
        return self.schedule_us / self.size

    @property
    def step_us_per_request(self) -> float:
        return self.step_us / self.size

    def to_dict(self) -> dict:
        return {
            "size": self.size,
            "schedule_us": self.schedule_us,
            "step_us": self.step_us,
            "schedule_us_per_request": self.schedule_us_per_request,
            "step_us_per_request": self.step_us_per_request,
            "scheduled_per_step": self.scheduled_per_step,
            "preempted_per_step": self.preempted_per_step,
        }


class OursDriver(Driver):
    """`kvstate.Scheduler` on a workload, settled into its regime; every `step()` is one full iteration."""

    def __init__(self, workload: Workload, *, lifecycle: str = "machine", host_blocks: int = 0) -> None:
        self.workload = workload
        config = SchedulerConfig(
            gpu_blocks=workload.gpu_blocks,
            host_blocks=host_blocks,
            block_size=BLOCK_SIZE,
            max_batch_size=workload.size,
            max_num_tokens=workload.token_budget,
            prefill_chunk_size=workload.token_budget,
            no_progress_limit=1_000_000,
            lifecycle=lifecycle,
        )
        self.scheduler = Scheduler(config)
        ids = [self.scheduler.submit(prompt, workload.max_new_tokens).request_id for prompt in workload.prompts]
        self._sampled = dict.fromkeys(ids, TOKEN)  # what the model returns; complete_step reads the produced ones
        self.settle()

    def step(self) -> None:
        scheduler = self.scheduler
        start = CLOCK()
        out = scheduler.schedule()
        scheduled = CLOCK()
        planned_chunks(out, scheduler.pool)
        scheduler.complete_migrations(out)
        scheduler.complete_step(out, self._sampled)
        end = CLOCK()
        self.record(scheduled - start, end - start, len(out.scheduled), len(out.recompute_paused) + len(out.suspended))


def largest_cache_bytes(info: Path = CACHE_INFO) -> int | None:
    """The size of this machine's largest CPU cache (Linux sysfs: ``indexN/size`` such as ``16384K``), or None
    where it cannot be read."""
    sizes = []
    for entry in info.glob("index*/size"):
        try:
            text = entry.read_text(encoding="ascii", errors="replace").strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text[:-1] if scale > 1 else text
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=None)


@functools.cache
def _eviction_buffer() -> tuple[bytearray, bytes]:
    """A buffer four times the largest cache (`EVICT_MIN_BYTES` to `EVICT_MAX_BYTES`), and one byte per 64-byte
    cache line of it, to write over it."""
    size = min(EVICT_MAX_BYTES, max(EVICT_MIN_BYTES, 4 * (largest_cache_bytes() or 0)))
    return bytearray(size), b"\1" * (size // 64)


def evict_caches() -> None:
    """Write one byte of every cache line of a buffer larger than every CPU cache: whatever a step touched before
    is evicted (the cold state of `measure`)."""
    buffer, ones = _eviction_buffer()
    buffer[::64] = ones


def measure(
    drivers: Mapping[str, Driver],
    *,
    repeats: int,
    warmup: int = 2,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    cache: str = "interleaved",
) -> dict[str, Figures]:
    """Step every driver `warmup + repeats` times and take medians of the measured steps (drivers time their own
    phases). `cache` says what a measured step finds in the caches (`CACHE_STATES`, module docstring):
    `interleaved`, every driver once per round in a seeded shuffled order (`timing.interleaved`); `warm`, each
    driver's steps back to back, drivers in a seeded shuffled order; `cold`, as `interleaved` with `evict_caches`
    before every step."""
    if cache not in CACHE_STATES:
        raise ValueError(f"cache must be one of {CACHE_STATES}, got {cache!r}")
    for driver in drivers.values():
        driver.clear()
    if cache == "warm":
        order = list(drivers)
        random.Random(seed).shuffle(order)
        for n, name in enumerate(order, 1):
            for _ in range(warmup + repeats):
                drivers[name].step()
            if progress is not None:
                progress(f"warm: {n}/{len(order)} drivers")
        return _figures(drivers, warmup)
    rounds = {"n": 0}

    def counted(step: Callable[[], None]) -> Callable[[], None]:
        def call() -> None:
            step()
            rounds["n"] += 1
            if progress is not None and rounds["n"] % len(drivers) == 0:
                progress(f"round {rounds['n'] // len(drivers)}/{warmup + repeats}")

        return call

    steps = {name: counted(d.step) for name, d in drivers.items()}
    evict = dict.fromkeys(drivers, evict_caches) if cache == "cold" else None
    interleaved(steps, repeats=repeats, warmup=warmup, seed=seed, setup=evict)
    return _figures(drivers, warmup)


def _figures(drivers: Mapping[str, Driver], warmup: int) -> dict[str, Figures]:
    """Each driver's `Figures`: medians of its steps after the first `warmup`."""
    return {
        name: Figures(
            size=d.workload.size,
            schedule_us=statistics.median(d.schedule_s[warmup:]) * 1e6,
            step_us=statistics.median(d.step_s[warmup:]) * 1e6,
            scheduled_per_step=statistics.fmean(d.scheduled[warmup:]),
            preempted_per_step=statistics.fmean(d.preempted[warmup:]),
        )
        for name, d in drivers.items()
    }


__all__ = [
    "BLOCK_SIZE",
    "CACHE_STATES",
    "REGIMES",
    "Driver",
    "Figures",
    "OursDriver",
    "Workload",
    "evict_caches",
    "largest_cache_bytes",
    "measure",
]
