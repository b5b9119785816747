"""`kvstate bench`: figures measured against physical limits and peers, each a ratio of variants run side by
side in one loop (`timing.interleaved`). Modules: `migration` (copy bandwidth, torch), `overhead` (lifecycle
and scheduler, pure Python), `end_to_end` (executor vs transformers, host tier sizes; torch), `table` (rich
table, JSON), `plots` (matplotlib PNGs). torch and matplotlib are imported only inside run functions.
"""

from __future__ import annotations

from kvstate.bench.results import Row, Section

GROUPS = ("migration", "overhead", "end-to-end")


def run_all(*, quick: bool = False, device: str = "auto", seed: int = 0, groups=GROUPS) -> list[Section]:
    """Every benchmark of `groups`, in order, with torch single-threaded (2-core machines; see DESIGN §6)."""
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise ValueError(f"unknown benchmark groups {sorted(unknown)}; choose from {GROUPS}")
    sections: list[Section] = []
    if "overhead" in groups:
        from kvstate.bench import overhead

        sections += overhead.run(quick=quick, seed=seed)
    if "migration" in groups or "end-to-end" in groups:
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            if "migration" in groups:
                from kvstate.bench import migration

                sections.insert(0, migration.run(quick=quick, device=device, seed=seed))
            if "end-to-end" in groups:
                from kvstate.bench import end_to_end

                sections += end_to_end.run(quick=quick, device=device, seed=seed)
        finally:
            torch.set_num_threads(threads)
    return sections


__all__ = ["GROUPS", "Row", "Section", "run_all"]
