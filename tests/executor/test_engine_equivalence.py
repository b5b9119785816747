"""OUTPUT-EQUIV on the real executor: under memory pressure every output equals its unpressured reference.

Each scenario also asserts that the pressure was real (the preemption paths it is about were taken), so a
workload change cannot silently turn a test into an unpressured one.
"""

from __future__ import annotations

import pytest

from executor import SamplingParams
from executor.checks import random_workload as workload
from executor.checks import submit_all as submit


def test_with_host_tier_suspends_and_recompute_pauses(make_engine, equivalent):
    engine = make_engine(gpu_blocks=16, host_blocks=6, block_size=4, prefill_chunk_size=64)
    submit(engine, workload(12, 1, (4, 30), (4, 24)))
    outputs = engine.run()
    assert engine.totals.suspensions > 0 and engine.totals.events["resume"] > 0
    assert engine.totals.recompute_pauses > 0 and engine.totals.recomputed_tokens > 0
    assert engine.totals.bytes_migrated == engine.totals.blocks_migrated * engine.cache.block_bytes > 0
    equivalent(engine, outputs)


def test_without_host_tier_every_eviction_is_a_recompute_pause(make_engine, equivalent):
    engine = make_engine(gpu_blocks=16, host_blocks=0, block_size=4, prefill_chunk_size=64)
    submit(engine, workload(12, 2, (4, 30), (4, 24)))
    outputs = engine.run()
    assert engine.totals.suspensions == 0 and engine.totals.blocks_migrated == 0
    assert engine.totals.recompute_pauses > 0 and engine.totals.events["replay"] > 0
    equivalent(engine, outputs)


def test_block_size_one(make_engine, equivalent):
    engine = make_engine(gpu_blocks=36, host_blocks=12, block_size=1, prefill_chunk_size=64)
    submit(engine, workload(10, 3, (2, 20), (2, 16)))
    outputs = engine.run()
    assert engine.totals.suspensions > 0 and engine.totals.recompute_pauses > 0
    equivalent(engine, outputs)


def test_chunked_prefill_smaller_than_prompts(make_engine, equivalent):
    engine = make_engine(gpu_blocks=20, host_blocks=6, block_size=4, prefill_chunk_size=5, max_num_tokens=12)
    work = workload(10, 4, (12, 40), (4, 16))
    assert all(len(prompt) > 5 for prompt, _ in work)
    submit(engine, work)
    outputs = engine.run()
    assert engine.totals.suspensions > 0 and engine.totals.recompute_pauses > 0
    equivalent(engine, outputs)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=0.8, seed=7),
        SamplingParams(temperature=1.3, top_k=20, seed=11),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.8, seed=3),
    ],
    ids=["temperature", "top-k", "top-p", "all"],
)
def test_seeded_sampling(make_engine, equivalent, sampling):
    engine = make_engine(gpu_blocks=16, host_blocks=6, block_size=4, prefill_chunk_size=7, seed=123)
    submit(engine, workload(10, 5, (4, 30), (4, 20)), sampling)
    outputs = engine.run()
    assert engine.totals.suspensions + engine.totals.recompute_pauses > 0
    equivalent(engine, outputs)


def test_sampling_seed_changes_output(make_engine, equivalent):
    """The seed matters (so the sampling tests above are not secretly greedy)."""
    work = workload(4, 6, (4, 10), (12, 12))
    runs = []
    for seed in (1, 2):
        engine = make_engine(gpu_blocks=64, seed=seed)
        submit(engine, work, SamplingParams(temperature=1.0))
        runs.append(engine.run())
    assert runs[0] != runs[1]


def test_a_lost_copy_is_detected(make_engine, monkeypatch):
    """The oracle has teeth: if suspend/resume copies do nothing, resumed requests produce different output."""
    engine = make_engine(gpu_blocks=16, host_blocks=12, block_size=4, prefill_chunk_size=64, check_invariants=False)
    submit(engine, workload(12, 1, (4, 30), (4, 24)))
    monkeypatch.setattr(engine.cache, "_copy", lambda *args, **kwargs: None)
    # zero the freed GPU blocks so a resumed request cannot read its own stale KV by chance
    original_complete = engine.scheduler.complete_migrations

    def complete_and_scrub(output):
        for plan in output.migrations:
            if plan.direction == "to_host":
                for src, _ in plan.pairs:
                    engine.cache.device_cache[src].zero_()
        original_complete(output)

    monkeypatch.setattr(engine.scheduler, "complete_migrations", complete_and_scrub)
    outputs = engine.run()
    assert engine.totals.suspensions > 0
    references = engine.reference_outputs()
    assert any(outputs[rid] != ref for rid, ref in references.items())
