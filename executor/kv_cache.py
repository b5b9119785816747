"""The paged KV cache: a device tier, an optional host tier, and fenced block copies between them.

Layout (both tiers): ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``; index 0 of the third
dimension holds keys, 1 holds values. One block's K and V for every layer are contiguous, so moving a request's
block moves all of its layers in one slice, and a run of consecutive block ids is one contiguous slice.

Invariants kept:
* block ids are the scheduler's: device block ``b`` is ``device[b]``, host block ``h`` is ``host[h]``; this class
  never allocates or frees a block id, it only copies the blocks a `MigrationPlan` names;
* `execute(plan)` moves every run of `plan.runs()` (merged consecutive ids on both sides) and counts each in
  `num_copies`; `num_transfers` counts the copy calls that crossed between the tiers. A plan of one run is one
  slice copy. On CUDA a plan of more runs is staged (`_copy_staged`): the device side is gathered into (offload)
  or scattered from (resume) a contiguous device staging buffer by one kernel, and the tier crossing is one DMA
  per run of consecutive host ids (one for an offload into a fresh host range or a resume of one: the usual case)
  instead of one per run (a DMA launch costs more than moving a small block). The staging
  buffer and the index tensors belong to the plan's `EventFence` until it is dropped, so nothing the copy stream
  still reads is freed or reused early. A CPU plan of up to `GATHER_MIN_RUNS` runs is one slice copy per run; one
  of more runs is one gather (`index_select(out=)`) when its destination ids are consecutive (an offload into a
  fresh host range), else one memcpy per run through NumPy views, whose call overhead is a fraction of a torch
  slice copy's: per-call overhead, not bandwidth, is what a fragmented plan of small blocks pays (`index_copy_`
  is slower than either);
* a plan's copies are complete once its `Fence` reports `done()`; `Fence.wait()` blocks the host until then and
  `Fence.order_before(stream)` makes a stream wait for them on the device. The scheduler may reuse a migration's
  source blocks only after its fence completed (the engine calls `complete_migrations` after `wait()`);
* on CUDA the copies run on a dedicated copy stream that first waits for the compute stream (so the forward
  passes that wrote a source block finish before it is read) and use ``non_blocking=True`` with a pinned host
  tier; on the CPU every copy is synchronous and the fence is already complete. Only fences of copies into the
  GPU tier (resumes) need `order_before` the forward: it never reads an offload's host blocks, and an offload's
  source blocks are reused only after its `wait()`. `copy_delay_cycles` holds the copy stream back before each
  plan (`torch.cuda._sleep`; tests and scripts/gpu-check use it to show that ordering, not luck, is at work);
* the host tier either exists with its full capacity or not at all: a failed allocation raises
  `HostTierAllocationError` and leaves the cache GPU-only, so the engine can fall back to GPU-only operation;
  `detach_host_tier` drops it mid-run (the engine does so only once the scheduler has no host blocks);
* `migrate(plan)` is `execute(plan)` for callers that handle failures: a copy that fails raises
  `MigrationFailed` only after every copy it had issued has completed, so the caller may release the plan's
  blocks at once (`Scheduler.fail_migration`); `migrate(plan, fail_after=k)` simulates such a failure after k
  runs (fault injection, `executor.faults`);
* `host_checksums(blocks)` is a CRC-32 per host block, over its bytes: any changed value changes it.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Protocol

import torch

from executor.batch import host_longs
from executor.model import ModelConfig
from kvstate.pool import TO_GPU, TO_HOST, MigrationPlan

GATHER_MIN_RUNS = 4  # a CPU plan with more runs than this is copied by one gather/scatter, not run by run


def _consecutive(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive values of `ids`: (index of the run's first element, its value, length)."""
    runs: list[tuple[int, int, int]] = []
    for i, value in enumerate(ids):
        if runs and value == runs[-1][1] + runs[-1][2]:
            first, start, n = runs[-1]
            runs[-1] = (first, start, n + 1)
        else:
            runs.append((i, value, 1))
    return runs


class HostTierAllocationError(RuntimeError):
    """The host tier could not be allocated (not enough pinned memory); run GPU-only or shrink `host_blocks`."""


class MigrationFailed(RuntimeError):
    """The copies of one migration plan failed; every copy that had been issued has completed (nothing in flight).

    `plan` is the failed plan and `runs_done` how many of its merged runs were copied before the failure; the
    destination blocks hold partial data and must not be read (report it with `Scheduler.fail_migration`)."""

    def __init__(self, plan: MigrationPlan, runs_done: int, reason: str) -> None:
        self.plan = plan
        self.runs_done = runs_done
        super().__init__(
            f"migration plan {plan.plan_id} ({plan.direction}, request {plan.request_id!r}, "
            f"{plan.num_blocks} blocks) failed after {runs_done} of {len(plan.runs())} copies: {reason}"
        )


class Fence(Protocol):
    """Completion of one migration plan's copies."""

    def wait(self) -> None:
        """Block the calling thread until the copies have completed."""

    def done(self) -> bool:
        """True once the copies have completed (never blocks)."""

    def order_before(self, stream: torch.cuda.Stream | None) -> None:
        """Make `stream` (a CUDA stream; None on the CPU) wait for the copies before its later work."""


class CompletedFence:
    """The fence of a synchronous copy: complete at creation."""

    __slots__ = ()

    def wait(self) -> None:
        return None

    def done(self) -> bool:
        return True

    def order_before(self, stream: torch.cuda.Stream | None) -> None:
        return None


class EventFence:
    """The fence of copies issued on a CUDA stream: an event recorded on that stream after the last copy.

    `keep` holds the tensors those copies use that nobody else holds (staging buffer, index tensors), so they
    stay allocated until the fence is dropped, which its owner does only after `wait()` or `done()`."""

    __slots__ = ("event", "keep")

    def __init__(self, event: torch.cuda.Event, keep: tuple[torch.Tensor, ...] = ()) -> None:
        self.event = event
        self.keep = keep

    def wait(self) -> None:
        self.event.synchronize()

    def done(self) -> bool:
        return bool(self.event.query())

    def order_before(self, stream: torch.cuda.Stream | None) -> None:
        if stream is not None:
            stream.wait_event(self.event)


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` is CUDA when a device is usable, else the CPU; ``"cuda"`` without one is a clear error."""
    if isinstance(device, torch.device):
        resolved = device
    elif device == "auto":
        resolved = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif device in ("cpu", "cuda") or str(device).startswith("cuda:"):
        resolved = torch.device(device)
    else:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch.cuda.is_available() is False; use 'cpu' or 'auto'")
    return resolved


def block_shape(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """The shape of one block: K and V of every layer (see the module docstring's layout)."""
    return (num_layers, 2, block_size, num_kv_heads, head_dim)


class ShapedModel(Protocol):
    """What a cache is shaped after: a model's configuration and the dtype of its weights."""

    @property
    def config(self) -> ModelConfig: ...

    @property
    def dtype(self) -> torch.dtype: ...


class PagedKVCache:
    """Device tier and (after `attach_host_tier`) host tier tensors, plus the copy machinery between them."""

    @classmethod
    def for_model(
        cls,
        model: ShapedModel,
        num_gpu_blocks: int,
        *,
        block_size: int,
        device: str | torch.device,
        num_layers: int | None = None,
    ) -> PagedKVCache:
        """A device tier of `num_gpu_blocks` blocks shaped for `model`: its KV heads, head size and dtype, and every
        layer (or `num_layers`: a pipeline stage holds only its own)."""
        c = model.config
        return cls(
            num_gpu_blocks,
            num_layers=c.num_layers if num_layers is None else num_layers,
            block_size=block_size,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            dtype=model.dtype,
            device=device,
        )

    def __init__(
        self,
        num_gpu_blocks: int,
        *,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "auto",
        num_host_blocks: int = 0,
    ) -> None:
        """Allocate the device tier; with `num_host_blocks` > 0 also the host tier (may raise
        `HostTierAllocationError`, after which the object is not created; prefer `attach_host_tier`)."""
        if num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be positive, got {num_gpu_blocks}")
        self.device = resolve_device(device)
        self.block_shape = block_shape(num_layers, block_size, num_kv_heads, head_dim)
        self.num_layers = num_layers
        self.block_size = block_size
        self.dtype = dtype
        self.device_cache = torch.zeros((num_gpu_blocks, *self.block_shape), dtype=dtype, device=self.device)
        # per layer: views of its keys and of its values (made once; the forward reads them every layer)
        self._layer_views = tuple((self.device_cache[:, i, 0], self.device_cache[:, i, 1]) for i in range(num_layers))
        self.host_cache: torch.Tensor | None = None
        self.num_copies = 0  # merged runs copied so far (one per run of each plan)
        self.num_transfers = 0  # copy calls between the tiers so far (a staged plan: one per run of host ids)
        self.copy_delay_cycles = 0  # tests and scripts/gpu-check: hold the copy stream this long before each plan
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if num_host_blocks:
            self.attach_host_tier(num_host_blocks)

    # ---- sizes
    @property
    def num_gpu_blocks(self) -> int:
        return self.device_cache.shape[0]

    @property
    def num_host_blocks(self) -> int:
        return 0 if self.host_cache is None else self.host_cache.shape[0]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (K and V of every layer): what a one-block migration moves."""
        numel = 1
        for n in self.block_shape:
            numel *= n
        return numel * self.device_cache.element_size()

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def copy_stream(self) -> torch.cuda.Stream | None:
        return self._copy_stream

    # ---- host tier
    def attach_host_tier(self, num_host_blocks: int, *, simulate_failure: bool = False) -> None:
        """Allocate the host tier (pinned when the device tier is on CUDA).

        Raises `HostTierAllocationError` when it cannot be allocated (or `simulate_failure` asks for that, for
        tests); the cache is then left without a host tier.
        """
        if num_host_blocks <= 0:
            raise ValueError(f"num_host_blocks must be positive, got {num_host_blocks}; 0 means no host tier")
        self.host_cache = None
        shape = (num_host_blocks, *self.block_shape)
        if simulate_failure:
            raise HostTierAllocationError(
                f"simulated failure allocating a host tier of {num_host_blocks} blocks "
                f"({num_host_blocks * self.block_bytes} bytes)"
            )
        try:
            self.host_cache = torch.zeros(shape, dtype=self.dtype, device="cpu", pin_memory=self.is_cuda)
        except (RuntimeError, MemoryError) as err:  # torch raises RuntimeError (OOM, pinning failed)
            raise HostTierAllocationError(
                f"could not allocate a host tier of {num_host_blocks} blocks ({num_host_blocks * self.block_bytes} "
                f"bytes{', pinned' if self.is_cuda else ''}): {err}; lower host_blocks or run GPU-only"
            ) from err

    def detach_host_tier(self) -> None:
        """Drop the host tier (it became unusable); the cache runs GPU-only from now on."""
        self.host_cache = None

    def host_checksums(self, blocks: Sequence[int]) -> tuple[int, ...]:
        """A CRC-32 of each host block's bytes (K and V of every layer), in the order given."""
        if self.host_cache is None:
            raise RuntimeError("host_checksums needs a host tier, but this cache has none")
        out = []
        for block in blocks:
            raw = self.host_cache[block].contiguous().view(torch.uint8)
            out.append(zlib.crc32(raw.numpy().tobytes()))
        return tuple(out)

    def corrupt_host_block(self, block: int, delta: float = 1024.0) -> None:
        """Fault injection: add `delta` to the first key value of layer 0 of host block `block` (its first token's
        slot, which every used block holds), as a memory error at rest would change it."""
        if self.host_cache is None:
            raise RuntimeError("corrupt_host_block needs a host tier, but this cache has none")
        self.host_cache[block, 0, 0, 0, 0, 0] += delta

    # ---- per-layer views used by attention
    def layer_keys(self, layer: int) -> torch.Tensor:
        """View ``[num_gpu_blocks, block_size, num_kv_heads, head_dim]`` of one layer's keys (writes go through)."""
        return self._layer_views[layer][0]

    def layer_values(self, layer: int) -> torch.Tensor:
        return self._layer_views[layer][1]

    # ---- migration
    def execute(self, plan: MigrationPlan) -> Fence:
        """Issue `plan`'s copies, one slice copy per merged run; returns the fence that completes with them."""
        if plan.direction == TO_HOST:
            source, dest = self.device_cache, self._host(plan)
        elif plan.direction == TO_GPU:
            source, dest = self._host(plan), self.device_cache
        else:
            raise ValueError(f"migration plan {plan.plan_id} has unknown direction {plan.direction!r}")
        runs = plan.runs()
        if self._copy_stream is None:
            if len(runs) <= GATHER_MIN_RUNS:
                for src, dst, n in runs:
                    self._copy(dest, dst, source, src, n, non_blocking=False)
            else:
                self._copy_fragmented(dest, source, plan.pairs, runs)
            return CompletedFence()
        compute = torch.cuda.current_stream(self.device)
        self._copy_stream.wait_stream(compute)  # source blocks written by earlier forward passes are final
        keep: tuple[torch.Tensor, ...] = ()
        with torch.cuda.stream(self._copy_stream):
            if self.copy_delay_cycles:
                torch.cuda._sleep(self.copy_delay_cycles)  # a slow copy engine, for ordering checks
            if len(runs) == 1:
                self._copy(dest, runs[0][1], source, runs[0][0], runs[0][2], non_blocking=True)
            else:
                keep = self._copy_staged(plan.direction, dest, source, plan.pairs, runs)
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        return EventFence(event, keep)

    def migrate(self, plan: MigrationPlan, *, fail_after: int | None = None) -> Fence:
        """`execute(plan)`, except that a failed copy raises `MigrationFailed` once nothing of the plan is in
        flight any more. With `fail_after=k`, copy only the first k merged runs, wait for them, and fail."""
        host = self._host(plan)  # a missing host tier is a caller bug, not a failed copy
        if fail_after is None:
            try:
                return self.execute(plan)
            except RuntimeError as err:
                self.drain()
                raise MigrationFailed(plan, 0, f"{type(err).__name__}: {err}") from err
        source, dest = (self.device_cache, host) if plan.direction == TO_HOST else (host, self.device_cache)
        runs = plan.runs()[: max(0, fail_after)]
        for src, dst, n in runs:
            self._copy(dest, dst, source, src, n, non_blocking=False)
        raise MigrationFailed(plan, len(runs), "injected copy failure (fault injection)")

    def drain(self) -> None:
        """Wait for every copy issued on the copy stream, so every fence is complete (CUDA; nothing to wait for
        on the CPU). The engine calls it after a failed step and in `close()`, before the tensors may be freed."""
        if self._copy_stream is not None:
            self._copy_stream.synchronize()

    def _copy(
        self, dest: torch.Tensor, dst: int, source: torch.Tensor, src: int, n: int, *, non_blocking: bool
    ) -> None:
        dest[dst : dst + n].copy_(source[src : src + n], non_blocking=non_blocking)
        self.num_copies += 1
        self.num_transfers += 1

    def _copy_staged(
        self,
        direction: str,
        dest: torch.Tensor,
        source: torch.Tensor,
        pairs: tuple[tuple[int, int], ...],
        runs: tuple[tuple[int, int, int], ...],
    ) -> tuple:
        """A plan of many runs through a contiguous staging buffer on the device tier's device, issued on the
        current stream (the copy stream on CUDA): an offload gathers its device blocks into the buffer with one
        `index_select` and moves it to the host with one DMA per run of consecutive host ids; a resume moves the
        host blocks into the buffer the same way and scatters them with one `index_copy_`. The index tensor is
        uploaded from pinned memory without blocking. Returns the tensors the queued copies still use (the
        caller keeps them until the copies are complete). Runs on the CPU too (tests), synchronously."""
        device = self.device_cache.device
        pinned = device.type == "cuda"
        device_ids = [src for src, _ in pairs] if direction == TO_HOST else [dst for _, dst in pairs]
        host_ids = [dst for _, dst in pairs] if direction == TO_HOST else [src for src, _ in pairs]
        index_host = host_longs(device_ids, pinned=pinned)
        index = index_host.to(device, non_blocking=True)
        staging = torch.empty((len(pairs), *self.block_shape), dtype=self.dtype, device=device)
        if direction == TO_HOST:
            torch.index_select(source, 0, index, out=staging)
        transfers = 0
        for first, host, n in _consecutive(host_ids):  # staging rows first.. <-> host blocks host..
            if direction == TO_HOST:
                dest[host : host + n].copy_(staging[first : first + n], non_blocking=pinned)
            else:
                staging[first : first + n].copy_(source[host : host + n], non_blocking=pinned)
            transfers += 1
        if direction == TO_GPU:
            dest.index_copy_(0, index, staging)
        self.num_copies += len(runs)
        self.num_transfers += transfers
        return staging, index, index_host

    def _copy_fragmented(
        self,
        dest: torch.Tensor,
        source: torch.Tensor,
        pairs: tuple[tuple[int, int], ...],
        runs: tuple[tuple[int, int, int], ...],
    ) -> None:
        """CPU copy of a plan of many runs: one gather when the destination ids are consecutive, one scatter
        when the source ids are, else one memcpy per run through NumPy views (a torch slice copy per run for a
        dtype NumPy lacks)."""
        first_dst, first_src = pairs[0][1], pairs[0][0]
        transfers = 1
        if all(dst == first_dst + i for i, (_, dst) in enumerate(pairs)):
            index = host_longs([src for src, _ in pairs])
            torch.index_select(source, 0, index, out=dest[first_dst : first_dst + len(pairs)])
        elif (np_dest := self._numpy(dest)) is not None and (np_source := self._numpy(source)) is not None:
            if all(src == first_src + i for i, (src, _) in enumerate(pairs)):  # one scatter (a resume)
                np_dest[[dst for _, dst in pairs]] = np_source[first_src : first_src + len(pairs)]
            else:
                for src, dst, n in runs:
                    np_dest[dst : dst + n] = np_source[src : src + n]
                transfers = len(runs)
        else:
            for src, dst, n in runs:
                dest[dst : dst + n].copy_(source[src : src + n])
            transfers = len(runs)
        self.num_copies += len(runs)
        self.num_transfers += transfers

    @staticmethod
    def _numpy(tensor: torch.Tensor):
        """A NumPy view sharing `tensor`'s memory, or None for a dtype NumPy lacks (bfloat16)."""
        try:
            return tensor.numpy()
        except TypeError:
            return None

    def _host(self, plan: MigrationPlan) -> torch.Tensor:
        if self.host_cache is None:
            raise RuntimeError(
                f"migration plan {plan.plan_id} ({plan.direction}) needs a host tier, but this cache has none; "
                "the scheduler must run with host_blocks=0 when the host tier is missing"
            )
        return self.host_cache
