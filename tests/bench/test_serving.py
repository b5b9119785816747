"""The serving workloads of the `transformers` group: their shapes, and a tiny run of every variant with outputs
compared (structure only, never wall times)."""

from __future__ import annotations

import pytest

from kvstate.bench.serving import HOST_TIERS, ServingShape, needed_blocks, workload_section, workloads

TINY = ServingShape(batch=2, prompt_len=4, new_tokens=4, repeats=1)


def test_the_workloads_differ_where_their_names_say() -> None:
    work = workloads(ServingShape(batch=16, prompt_len=32, new_tokens=64, repeats=1), vocab=512, seed=0)
    assert set(work) == {"best case", "ragged prompts", "staggered budgets", "arrivals during decode"}
    assert all(len(requests) == 16 for requests in work.values())
    assert {len(r.prompt) for r in work["best case"]} == {32} and {r.budget for r in work["best case"]} == {64}
    assert len({len(r.prompt) for r in work["ragged prompts"]}) > 1
    assert all(8 <= len(r.prompt) <= 64 for r in work["ragged prompts"])
    assert len({r.budget for r in work["staggered budgets"]}) > 1
    arrivals = [r.arrival for r in work["arrivals during decode"]]
    assert arrivals[:8] == [0] * 8 and arrivals[8:] == sorted(arrivals[8:]) and min(arrivals[8:]) > 0
    assert workloads(TINY, 512, 3) == workloads(TINY, 512, 3)  # seeded


def test_every_variant_runs_and_every_output_is_compared() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        section = workload_section(shape=TINY, device="cpu")
    finally:
        torch.set_num_threads(threads)
    names = [row.name for row in section.rows]
    assert len(names) == 4 + len(HOST_TIERS)
    need = needed_blocks(workloads(TINY, 512, 0)["best case"])
    assert section.data["gpu_blocks_needed"] == need
    for row in section.rows[:4]:
        assert row.baseline_name.endswith("one static batch at a time") and row.ratio > 0
        assert row.note == "greedy outputs equal for 2/2" and row.met is not None
    for row, tier in zip(section.rows[4:], HOST_TIERS, strict=True):
        assert f"GPU tier {need // 2} of {need} blocks, host tier {tier}" in row.name
        assert row.note.startswith("outputs equal to unpressured for 2/2, to generate for 2;")
        assert (row.met is not None) == (tier == "full")
