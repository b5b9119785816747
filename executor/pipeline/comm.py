"""The collectives and point-to-point messages the pipeline uses, on `torch.distributed` (gloo on the CPU, NCCL on
CUDA), or trivially for one process (world size 1 needs no process group, so the loop can be tested in-process).

Invariants kept: every rank calls the same collectives in the same order (host-tier agreement, before the loop);
point-to-point messages between two ranks are received in the order they were posted (one channel per direction);
sends are posted without waiting (`isend`), and their buffers are kept alive until the send completed, so a rank
runs ahead of its successor by the micro-batches in flight; every blocking call is bounded by the process group's
timeout, so a lost peer fails the run instead of hanging it.

On gloo a receiver posts the receive of its next frame ahead (`expect`): gloo hands a frame over only once the
receiver has posted its receive, and a send that finds none waits for a round trip through the sender's event-loop
thread, which on a pinned core waits behind the sender's computation (up to milliseconds). At most one receive per
peer is posted ahead, and only when a message from that peer is sure to come, so none is left unmatched at the end.
NCCL runs a rank's sends and receives to one peer in order on one stream, so a receive posted ahead would hold up
the rank's own sends (and deadlock): there `expect` does nothing.

A message (`send_message`) travels as one frame (its length, the pickled object and, on gloo, the raw bytes of an
attached CPU tensor), plus one overflow message only when it is larger than the frame: each point-to-point message
is a blocking hand-off between processes, which costs far more than its bytes on a loaded machine, so a pipeline
pass sends one message per hop. On NCCL the attached tensor follows as its own message. On gloo a frame down the
pipeline (to a later rank) holds `down_frame_bytes`, sized by the caller for a pass's message with its hidden
states (an overflow is a second hand-off, which waits for the sender's event loop); every other frame (the sampled
tokens going back; every frame on NCCL) holds `FRAME_BYTES` (`frame_bytes`). The receiver posts a frame of that
size; on gloo the sender sends only the bytes the message fills (gloo fills the start of a larger receive, and the
length in the header says how much), since every byte sent costs time on both sides; NCCL needs equal sizes, so
there every frame is sent whole.
"""

from __future__ import annotations

import pickle
import struct
from collections import deque
from datetime import timedelta
from typing import Any

import torch

FRAME_BYTES = 64 * 1024  # the least first part of a message: tokens going back, and a pass's message on its own
_HEADER_FORMAT = struct.Struct("<qq")  # length of the frame's content after the header, length of its pickled part
_HEADER = _HEADER_FORMAT.size


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of `tensor` (moved to the CPU, made contiguous), without a copy when it already is both."""
    flat = tensor.detach().cpu().contiguous().view(-1).view(torch.uint8)
    return flat.numpy().data


def init_process_group(
    backend: str, rank: int, world_size: int, timeout_s: float, init_method: str = "env://", store: Any = None
) -> None:
    """Join the default process group at `store` (a `torch.distributed.Store`), or else at `init_method`
    (env:// reads MASTER_ADDR/MASTER_PORT, as torchrun sets them)."""
    import torch.distributed as dist

    where = {"store": store} if store is not None else {"init_method": init_method}
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s), **where)


class Comm:
    """Object and tensor collectives of one rank. `device` is where NCCL needs object and tensor buffers."""

    def __init__(self, rank: int, world_size: int, device: torch.device, down_frame_bytes: int = FRAME_BYTES) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.down_frame_bytes = max(FRAME_BYTES, down_frame_bytes)
        self._object_device: torch.device | None = None  # NCCL: where frames live; None: gloo, tensors travel inline
        if world_size > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise RuntimeError(
                    "the pipeline needs torch.distributed initialised (init_process_group) for "
                    f"world size {world_size}; launch with torchrun or run_pipeline"
                )
            self._dist = dist
            self._object_device = device if dist.get_backend() == "nccl" else None
        self._posted: deque[tuple[Any, torch.Tensor]] = deque()  # (work, buffer) of sends not known complete
        self._expected: dict[int, tuple[Any, torch.Tensor]] = {}  # src -> (work, frame) of a receive posted ahead

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
        """Post `tensor` to `dst` without waiting for it to be received."""
        tensor = tensor.contiguous()
        self._posted.append((self._dist.isend(tensor, dst=dst), tensor))
        while self._posted and self._posted[0][0].is_completed():
            self._posted.popleft()

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        self._dist.recv(buffer, src=src)
        return buffer

    def frame_bytes(self, src: int, dst: int) -> int:
        """The frame size of every message from `src` to `dst`, the same on both ends (module docstring)."""
        return self.down_frame_bytes if dst > src and self._object_device is None else FRAME_BYTES

    def send_message(self, obj: Any, dst: int, tensor: torch.Tensor | None = None) -> None:
        """Post a picklable `obj`, with `tensor` attached, to `dst` without waiting (`recv_message` takes both)."""
        inline = tensor is not None and self._object_device is None
        raw = _raw_bytes(tensor) if tensor is not None and inline else None
        pickled = pickle.dumps((obj, None if tensor is None else (tuple(tensor.shape), str(tensor.dtype), inline)))
        end = _HEADER + len(pickled)
        content = len(pickled) + (len(raw) if raw is not None else 0)
        size = self.frame_bytes(self.rank, dst)
        filled = _HEADER + content if self._object_device is None else max(size, _HEADER + content)
        frame = bytearray(filled)  # assembled as bytes: one allocation, no tensor ops
        _HEADER_FORMAT.pack_into(frame, 0, content, len(pickled))
        frame[_HEADER:end] = pickled
        if raw is not None:
            frame[end : end + len(raw)] = raw
        buffer = torch.frombuffer(frame, dtype=torch.uint8)  # shares `frame` (and keeps it alive)
        if self._object_device is not None:
            buffer = buffer.to(self._object_device)
        self.send(buffer[:size], dst)
        if buffer.numel() > size:
            self.send(buffer[size:], dst)
        if tensor is not None and not inline:
            self.send(tensor, dst)

    def expect(self, src: int) -> None:
        """Post the receive of the next message's frame from `src` now, on gloo (module docstring); call it only when
        `src` will send another message. Posting it again before `recv_message` took it does nothing."""
        if self.world_size == 1 or self._object_device is not None or src in self._expected:
            return
        frame = torch.empty(self.frame_bytes(src, self.rank), dtype=torch.uint8)
        self._expected[src] = (self._dist.irecv(frame, src=src), frame)

    def _recv_frame(self, src: int) -> torch.Tensor:
        """The next frame from `src` (on the CPU): the receive posted ahead, or one posted now."""
        if src in self._expected:
            work, frame = self._expected.pop(src)
            work.wait()
            return frame
        frame = torch.empty(self.frame_bytes(src, self.rank), dtype=torch.uint8, device=self._object_device or "cpu")
        self._dist.recv(frame, src=src)
        return frame.cpu()

    def recv_message(self, src: int) -> tuple[Any, torch.Tensor | None]:
        """The next (object, attached tensor or None) `src` posted to this rank with `send_message` (trusted peers
        only: unpickling runs the sender's code)."""
        device = self._object_device or "cpu"
        frame = self._recv_frame(src)
        content, pickled = _HEADER_FORMAT.unpack_from(frame.numpy().data)
        if _HEADER + content > len(frame):
            rest = torch.empty(_HEADER + content - len(frame), dtype=torch.uint8, device=device)
            self._dist.recv(rest, src=src)
            frame = torch.cat((frame, rest.cpu()))
        view = frame.numpy().data
        obj, attached = pickle.loads(view[_HEADER : _HEADER + pickled])
        if attached is None:
            return obj, None
        shape, dtype_name, inline = attached
        dtype = getattr(torch, dtype_name.removeprefix("torch."))
        if not inline:
            return obj, self.recv(shape, dtype, src)
        tensor = frame[_HEADER + pickled : _HEADER + content].clone().view(dtype).view(shape)
        return obj, tensor.to(self.device)

    def flush(self) -> None:
        """Wait until every posted send completed (before leaving the process group)."""
        while self._posted:
            self._posted.popleft()[0].wait()
