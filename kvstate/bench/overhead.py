"""Lifecycle and scheduler overhead, pure Python (no torch).

* One transition through the compiled `TransitionTable` beside the same transition through the `transitions`
  machine (`Lifecycle`): suspend and resume alternately on one request, guards evaluated, no effect hooks.
* One `Scheduler.schedule()` call with N active requests, in steady decode (every request decodes, nobody
  changes state) and under pressure (the GPU tier holds about two thirds of what the requests want, so passes
  suspend, resume, recompute-pause and replay), beside the nano-vllm-style `PeerScheduler` on the same
  workload. Every size and variant takes turns in one loop; `complete_step` runs untimed between calls.
* `schedule()` with the lifecycle fired through the `transitions` machine (the default) beside the compiled
  table, steady and under pressure.
* Requests scheduled per step under host-tier pressure beside a recompute-only configuration of the same
  scheduler (WORK-CONSERVE: room on its way is reserved, so one suspension does not make every later requester
  of the pass wait).
"""

from __future__ import annotations

from kvstate.bench.peer_scheduler import PeerScheduler, PeerSeq
from kvstate.bench.results import Row, Section
from kvstate.bench.timing import interleaved, medians
from kvstate.config import SchedulerConfig
from kvstate.lifecycle import STATE_ATTRIBUTE, Lifecycle, TransitionTable
from kvstate.pool import TieredBlockPool
from kvstate.request import new_request
from kvstate.roles import ACTIVE
from kvstate.scheduler import Scheduler

SIZES = (256, 1024, 4096)
TARGET_SIZE = 1024
BLOCK_SIZE = 16
MAX_NEW_TOKENS = 1000  # nobody finishes while we measure (capped to fit small test tiers alone)
TRANSITIONS_PER_CALL = 1000


def transition_section(*, repeats: int, seed: int = 0) -> Section:
    """µs per transition: compiled table beside the `transitions` machine."""
    pool = TieredBlockPool(8, 8)
    implementations = {"table": TransitionTable(), "machine": Lifecycle()}
    variants = {}
    for name, lifecycle in implementations.items():
        request = new_request(name, [1], 4)
        setattr(request, STATE_ATTRIBUTE, lifecycle.spec.role(ACTIVE))

        def call(fire=lifecycle.fire, request=request) -> None:
            for _ in range(TRANSITIONS_PER_CALL // 2):
                fire(request, "suspend", pool)
                fire(request, "resume", pool)

        variants[name] = call
    times = medians(interleaved(variants, repeats=repeats, warmup=1, seed=seed))
    us = {name: t / TRANSITIONS_PER_CALL * 1e6 for name, t in times.items()}
    row = Row(group="overhead", name="one lifecycle transition, compiled table", value=us["table"], unit="µs",
              baseline_name="transitions machine", baseline=us["machine"], better="lower",
              target="value <= 1 µs", met=us["table"] <= 1.0, note="suspend/resume, guards, no hooks")
    return Section("transition", [row], {"us_per_transition": us})


class _Driver:
    """One scheduler kept stepping: `prepare()` (untimed) completes the last output, `call()` schedules."""

    def __init__(self, size: int, pressure: bool, peer: bool, lifecycle: str = "machine",
                 host_tier: bool = True) -> None:
        self.peer = peer
        prompts = [1 + i % BLOCK_SIZE for i in range(size)]  # staggered block boundaries
        blocks = size * 3 if not pressure else size * 2 // 3 * 2
        if peer:
            self.s = PeerScheduler(blocks, BLOCK_SIZE, size)
            for n in prompts:
                self.s.add(PeerSeq(n))
        else:
            config = SchedulerConfig(gpu_blocks=blocks, host_blocks=size // 2 if pressure and host_tier else 0,
                                     block_size=BLOCK_SIZE, max_batch_size=size, max_num_tokens=size * BLOCK_SIZE,
                                     prefill_chunk_size=BLOCK_SIZE, no_progress_limit=1_000_000,
                                     lifecycle=lifecycle)
            self.s = Scheduler(config)
            new_tokens = min(MAX_NEW_TOKENS, (blocks - 1) * BLOCK_SIZE - BLOCK_SIZE)
            for n in prompts:
                self.s.submit(list(range(n)), new_tokens)
        self.out = None
        for _ in range(3 if not pressure else 2 * BLOCK_SIZE + 3):  # reach the regime being measured
            self.prepare()
            self.call()
        self.prepare()

    def prepare(self) -> None:
        if self.out is None:
            return
        if self.peer:
            self.s.postprocess(self.out[0])
        else:
            self.s.complete_migrations(self.out)
            self.s.complete_step(self.out, dict.fromkeys((r.request_id for r in self.out.scheduled), 1))
        self.out = None

    def call(self) -> None:
        self.out = self.s.schedule()


def scheduler_section(*, sizes=SIZES, repeats: int, seed: int = 0, lifecycle: str = "machine") -> Section:
    """Median µs per `schedule()` call for every size, steady and under pressure, ours beside the peer."""
    drivers = {(size, regime, who): _Driver(size, regime == "pressure", who == "peer", lifecycle=lifecycle)
               for size in sizes for regime in ("steady", "pressure") for who in ("ours", "peer")}
    keys = {f"{size} {regime} {who}": d for (size, regime, who), d in drivers.items()}
    times = medians(interleaved({k: d.call for k, d in keys.items()}, repeats=repeats, warmup=2, seed=seed,
                                setup={k: d.prepare for k, d in keys.items()}))
    us = {k: t * 1e6 for k, t in times.items()}
    section = Section("scheduler", data={"sizes": list(sizes), "us_per_call": us})
    for regime in ("steady", "pressure"):
        for size in sizes:
            ours, peer = us[f"{size} {regime} ours"], us[f"{size} {regime} peer"]
            target = size == TARGET_SIZE
            section.rows.append(Row(
                group="overhead", name=f"schedule(), {size} requests, {'steady decode' if regime == 'steady' else 'under pressure'}",
                value=ours, unit="µs", baseline_name="nano-vllm-style peer", baseline=peer, better="lower",
                target="value <= 1000 µs" if target else "", met=(ours <= 1000) if target else None,
                note=f"{ours / size:.3f} µs/request"))
        if 1024 in sizes and 4096 in sizes:
            big, small = us[f"4096 {regime} ours"] / 4096, us[f"1024 {regime} ours"] / 1024
            section.rows.append(Row(
                group="overhead", name=f"schedule() growth, {regime}: per-request µs at 4096 / at 1024",
                value=big, unit="µs/req", baseline_name="per-request µs at 1024", baseline=small, better="lower",
                target="ratio <= 1.25", met=big / small <= 1.25, note="1.0 = linear"))
    return section


def lifecycle_section(*, size: int = TARGET_SIZE, repeats: int, seed: int = 0) -> Section:
    """Median µs per `schedule()` call with the transitions machine beside the compiled table."""
    drivers = {f"{regime} {kind}": _Driver(size, regime == "pressure", False, lifecycle=kind)
               for regime in ("steady", "pressure") for kind in ("machine", "compiled")}
    times = medians(interleaved({k: d.call for k, d in drivers.items()}, repeats=repeats, warmup=2, seed=seed,
                                setup={k: d.prepare for k, d in drivers.items()}))
    us = {k: t * 1e6 for k, t in times.items()}
    section = Section("lifecycle", data={"size": size, "us_per_call": us})
    for regime in ("steady", "pressure"):
        machine, compiled = us[f"{regime} machine"], us[f"{regime} compiled"]
        section.rows.append(Row(
            group="overhead", name=f"schedule(), {size} requests, {regime}: transitions machine (default)",
            value=machine, unit="µs", baseline_name="compiled table", baseline=compiled, better="lower",
            note=f"machine share {max(0.0, machine - compiled) / machine:.0%} of the call"))
    return section


def pressure_section(*, sizes=SIZES, steps: int = 12) -> Section:
    """Requests scheduled per step under pressure, with a host tier (size/2 blocks) beside recompute only."""
    section = Section("host_pressure", data={"sizes": list(sizes), "steps": steps, "scheduled_per_step": {}})
    for size in sizes:
        per_step = {}
        for name, host_tier in (("host tier", True), ("recompute only", False)):
            driver = _Driver(size, True, False, host_tier=host_tier)
            counts = []
            for _ in range(steps):
                driver.call()
                counts.append(len(driver.out.scheduled))
                driver.prepare()
            per_step[name] = sum(counts) / steps
        section.data["scheduled_per_step"][size] = per_step
        ratio = per_step["host tier"] / per_step["recompute only"]
        section.rows.append(Row(
            group="overhead", name=f"requests scheduled per step under pressure, {size} requests, host tier {size // 2}",
            value=per_step["host tier"], unit="req/step", baseline_name="recompute only (no host tier)",
            baseline=per_step["recompute only"], target="ratio >= 0.95", met=ratio >= 0.95,
            note=f"GPU tier {size * 2 // 3 * 2} blocks of {BLOCK_SIZE}"))
    return section


def run(*, quick: bool = False, seed: int = 0, lifecycle: str = "machine") -> list[Section]:
    return [transition_section(repeats=5 if quick else 15, seed=seed),
            scheduler_section(repeats=10 if quick else 40, seed=seed, lifecycle=lifecycle)]
