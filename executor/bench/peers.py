"""The `vllm` and `nano-vllm` groups: our scheduler beside a peer's real scheduler on the same workloads, in one
loop.

Both sides step the same `stepping.Workload`s (256 / 1,024 / 4,096 running requests, blocks of 16 tokens): steady
decode, and memory pressure with recompute-only preemption (what both peers do; ours runs without a host tier, so
it too can only recompute-pause), ours once per lifecycle implementation under pressure. Per size and regime, two
rows: `schedule()` alone, and a full step (ours: schedule() + planned_chunks() + complete_migrations() +
complete_step(); the peer's: what its engine calls around the model, see its driver), each as ours over the peer's
µs with the per-request cost in the note. Beside an installed peer, the pressure workloads are then measured again
on new drivers of both sides, once with caches warm and once with them evicted before each step (`stepping.measure`):
each pressure step row's note gives those two ratios beside its own (the interleaved loop's, which the target is held
against). A steady workload that preempted, on either side, is an error: it would not measure steady decode.
Without the peer ours is still measured and the rows say why there is no baseline.

* `vllm`: vLLM 0.33's v1 `Scheduler` (`vllm_peer`, installed by `scripts/install-peers`);
* `nano-vllm`: nano-vllm's `engine/` scheduler from a checkout the user points the bench at (`nanovllm_peer`).

The engine beside `transformers` is `end_to_end` (`transformers` group).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from executor.bench.overhead import SIZES, WARMUP, machine_share
from executor.bench.results import Row, Section
from executor.bench.stepping import REGIMES, Driver, Figures, OursDriver, Workload, measure
from kvstate.config import LIFECYCLES

BRACKETS = ("warm", "cold")  # the cache states the pressure drivers are measured in again (`stepping.measure`)
NOT_INSTALLED = "vLLM v1 Scheduler: not installed (run scripts/install-peers)"


@dataclass(frozen=True)
class Peer:
    """A peer scheduler as one group of rows: its name in the rows, how to build its driver on a workload (None:
    unavailable, `missing` says why), what its step calls, and the ratio targets of ours over it per regime."""

    group: str
    name: str
    driver: Callable[[Workload], Driver] | None
    missing: str | None
    step_calls: str
    schedule_call: str
    targets: dict[str, float]  # regime -> the step ratio (ours / peer) to stay at or below, at every size


# the goals: ours over vLLM's step <= 0.05 steady and <= 0.1 under pressure; over nano-vllm's <= 0.7
VLLM_TARGETS = {"steady": 0.05, "pressure": 0.1}
NANO_VLLM_TARGETS = {"steady": 0.7, "pressure": 0.7}


def vllm_peer(progress: Callable[[str], None]) -> Peer:
    """vLLM's v1 scheduler, imported here; its absence leaves the peer without a driver."""
    driver: Callable[[Workload], Driver] | None
    missing: str | None
    try:
        progress("importing vLLM")
        from executor.bench.vllm_peer import VLLM_VERSION, VLLMDriver
    except ImportError as err:
        driver, name, missing = None, NOT_INSTALLED, str(err)
    else:
        driver, name, missing = VLLMDriver, f"vLLM {VLLM_VERSION}", None
    return Peer(
        "vllm", name, driver, missing, "schedule() + update_from_output()", "Scheduler.schedule()", VLLM_TARGETS
    )


def nano_vllm_peer(checkout: str | None) -> Peer:
    """nano-vllm's scheduler from `checkout` (None: not given, the rows say where to get it)."""
    from executor.bench import nanovllm_peer

    driver: Callable[[Workload], Driver] | None = None
    if checkout is None:
        name = f"nano-vllm: no checkout given (git clone {nanovllm_peer.WHERE}; kvstate bench --nano-vllm DIR)"
        missing: str | None = "no checkout given"
    else:
        try:
            nano = nanovllm_peer.load(checkout)
        except nanovllm_peer.NanoVLLMUnavailable as err:
            name, missing = f"nano-vllm: unavailable ({err})", str(err)
        else:
            name, missing = f"nano-vllm {nano.source}", None
            driver = functools.partial(nanovllm_peer.NanoVLLMDriver, nano=nano)
    return Peer(
        "nano-vllm", name, driver, missing, "schedule() + postprocess()", "Scheduler.schedule()", NANO_VLLM_TARGETS
    )


def peer_section(
    peer: Peer,
    *,
    sizes=SIZES,
    repeats: int,
    seed: int = 0,
    lifecycle: str = "machine",
    progress: Callable[[str], None] | None = None,
) -> Section:
    """Ours beside `peer` per size: steady (ours with `lifecycle`) and under recompute-only pressure (ours with
    both lifecycles), every driver taking turns in one loop; then, beside a peer that is installed, new pressure
    drivers of both sides warm and new ones cold (`BRACKETS`; `data["brackets"]`)."""
    say = progress or (lambda message: None)
    steps = WARMUP + repeats
    builders: dict[str, Callable[[], Driver]] = {}
    for size in sizes:
        for regime in REGIMES:
            workload = Workload(size, regime, steps)
            for kind in _lifecycles(regime, lifecycle):
                builders[f"{size} {regime} ours {kind}"] = functools.partial(OursDriver, workload, lifecycle=kind)
            if peer.driver is not None:
                builders[f"{size} {regime} {peer.group}"] = functools.partial(peer.driver, workload)
    figures = measure(_settled(builders, say), repeats=repeats, warmup=WARMUP, seed=seed, progress=say)
    _check_steady(figures)
    pressured = {name: build for name, build in builders.items() if " pressure " in name}
    brackets = {}
    # New drivers for each: a pressure workload's resident set shrinks as its requests grow, so the drivers already
    # stepped would measure a lighter regime than the interleaved figures did.
    for cache in BRACKETS if peer.driver is not None else ():
        say(f"pressure again, caches {cache}")
        brackets[cache] = measure(_settled(pressured, say), repeats=repeats, warmup=WARMUP, seed=seed, cache=cache)
    section = Section(
        peer.group,
        data={
            "peer": peer.name,
            "missing": peer.missing,
            "sizes": list(sizes),
            "repeats": repeats,
            "lifecycle": lifecycle,
            "figures": {k: f.to_dict() for k, f in figures.items()},
            "brackets": {cache: {k: f.to_dict() for k, f in found.items()} for cache, found in brackets.items()},
        },
    )
    for regime in REGIMES:
        for size in sizes:
            theirs = figures.get(f"{size} {regime} {peer.group}")
            for kind in _lifecycles(regime, lifecycle):
                ours = figures[f"{size} {regime} ours {kind}"]
                extra = ""
                if regime == "pressure" and kind == "machine":
                    compiled = figures[f"{size} {regime} ours compiled"]
                    extra = f"; transitions machine share {machine_share(ours, compiled):.0%}"
                if regime == "pressure" and theirs is not None:
                    extra += _bracket_note(brackets, f"{size} {regime}", kind, peer.group)
                section.rows += _rows(peer, size, regime, kind, ours=ours, theirs=theirs, extra=extra)
    return section


def vllm_section(*, progress: Callable[[str], None] | None = None, **options) -> Section:
    """`peer_section` beside vLLM's scheduler (`options`: those of `peer_section`)."""
    return peer_section(vllm_peer(progress or (lambda message: None)), progress=progress, **options)


def nano_vllm_section(checkout: str | None, **options) -> Section:
    """`peer_section` beside nano-vllm's scheduler from `checkout` (`options`: those of `peer_section`)."""
    return peer_section(nano_vllm_peer(checkout), **options)


def _settled(builders: dict[str, Callable[[], Driver]], say: Callable[[str], None]) -> dict[str, Driver]:
    """A new driver from each builder, settled into its regime."""
    drivers: dict[str, Driver] = {}
    for n, (name, build) in enumerate(builders.items(), 1):
        say(f"settling {name} ({n}/{len(builders)})")
        drivers[name] = build()
    return drivers


def _check_steady(figures: dict[str, Figures]) -> None:
    """Every steady driver decoded every request on every measured step and preempted none."""
    for name, f in figures.items():
        if " steady " in name and (f.preempted_per_step or f.scheduled_per_step != f.size):
            raise RuntimeError(
                f"{name}: the steady workload preempted ({f.preempted_per_step:.1f} per step) or left requests out "
                f"({f.scheduled_per_step:.1f} of {f.size} scheduled per step); it does not measure steady decode "
                "(executor.bench.stepping.Workload sizes its GPU tier)"
            )


def _lifecycles(regime: str, lifecycle: str) -> tuple[str, ...]:
    """Steady decode fires no lifecycle event: one run of ours; under pressure, one per implementation."""
    return (lifecycle,) if regime == "steady" else LIFECYCLES


def _bracket_note(brackets: dict[str, dict[str, Figures]], workload: str, kind: str, group: str) -> str:
    """The step ratio of ours (lifecycle `kind`) over the peer on `workload` in each bracketing cache state."""
    ratios = [
        f"{cache} {found[f'{workload} ours {kind}'].step_us / found[f'{workload} {group}'].step_us:.2f}"
        for cache, found in brackets.items()
    ]
    return f"; step ratio with caches {', '.join(ratios)}"


def _rows(
    peer: Peer, size: int, regime: str, kind: str, *, ours: Figures, theirs: Figures | None, extra: str
) -> list[Row]:
    """The schedule() row and the step row of one workload (and lifecycle), ours over the peer's µs; `extra` ends
    the step row's note."""
    where = "steady decode" if regime == "steady" else f"under pressure (recompute only), lifecycle {kind}"
    work = (
        ""
        if theirs is None or regime == "steady"
        else f"; preempted/step {ours.preempted_per_step:.1f} vs {theirs.preempted_per_step:.1f}"
    )
    goal = peer.targets[regime]
    rows = []
    for label, their_call, mine, base in (
        ("schedule()", peer.schedule_call, ours.schedule_us, None if theirs is None else theirs.schedule_us),
        ("step", peer.step_calls, ours.step_us, None if theirs is None else theirs.step_us),
    ):
        targeted = label == "step"
        note = f"{mine / size:.3f} µs/request" + ("" if base is None else f" vs {base / size:.3f}") + work
        rows.append(
            Row(
                group=peer.group,
                name=f"{label}, {size} running, {where}",
                value=mine,
                unit="µs",
                baseline_name=peer.name if base is None else f"{peer.name} {their_call}",
                baseline=base,
                better="lower",
                target=f"ratio <= {goal}" if targeted else "",
                met=mine / base <= goal if targeted and base else None,
                note=note + (extra if label == "step" else ""),
            )
        )
    return rows


__all__ = [
    "NANO_VLLM_TARGETS",
    "NOT_INSTALLED",
    "VLLM_TARGETS",
    "Peer",
    "nano_vllm_peer",
    "nano_vllm_section",
    "peer_section",
    "vllm_peer",
    "vllm_section",
]
