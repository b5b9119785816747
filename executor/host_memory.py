"""What this machine's memory holds (`available_memory`, `physical_memory`) and what loading a GGUF checkpoint
takes (`load_memory`, `check_load_memory`), without torch: a command checks a file against the machine before
it imports torch, so a refusal costs a header read, not a torch import.

Invariants kept: the memory a load takes is computed from the header alone (tensor shapes, the bytes the
header's ggml types give each tensor) and the name of the dtype the model is loaded into; a dtype is known by
its name (``float32`` or ``torch.float32``, so a `torch.dtype` works too) and one without a paged-attention
kernel here is a `ValueError`; a refusal is one `CheckpointError` naming the file, what loading takes and what
the machine has.
"""

from __future__ import annotations

import math
import os

from executor.checkpoint_files import CheckpointError
from executor.gguf_file import GGUFHeader

# the bytes of one value of each dtype a model may be loaded into (the engine's `resolve_dtype` accepts these)
ITEM_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
GIB = 1024**3


def dtype_name(dtype: object) -> str:
    """The name of `dtype` (a name, or a `torch.dtype`, whose `str` is ``torch.NAME``), one of `ITEM_BYTES`."""
    name = str(dtype).removeprefix("torch.")
    if name not in ITEM_BYTES:
        raise ValueError(f"dtype must be one of {sorted(ITEM_BYTES)}, got {dtype!r}")
    return name


def physical_memory() -> int | None:
    """Bytes of physical memory of this machine (Linux `sysconf`), or None where it cannot be read."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def available_memory() -> int | None:
    """Bytes of memory this machine can give a process now without swapping (Linux ``MemAvailable``), else its
    physical memory, or None where neither can be read."""
    try:
        with open("/proc/meminfo", "rb") as handle:
            for line in handle.read(1 << 16).splitlines():
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return physical_memory()


def load_memory(header: GGUFHeader, dtype: object) -> int:
    """Bytes loading the file into `dtype` takes at its peak, at least: every weight dequantized to float32, the
    model built in float32 and cast to `dtype`, and the raw bytes of the largest tensor."""
    values = sum(math.prod(info.shape) for info in header.tensors)
    largest = max((info.nbytes for info in header.tensors), default=0)
    return values * (4 + 4 + ITEM_BYTES[dtype_name(dtype)]) + largest


def check_load_memory(header: GGUFHeader, dtype: object, available: int | None = None) -> None:
    """Refuse a file whose weights cannot be loaded into `dtype` in `available` bytes (by default what the
    machine has free now)."""
    available = available_memory() if available is None else available
    needed = load_memory(header, dtype)
    if available is not None and needed > available:
        raise CheckpointError(
            f"loading its {len(header.tensors)} tensors as {dtype_name(dtype)} takes at least "
            f"{needed / GIB:.2f} GiB of memory, but this machine has {available / GIB:.2f} GiB available; use a "
            "smaller model or a machine with more memory",
            path=header.path,
            field="tensors",
        )


__all__ = ["ITEM_BYTES", "available_memory", "check_load_memory", "dtype_name", "load_memory", "physical_memory"]
