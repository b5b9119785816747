"""The paged KV cache: layout, merged-run copies, fences, host-tier allocation failure; CUDA copy stream."""

from __future__ import annotations

import pytest
import torch

from executor import CompletedFence, EventFence, HostTierAllocationError, PagedKVCache
from kvstate.config import SchedulerConfig
from kvstate.pool import TO_GPU, TO_HOST, MigrationPlan


def _cache(gpu=16, host=8, device="cpu", dtype=torch.float32) -> PagedKVCache:
    return PagedKVCache(
        gpu, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype, device=device, num_host_blocks=host
    )


def _fill(tensor: torch.Tensor) -> None:
    tensor.copy_(torch.arange(tensor.numel(), dtype=tensor.dtype).view_as(tensor))


def test_layout_and_block_bytes():
    cache = _cache()
    assert cache.device_cache.shape == (16, 2, 2, 4, 2, 8)
    assert cache.host_cache.shape == (8, 2, 2, 4, 2, 8)
    assert cache.block_bytes == 2 * 2 * 4 * 2 * 8 * 4
    assert cache.device_cache[3].is_contiguous()  # one block's K and V of every layer are contiguous
    keys = cache.layer_keys(1)
    keys[5, 2] = 7.0
    assert torch.all(cache.device_cache[5, 1, 0, 2] == 7.0)  # the per-layer view writes through


def test_consecutive_ids_copy_as_one_run():
    cache = _cache()
    _fill(cache.device_cache)
    plan = MigrationPlan(0, "r", TO_HOST, ((3, 0), (4, 1), (5, 2), (6, 3)))
    fence = cache.execute(plan)
    assert cache.num_copies == 1
    assert isinstance(fence, CompletedFence) and fence.done()
    fence.wait()
    assert torch.equal(cache.host_cache[0:4], cache.device_cache[3:7])


def test_runs_split_where_ids_stop_being_consecutive():
    cache = _cache()
    _fill(cache.host_cache)
    pairs = ((0, 9), (1, 10), (5, 11), (6, 2), (7, 3))  # runs: (0,9,2) (5,11,1) (6,2,2)
    cache.execute(MigrationPlan(1, "r", TO_GPU, pairs))
    assert cache.num_copies == 3
    for src, dst in pairs:
        assert torch.equal(cache.device_cache[dst], cache.host_cache[src])


def test_round_trip_preserves_every_byte():
    cache = _cache(dtype=torch.float64)
    _fill(cache.device_cache)
    original = cache.device_cache[[2, 7, 8]].clone()
    cache.execute(MigrationPlan(0, "r", TO_HOST, ((2, 5), (7, 0), (8, 1))))
    cache.device_cache.zero_()
    cache.execute(MigrationPlan(1, "r", TO_GPU, ((5, 11), (0, 12), (1, 13))))
    assert torch.equal(cache.device_cache[11:14], original)


def test_host_tier_allocation_failure_is_catchable():
    cache = _cache(host=0)
    assert cache.host_cache is None and cache.num_host_blocks == 0
    with pytest.raises(HostTierAllocationError, match="simulated"):
        cache.attach_host_tier(4, simulate_failure=True)
    assert cache.host_cache is None
    with pytest.raises(RuntimeError, match="needs a host tier"):
        cache.execute(MigrationPlan(0, "r", TO_HOST, ((0, 0),)))


def test_real_allocation_error_becomes_host_tier_error(monkeypatch):
    cache = _cache(host=0)
    real_zeros = torch.zeros

    def failing_zeros(*args, **kwargs):
        if kwargs.get("device") == "cpu" and "pin_memory" in kwargs:
            raise RuntimeError("CUDA error: out of memory (pinned)")
        return real_zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", failing_zeros)
    with pytest.raises(HostTierAllocationError, match="out of memory"):
        cache.attach_host_tier(4)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        _cache(gpu=0)
    with pytest.raises(ValueError, match="device must be"):
        _cache(device="tpu")
    with pytest.raises(ValueError, match="direction"):
        _cache().execute(MigrationPlan(0, "r", "sideways", ((0, 0),)))


# ---------------------------------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
def test_cuda_copies_run_on_the_copy_stream_with_an_event_fence():
    cache = _cache(gpu=64, host=64, device="cuda")
    assert cache.host_cache.is_pinned()
    assert cache.copy_stream is not None and cache.copy_stream != torch.cuda.current_stream()
    _fill(cache.device_cache)
    expected = cache.device_cache[0:32].cpu()
    fence = cache.execute(MigrationPlan(0, "r", TO_HOST, tuple((i, i) for i in range(32))))
    assert isinstance(fence, EventFence)
    fence.wait()
    assert fence.done()
    assert cache.num_copies == 1
    assert torch.equal(cache.host_cache[0:32], expected)


DELAY = 20_000_000  # torch.cuda._sleep cycles: ~10-20 ms, far longer than any copy or kernel below


@pytest.mark.cuda
def test_cuda_copy_waits_for_prior_compute_and_compute_waits_for_the_fence():
    """A copy issued right after a kernel that writes its source sees the kernel's result; a kernel ordered
    after the fence sees the copied data even when the copy stream is held back (and, as the control shows,
    would not without the fence: the check is not racy by luck)."""
    cache = _cache(gpu=64, host=64, device="cuda", dtype=torch.float32)
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(4):
        big = big @ big / 64.0  # keep the compute stream busy
    cache.device_cache[0:8].fill_(3.0)  # queued on the compute stream behind the matmuls
    fence = cache.execute(MigrationPlan(0, "r", TO_HOST, tuple((i, i) for i in range(8))))
    fence.wait()
    assert torch.all(cache.host_cache[0:8] == 3.0)
    cache.copy_delay_cycles = DELAY  # the copy engine is slow from now on
    for plan_id, (first, fenced) in enumerate(((20, True), (40, False)), start=1):
        cache.host_cache[8:16].fill_(5.0 + plan_id)
        torch.cuda.synchronize()
        fence = cache.execute(MigrationPlan(plan_id, "r", TO_GPU, tuple((8 + i, first + i) for i in range(8))))
        if fenced:
            fence.order_before(torch.cuda.current_stream())
        total = cache.device_cache[first : first + 8].sum()  # runs on the compute stream
        seen = total.item()
        fence.wait()
        expected = (5.0 + plan_id) * cache.device_cache[first : first + 8].numel()
        if fenced:
            assert seen == expected and fence.done()
        else:  # the control: without the fence the compute stream read the blocks before the copy landed
            assert seen == 0.0 and cache.device_cache[first : first + 8].sum().item() == expected


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["alternating", "random"])
def test_cuda_fragmented_plans_are_staged_with_one_transfer_per_direction(layout):
    """A fragmented plan is one gather (or scatter) on the device and one DMA per direction; the data round-trips
    exactly, also with the copy stream held back."""
    from executor.bench.migration import layout_plans

    offload, resume, gpu_blocks = layout_plans(layout, 16, seed=3)
    cache = _cache(gpu=gpu_blocks, host=16, device="cuda", dtype=torch.float32)
    cache.copy_delay_cycles = DELAY
    cache.device_cache.normal_()
    ids = [src for src, _ in offload.pairs]
    original = cache.device_cache[ids].clone()
    cache.execute(offload).wait()
    assert cache.num_transfers == 1 and cache.num_copies == len(offload.runs()) > 1
    cache.device_cache.zero_()
    fence = cache.execute(resume)
    fence.order_before(torch.cuda.current_stream())
    back = cache.device_cache[[dst for _, dst in resume.pairs]].clone()  # read on the compute stream
    fence.wait()
    assert torch.equal(back, original) and cache.num_transfers == 2


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "float16"])
def test_cuda_engine_outputs_equal_references(dtype):
    """Every dtype on CUDA (float32 is the engine's default there) under pressure, by the per-dtype rule
    (`executor.checks`: exact in float64 and float32), with the copy stream held back."""
    from executor import Engine, EngineConfig
    from executor.checks import leaked_blocks, mismatches, random_workload, submit_all

    with Engine(
        EngineConfig(
            device="cuda",
            dtype=dtype,
            scheduler=SchedulerConfig(gpu_blocks=16, host_blocks=6, block_size=4),
            check_invariants=True,
        )
    ) as engine:
        engine.cache.copy_delay_cycles = DELAY // 10
        submit_all(engine, random_workload(12, 1, (4, 30), (4, 24)))
        outputs = engine.run()
        assert engine.totals.suspensions > 0 and engine.totals.recompute_pauses > 0
        assert not mismatches(engine, outputs)
        assert leaked_blocks(engine) == 0


@pytest.mark.cuda
def test_cuda_engine_without_resume_fences_garbles_outputs(monkeypatch):
    """The control of the test above: with the copy stream held back and the resume fences removed, outputs
    differ from their references, so passing with the fences is not luck."""
    from executor import Engine, EngineConfig, EventFence
    from executor.checks import mismatches, random_workload, submit_all

    with Engine(
        EngineConfig(
            device="cuda", dtype="float32", scheduler=SchedulerConfig(gpu_blocks=16, host_blocks=6, block_size=4)
        )
    ) as engine:
        engine.cache.copy_delay_cycles = DELAY
        submit_all(engine, random_workload(12, 1, (4, 30), (4, 24)))
        with monkeypatch.context() as patch:
            patch.setattr(EventFence, "order_before", lambda self, stream: None)
            outputs = engine.run()
        engine.cache.copy_delay_cycles = 0
        assert engine.totals.events["resume"] > 0
        assert mismatches(engine, outputs)


@pytest.mark.cuda
@pytest.mark.parametrize("offload", ["on_demand", "eager"])
def test_cuda_engine_under_each_offload_policy_with_the_copy_stream_held_back(offload):
    """Both offload policies on CUDA, the copy stream held back: an offload's GPU sources are reused only after
    its copy down completed, so every output still equals its reference."""
    from executor import Engine, EngineConfig, offload_spec
    from executor.checks import leaked_blocks, mismatches, random_workload, submit_all

    config = EngineConfig(
        device="cuda",
        dtype="float32",
        scheduler=SchedulerConfig(gpu_blocks=16, host_blocks=8, block_size=4),
        check_invariants=True,
        spec=offload_spec(offload),
    )
    with Engine(config) as engine:
        engine.cache.copy_delay_cycles = DELAY // 10
        submit_all(engine, random_workload(12, 1, (4, 30), (4, 24)))
        outputs = engine.run()
        assert engine.totals.events["offload"] > 0 and engine.totals.events["resume"] > 0
        assert not mismatches(engine, outputs)
        assert leaked_blocks(engine) == 0


@pytest.mark.cuda
def test_cuda_engine_reusing_offload_sources_before_their_copy_garbles_outputs(monkeypatch):
    """The control of the test above: with the copy stream held back and an offload's fence treated as complete at
    once (its GPU sources given back before the copy down read them), later steps overwrite those blocks first and
    outputs differ from their references, so passing with the fences is not luck."""
    from executor import Engine, EngineConfig
    from executor.checks import mismatches, random_workload, submit_all
    from executor.host_tier import HostTier

    wait = HostTier.wait

    def unfenced(self, plan, fence, iteration):
        wait(self, plan, CompletedFence() if plan.direction == TO_HOST else fence, iteration)

    config = EngineConfig(
        device="cuda", dtype="float32", scheduler=SchedulerConfig(gpu_blocks=16, host_blocks=8, block_size=4)
    )
    with Engine(config) as engine:
        engine.cache.copy_delay_cycles = DELAY
        submit_all(engine, random_workload(12, 1, (4, 30), (4, 24)))
        with monkeypatch.context() as patch:
            patch.setattr(HostTier, "wait", unfenced)
            outputs = engine.run()
            engine.cache.drain()
        engine.cache.copy_delay_cycles = 0
        assert engine.totals.events["offload"] > 0 and engine.totals.events["resume"] > 0
        assert mismatches(engine, outputs)
