"""What a report draws, computed from a lifecycle trace (spec/TRACE.md) without torch or matplotlib.

* `state_spans`: per request, the states it was in and the iterations each lasted (half-open
  ``[start, end)``; a transition fired within the iteration it happened in; a state entered and left in the
  same iteration has no width and is kept only in the edge counts);
* `occupancy`: per iteration, each tier's held, fenced and free blocks after the last transition of that
  iteration (iterations without a transition carry the previous value);
* `edge_counts`: how often each spec edge ``(event, from, to)`` fired.
A trace records transitions only, not submissions, so a request's first span (normally `waiting`) is drawn
from the trace's first iteration.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kvstate.errors import KVStateError


class TraceError(KVStateError, ValueError):
    """The trace file is missing, empty or malformed; the message names the line and what to fix."""


REQUIRED = ("iteration", "request_id", "event", "from", "to", "gpu_free", "host_free", "gpu_fenced",
            "host_fenced", "gpu_capacity", "host_capacity")


@dataclass(frozen=True, slots=True)
class Span:
    state: str
    start: int
    end: int


@dataclass
class TraceSummary:
    """Everything the report draws. `requests` keeps first-appearance order."""

    requests: list[Hashable] = field(default_factory=list)
    spans: dict[Hashable, list[Span]] = field(default_factory=dict)
    occupancy: list[dict[str, int]] = field(default_factory=list)
    edge_counts: Counter = field(default_factory=Counter)
    done_reasons: Counter = field(default_factory=Counter)
    first_iteration: int = 0
    last_iteration: int = 0
    lines: int = 0


def load_lines(path: str | Path) -> list[dict]:
    """The trace's objects; raises `TraceError` for a missing file, an empty trace or a bad line."""
    import json

    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace {path} does not exist; write one with `kvstate demo --trace {path}`")
    lines = []
    with path.open(encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as err:
                raise TraceError(f"{path}:{number}: not a JSON object ({err}); is this an NDJSON trace "
                                 "(spec/TRACE.md)?") from err
            missing = [k for k in REQUIRED if not isinstance(obj, dict) or k not in obj]
            if missing:
                raise TraceError(f"{path}:{number}: missing fields {missing}; the format is in spec/TRACE.md")
            lines.append(obj)
    if not lines:
        raise TraceError(f"trace {path} has no lines; run an engine with a trace_path first")
    return lines


def summarize(lines: Iterable[dict]) -> TraceSummary:
    """Spans, occupancy and edge counts of the trace lines (in file order)."""
    s = TraceSummary()
    lines = list(lines)
    s.lines = len(lines)
    s.first_iteration = lines[0]["iteration"]
    s.last_iteration = lines[-1]["iteration"]
    current: dict[Hashable, tuple[str, int]] = {}
    by_iteration: dict[int, dict[str, int]] = {}
    for line in lines:
        rid, it = line["request_id"], line["iteration"]
        if rid not in current:
            s.requests.append(rid)
            s.spans[rid] = []
            current[rid] = (line["from"], s.first_iteration)
        state, since = current[rid]
        if it > since:
            s.spans[rid].append(Span(state, since, it))
        current[rid] = (line["to"], max(it, since))
        s.edge_counts[(line["event"], line["from"], line["to"])] += 1
        if line["to"] == "done" and line.get("done_reason"):
            s.done_reasons[line["done_reason"]] += 1
        by_iteration[it] = _occupancy(line)
    end = s.last_iteration + 1
    for rid, (state, since) in current.items():
        if state != "done" and end > since:
            s.spans[rid].append(Span(state, since, end))  # still active when the trace ends
    previous = None
    for it in range(s.first_iteration, s.last_iteration + 1):
        previous = by_iteration.get(it, previous)
        s.occupancy.append({"iteration": it, **previous})
    return s


def _occupancy(line: dict) -> dict[str, int]:
    out = {}
    for tier in ("gpu", "host"):
        capacity, free, fenced = line[f"{tier}_capacity"], line[f"{tier}_free"], line[f"{tier}_fenced"]
        out.update({f"{tier}_capacity": capacity, f"{tier}_free": free, f"{tier}_fenced": fenced,
                    f"{tier}_held": capacity - free - fenced})
    return out
