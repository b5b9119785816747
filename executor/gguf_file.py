"""GGUF files (llama.cpp's single-file checkpoint format), read bounded: the header, then tensors one at a time.

A GGUF file is a header — magic ``GGUF``, version, tensor count, metadata count, the metadata (typed key/value
pairs: the architecture's sizes, the tokenizer's vocabulary and merges, the chat template) and one entry per
tensor (name, dimensions, ggml type, offset) — followed by the aligned tensor data. The well-kept readers
(the `gguf` package's `GGUFReader`, transformers' GGUF reader) trust every length and count the header states;
this one refuses a header that lies (`read_gguf_header`), so that nothing past it touches the file unchecked.
The element types and their block sizes, and the dequantization of each block type, are the `gguf` package's
(`gguf.GGMLQuantizationType`, `gguf.GGML_QUANT_SIZES`, `gguf.quants.dequantize`); `gguf` is imported only when
a file is read (the ``smollm2`` extra installs it).

Invariants kept (every refusal is a `CheckpointError` naming the file and the field or tensor, a name read from the
file always escaped and cut short as `kvstate.untrusted.shown` writes it: no name can start a line of its own):
* only a regular file is opened (a FIFO or a device is refused without blocking), and no read goes past
  `GGUFLimits.max_header_bytes` while parsing the header, nor past the end of the file;
* counts are bounded before anything is allocated for them (tensors, metadata entries, array items, string
  bytes, dimensions), and so is the sum of every array's items (each becomes a Python object, many times the
  bytes it takes in the file); an array of arrays is refused;
* every tensor has a unique name, 1 to 4 positive dimensions, a type of `SUPPORTED_TYPES` whose block divides
  its rows, an aligned offset, and a byte range inside the file that overlaps no other tensor's;
* `read_tensor` returns float32 values that are all finite, read from exactly the tensor's byte range.
"""

from __future__ import annotations

import itertools
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from executor.checkpoint_files import CheckpointError, open_regular
from kvstate.untrusted import shown

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 counted in 32 bits and is long gone
DEFAULT_ALIGNMENT = 32  # `general.alignment` when the file does not state it
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
# The tensor types read (their dequantization is the `gguf` package's; tests build a file of each). Others —
# the K-quants, the IQ types, integer tensors — are refused by name.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")

# metadata value type ids (the GGUF specification's gguf_type)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class GGUFLimits:
    """What a header may hold; generous for every public Llama (Llama 3's header is about 8 MiB, its tensor count
    under 1,000). A header past a limit is refused before anything is allocated for it."""

    max_header_bytes: int = 64 << 20
    max_tensors: int = 1 << 16
    max_metadata: int = 1 << 12
    max_array_items: int = 1 << 22  # a vocabulary or a merge table
    max_total_items: int = 1 << 21  # array items of the whole header: each becomes a Python object
    max_string_bytes: int = 1 << 20  # a chat template is a few KiB; a token, bytes
    max_name_bytes: int = 1 << 10  # a tensor name (GGUF's own limit is 64)


GGUF_LIMITS = GGUFLimits()


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a GGUF file: its `shape` in torch order (outermost first; the file stores ggml order,
    innermost first), its ggml type's name (`kind`), and where its bytes lie in the file (`offset`, `nbytes`)."""

    name: str
    shape: tuple[int, ...]
    kind: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """A checked GGUF header: `metadata` {key: value} (numbers, booleans, strings and lists of them) and the
    `tensors`, each inside the file and overlapping none of the others."""

    path: Path
    version: int
    metadata: Mapping[str, Any]
    tensors: tuple[TensorInfo, ...]

    def tensor(self, name: str) -> TensorInfo | None:
        return next((t for t in self.tensors if t.name == name), None)


def import_gguf():
    """The `gguf` package, or a `CheckpointError` that says how to install it."""
    try:
        import gguf
    except ImportError as err:
        raise CheckpointError(
            "reading GGUF checkpoints needs the 'gguf' package: pip install 'kvstate[smollm2]'"
        ) from err
    return gguf


class _Header:
    """A cursor over the header bytes: reads refused past the end of the file or `max_header_bytes`."""

    def __init__(self, handle: IO[bytes], path: Path, limits: GGUFLimits, size: int) -> None:
        self.handle, self.path, self.limits = handle, path, limits
        self.end = min(size, limits.max_header_bytes)
        self.pos = 0
        self.items = 0  # array items read so far

    def fail(self, field: str, message: str) -> CheckpointError:
        return CheckpointError(message, path=self.path, field=field)

    def take(self, n: int, field: str) -> bytes:
        if self.pos + n > self.end:
            where = "the end of the file" if self.end < self.limits.max_header_bytes else "the header limit"
            raise self.fail(
                field,
                f"needs {n} bytes at offset {self.pos}, past {where} ({self.end} bytes): the file is truncated, "
                "or its header states sizes it does not hold",
            )
        data = self.handle.read(n)
        if len(data) != n:
            raise self.fail(field, f"the file ended at offset {self.pos + len(data)} while reading it")
        self.pos += n
        return data

    def scalar(self, fmt: str, field: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), field))[0]

    def count(self, field: str, limit: int, what: str) -> int:
        n = self.scalar("<Q", field)
        if n > limit:
            raise self.fail(field, f"states {shown(n)} {what}; at most {limit} are read (GGUFLimits)")
        return n

    def string(self, field: str, limit: int | None = None) -> str:
        n = self.count(field, limit or self.limits.max_string_bytes, "bytes of text")
        try:
            return self.take(n, field).decode("utf-8")
        except UnicodeDecodeError as err:
            raise self.fail(field, f"is not UTF-8 text ({err.reason} at byte {err.start})") from None

    def value(self, kind: int, field: str, *, in_array: bool = False) -> Any:
        if kind in _SCALARS:
            value = self.scalar(_SCALARS[kind], field)
            if isinstance(value, float) and not math.isfinite(value):
                raise self.fail(field, f"is {value}, not a finite number")
            return value
        if kind == _STRING:
            return self.string(field)
        if kind == _ARRAY and not in_array:
            item = self.scalar("<I", field)
            n = self.count(field, self.limits.max_array_items, "array items")
            self.items += n
            if self.items > self.limits.max_total_items:
                raise self.fail(
                    field,
                    f"takes the header's arrays to {self.items} items; a header holds at most "
                    f"{self.limits.max_total_items} in all (GGUFLimits)",
                )
            if item in _SCALARS:  # read in one go: a token-type table has one item per token
                fmt = _SCALARS[item]
                values = list(struct.unpack(f"<{n}{fmt[1]}", self.take(n * struct.calcsize(fmt), field)))
                if fmt[1] in "fd" and not all(map(math.isfinite, values)):
                    raise self.fail(field, "holds a number that is not finite")
                return values
            return [self.value(item, f"{field}[{i}]", in_array=True) for i in range(n)]
        what = "an array of arrays" if kind == _ARRAY else f"a value of unknown type {kind}"
        raise self.fail(field, f"holds {what}, which GGUF Llama checkpoints do not use")


def read_gguf_header(path: str | Path, limits: GGUFLimits = GGUF_LIMITS) -> GGUFHeader:
    """The checked header of the GGUF file at `path` (module docstring: invariants); reads no tensor data."""
    gguf = import_gguf()
    path = Path(path)
    with open_regular(path, "GGUF file") as handle:
        size = os.fstat(handle.fileno()).st_size
        header = _Header(handle, path, limits, size)
        if size < len(MAGIC) or header.take(len(MAGIC), "magic") != MAGIC:
            raise header.fail("magic", "the file does not start with GGUF: it is not a GGUF checkpoint")
        version = header.scalar("<I", "version")
        if version not in VERSIONS:
            raise header.fail("version", f"is {version}; GGUF versions {' and '.join(map(str, VERSIONS))} are read")
        tensor_count = header.count("tensor_count", limits.max_tensors, "tensors")
        metadata_count = header.count("metadata_kv_count", limits.max_metadata, "metadata entries")
        metadata: dict[str, Any] = {}
        for i in range(metadata_count):
            key = header.string(f"metadata[{i}].key", limits.max_name_bytes)
            if key in metadata:
                raise header.fail(key, "appears twice in the metadata")
            metadata[key] = header.value(header.scalar("<I", key), key)
        entries = [_tensor_entry(header, i, gguf) for i in range(tensor_count)]
    alignment = _alignment(header, metadata)
    tensors = _place(header, entries, _aligned(header.pos, alignment), size, alignment)
    return GGUFHeader(path, version, metadata, tensors)


def _tensor_entry(header: _Header, index: int, gguf) -> tuple[str, tuple[int, ...], str, int, int]:
    """(name, torch-order shape, type name, offset in the data section, bytes) of tensor `index`."""
    name = header.string(f"tensor[{index}].name", header.limits.max_name_bytes)
    where = f"tensor {name}"
    dims = header.scalar("<I", where)
    if not 1 <= dims <= MAX_DIMS:
        raise header.fail(where, f"has {dims} dimensions; a tensor has 1 to {MAX_DIMS}")
    ne = struct.unpack(f"<{dims}Q", header.take(8 * dims, where))
    if not all(ne):
        raise header.fail(where, f"has a dimension of 0 in {list(ne)}")
    type_id, offset = struct.unpack("<IQ", header.take(12, where))
    try:
        kind = gguf.GGMLQuantizationType(type_id).name
    except ValueError:
        kind = f"unknown type {type_id}"
    if kind not in SUPPORTED_TYPES:
        raise header.fail(
            where, f"is {kind}; the types read are {', '.join(SUPPORTED_TYPES)} (convert or requantize the file)"
        )
    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    if ne[0] % block:
        raise header.fail(where, f"rows of {ne[0]} values do not split into {kind} blocks of {block}")
    return name, tuple(reversed(ne)), kind, offset, math.prod(ne) // block * block_bytes


def _alignment(header: _Header, metadata: Mapping[str, Any]) -> int:
    value = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 16 or value & (value - 1):
        raise header.fail("general.alignment", f"is {shown(value)}; it must be a power of two up to 65536")
    return value


def _aligned(position: int, alignment: int) -> int:
    return -(-position // alignment) * alignment


def _place(
    header: _Header, entries: list[tuple[str, tuple[int, ...], str, int, int]], start: int, size: int, alignment: int
) -> tuple[TensorInfo, ...]:
    """The tensors with their absolute byte ranges, refused when a range leaves the file or overlaps another."""
    names: set[str] = set()
    tensors = []
    for name, shape, kind, offset, nbytes in entries:
        where = f"tensor {name}"
        if name in names:
            raise header.fail(where, "appears twice in the tensor table")
        names.add(name)
        if offset % alignment:
            raise header.fail(where, f"starts at offset {offset}, not a multiple of the alignment {alignment}")
        if start + offset + nbytes > size:
            raise header.fail(
                where,
                f"claims bytes {start + offset}..{start + offset + nbytes} of a {size}-byte file: the file is "
                "truncated, or its header lies about the tensor's size",
            )
        tensors.append(TensorInfo(name, shape, kind, start + offset, nbytes))
    ordered = sorted(tensors, key=lambda t: t.offset)
    for before, after in itertools.pairwise(ordered):
        if before.offset + before.nbytes > after.offset:
            raise header.fail(f"tensor {after.name}", f"overlaps the bytes of tensor {shown(before.name)}")
    return tuple(tensors)


def read_tensor(header: GGUFHeader, info: TensorInfo) -> np.ndarray:
    """The values of `info` as a float32 array of its shape, dequantized by the `gguf` package; refused when a
    value is NaN or infinite."""
    gguf = import_gguf()
    with open_regular(header.path, "GGUF file") as handle:
        handle.seek(info.offset)
        buffer = bytearray(info.nbytes)
        if handle.readinto(buffer) != info.nbytes:
            raise CheckpointError(f"the file ended inside tensor {shown(info.name)}; copy it again", path=header.path)
    rows = np.frombuffer(buffer, dtype=np.uint8).reshape(math.prod(info.shape[:-1]), -1)
    values = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[info.kind]).astype(np.float32, copy=False)
    values = values.reshape(info.shape)
    if not np.isfinite(values).all():
        raise CheckpointError(
            f"tensor {shown(info.name)} holds NaN or infinite values; the checkpoint is corrupt", path=header.path
        )
    return values
