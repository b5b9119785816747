"""The `offload` group: the spec's two offload policies on the bursty workload (structure only, never wall
times): the workload's bursts, both policies run side by side with every output compared, and rows that say what
each copied beside the other."""

from __future__ import annotations

import dataclasses

import pytest

from executor.bench import GROUPS, TORCH_GROUPS
from executor.bench.offload import OFFLOADS, QUICK_BURSTS, bursty_section, bursty_workload

TINY = dataclasses.replace(QUICK_BURSTS, steps=12, burst_every=6, burst_size=3, gpu_blocks=12)


def test_the_workload_is_a_stream_with_bursts() -> None:
    work = bursty_workload(QUICK_BURSTS, vocab=512, seed=0)
    bursts = [s for s in range(QUICK_BURSTS.steps) if s % QUICK_BURSTS.burst_every == QUICK_BURSTS.burst_every // 2]
    assert len(work) == QUICK_BURSTS.steps + len(bursts) * QUICK_BURSTS.burst_size
    arrivals = [r.arrival for r in work]
    assert arrivals == sorted(arrivals) and set(arrivals) == set(range(QUICK_BURSTS.steps))
    for step in range(QUICK_BURSTS.steps):
        at = [r for r in work if r.arrival == step]
        assert len(at) == 1 + (QUICK_BURSTS.burst_size if step in bursts else 0)
        assert [len(r.prompt) for r in at[1:]] == [QUICK_BURSTS.burst_prompt_len] * (len(at) - 1)
    assert bursty_workload(QUICK_BURSTS, 512, 3) == bursty_workload(QUICK_BURSTS, 512, 3)  # seeded
    assert "offload" in GROUPS and "offload" in TORCH_GROUPS


def test_both_policies_run_side_by_side_and_every_output_is_compared() -> None:
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        section = bursty_section(shape=TINY, device="cpu")
    finally:
        torch.set_num_threads(threads)
    runs, requests = section.data["runs"], section.data["requests"]
    assert section.data["outputs_equal"] == dict.fromkeys(OFFLOADS, requests)
    assert all(runs[o]["events"].get("suspend", 0) > 0 for o in OFFLOADS)  # the bursts did pressure the GPU tier
    assert runs["eager"]["resumed_without_copy"] == runs["eager"]["blocks_relocked"] == 0
    assert len(section.rows) == 2 * len(OFFLOADS)
    for row in section.rows:
        assert row.group == "offload" and row.met is True and row.value > 0 and row.baseline > 0
        assert row.target == "outputs equal to unpressured"
    rows = {row.name.rsplit(", offload ", 1)[1]: row for row in section.rows}
    for ours, theirs in (OFFLOADS, OFFLOADS[::-1]):
        rate, copied = rows[f"{ours}: decode tokens/s"], rows[f"{ours}: blocks copied between the tiers"]
        assert rate.unit == "tok/s" and rate.baseline_name == f"offload {theirs}, same loop"
        assert rate.value == section.data["tokens_per_s"][ours]
        assert f"outputs equal to unpressured for {requests}/{requests}" in rate.note
        assert f"{runs[ours]['steps']} engine steps" in rate.note
        assert copied.better == "lower" and copied.baseline_name == f"offload {theirs}"
        assert (copied.value, copied.baseline) == (runs[ours]["blocks_migrated"], runs[theirs]["blocks_migrated"])
        mine = runs[ours]
        assert copied.note.startswith(
            f"{mine['blocks_offloaded']} blocks offloaded and {mine['blocks_onboarded']} onboarded"
        )
        assert f"{mine['resumed_without_copy']} of {mine['events']['resume']} resumes without a copy" in copied.note
