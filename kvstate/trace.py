"""The lifecycle trace: one JSON object per line for every lifecycle transition (format: spec/TRACE.md).

Pure Python (no torch), so any scheduler driver can write traces that `kvstate validate` checks.

Invariants kept:
* one line per transition, written when the scheduler reports it (after the transition's effect ran), in the
  order the transitions happened; each line's (event, from, to) is an edge of spec/lifecycle.toml;
* block counts are read from the pool at that moment, so for every line
  ``gpu_free + gpu_fenced + (blocks held by all requests) == gpu_capacity`` (and likewise for the host tier).
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterator
from pathlib import Path
from typing import IO

from kvstate.request import Request
from kvstate.scheduler import Scheduler
from kvstate.spec import Transition

TRACE_FIELDS = (
    "iteration", "request_id", "event", "from", "to", "gpu_blocks", "host_blocks", "gpu_free", "host_free",
    "gpu_fenced", "host_fenced", "gpu_capacity", "host_capacity", "generated", "computed_tokens", "done_reason",
)


def trace_record(scheduler: Scheduler, request: Request, transition: Transition) -> dict:
    """The trace object for `transition` of `request`, just taken in `scheduler`."""
    pool = scheduler.pool
    return {
        "iteration": scheduler.iteration,
        "request_id": request.request_id,
        "event": transition.event,
        "from": transition.source,
        "to": transition.dest,
        "gpu_blocks": request.num_gpu_blocks,
        "host_blocks": request.num_host_blocks,
        "gpu_free": pool.gpu.num_free,
        "host_free": pool.host.num_free,
        "gpu_fenced": len(pool.gpu.fenced),
        "host_fenced": len(pool.host.fenced),
        "gpu_capacity": pool.gpu.capacity,
        "host_capacity": pool.host.capacity,
        "generated": len(request.generated),
        "computed_tokens": request.num_computed_tokens,
        "done_reason": request.done_reason if transition.dest in scheduler.spec.terminal_states else None,
    }


class TraceWriter:
    """Writes trace lines to a file (line-buffered, so a crashed run still leaves every line before it)."""

    def __init__(self, path: str | Path, scheduler: Scheduler) -> None:
        self.path = Path(path)
        self.scheduler = scheduler
        self._file: IO[str] | None = self.path.open("w", encoding="utf-8", buffering=1)
        self.lines = 0

    def __call__(self, request: Request, transition: Transition) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(trace_record(self.scheduler, request, transition), separators=(",", ":")) + "\n")
        self.lines += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_trace(path: str | Path) -> Iterator[dict[str, Hashable]]:
    """The objects of a trace file, one per non-empty line, read within the untrusted-trace limits and checked
    against the format above (raises `kvstate.checker.trace.TraceError`, a `ValueError`, naming the line and field)."""
    from kvstate.checker.trace import open_trace, parse_line, trace_lines

    with open_trace(path) as handle:
        for number, raw in trace_lines(handle, path=path):
            if raw.strip():
                yield parse_line(raw, number, path=path)
