"""Batch building (`PagedBatch.build`): attention groups padded with each request's own first block, keys read up to
the longest context and masked past each shorter one, outputs put back in batch order, short tables refused."""

from __future__ import annotations

import random

import pytest
import torch

from executor import PagedBatch, PagedKVCache, SeqChunk

BLOCK = 4


def _cache(model, blocks: int) -> PagedKVCache:
    return PagedKVCache.for_model(model, blocks, block_size=BLOCK, device="cpu")


def test_attention_plan():
    """A decode-only batch is one group read in place (no row gather, no reorder); a mixed batch is a decode group
    and a chunk group, whose outputs are put back in batch order."""
    decodes = [SeqChunk((1,), 6, (2, 5)), SeqChunk((2,), 3, (7,)), SeqChunk((3,), 9, (0, 1, 4))]
    batch = PagedBatch.build(decodes, BLOCK)
    (group,) = batch.groups
    assert batch.out_order is None and group.query_rows is None and group.valid is None
    assert (group.num_seqs, group.num_queries, group.num_blocks) == (3, 1, 3)
    assert group.blocks.tolist() == [2, 5, 2, 7, 7, 7, 0, 1, 4]  # padded with each request's own first block
    # keys are read up to the longest context (10 of the 12 slots gathered), the shorter ones masked
    assert group.num_keys == 10 and group.mask.shape == (3, 1, 1, 10)
    assert group.mask.sum(-1).flatten().tolist() == [7, 4, 10]

    mixed = PagedBatch.build([SeqChunk((5, 6, 7), 0, (3,)), decodes[0], SeqChunk((8, 9), 4, (6, 8))], BLOCK)
    dec, chunk = mixed.groups
    assert (dec.num_seqs, chunk.num_seqs, chunk.num_queries) == (1, 2, 3)
    assert chunk.query_rows.tolist() == [0, 1, 2, 4, 5, 5] and chunk.valid.tolist() == [0, 1, 2, 3, 4]
    assert mixed.out_order.tolist() == [1, 2, 3, 0, 4, 5]
    # causal within a chunk plus every cached position: row 4 (position 4 of the second chunk) sees keys 0..4
    assert chunk.mask[1, 0].sum(-1).tolist() == [5, 6, 6]


def test_ragged_contexts_mask_past_each_context():
    """With unequal contexts the keys are read up to the longest and each shorter one is masked past its end."""
    batch = PagedBatch.build([SeqChunk((1,), 2, (4,)), SeqChunk((2,), 6, (0, 3))], BLOCK)
    (group,) = batch.groups
    assert group.num_keys == 7 and group.mask.shape == (2, 1, 1, 7)
    assert group.mask.sum(-1).flatten().tolist() == [3, 7]


def test_equal_contexts_read_no_padding_and_need_no_mask(tiny_model):
    """Requests decoding at the same position read exactly their context (no mask); their logits equal those of
    each request decoded alone and those of the dense forward."""
    rng = random.Random(3)
    tables = [(0, 1, 2), (5, 3, 4), (8, 7, 6)]
    prompts = [[rng.randrange(512) for _ in range(9)] for _ in tables]
    nxt = [rng.randrange(512) for _ in tables]
    cache = _cache(tiny_model, 9)
    prefill = [SeqChunk(tuple(p), 0, t) for p, t in zip(prompts, tables, strict=True)]
    tiny_model.forward_paged(PagedBatch.build(prefill, BLOCK), cache)
    decode = [SeqChunk((n,), 9, t) for n, t in zip(nxt, tables, strict=True)]
    batch = PagedBatch.build(decode, BLOCK)
    (group,) = batch.groups
    assert (group.num_blocks, group.num_keys, group.mask) == (3, 10, None)  # 12 slots gathered, 10 read
    together = tiny_model.forward_paged(batch, cache)
    for i, chunk in enumerate(decode):
        alone = PagedBatch.build([chunk], BLOCK)
        assert alone.groups[0].mask is None
        torch.testing.assert_close(together[i], tiny_model.forward_paged(alone, cache)[0], rtol=1e-12, atol=1e-12)
        dense = tiny_model.forward_dense(prompts[i] + [nxt[i]])[-1]
        torch.testing.assert_close(together[i], dense, rtol=1e-10, atol=1e-10)


def test_table_too_short_is_refused():
    with pytest.raises(ValueError, match="needs 2 blocks"):
        PagedBatch.build([SeqChunk((1, 2, 3, 4, 5), 0, (0,))], 4)
