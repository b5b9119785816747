"""Which device and which process-group backend every pipeline rank uses: a pure function of the settings and the
number of visible GPUs, so it is tested on the CPU.

Invariants kept:
* NCCL never runs two ranks of one group on one GPU (it fails at the first collective with a duplicate-GPU
  error): such a setting is refused before any rank starts, with the fix;
* a CUDA device without an index puts local rank r on GPU `r % count`; an explicit `cuda:N` puts every rank there;
* the CPU runs gloo only; CUDA runs NCCL unless gloo is asked for;
* `rank_cores` gives every local rank its own cores when there are at least as many cores as ranks (disjoint,
  covering all of them), so the stages of a pipeline never queue on one core behind each other.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from executor.pipeline.config import PipelineConfigError


@dataclass(frozen=True)
class DeviceAssignment:
    """The backend of the process group and the device of each local rank (`devices[r]`: "cpu" or "cuda:N")."""

    backend: str
    devices: tuple[str, ...]

    def device_of(self, local_rank: int) -> str:
        return self.devices[local_rank]


def assign_devices(device: str, backend: str, local_world_size: int, cuda_count: int) -> DeviceAssignment:
    """Devices of `local_world_size` ranks on one machine with `cuda_count` GPUs for the engine's `device`
    ("auto", "cpu", "cuda", "cuda:N") and the pipeline's `backend` ("auto", "gloo", "nccl"); raises
    `PipelineConfigError` naming the fix when the ranks cannot run so."""
    if device == "auto":
        device = "cuda" if cuda_count > 0 else "cpu"
    if device == "cpu":
        if backend == "nccl":
            raise PipelineConfigError(
                "backend 'nccl' needs CUDA devices but the pipeline runs on the CPU; use "
                "backend 'gloo' (or 'auto'), or device 'cuda'"
            )
        return DeviceAssignment("gloo", ("cpu",) * local_world_size)
    if device != "cuda" and not device.startswith("cuda:"):
        raise PipelineConfigError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if cuda_count < 1:
        raise PipelineConfigError(f"device {device!r} was asked for but no CUDA device is visible; use 'cpu' or 'auto'")
    if device == "cuda":
        indices = tuple(rank % cuda_count for rank in range(local_world_size))
    else:
        index = int(device.removeprefix("cuda:"))
        if not 0 <= index < cuda_count:
            raise PipelineConfigError(
                f"device {device!r} is not visible: this machine shows {cuda_count} CUDA "
                f"device(s), cuda:0..cuda:{cuda_count - 1}"
            )
        indices = (index,) * local_world_size
    if len(set(indices)) < len(indices):
        raise PipelineConfigError(
            f"{local_world_size} pipeline stages on device {device!r} would put two ranks on one GPU "
            f"({cuda_count} visible), which NCCL refuses at its first collective (duplicate GPU); run at most "
            f"{cuda_count} stage(s) per machine with device 'cuda', or use device 'cpu'"
        )
    return DeviceAssignment("nccl" if backend == "auto" else backend, tuple(f"cuda:{i}" for i in indices))


def rank_cores(local_rank: int, local_world_size: int, cores: Iterable[int]) -> frozenset[int] | None:
    """The CPU cores local rank `local_rank` of `local_world_size` runs on: a contiguous share of the sorted `cores`
    (this process's allowed ones), or None (leave the affinity alone) when there are fewer cores than ranks."""
    ordered = sorted(cores)
    if len(ordered) < local_world_size:
        return None
    begin, end = (len(ordered) * r // local_world_size for r in (local_rank, local_rank + 1))
    return frozenset(ordered[begin:end])
