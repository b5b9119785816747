"""The `vllm` group: our scheduler beside vLLM's real v1 `Scheduler` on the same workloads, in one loop.

Both sides step the same `stepping.Workload`s (256 / 1,024 / 4,096 running requests, blocks of 16 tokens): steady
decode, and memory pressure with recompute-only preemption (what vLLM does; ours runs without a host tier, so it
too can only recompute-pause), ours once per lifecycle implementation under pressure. Per size and regime, two
rows: `schedule()` alone, and a full step (ours: schedule() + planned_chunks() + complete_migrations() +
complete_step(); vLLM: schedule() + update_from_output() with the model runner's reply fed back), each as ours over
vLLM's µs with the per-request cost in the note. Without vLLM (`scripts/install-peers`) ours is still measured and
the rows say "not installed". The engine beside `transformers` is `end_to_end.decode_section` (`transformers`
group).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from kvstate.bench.overhead import SIZES, TARGET_SIZES, WARMUP, machine_share
from kvstate.bench.results import Row, Section
from kvstate.bench.stepping import REGIMES, Driver, Figures, OursDriver, Workload, measure
from kvstate.config import LIFECYCLES

NOT_INSTALLED = "vLLM v1 Scheduler: not installed (run scripts/install-peers)"
STEP_RATIO_TARGET = 0.07  # issue 13: our steady step <= 0.07x vLLM's at 1,024 and 4,096


def vllm_section(
    *,
    sizes=SIZES,
    repeats: int,
    seed: int = 0,
    lifecycle: str = "machine",
    progress: Callable[[str], None] | None = None,
) -> Section:
    """Ours beside vLLM per size: steady (ours with `lifecycle`) and under recompute-only pressure (ours with
    both lifecycles). vLLM is imported here; its absence leaves the rows without a baseline."""
    say = progress or (lambda message: None)
    peer_driver: Callable[[Workload], Driver] | None
    missing: str | None
    try:
        say("importing vLLM")
        from kvstate.bench.vllm_peer import VLLM_VERSION, VLLMDriver
    except ImportError as err:
        peer_driver, peer, missing = None, NOT_INSTALLED, str(err)
    else:
        peer_driver, peer, missing = VLLMDriver, f"vLLM {VLLM_VERSION}", None
    steps = WARMUP + repeats
    builders: dict[str, Callable[[], Driver]] = {}
    for size in sizes:
        for regime in REGIMES:
            workload = Workload(size, regime, steps)
            for kind in _lifecycles(regime, lifecycle):
                builders[f"{size} {regime} ours {kind}"] = functools.partial(OursDriver, workload, lifecycle=kind)
            if peer_driver is not None:
                builders[f"{size} {regime} vllm"] = functools.partial(peer_driver, workload)
    drivers: dict[str, Driver] = {}
    for n, (name, build) in enumerate(builders.items(), 1):
        say(f"settling {name} ({n}/{len(builders)})")
        drivers[name] = build()
    figures = measure(drivers, repeats=repeats, warmup=WARMUP, seed=seed, progress=say)
    section = Section(
        "vllm",
        data={
            "peer": peer,
            "missing": missing,
            "sizes": list(sizes),
            "repeats": repeats,
            "lifecycle": lifecycle,
            "figures": {k: f.to_dict() for k, f in figures.items()},
        },
    )
    for regime in REGIMES:
        for size in sizes:
            theirs = figures.get(f"{size} {regime} vllm")
            for kind in _lifecycles(regime, lifecycle):
                ours = figures[f"{size} {regime} ours {kind}"]
                share = ""
                if regime == "pressure" and kind == "machine":
                    compiled = figures[f"{size} {regime} ours compiled"]
                    share = f"; transitions machine share {machine_share(ours, compiled):.0%}"
                section.rows += _rows(size, regime, kind, ours=ours, theirs=theirs, peer=peer, share=share)
    return section


def _lifecycles(regime: str, lifecycle: str) -> tuple[str, ...]:
    """Steady decode fires no lifecycle event: one run of ours; under pressure, one per implementation."""
    return (lifecycle,) if regime == "steady" else LIFECYCLES


def _rows(
    size: int, regime: str, kind: str, *, ours: Figures, theirs: Figures | None, peer: str, share: str
) -> list[Row]:
    """The schedule() row and the step row of one workload (and lifecycle), ours over vLLM's µs."""
    where = "steady decode" if regime == "steady" else f"under pressure (recompute only), lifecycle {kind}"
    work = (
        ""
        if theirs is None or regime == "steady"
        else f"; preempted/step {ours.preempted_per_step:.1f} vs {theirs.preempted_per_step:.1f}"
    )
    rows = []
    for label, their_call, mine, base in (
        ("schedule()", "Scheduler.schedule()", ours.schedule_us, None if theirs is None else theirs.schedule_us),
        ("step", "schedule() + update_from_output()", ours.step_us, None if theirs is None else theirs.step_us),
    ):
        targeted = label == "step" and regime == "steady" and size in TARGET_SIZES
        note = f"{mine / size:.3f} µs/request" + ("" if base is None else f" vs {base / size:.3f}") + work
        rows.append(
            Row(
                group="vllm",
                name=f"{label}, {size} running, {where}",
                value=mine,
                unit="µs",
                baseline_name=peer if base is None else f"{peer} {their_call}",
                baseline=base,
                better="lower",
                target=f"ratio <= {STEP_RATIO_TARGET}" if targeted else "",
                met=mine / base <= STEP_RATIO_TARGET if targeted and base else None,
                note=note + (share if label == "step" else ""),
            )
        )
    return rows


__all__ = ["NOT_INSTALLED", "vllm_section"]
