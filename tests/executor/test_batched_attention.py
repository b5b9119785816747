"""Batched paged attention: one padded, masked call per group of requests equals attending request by request."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from executor import PagedBatch, PagedKVCache, SeqChunk

BLOCK = 4


def _cache(model, blocks: int) -> PagedKVCache:
    return PagedKVCache.for_model(model, blocks, block_size=BLOCK, device="cpu")


def _unbatched(batch: PagedBatch) -> PagedBatch:
    return dataclasses.replace(batch, groups=None, out_order=None)


def _schedule(seed: int, requests: int = 6):
    """Forward passes of `requests` sequences: random prompt chunks, then decodes, mixed in random order, with
    scattered block tables. Returns ([[(request, chunk), ...] per pass], sequences)."""
    rng = random.Random(seed)
    seqs = [[rng.randrange(512) for _ in range(rng.randint(1, 30))] for _ in range(requests)]
    free = list(range(64))
    rng.shuffle(free)
    tables = []
    for s in seqs:
        need = -(-len(s) // BLOCK)
        tables.append(tuple(free[:need]))
        free = free[need:]
    done = [0] * requests
    passes = []
    while any(d < len(s) for d, s in zip(done, seqs, strict=True)):
        chunks = []
        for i in rng.sample(range(requests), requests):
            if done[i] < len(seqs[i]):
                n = 1 if done[i] and rng.random() < 0.6 else rng.randint(1, 7)
                n = min(n, len(seqs[i]) - done[i])
                chunks.append(
                    (i, SeqChunk(tuple(seqs[i][done[i] : done[i] + n]), done[i], tables[i], rng.random() < 0.8))
                )
                done[i] += n
        passes.append(chunks)
    return passes, seqs


@pytest.mark.parametrize("seed", range(6))
def test_batched_equals_per_request(tiny_model, seed):
    """Every pass of a mixed schedule (prefill chunks and decodes, any order) gives the logits and cache contents
    of the request-by-request path, up to float64 rounding."""
    passes, _ = _schedule(seed)
    batched, looped = _cache(tiny_model, 64), _cache(tiny_model, 64)
    for chunks in passes:
        batch = PagedBatch.build([c for _, c in chunks], BLOCK)
        out = tiny_model.forward_paged(batch, batched)
        ref = tiny_model.forward_paged(_unbatched(batch), looped)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        assert torch.equal(out.argmax(-1), ref.argmax(-1))
    torch.testing.assert_close(batched.device_cache, looped.device_cache, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_schedule_equals_dense(tiny_model, seed):
    """The sampling rows of a mixed schedule equal the dense forward of each sequence at that position."""
    passes, seqs = _schedule(seed + 10)
    cache = _cache(tiny_model, 64)
    dense = [tiny_model.forward_dense(s) for s in seqs]
    for chunks in passes:
        out = tiny_model.forward_paged(PagedBatch.build([c for _, c in chunks], BLOCK), cache)
        rows = [(i, c.start + len(c.tokens) - 1) for i, c in chunks if c.produces_token]
        assert out.shape[0] == len(rows)
        for row, (i, pos) in enumerate(rows):
            torch.testing.assert_close(out[row], dense[i][pos], rtol=1e-10, atol=1e-10)


def test_decode_does_not_depend_on_batch_mates(tiny_model):
    """A short request's decode logits alone equal those in a batch with longer (padded-against) batch-mates,
    and reading never touches a block outside the request's table: blocks no request owns hold NaN."""
    rng = random.Random(3)
    lengths = [5, 31, 17, 2]  # the first is padded to the 8 blocks of the second
    tables = [(40, 3), (11, 12, 13, 14, 15, 16, 17, 18), (60, 61, 2, 62, 63), (70,)]
    prompts = [[rng.randrange(512) for _ in range(n)] for n in lengths]
    nxt = [rng.randrange(512) for _ in lengths]

    def run(members):
        cache = _cache(tiny_model, 128)
        owned = sorted({b for i in members for b in tables[i]})
        unowned = torch.ones(128, dtype=torch.bool)
        unowned[owned] = False
        cache.device_cache[unowned] = float("nan")
        prefill = [SeqChunk(tuple(prompts[i]), 0, tables[i]) for i in members]
        tiny_model.forward_paged(PagedBatch.build(prefill, BLOCK), cache)
        decode = [SeqChunk((nxt[i],), lengths[i], tables[i]) for i in members]
        out = tiny_model.forward_paged(PagedBatch.build(decode, BLOCK), cache)
        assert torch.isfinite(out).all()
        return out

    alone = run([0])
    together = run([1, 0, 3, 2])
    torch.testing.assert_close(together[1], alone[0], rtol=1e-12, atol=1e-12)
    assert together[1].argmax() == alone[0].argmax()
    expected = tiny_model.forward_dense(prompts[0] + [nxt[0]])[-1]
    torch.testing.assert_close(alone[0], expected, rtol=1e-10, atol=1e-10)
