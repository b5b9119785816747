"""The typed schema of bounds and sweep files: every field's exact type and range, checked before anything is built.

A bounds file may come from anyone, and a value that is harmless in the file (a number) can explode in what the
checker derives from it: a pool of `gpu_blocks` free blocks, a reference output of `max_new_tokens` tokens, a world
copied at every step of the search. So each field has an exact type (an integer is never a boolean, a boolean never
a string, a list holds elements of one type) and a range that keeps that derived work small:

* at most `MAX_REQUESTS` requests, each of at most `MAX_PROMPT_LEN` prompt tokens and `MAX_NEW_TOKENS` new ones;
* at most `MAX_BLOCKS` blocks per tier, `MAX_BLOCK_SIZE` tokens per block, `MAX_CHUNK` tokens per prefill chunk,
  `MAX_STAGES` pipeline stages and micro-batches, `MAX_DELAY` passes of copy delay, `MAX_FAULTS` injected faults of
  each kind and `MAX_BUDGET` for each scheduler budget;
* a memory estimate of one world of the search (`world_bytes`: every stage's KV slots of both tiers) of at most
  `MAX_WORLD_BYTES`.

Invariant kept: `check_table` accepts a table only when every field it holds has its field's exact type and lies in
its range; each refusal is a `BoundsError` whose message names the file and line (where the file is known), the
table and the field, and the limit it broke.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kvstate.errors import KVStateError
from kvstate.untrusted import shown

__all__ = [
    "BOUND_FIELDS",
    "MAX_BLOCKS",
    "MAX_BLOCK_SIZE",
    "MAX_BUDGET",
    "MAX_CHUNK",
    "MAX_DELAY",
    "MAX_FAULTS",
    "MAX_NEW_TOKENS",
    "MAX_PROMPT_LEN",
    "MAX_REQUESTS",
    "MAX_STAGES",
    "MAX_WORLD_BYTES",
    "SWEEP_FIELDS",
    "BoundsError",
    "Field",
    "Locate",
    "check_table",
    "key_locator",
    "world_bytes",
    "world_problem",
]

MAX_REQUESTS = 32
MAX_PROMPT_LEN = 4096
MAX_NEW_TOKENS = 4096
MAX_BLOCKS = 65_536
MAX_BLOCK_SIZE = 1024
MAX_CHUNK = 4096
MAX_STAGES = 8
MAX_DELAY = 8
MAX_FAULTS = 8
MAX_BUDGET = 65_536
MAX_LIST = 64  # values of one sweep dimension
MAX_TEXT = 4096  # characters of a description or a name
MAX_WORLD_BYTES = 16 << 20  # one world's KV slots, by `world_bytes`
SLOT_BYTES = 8  # one token slot of a block (a list entry)
BLOCK_BYTES = 64  # one block's own list


class BoundsError(KVStateError, ValueError):
    """The bounds file is malformed or names an unknown bound; the message names the entry."""


@dataclass(frozen=True, slots=True)
class Field:
    """One field of a table: its kind (`int`, `bool`, `str`, `requests`, `positions`, `ints`, `bools`, `strs`),
    its inclusive range (integers and list elements), and whether `None` stands for "left out"."""

    kind: str
    minimum: int = 0
    maximum: int = 0
    nullable: bool = False


BOUND_FIELDS: dict[str, Field] = {
    "name": Field("str", maximum=MAX_TEXT),
    "description": Field("str", maximum=MAX_TEXT),
    "requests": Field("requests", 1, MAX_REQUESTS),
    "gpu_blocks": Field("int", 1, MAX_BLOCKS),
    "host_blocks": Field("int", 0, MAX_BLOCKS),
    "block_size": Field("int", 1, MAX_BLOCK_SIZE),
    "chunk_size": Field("int", 1, MAX_CHUNK),
    "pipeline_stages": Field("int", 1, MAX_STAGES),
    "micro_batches": Field("int", 1, MAX_STAGES),
    "copy_delay": Field("int", 0, MAX_DELAY),
    "cancel": Field("bool"),
    "env_cancels": Field("int", 0, MAX_FAULTS),
    "env_aborts": Field("int", 0, MAX_FAULTS),
    "env_host_losses": Field("int", 0, MAX_FAULTS),
    "env_copy_failures": Field("int", 0, MAX_FAULTS),
    "recompute_pause": Field("bool"),
    "capacity_policy": Field("str", maximum=MAX_TEXT),
    "max_batch_size": Field("int", 1, MAX_BUDGET, nullable=True),
    "max_num_tokens": Field("int", 1, MAX_BUDGET, nullable=True),
    "max_preemptions": Field("int", 1, MAX_BUDGET, nullable=True),
    "no_progress_limit": Field("int", 1, MAX_BUDGET, nullable=True),
    "stop_at": Field("positions", -1, MAX_NEW_TOKENS - 1),
    "abstract_model": Field("bool"),
    "offload": Field("str", maximum=MAX_TEXT, nullable=True),
}

SWEEP_FIELDS: dict[str, Field] = {
    "description": Field("str", maximum=MAX_TEXT),
    "parts": Field("strs", maximum=MAX_TEXT),
    "request_counts": Field("ints", 1, MAX_REQUESTS),
    "prompt_lens": Field("ints", 1, MAX_PROMPT_LEN),
    "max_new_tokens": Field("ints", 1, MAX_NEW_TOKENS),
    "gpu_extra": Field("ints", 0, MAX_BLOCKS),
    "host_blocks": Field("ints", 0, MAX_BLOCKS),
    "block_sizes": Field("ints", 1, MAX_BLOCK_SIZE),
    "chunk_sizes": Field("ints", 1, MAX_CHUNK),
    "pipeline_stages": Field("ints", 1, MAX_STAGES),
    "copy_delays": Field("ints", 0, MAX_DELAY),
    "offloads": Field("strs", maximum=MAX_TEXT),
    "recompute_pauses": Field("bools"),
    "capacity_policies": Field("strs", maximum=MAX_TEXT),
    "env_cancels": Field("int", 0, MAX_FAULTS),
    "env_aborts": Field("int", 0, MAX_FAULTS),
    "env_host_losses": Field("int", 0, MAX_FAULTS),
    "env_copy_failures": Field("int", 0, MAX_FAULTS),
    "cancel": Field("bool"),
    "abstract_model": Field("bool"),
}

Locate = Callable[[str], str]  # a field's name -> "FILE:LINE: " (or "" where the file is not known)


def check_table(data: Mapping, fields: Mapping[str, Field], where: str, locate: Locate | None = None) -> None:
    """Refuse the first field of `data` (a table of `fields`) whose value has the wrong type or lies out of range.
    Keys `fields` does not list are left to the caller (which names the known ones)."""
    for key, value in data.items():
        spec = fields.get(key)
        if spec is None:
            continue
        problem = _problem(spec, value)
        if problem is not None:
            place = locate(key) if locate is not None else ""
            raise BoundsError(f"{place}{where}: {key} {problem}")


def _problem(spec: Field, value: object) -> str | None:
    """What is wrong with `value` as a value of `spec`, or None."""
    if value is None and spec.nullable:
        return None
    if spec.kind in ("int", "bool", "str"):
        return _scalar_problem(spec, value)
    if not isinstance(value, (list, tuple)):
        return f"must be a list, got {_typed(value)}"
    most = spec.maximum if spec.kind == "requests" else MAX_REQUESTS if spec.kind == "positions" else MAX_LIST
    if len(value) > most or (spec.kind == "requests" and not value):
        return f"must list {'1' if spec.kind == 'requests' else '0'} to {most} items, got {len(value)}"
    element = {
        "requests": None,
        "positions": Field("int", spec.minimum, spec.maximum),
        "ints": Field("int", spec.minimum, spec.maximum),
        "bools": Field("bool"),
        "strs": Field("str", maximum=spec.maximum),
    }[spec.kind]
    for index, item in enumerate(value):
        problem = _request_problem(item) if element is None else _scalar_problem(element, item)
        if problem is not None:
            return f"item {index}: {problem}"
    return None


def _request_problem(item: object) -> str | None:
    if not isinstance(item, (list, tuple)) or len(item) != 2:
        return f"must be [prompt_len, max_new_tokens], got {_typed(item)}"
    for label, value, most in (("prompt_len", item[0], MAX_PROMPT_LEN), ("max_new_tokens", item[1], MAX_NEW_TOKENS)):
        problem = _scalar_problem(Field("int", 1, most), value)
        if problem is not None:
            return f"{label} {problem}"
    return None


def _scalar_problem(spec: Field, value: object) -> str | None:
    if spec.kind == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            return f"must be an integer, got {_typed(value)}"
        if not spec.minimum <= value <= spec.maximum:
            return f"must be between {spec.minimum} and {spec.maximum}, got {shown(value)}"
        return None
    if spec.kind == "bool":
        return None if isinstance(value, bool) else f"must be true or false, got {_typed(value)}"
    if not isinstance(value, str):
        return f"must be a string, got {_typed(value)}"
    return f"must be at most {spec.maximum} characters, got {len(value)}" if len(value) > spec.maximum else None


def _typed(value: object) -> str:
    """`value` as a message shows it, with its TOML type."""
    kinds = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "a list", dict: "a table"}
    return f"{shown(value)} ({kinds.get(type(value), type(value).__name__)})"


def world_bytes(gpu_blocks: int, host_blocks: int, block_size: int, stages: int) -> int:
    """An estimate of the memory one world of the refinement's search holds for KV slots: every stage keeps a list of
    `block_size` slots per block of each tier (`kvstate.sim.SimExecutor`), and each world is a copy."""
    return stages * (gpu_blocks + host_blocks) * (BLOCK_BYTES + SLOT_BYTES * block_size)


def world_problem(gpu_blocks: int, host_blocks: int, block_size: int, stages: int) -> str | None:
    """Why a bound's tiers are too large for the search to hold one world per state (None: they are not)."""
    need = world_bytes(gpu_blocks, host_blocks, block_size, stages)
    if need <= MAX_WORLD_BYTES:
        return None
    return (
        f"one world of the search would hold about {need >> 20} MiB of KV slots ((gpu_blocks + host_blocks) x "
        f"block_size x pipeline_stages = ({gpu_blocks} + {host_blocks}) x {block_size} x {stages}), more than the "
        f"{MAX_WORLD_BYTES >> 20} MiB limit: shrink the tiers or the block size"
    )


def key_locator(source: Path, header: str) -> Locate:
    """A `Locate` for the fields of the table `[header]` of the TOML file `source`: "FILE:LINE: " at the line that
    sets the field (the table's own line when no line does; the file alone when the table is not found). The file
    is read again (its first MiB) only when a field is refused."""

    def locate(key: str) -> str:
        try:
            with open(source, "rb") as handle:
                text = handle.read(1 << 20).decode("utf-8", errors="replace")
        except OSError:
            return f"{source}: "
        start = 0 if not header else _header_at(text, header)  # "": the keys before the first table
        if start is None:
            return f"{source}: "
        following = re.search(r"^[ \t]*\[+[ \t]*[A-Za-z_\"']", text[start + 1 :], re.M)  # the next table
        end = len(text) if following is None else start + 1 + following.start()
        found = re.search(rf"^[ \t]*[\"']?{re.escape(key)}[\"']?[ \t]*=", text[start:end], re.M)
        at = start + (found.start() if found else 0)
        return f"{source}:{text.count(chr(10), 0, at) + 1}: "

    return locate


def _header_at(text: str, header: str) -> int | None:
    parts = header.split(".")
    pattern = r"[ \t]*\.[ \t]*".join(rf"(?:{re.escape(p)}|\"{re.escape(p)}\"|'{re.escape(p)}')" for p in parts)
    found = re.search(rf"^[ \t]*\[[ \t]*{pattern}[ \t]*\]", text, re.M)
    return None if found is None else found.start()
