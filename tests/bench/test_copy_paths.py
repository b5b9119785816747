"""The CPU copy paths `PagedKVCache.execute` takes for fragmented plans move exactly the named blocks."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from executor import PagedKVCache  # noqa: E402
from executor.kv_cache import GATHER_MIN_RUNS  # noqa: E402
from kvstate.pool import TO_GPU, TO_HOST, MigrationPlan  # noqa: E402


def _cache(dtype=torch.float32) -> PagedKVCache:
    cache = PagedKVCache(
        32, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype, device="cpu", num_host_blocks=16
    )
    cache.device_cache.copy_(torch.arange(cache.device_cache.numel()).view_as(cache.device_cache))
    cache.host_cache.copy_(-torch.arange(cache.host_cache.numel()).view_as(cache.host_cache) - 1)
    return cache


PLANS = {
    "gather (consecutive destinations)": (TO_HOST, tuple((2 * i, 3 + i) for i in range(10))),
    "scatter (consecutive sources)": (TO_GPU, tuple((i, 2 * i + 1) for i in range(10))),
    "both fragmented": (TO_GPU, tuple((2 * i, 3 * i) for i in range(8))),
    "unsorted destinations": (TO_HOST, tuple((i * 3, 15 - i) for i in range(10))),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(PLANS))
def test_fragmented_plans_copy_exactly_their_blocks(name, dtype):
    direction, pairs = PLANS[name]
    cache = _cache(dtype)
    plan = MigrationPlan(0, "r", direction, pairs)
    assert len(plan.runs()) > GATHER_MIN_RUNS
    source, dest = (
        (cache.device_cache, cache.host_cache) if direction == TO_HOST else (cache.host_cache, cache.device_cache)
    )
    before_source, before_dest = source.clone(), dest.clone()
    fence = cache.execute(plan)
    assert fence.done()
    assert cache.num_copies == len(plan.runs())
    assert torch.equal(source, before_source)
    written = {dst for _, dst in pairs}
    for src, dst in pairs:
        assert torch.equal(dest[dst], before_source[src])
    for block in range(dest.shape[0]):
        if block not in written:
            assert torch.equal(dest[block], before_dest[block])
