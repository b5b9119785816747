"""Lifecycle and scheduler overhead, pure Python (no torch).

* One transition through the compiled `TransitionTable` beside the same transition through the `transitions`
  machine (`Lifecycle`): suspend and resume alternately on one request (a resume of a request held wholly on the
  GPU: the usual one under lazy suspension), guards evaluated, no effect hooks.
* Our per-step cost (`stepping`: schedule() + planned_chunks() + complete_migrations() + complete_step()) at
  256 / 1,024 / 4,096 running requests, in steady decode and under pressure with recompute-only preemption,
  with both lifecycle implementations under pressure, every variant taking turns in one loop: per-request
  cost against its targets, its growth with size, pressure against steady, and the share of the `transitions`
  machine. The same steps beside vLLM's scheduler are the `vllm` group (`executor.bench.peers`).
* `schedule()` with the lifecycle fired through the `transitions` machine (the default) beside the compiled
  table, steady and under pressure with a host tier.
* Requests scheduled per step under host-tier pressure beside a recompute-only configuration of the same
  scheduler (WORK-CONSERVE: room on its way is reserved, so one suspension does not make every later requester
  of the pass wait).
"""

from __future__ import annotations

import math

from executor.bench.results import Row, Section
from executor.bench.stepping import BLOCK_SIZE, REGIMES, Figures, OursDriver, Workload, measure
from executor.bench.timing import interleaved, medians
from kvstate.config import LIFECYCLES
from kvstate.lifecycle import Lifecycle, TransitionTable
from kvstate.request import STATE_ATTRIBUTE, new_request
from kvstate.roles import ACTIVE
from kvstate.semantics import PassView

SIZES = (256, 1024, 4096)
QUICK_SIZES = (256, 1024)
TARGET_SIZE = 1024
TARGET_SIZES = (1024, 4096)  # where the per-request step target applies (<= 1.0 µs per request)
WARMUP = 2  # measured steps thrown away per driver
TRANSITIONS_PER_CALL = 1000


def transition_section(*, repeats: int, seed: int = 0) -> Section:
    """µs per transition: compiled table beside the `transitions` machine."""
    # the figures the guards read: a host tier, nothing in flight, the utilization gate open (outside a pass)
    pool = PassView(8, 8, True, 1, BLOCK_SIZE, BLOCK_SIZE, None, math.inf)
    implementations: dict[str, TransitionTable | Lifecycle] = {"table": TransitionTable(), "machine": Lifecycle()}
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
    row = Row(
        group="overhead",
        name="one lifecycle transition, compiled table",
        value=us["table"],
        unit="µs",
        baseline_name="transitions machine",
        baseline=us["machine"],
        better="lower",
        target="value <= 1 µs",
        met=us["table"] <= 1.0,
        note="suspend/resume, guards, no hooks",
    )
    return Section("transition", [row], {"us_per_transition": us})


def scheduler_section(
    *, sizes=SIZES, repeats: int, seed: int = 0, lifecycle: str = "machine", progress=None
) -> Section:
    """Our step and schedule() per size: steady (with `lifecycle`) and under recompute-only pressure (both)."""
    steps = WARMUP + repeats
    drivers = {}
    for size in sizes:
        drivers[f"{size} steady ours"] = OursDriver(Workload(size, "steady", steps), lifecycle=lifecycle)
        for kind in LIFECYCLES:
            drivers[f"{size} pressure ours {kind}"] = OursDriver(Workload(size, "pressure", steps), lifecycle=kind)
    figures = measure(drivers, repeats=repeats, warmup=WARMUP, seed=seed, progress=progress)
    section = Section(
        "scheduler",
        data={
            "sizes": list(sizes),
            "lifecycle": lifecycle,
            "repeats": repeats,
            "figures": {k: f.to_dict() for k, f in figures.items()},
        },
    )
    for size in sizes:
        steady = figures[f"{size} steady ours"]
        target = size in TARGET_SIZES
        section.rows.append(
            Row(
                group="overhead",
                name=f"step, {size} running, steady decode: per request",
                value=steady.step_us_per_request,
                unit="µs",
                baseline_name="of which schedule()",
                baseline=steady.schedule_us_per_request,
                better="lower",
                target="value <= 1.0 µs" if target else "",
                met=steady.step_us_per_request <= 1.0 if target else None,
                note=f"step {steady.step_us:,.0f} µs = schedule() + planned_chunks + complete_step",
            )
        )
    if {1024, 4096} <= set(sizes):
        big, small = figures["4096 steady ours"], figures["1024 steady ours"]
        section.rows.append(
            Row(
                group="overhead",
                name="step growth, steady: per-request µs at 4,096 / at 1,024",
                value=big.step_us_per_request,
                unit="µs/req",
                baseline_name="per-request µs at 1,024",
                baseline=small.step_us_per_request,
                better="lower",
                target="ratio <= 1.1",
                met=big.step_us_per_request / small.step_us_per_request <= 1.1,
                note="1.0 = linear",
            )
        )
    for size in sizes:
        steady = figures[f"{size} steady ours"]
        machine, compiled = figures[f"{size} pressure ours machine"], figures[f"{size} pressure ours compiled"]
        for kind, pressured in (("machine", machine), ("compiled", compiled)):
            ratio = pressured.step_us_per_request / steady.step_us_per_request
            share = f"; transitions machine share {machine_share(machine, compiled):.0%}" if kind == "machine" else ""
            section.rows.append(
                Row(
                    group="overhead",
                    name=f"step, {size} running, under pressure (recompute only), lifecycle {kind}: per request",
                    value=pressured.step_us_per_request,
                    unit="µs",
                    baseline_name="steady decode",
                    baseline=steady.step_us_per_request,
                    better="lower",
                    target="ratio <= 2",
                    met=ratio <= 2,
                    note=(
                        f"{pressured.preempted_per_step:.1f} preempted, {pressured.scheduled_per_step:.0f} scheduled "
                        f"per step{share}"
                    ),
                )
            )
    return section


def machine_share(machine: Figures, compiled: Figures) -> float:
    """The share of a step the `transitions` machine takes: what the compiled table saves, over the step."""
    return max(0.0, machine.step_us - compiled.step_us) / machine.step_us


def lifecycle_section(*, size: int = TARGET_SIZE, repeats: int, seed: int = 0) -> Section:
    """Median µs per `schedule()` call with the transitions machine beside the compiled table (pressure: host tier
    of size/2 blocks)."""
    drivers = {
        f"{regime} {kind}": OursDriver(
            Workload(size, regime, WARMUP + repeats),
            lifecycle=kind,
            host_blocks=size // 2 if regime == "pressure" else 0,
        )
        for regime in REGIMES
        for kind in LIFECYCLES
    }
    figures = measure(drivers, repeats=repeats, warmup=WARMUP, seed=seed)
    us = {k: f.schedule_us for k, f in figures.items()}
    section = Section("lifecycle", data={"size": size, "us_per_call": us})
    for regime in REGIMES:
        machine, compiled = us[f"{regime} machine"], us[f"{regime} compiled"]
        section.rows.append(
            Row(
                group="overhead",
                name=f"schedule(), {size} requests, {regime}: transitions machine (default)",
                value=machine,
                unit="µs",
                baseline_name="compiled table",
                baseline=compiled,
                better="lower",
                note=f"machine share {max(0.0, machine - compiled) / machine:.0%} of the call",
            )
        )
    return section


def pressure_section(*, sizes=SIZES, steps: int = 12) -> Section:
    """Requests scheduled per step under pressure, with a host tier (size/2 blocks) beside recompute only."""
    section = Section("host_pressure", data={"sizes": list(sizes), "steps": steps, "scheduled_per_step": {}})
    for size in sizes:
        per_step = {}
        for name, host_tier in (("host tier", True), ("recompute only", False)):
            driver = OursDriver(Workload(size, "pressure", steps), host_blocks=size // 2 if host_tier else 0)
            for _ in range(steps):
                driver.step()
            per_step[name] = sum(driver.scheduled[-steps:]) / steps  # after the settling steps
        section.data["scheduled_per_step"][size] = per_step
        ratio = per_step["host tier"] / per_step["recompute only"]
        section.rows.append(
            Row(
                group="overhead",
                name=f"requests scheduled per step under pressure, {size} requests, host tier {size // 2}",
                value=per_step["host tier"],
                unit="req/step",
                baseline_name="recompute only (no host tier)",
                baseline=per_step["recompute only"],
                target="ratio >= 0.95",
                met=ratio >= 0.95,
                note=f"GPU tier {Workload(size, 'pressure', steps).gpu_blocks} blocks of {BLOCK_SIZE}",
            )
        )
    return section


def run(
    *,
    quick: bool = False,
    seed: int = 0,
    lifecycle: str = "machine",
    progress=None,
    sizes: tuple[int, ...] | None = None,
) -> list[Section]:
    return [
        transition_section(repeats=5 if quick else 15, seed=seed),
        scheduler_section(
            sizes=sizes or (QUICK_SIZES if quick else SIZES),
            repeats=10 if quick else 40,
            seed=seed,
            lifecycle=lifecycle,
            progress=progress,
        ),
    ]
