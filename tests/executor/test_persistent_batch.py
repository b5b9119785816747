"""The persistent decode batch: a kept decode plan is updated in place where the batch changed (positions moved
on, a request entered a new block, requests left), and its logits equal a fresh build's bit for bit."""

from __future__ import annotations

import random

import torch

from executor import BatchPlanner, PagedBatch, PagedKVCache, SeqChunk
from kvstate.output import PlannedBatch

BLOCK = 4


def _columns(chunks: list[SeqChunk]) -> PlannedBatch:
    return PlannedBatch(
        [None] * len(chunks),  # type: ignore[list-item]
        [c.start for c in chunks],
        [c.tokens for c in chunks],
        [c.block_table for c in chunks],
        [c.produces_token for c in chunks],
    )


def _prefilled(model, blocks: int, lengths: list[int], tables: list[tuple[int, ...]], rng: random.Random):
    """Two caches of `blocks` blocks, each holding the same random prompts of these lengths in these tables."""
    caches = [PagedKVCache.for_model(model, blocks, block_size=BLOCK, device="cpu") for _ in range(2)]
    prefill = [
        SeqChunk(tuple(rng.randrange(512) for _ in range(n)), 0, t) for n, t in zip(lengths, tables, strict=True)
    ]
    for cache in caches:
        model.forward_paged(PagedBatch.build(prefill, BLOCK), cache)
    return caches


def test_requests_that_leave_are_dropped_from_the_kept_plan_in_place(tiny_model) -> None:
    """Five requests of unequal contexts decode; one leaves at step 2, two more at step 4 (out of the middle and
    the end): the planner keeps its plan and its kept keys and values, rows dropped, and every step's logits equal
    a fresh build's on a second cache. A request that joins after the plan's own is appended to the kept plan
    (its blocks alone gathered into the kept keys and values), with a fresh build's logits; a reordered batch
    makes a new plan."""
    rng = random.Random(5)
    tables = [tuple(range(6 * i, 6 * i + 6)) for i in range(5)]  # room to grow: 6 blocks each
    lengths = [3, 5, 8, 2, 6]
    planned, fresh = _prefilled(tiny_model, 30, lengths, tables, rng)
    planner = BatchPlanner(BLOCK)
    live = list(range(5))
    kept = []
    for step in range(7):
        if step == 2:
            live.remove(1)
        if step == 4:
            live.remove(4)
            live.remove(2)
        chunks = [SeqChunk((rng.randrange(512),), lengths[i], tables[i]) for i in live]
        batch = planner.plan(_columns(chunks))
        logits = tiny_model.forward_paged(batch, planned)
        assert torch.equal(logits, tiny_model.forward_paged(PagedBatch.build(chunks, BLOCK), fresh))
        assert batch.positions.tolist() == [lengths[i] for i in live]
        kept.append(batch.decode_kv)
        lengths = [n + 1 if i in live else n for i, n in enumerate(lengths)]
    assert planner.builds == 1 and planner.reuses == 6 and all(kv is kept[0] for kv in kept)
    assert all(keys.shape[0] == len(live) for keys, _ in kept[-1].kept.values())
    joined = [SeqChunk((1,), lengths[i], tables[i]) for i in (*live, 1)]  # request 1 is back, after the others
    batch = planner.plan(_columns(joined))
    logits = tiny_model.forward_paged(batch, planned)
    assert torch.equal(logits, tiny_model.forward_paged(PagedBatch.build(joined, BLOCK), fresh))
    assert planner.builds == 1 and planner.reuses == 7 and batch.decode_kv is kept[0]
    assert all(keys.shape[0] == len(live) + 1 for keys, _ in kept[0].kept.values())
    reordered = [SeqChunk((1,), lengths[i] + 1, tables[i]) for i in (1, *live)]
    planner.plan(_columns(reordered))
    assert planner.builds == 2


def test_blocks_that_change_owner_while_the_planner_sees_no_batch_are_never_read_as_the_old_owners(
    tiny_model,
) -> None:
    """Request "a" decodes beside "c"; then, with no batch planned in between, "a" leaves and "b" takes its very
    blocks with KV of its own, one position further than "a" was (a resume into freed blocks): a batch that names
    its owners is matched by owner, so "b" is no row of the kept plan and its logits equal a fresh build's."""
    rng = random.Random(7)
    shared, other = (0, 1, 2), (3, 4, 5)
    planned, fresh = (PagedKVCache.for_model(tiny_model, 8, block_size=BLOCK, device="cpu") for _ in range(2))

    def prefill(tokens: int, table: tuple[int, ...], owner: str) -> None:
        chunk = SeqChunk(tuple(rng.randrange(512) for _ in range(tokens)), 0, table, owner=owner)
        for cache in (planned, fresh):
            tiny_model.forward_paged(PagedBatch.build([chunk], BLOCK), cache)

    prefill(5, shared, "a")
    prefill(5, other, "c")
    planner = BatchPlanner(BLOCK)
    step = [SeqChunk((7,), 5, shared, owner="a"), SeqChunk((8,), 5, other, owner="c")]
    tiny_model.forward_paged(planner.plan(step), planned)
    tiny_model.forward_paged(PagedBatch.build(step, BLOCK), fresh)
    prefill(6, tuple(shared), "b")  # "a" left; "b" resumed into its blocks (a new table object, the same blocks)
    after = [SeqChunk((9,), 6, tuple(shared), owner="b"), SeqChunk((10,), 6, other, owner="c")]
    logits = tiny_model.forward_paged(planner.plan(after), planned)
    assert torch.equal(logits, tiny_model.forward_paged(PagedBatch.build(after, BLOCK), fresh))


def test_leaving_from_the_front_or_the_back_and_joining_into_spare_rows_copy_no_kept_rows(tiny_model) -> None:
    """Six requests decode; the oldest leave from the front, then the newest from the back, then two join, then
    one leaves from the middle: every step's logits equal a fresh build's, and the kept keys and values stay in
    the buffers they were gathered into (views moved, no rows copied) until the middle leaves."""
    rng = random.Random(11)
    tables = [tuple(range(5 * i, 5 * i + 5)) for i in range(8)]
    lengths = [9, 3, 5, 4, 7, 6, 8, 2]  # within the 3 blocks the first batch gives each request
    planned, fresh = _prefilled(tiny_model, 40, lengths, tables, rng)
    planner = BatchPlanner(BLOCK)
    batches = [[0, 1, 2, 3, 4, 5], [2, 3, 4, 5], [2, 3, 4], [2, 3, 4, 6, 7], [2, 4, 6, 7]]
    buffers = []
    for live in batches:
        chunks = [SeqChunk((rng.randrange(512),), lengths[i], tables[i]) for i in live]
        batch = planner.plan(_columns(chunks))
        logits = tiny_model.forward_paged(batch, planned)
        assert torch.equal(logits, tiny_model.forward_paged(PagedBatch.build(chunks, BLOCK), fresh)), live
        assert batch.positions.tolist() == [lengths[i] for i in live]
        kept = batch.decode_kv.kept.values()
        assert all(keys.shape[0] == len(live) for keys, _ in kept)
        buffers.append([t.untyped_storage().data_ptr() for pair in kept for t in pair])  # the memory they view
        for i in live:
            lengths[i] += 1
    assert planner.builds == 1 and planner.reuses == len(batches) - 1
    assert [later == buffers[0] for later in buffers[1:]] == [True, True, True, False]
