"""The model: paged attention equals dense attention; logits do not depend on batch-mates or chunking; the rotary
factors every layer shares equal Hugging Face's rotation."""

from __future__ import annotations

import random

import pytest
import torch

from executor import LlamaModel, ModelConfig, PagedBatch, PagedKVCache, SeqChunk
from executor.model import apply_rotary, rotary_cos_sin


def _cache(model: LlamaModel, blocks: int, block_size: int) -> PagedKVCache:
    return PagedKVCache.for_model(model, blocks, block_size=block_size, device="cpu")


def _paged_logits_per_position(model, sequences, block_size, chunk, blocks=256, seed=0):
    """Run every sequence through the paged path in chunks of `chunk` tokens, all sequences batched together
    in each forward pass, with scattered (shuffled) block tables; returns {i: logits [len, vocab]}."""
    cache = _cache(model, blocks, block_size)
    free = list(range(blocks))
    random.Random(seed).shuffle(free)
    tables = {}
    for i, seq in enumerate(sequences):
        need = -(-len(seq) // block_size)
        tables[i], free = tuple(free[:need]), free[need:]
    done = dict.fromkeys(range(len(sequences)), 0)
    logits = {i: [] for i in range(len(sequences))}
    while any(done[i] < len(s) for i, s in enumerate(sequences)):
        chunks, owners = [], []
        for i, seq in enumerate(sequences):
            if done[i] < len(seq):
                n = min(chunk, len(seq) - done[i])
                chunks.append(SeqChunk(tuple(seq[done[i] : done[i] + n]), done[i], tables[i], True))
                owners.append((i, n))
        # every token's logits: run each chunk with sample rows at every token, by building one batch per token
        batch = PagedBatch.build(chunks, block_size)
        out = model.forward_paged(batch, cache)
        for row, (i, n) in enumerate(owners):
            logits[i].append(out[row : row + 1])
            done[i] += n
    return {i: torch.cat(rows) for i, rows in logits.items()}


@pytest.mark.parametrize("block_size,chunk", [(1, 1), (4, 3), (16, 64), (5, 1)])
def test_paged_equals_dense(tiny_model, block_size, chunk):
    """The logits of each chunk's last token equal the dense forward's logits at that position."""
    rng = random.Random(block_size * 100 + chunk)
    sequences = [[rng.randrange(512) for _ in range(rng.randint(3, 40))] for _ in range(4)]
    paged = _paged_logits_per_position(tiny_model, sequences, block_size, chunk)
    for i, seq in enumerate(sequences):
        dense = tiny_model.forward_dense(seq)
        ends = [min(start + chunk, len(seq)) - 1 for start in range(0, len(seq), chunk)]
        torch.testing.assert_close(paged[i], dense[ends], rtol=1e-10, atol=1e-10)


def test_decode_after_prefill_equals_dense(tiny_model):
    """Prefill a prompt, then decode one token at a time: every step equals the dense forward."""
    seq = [random.Random(1).randrange(512) for _ in range(30)]
    paged = _paged_logits_per_position(tiny_model, [seq[:20]], 4, 20, seed=1)[0]
    torch.testing.assert_close(paged, tiny_model.forward_dense(seq[:20])[19:20], rtol=1e-10, atol=1e-10)
    cache = _cache(tiny_model, 16, 4)
    table = tuple(range(15, 7, -1))
    tiny_model.forward_paged(PagedBatch.build([SeqChunk(tuple(seq[:20]), 0, table)], 4), cache)
    dense = tiny_model.forward_dense(seq)
    for pos in range(20, 30):
        out = tiny_model.forward_paged(PagedBatch.build([SeqChunk((seq[pos],), pos, table)], 4), cache)
        torch.testing.assert_close(out[0], dense[pos], rtol=1e-10, atol=1e-10)


def test_no_sample_rows_and_sample_selection(tiny_model):
    cache = _cache(tiny_model, 8, 4)
    batch = PagedBatch.build([SeqChunk((1, 2, 3), 0, (0,), False), SeqChunk((4, 5), 0, (1,), True)], 4)
    out = tiny_model.forward_paged(batch, cache)
    assert out.shape == (1, tiny_model.config.vocab_size)
    torch.testing.assert_close(out[0], tiny_model.forward_dense([4, 5])[1], rtol=1e-10, atol=1e-10)


def test_seeded_weights_are_reproducible_and_seed_dependent():
    a, b, c = LlamaModel.from_seed(seed=5), LlamaModel.from_seed(seed=5), LlamaModel.from_seed(seed=6)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.embed_tokens.weight, c.embed_tokens.weight)


def test_tied_embeddings_and_dtype():
    model = LlamaModel.from_seed(ModelConfig(tie_word_embeddings=True), dtype=torch.float32)
    assert model.lm_head is None and model.dtype == torch.float32
    out = model.forward_dense([1, 2, 3])
    assert out.dtype == torch.float32
    hidden = model._decode(torch.tensor([1, 2, 3]), torch.arange(3), None, None)
    torch.testing.assert_close(out, hidden @ model.embed_tokens.weight.T)


def test_model_config_validation():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig(hidden_size=0)


def test_rotary_equals_rotate_half():
    """`apply_rotary` with the shared factors equals Hugging Face's ``x * cos + rotate_half(x) * sin`` exactly."""
    positions = torch.tensor([0, 1, 7, 300, 4095])
    x = torch.randn(5, 3, 16, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    cos, sin = rotary_cos_sin(positions, 16, 10000.0, torch.float32)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    ref_cos, ref_sin = angles.cos().float()[:, None, :], angles.sin().float()[:, None, :]
    rotate_half = torch.cat((-x[..., 8:], x[..., :8]), dim=-1)
    assert torch.equal(apply_rotary(x, cos, sin), x * ref_cos + rotate_half * ref_sin)
