"""The decode plan: batches read as columns, tables recognised by identity or by their blocks, and the keys and
values a reused plan keeps (`DecodeKV`), within a budget, giving the logits of a fresh gather."""

from __future__ import annotations

import random

import torch

from executor import BatchPlanner, PagedBatch, PagedKVCache, SeqChunk
from executor.decode_kv import DecodeKV
from kvstate.output import PlannedBatch

BLOCK = 4


def _cache(model, blocks: int) -> PagedKVCache:
    return PagedKVCache.for_model(model, blocks, block_size=BLOCK, device="cpu")


def _columns(chunks: list[SeqChunk]) -> PlannedBatch:
    """The same chunks as the scheduler hands them over: parallel columns (no request objects needed here)."""
    return PlannedBatch(
        [None] * len(chunks),  # type: ignore[list-item]
        [c.start for c in chunks],
        [c.tokens for c in chunks],
        [c.block_table for c in chunks],
        [c.produces_token for c in chunks],
    )


def test_planner_reads_columns_like_chunks():
    """The planner gives the same batches, and reuses the same steps, whether it is handed chunk records or the
    scheduler's columns; a table handed over as a new object with the same blocks keeps the plan."""
    tables = [(10, 11, 12, 13), (20, 21, 22, 23), (30, 31, 32, 33)]
    by_chunks, by_columns = BatchPlanner(BLOCK), BatchPlanner(BLOCK)
    positions = [3, 5, 6]
    for step in range(8):
        # every other step the tables arrive as fresh tuples holding the same blocks
        given = tables if step % 2 else [tuple(block for block in t) for t in tables]
        assert (given[0] is tables[0]) == bool(step % 2)
        chunks = [SeqChunk((step + i,), positions[i] + step, given[i]) for i in range(3)]
        a, b = by_chunks.plan(chunks), by_columns.plan(_columns(chunks))
        fresh = PagedBatch.build(chunks, BLOCK)
        for batch in (a, b):
            assert batch.seqs == fresh.seqs
            assert batch.positions.tolist() == fresh.positions.tolist()
            assert batch.slot_blocks.tolist() == fresh.slot_blocks.tolist()
            assert batch.groups[0].blocks.tolist() == fresh.groups[0].blocks.tolist()
            assert batch.groups[0].num_keys == fresh.groups[0].num_keys
    assert by_chunks.reuses == by_columns.reuses > 0
    assert by_chunks.builds == by_columns.builds


def test_planner_rebuilds_when_a_table_holds_other_blocks():
    """A fresh table object whose blocks differ from the plan's is another request: the plan is rebuilt."""
    planner = BatchPlanner(BLOCK)
    planner.plan(_columns([SeqChunk((1,), 5, (3, 4)), SeqChunk((1,), 5, (6, 7))]))
    batch = planner.plan(_columns([SeqChunk((2,), 6, (3, 4)), SeqChunk((2,), 6, (6, 9))]))
    assert planner.reuses == 0 and batch.groups[0].blocks.tolist() == [3, 4, 6, 9]


def _ragged_decode(model, planner: BatchPlanner, steps: int) -> list[tuple[bool, DecodeKV | None]]:
    """Decode three requests of unequal contexts (masked, crossing block boundaries) `steps` times with `planner`
    on one cache and with fresh builds on another: the logits must be equal, bit for bit, at every step.
    Returns (plan reused, the batch's DecodeKV) per step."""
    rng = random.Random(7)
    tables = [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    lengths = [3, 6, 9]
    planned, fresh = _cache(model, 12), _cache(model, 12)
    prefill = [
        SeqChunk(tuple(rng.randrange(512) for _ in range(n)), 0, t) for n, t in zip(lengths, tables, strict=True)
    ]
    for cache in (planned, fresh):
        model.forward_paged(PagedBatch.build(prefill, BLOCK), cache)
    seen = []
    for _ in range(steps):
        chunks = [SeqChunk((rng.randrange(512),), n, t) for n, t in zip(lengths, tables, strict=True)]
        before = planner.reuses
        batch = planner.plan(_columns(chunks))
        logits = model.forward_paged(batch, planned)
        assert torch.equal(logits, model.forward_paged(PagedBatch.build(chunks, BLOCK), fresh))
        seen.append((planner.reuses > before, batch.decode_kv))
        lengths = [n + 1 for n in lengths]
    return seen


def test_a_reused_decode_plan_keeps_its_keys_and_values_and_gives_the_logits_of_a_fresh_gather(tiny_model):
    """Steps after a decode plan's first gather no blocks: each layer's keys and values are kept by the plan's
    `DecodeKV` and take only the new token's; the logits equal a fresh build's at every step, across block
    boundaries inside the plan and across the rebuild when the longest context outgrows it (a new DecodeKV)."""
    seen = _ragged_decode(tiny_model, BatchPlanner(BLOCK), steps=5)
    # contexts 3, 6, 9 need 3 blocks; at step 3 the longest reaches position 12, a 4th block: rebuilt
    assert [reused for reused, _ in seen] == [False, True, True, False, True]
    kept = [kv for _, kv in seen]
    assert kept[0] is kept[1] is kept[2] and kept[3] is kept[4] and kept[0] is not kept[3]
    assert all(kv is not None and sorted(kv.kept) == list(range(tiny_model.config.num_layers)) for kv in kept)


def test_a_decode_plan_over_its_budget_keeps_nothing_and_gathers_every_step(tiny_model):
    seen = _ragged_decode(tiny_model, BatchPlanner(BLOCK, decode_kv_budget=0), steps=3)
    assert [reused for reused, _ in seen] == [False, True, True]
    assert all(kv is not None and kv.kept == {} for _, kv in seen)


def test_an_engine_without_decode_kv_memory_gives_the_same_outputs(make_engine):
    """`EngineConfig.decode_kv_bytes` bounds what the engine's decode plans keep; at 0 they keep nothing and gather
    every step, and the outputs are the same token for token."""
    rng = random.Random(11)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(2, 12))] for _ in range(6)]
    outputs, kept = [], []
    for budget in (0, 1 << 20):
        engine = make_engine(gpu_blocks=64, block_size=4, decode_kv_bytes=budget)
        ids = [engine.add_request(p, 10) for p in prompts]
        seen = set()
        while engine.scheduler.has_unfinished:
            engine.step()
            kv = engine._planner._decode_kv  # the plan of this step's batch (None: not a decode-only batch)
            if kv is not None:
                seen.add(len(kv.kept))
        outputs.append([engine.outputs()[i] for i in ids])
        kept.append(max(seen))
    assert outputs[0] == outputs[1]
    assert kept == [0, engine.model.config.num_layers]
