"""The collectives the pipeline uses, on `torch.distributed` (gloo on the CPU, NCCL on CUDA), or trivially for one
process (world size 1 needs no process group, so the loop can be tested in-process).

Invariants kept: every rank calls the same collectives in the same order (the runtime loop is lockstep); each
call is bounded by the process group's timeout, so a lost peer fails the run instead of hanging it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch


def pick_backend(requested: str, device: torch.device) -> str:
    if requested != "auto":
        return requested
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(backend: str, rank: int, world_size: int, timeout_s: float,
                       init_method: str = "env://", store: Any = None) -> None:
    """Join the default process group at `store` (a `torch.distributed.Store`), or else at `init_method`
    (env:// reads MASTER_ADDR/MASTER_PORT, as torchrun sets them)."""
    import torch.distributed as dist

    where = {"store": store} if store is not None else {"init_method": init_method}
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s), **where)


class Comm:
    """Object and tensor collectives of one rank. `device` is where NCCL needs object and tensor buffers."""

    def __init__(self, rank: int, world_size: int, device: torch.device) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        if world_size > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise RuntimeError("the pipeline needs torch.distributed initialised (init_process_group) for "
                                   f"world size {world_size}; launch with torchrun or run_pipeline")
            self._dist = dist
            self._object_device = device if dist.get_backend() == "nccl" else None

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank == 0 else None]
        self._dist.broadcast_object_list(box, src=0, device=self._object_device)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, indexed by rank."""
        if self.world_size == 1:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(gathered, obj)
        return gathered

    def all_reduce_min(self, value: int) -> int:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN)
        return int(t.item())

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self._dist.send(tensor.contiguous(), dst=dst)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        self._dist.recv(buffer, src=src)
        return buffer
