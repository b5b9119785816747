"""Migration bandwidth: offload and resume copies through `executor.PagedKVCache.execute` versus one contiguous
copy of the same bytes on the same device (the physical limit a block copier can approach).

The plans are real `MigrationPlan`s from a `TieredBlockPool`, in three layouts of the request's GPU blocks:
`contiguous` (one run), `alternating` (every other block: one-block runs) and `random` (a seeded mix, short
runs). Every block size copies the same total bytes. The baseline is a plain memory copy on the CPU and a
pinned host <-> device copy on CUDA. torch is imported inside `run`.
"""

from __future__ import annotations

import random

from executor.bench.results import Row, Section
from executor.bench.timing import interleaved, medians
from kvstate.pool import TieredBlockPool

LAYOUTS = ("contiguous", "alternating", "random")
BLOCK_TOKENS = (8, 32, 128)  # with the cache shape below: 16 KiB, 64 KiB and 256 KiB blocks
DEFAULT_BLOCK_TOKENS = 32  # 64 KiB blocks
CACHE_SHAPE = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64}  # float32: 2 KiB of K and V per token


def layout_plans(layout: str, num_blocks: int, seed: int = 0):
    """(offload plan, resume plan, gpu tier size) of a suspended request holding `num_blocks` blocks in `layout`, all
    of them offloaded at once (an eager offload, or an allocation that needs them all) and then copied back.

    Another request holds the GPU blocks in between, so the resume lands on the same fragmented ids."""
    gpu_blocks = num_blocks if layout == "contiguous" else 2 * num_blocks
    pool = TieredBlockPool(gpu_blocks, num_blocks, block_size=1)
    if layout == "contiguous":
        pool.allocate("r", num_blocks)
    else:
        rng = random.Random(seed)
        owners = (
            ["r", "other"] * num_blocks
            if layout == "alternating"
            else rng.sample(["r"] * num_blocks + ["other"] * num_blocks, 2 * num_blocks)
        )
        for owner in owners:
            pool.allocate(owner, 1)
    pool.hold("r")
    offload = pool.offload("r", num_blocks)
    pool.complete(offload)
    resume = pool.onboard("r")
    if resume is None:  # every block was offloaded, so a resume copies them all
        raise AssertionError("a request offloaded whole resumes with a copy")
    pool.complete(resume)
    return offload, resume, gpu_blocks


def run(*, quick: bool = False, device: str = "auto", seed: int = 0) -> Section:
    import torch

    from executor.kv_cache import PagedKVCache, resolve_device

    dev = resolve_device(device)
    total_bytes = (8 if quick else 32) << 20
    repeats = 5 if quick else 15
    section = Section("migration", data={"device": dev.type, "total_bytes": total_bytes, "series": []})
    pin = dev.type == "cuda"

    def sync() -> None:
        if pin:
            torch.cuda.synchronize(dev)

    def via_cache(cache: PagedKVCache, plan):
        def call() -> None:
            cache.execute(plan).wait()

        return call

    def flat(dst, src):
        def call() -> None:
            dst.copy_(src, non_blocking=pin)
            sync()

        return call

    for tokens in BLOCK_TOKENS:
        block_bytes = tokens * CACHE_SHAPE["num_layers"] * 2 * CACHE_SHAPE["num_kv_heads"] * CACHE_SHAPE["head_dim"] * 4
        n = total_bytes // block_bytes
        plans = {layout: layout_plans(layout, n, seed) for layout in LAYOUTS}
        cache = PagedKVCache(
            2 * n, block_size=tokens, dtype=torch.float32, device=dev, num_host_blocks=n, **CACHE_SHAPE
        )
        cache.device_cache.normal_(generator=torch.Generator(device=dev).manual_seed(seed))
        numel = total_bytes // 4
        flat_host = torch.empty(numel, dtype=torch.float32, pin_memory=pin)
        flat_host_src = torch.randn(numel, dtype=torch.float32, generator=torch.Generator().manual_seed(seed))
        flat_host_src = flat_host_src.pin_memory() if pin else flat_host_src
        flat_dev = torch.empty(numel, dtype=torch.float32, device=dev)
        variants = {"baseline to_host": flat(flat_host, flat_dev), "baseline to_gpu": flat(flat_dev, flat_host_src)}
        for layout, (offload, resume, _) in plans.items():
            variants[f"offload {layout}"] = via_cache(cache, offload)
            variants[f"resume {layout}"] = via_cache(cache, resume)
        times = medians(interleaved(variants, repeats=repeats, warmup=2, seed=seed))
        for layout, (offload, resume, _) in plans.items():
            for op, plan, base in (("offload", offload, "baseline to_host"), ("resume", resume, "baseline to_gpu")):
                ours, limit = total_bytes / times[f"{op} {layout}"] / 1e9, total_bytes / times[base] / 1e9
                default = tokens == DEFAULT_BLOCK_TOKENS
                goal = 0.8 if dev.type == "cuda" else 0.7
                section.rows.append(
                    Row(
                        group="migration",
                        name=f"{op} {layout}, {block_bytes >> 10} KiB blocks x {n}",
                        value=ours,
                        unit="GB/s",
                        baseline_name="contiguous copy",
                        baseline=limit,
                        target=f"ratio >= {goal}" if default else "",
                        met=(ours / limit >= goal) if default else None,
                        note=f"{len(plan.runs())} runs",
                    )
                )
                section.data["series"].append(
                    {
                        "op": op,
                        "layout": layout,
                        "block_bytes": block_bytes,
                        "blocks": n,
                        "runs": len(plan.runs()),
                        "gbps": ours,
                        "baseline_gbps": limit,
                    }
                )
    return section
