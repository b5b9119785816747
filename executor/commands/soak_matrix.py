"""The soak's matrix: the injected faults split into mixes, each run long enough, and the count of every path.

A fault that ends the host tier (`TIER_ENDING`: it cannot be allocated, or it is lost) ends every host path for the
rest of its run, so one run with it exercises the host tier only until it fires. `fault_mixes` gives each such kind
a mix of its own (a share of the requests, `TIER_ENDING_SHARE`, with the other injected faults), and runs every
other fault together in the main mix with the rest of the requests, so the host tier stays up there for the whole
run. `MatrixReport` counts each path (suspensions, offloads, resumes with and without a copy, recompute-pauses,
replays, cancels) and each injected fault kind, per mix and in all, and names the paths below their floor
(`MatrixReport.barely_exercised`): a path the settings ask for that ran too rarely to have been tested.

Invariants kept: the mixes together run exactly the requested number of requests; every mix has the soak's
seed; `Mix`, `PathCount` and `MatrixReport` are immutable values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from executor.faults import FaultSpec

if TYPE_CHECKING:  # annotations only: importing this module imports no torch
    from executor.commands.soak import SoakReport, SoakSettings
    from kvstate.stats import IterationStats

__all__ = [
    "FLOOR_SHARE",
    "HOST_PATHS",
    "PATHS",
    "TIER_ENDING",
    "TIER_ENDING_SHARE",
    "MatrixReport",
    "Mix",
    "PathCount",
    "fault_mixes",
    "path_counts",
    "run_matrix",
    "summary_columns",
]

TIER_ENDING = ("host_alloc", "host_loss")  # fault kinds that end the host tier for the rest of a run
TIER_ENDING_SHARE = 0.15  # the share of the requests each tier-ending kind's own mix runs
FLOOR_SHARE = 0.01  # a path counted fewer times than this share of the requests (and at least once) ran too rarely
HOST_PATHS = ("suspensions", "offloads", "resumes with a copy", "resumes without a copy")
PATHS = (*HOST_PATHS, "recompute-pauses", "replays", "cancels")


@dataclass(frozen=True, slots=True)
class Mix:
    """One run of the matrix: its name (`main`, or the tier-ending fault kind it isolates) and its settings."""

    name: str
    settings: SoakSettings


@dataclass(frozen=True, slots=True)
class PathCount:
    """How often one path ran: per mix (in the matrix's order), in all, and the floor it should reach."""

    path: str
    per_mix: tuple[int, ...]
    floor: int

    @property
    def total(self) -> int:
        return sum(self.per_mix)

    @property
    def barely(self) -> bool:
        return self.total < self.floor


def _kind(text: str) -> str:
    return FaultSpec.parse(text).kind


def fault_mixes(settings: SoakSettings) -> tuple[Mix, ...]:
    """The mixes of `settings`: a main mix with every fault that keeps the host tier, and one mix per tier-ending
    fault (`TIER_ENDING_SHARE` of the requests each, with the other faults too; a bare ``host_loss`` fires once,
    when the mix's requests have arrived). One mix when there is no host tier, no tier-ending fault, or too few
    requests to split."""
    ending = [text for text in settings.faults if _kind(text) in TIER_ENDING]
    kept = tuple(text for text in settings.faults if _kind(text) not in TIER_ENDING)
    own = max(1, int(settings.requests * TIER_ENDING_SHARE))
    main = settings.requests - own * len(ending)
    if not ending or not settings.host_blocks or main < 1:
        return (Mix("main", settings),)
    isolated = tuple(
        Mix(
            _kind(text),
            replace(
                settings,
                requests=own,
                faults=(*kept, _when_loaded(text, own / settings.arrival_rate)),
                trace=_trace_of(settings.trace, _kind(text)),
            ),
        )
        for text in ending
    )
    return (Mix("main", replace(settings, requests=main, faults=kept)), *isolated)


def _when_loaded(text: str, arrivals_end: float) -> str:
    """`text`, except a bare ``host_loss`` (no rate, no iterations): once, at the iteration its mix's last request
    is expected to arrive (`arrivals_end`), when the most requests hold host copies to lose."""
    return f"host_loss@{max(1, round(arrivals_end))}" if text.strip() == "host_loss" else text


def _trace_of(trace: str | None, mix: str) -> str | None:
    """The trace file of a mix other than the main one: the main trace's name with the mix before its suffix."""
    if trace is None:
        return None
    path = Path(trace)
    return str(path.with_name(f"{path.stem}.{mix}{path.suffix}"))


def path_counts(report: SoakReport) -> dict[str, int]:
    """How often each path of `PATHS` ran in one soak, and each fault kind fired (keyed by the kind)."""
    counts = {
        "suspensions": report.suspensions,
        "offloads": report.events.get("offload", 0),
        "resumes with a copy": report.resumes - report.resumed_without_copy,
        "resumes without a copy": report.resumed_without_copy,
        "recompute-pauses": report.recompute_pauses,
        "replays": report.replays,
        "cancels": report.cancelled,
    }
    return counts | dict(report.faults)


def _floors(settings: SoakSettings) -> dict[str, int]:
    """The paths and fault kinds `settings` ask for, with their floors: `FLOOR_SHARE` of the requests (at least
    1), and 1 for a tier-ending fault (it fires at most once per run)."""
    floor = max(1, math.ceil(settings.requests * FLOOR_SHARE))
    wanted = [
        p for p in PATHS if (p not in HOST_PATHS or settings.host_blocks) and (p != "cancels" or settings.cancel_rate)
    ]
    floors = dict.fromkeys(wanted, floor)
    if settings.host_blocks:  # every fault kind acts on the host tier
        floors |= {kind: 1 if kind in TIER_ENDING else floor for kind in map(_kind, settings.faults)}
    return floors


@dataclass(frozen=True)
class MatrixReport:
    """The soaks of a matrix, in order; `ok` when every one is."""

    settings: SoakSettings
    runs: tuple[tuple[Mix, SoakReport], ...]

    @property
    def ok(self) -> bool:
        return all(report.ok for _, report in self.runs)

    @property
    def reports(self) -> tuple[SoakReport, ...]:
        return tuple(report for _, report in self.runs)

    def paths(self) -> tuple[PathCount, ...]:
        """Every path and fault kind asked for or seen, with its count per mix and its floor (0: not asked for)."""
        counts = [path_counts(report) for report in self.reports]
        floors = _floors(self.settings)
        names = list(floors) + sorted({k for c in counts for k in c} - set(floors) - set(PATHS))
        return tuple(PathCount(name, tuple(c.get(name, 0) for c in counts), floors.get(name, 0)) for name in names)

    def barely_exercised(self) -> tuple[str, ...]:
        """The paths and fault kinds asked for that ran fewer times than their floor."""
        return tuple(p.path for p in self.paths() if p.barely)


def run_matrix(
    settings: SoakSettings,
    run_soak: Callable[..., SoakReport],
    on_progress: Callable[[str, int, int, IterationStats | None], None] | None = None,
) -> MatrixReport:
    """Run every mix of `settings` (`fault_mixes`) to the end, one after the other, with `run_soak(settings,
    progress)` (the soak command's `run_soak`); `on_progress(mix, done, total, stats)` after each iteration."""
    runs = []
    for mix in fault_mixes(settings):
        progress = None if on_progress is None else _progress_of(mix.name, on_progress)
        runs.append((mix, run_soak(mix.settings, progress)))
    return MatrixReport(settings, tuple(runs))


def _progress_of(
    name: str, on_progress: Callable[[str, int, int, IterationStats | None], None]
) -> Callable[[int, int, IterationStats | None], None]:
    return lambda done, total, stats: on_progress(name, done, total, stats)


def summary_columns(report: MatrixReport) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The summary table of a matrix: one column per mix, one row per `SoakReport.rows` metric."""
    heads = [f"{mix.name} ({mix.settings.requests} requests)" for mix, _ in report.runs]
    by_mix = [dict(r.rows()) for r in report.reports]
    names: Mapping[str, str] = by_mix[0]
    return heads, [(name, [rows[name] for rows in by_mix]) for name in names]
