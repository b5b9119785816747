"""`kvstate bench`: figures measured against physical limits and peers, each a ratio of variants run side by
side in one loop (`timing.interleaved`). Modules: `migration` (copy bandwidth, torch), `overhead` (lifecycle
and scheduler, pure Python; also the `lifecycle` group's schedule() rows and the `pressure` group), `end_to_end`
(executor vs transformers, host tier sizes, the `lifecycle` group's engine rows; torch), `table` (rich
table, JSON), `plots` (matplotlib PNGs). torch and matplotlib are imported only inside run functions.
"""

from __future__ import annotations

from kvstate.bench.results import Row, Section

GROUPS = ("migration", "overhead", "end-to-end", "lifecycle", "pressure")


def run_all(*, quick: bool = False, device: str = "auto", seed: int = 0, groups=GROUPS,
            lifecycle: str = "machine") -> list[Section]:
    """Every benchmark of `groups`, in order, with torch single-threaded (2-core machines; see DESIGN §6)."""
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise ValueError(f"unknown benchmark groups {sorted(unknown)}; choose from {GROUPS}")
    sections: list[Section] = []
    if "overhead" in groups or "lifecycle" in groups or "pressure" in groups:
        from kvstate.bench import overhead

        if "overhead" in groups:
            sections += overhead.run(quick=quick, seed=seed, lifecycle=lifecycle)
        if "lifecycle" in groups:
            sections.append(overhead.lifecycle_section(repeats=10 if quick else 40, seed=seed))
        if "pressure" in groups:
            sections.append(overhead.pressure_section(sizes=(256, 1024) if quick else overhead.SIZES,
                                                      steps=6 if quick else 12))
    if "migration" in groups or "end-to-end" in groups or "lifecycle" in groups:
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            if "migration" in groups:
                from kvstate.bench import migration

                sections.insert(0, migration.run(quick=quick, device=device, seed=seed))
            if "end-to-end" in groups:
                from kvstate.bench import end_to_end

                sections += end_to_end.run(quick=quick, device=device, seed=seed, lifecycle=lifecycle)
            if "lifecycle" in groups:
                from kvstate.bench import end_to_end

                sections.append(end_to_end.lifecycle_section(quick=quick, device=device, seed=seed))
        finally:
            torch.set_num_threads(threads)
    return sections


__all__ = ["GROUPS", "Row", "Section", "run_all"]
