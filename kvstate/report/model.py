"""What a report draws, computed from a lifecycle trace (spec/TRACE.md) without torch or matplotlib.

* `state_spans`: per request, the states it was in and the iterations each lasted (half-open
  ``[start, end)``; a transition fired within the iteration it happened in; a state entered and left in the
  same iteration has no width and is kept only in the edge counts); a span of a held state (suspended) also says
  where the request's KV was (`placement`: on the GPU, split, or offloaded to the host), and an offload starts a
  new span;
* `occupancy`: per iteration, each tier's owned (by requests), fenced and free blocks after the last transition
  of that iteration, and the GPU blocks held by requests in held states (owned, not locked: a suspended request
  keeps its GPU blocks until they are offloaded); a held request's count is exact, since every change of it is a
  line of its own (iterations without a transition carry the previous value). When the trace spans more than
  `MAX_OCCUPANCY_ROWS` iterations, only the iterations with a transition get a row (each holds until the next
  row: the same step plot), so memory is bounded by the trace's lines, not by its iteration numbers;
* `edge_counts`: how often each spec edge ``(event, from, to)`` fired;
* for a counterexample trace (its header: `kvstate.trace.read_header`), the invariant it violates and the lines of
  its violating step, whose block counts may be out of range (below 0: owned above capacity).
A trace of more than `MAX_REPORT_REQUESTS` requests is refused when the first request past it appears, so the
memory a report takes is bounded whatever the trace holds (`kvstate validate` checks a trace of any size).
A trace records transitions only, not submissions, so a request's first span (normally `waiting`) is drawn
from the trace's first iteration. Lines are read one at a time by the trace validator's bounded reader
(`kvstate.checker.trace`: line and file size limits, every field of its documented type), so a hostile trace is a
`TraceError` naming the file, line and field.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvstate.checker.trace import TraceError
from kvstate.spec import Spec, default_spec
from kvstate.trace import BLOCK_COUNT_FIELDS, CounterexampleHeader, read_trace
from kvstate.untrusted import shown

MAX_OCCUPANCY_ROWS = 10_000
MAX_REPORT_REQUESTS = 20_000  # requests one report draws (a timeline row each): bounds its memory and time


@dataclass(frozen=True, slots=True)
class Span:
    """A request in `state` over iterations ``[start, end)``; `placement` says where a held state's KV was ("gpu",
    "split" or "host"; `placement`), "" for every other state."""

    state: str
    start: int
    end: int
    placement: str = ""


def placement(line: dict) -> str:
    """Where the KV of a request in a held state is after `line`: "gpu", "split" or "host"."""
    if not line["host_blocks"]:
        return "gpu"
    return "split" if line["gpu_blocks"] else "host"


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
    loop: tuple[int, int] | None = None  # a counterexample's iterations that repeat forever (first, last)
    violation: CounterexampleHeader | None = None  # a counterexample trace's header: the invariant it violates
    violating_lines: list[dict] = field(default_factory=list)  # the lines of the violating step (its iteration)

    def out_of_range(self, line: dict) -> tuple[str, ...]:
        """The block counts of `line` below 0 (only a counterexample's violating step carries any)."""
        return tuple(f for f in BLOCK_COUNT_FIELDS if line[f] < 0)


def load_lines(
    path: str | Path, progress: Callable[[int, int], None] | None = None, every: int = 100_000
) -> Iterator[dict]:
    """The trace's objects, read lazily (`kvstate.trace.read_trace`, which tells `progress` the lines and bytes
    read every `every` lines); raises `TraceError` for a missing file, an empty trace or a bad line."""
    empty = True
    for line in read_trace(path, progress=progress, every=every):
        empty = False
        yield line
    if empty:
        raise TraceError("the trace has no lines; run an engine with a trace_path first", path=path)


def summarize(
    lines: Iterable[dict],
    *,
    loop: tuple[int, int] | None = None,
    spec: Spec | None = None,
    violation: CounterexampleHeader | None = None,
) -> TraceSummary:
    """Spans, occupancy and edge counts of the trace lines (in file order; read once, so a generator will do), with
    `spec`'s residencies (default: the packaged spec's).

    `loop` marks iterations of a counterexample that repeat forever; the summary then reaches at least to its last
    one (a loop of scheduler steps may take no transition at all). `violation` (a counterexample trace's header)
    keeps the lines of its violating step, and the summary reaches at least to that step."""
    s = TraceSummary(loop=loop, violation=violation)
    held_states = (spec or default_spec()).states_holding("host")  # the held residency: KV on either tier
    current: dict[Hashable, tuple[str, int, str]] = {}
    held: dict[Hashable, int] = {}  # request in a held state -> its GPU blocks (exact: every change is a line)
    held_total = 0
    by_iteration: dict[int, dict[str, int]] = {}
    ended: set[Hashable] = set()
    for line in lines:
        rid, it = line["request_id"], line["iteration"]
        if not s.lines:
            s.first_iteration = it
        elif it < s.last_iteration:
            raise TraceError(
                f"transition {s.lines + 1}: iteration {it} is below {s.last_iteration} of the line "
                "before; lines must be in the order the transitions happened (`kvstate validate` "
                "checks a trace)"
            )
        s.lines += 1
        s.last_iteration = it
        if rid not in current:
            if len(s.requests) == MAX_REPORT_REQUESTS:
                raise TraceError(
                    f"transition {s.lines}: request {shown(rid, 40)} is the trace's request number "
                    f"{MAX_REPORT_REQUESTS + 1}; a report draws at most {MAX_REPORT_REQUESTS} (a timeline row "
                    "each): report a part of the trace, or check it all with `kvstate validate`"
                )
            s.requests.append(rid)
            s.spans[rid] = []
            current[rid] = (line["from"], s.first_iteration, "")
        state, since, where = current[rid]
        if it > since:
            s.spans[rid].append(Span(state, since, it, where))
        holding = line["to"] in held_states
        current[rid] = (line["to"], max(it, since), placement(line) if holding else "")
        held_total += (line["gpu_blocks"] if holding else 0) - held.pop(rid, 0)
        if holding:
            held[rid] = line["gpu_blocks"]
        s.edge_counts[(line["event"], line["from"], line["to"])] += 1
        if line.get("done_reason"):  # written only on entering the terminal state (spec/TRACE.md)
            s.done_reasons[line["done_reason"]] += 1
            ended.add(rid)
        by_iteration[it] = _occupancy(line, held_total)
        _keep_if_violating(s, line)
    if not s.lines:
        raise TraceError("the trace has no lines; nothing to summarize")
    _reach_loop(s, by_iteration)
    _reach_violating_step(s, by_iteration)
    end = s.last_iteration + 1
    for rid, (state, since, where) in current.items():
        if rid not in ended and end > since:
            s.spans[rid].append(Span(state, since, end, where))  # still active when the trace ends
    dense = s.last_iteration - s.first_iteration < MAX_OCCUPANCY_ROWS
    previous = by_iteration[s.first_iteration]  # the first line's iteration: every later one carries a value
    for it in range(s.first_iteration, s.last_iteration + 1) if dense else sorted(by_iteration):
        previous = by_iteration.get(it, previous)
        s.occupancy.append({"iteration": it, **previous})
    return s


def _reach_loop(s: TraceSummary, by_iteration: dict[int, dict[str, int]]) -> None:
    """Extend `s` to the last iteration of its loop (a loop of steps that takes no transition leaves no line)."""
    if s.loop is None:
        return
    first, last = s.loop
    if not 0 <= first <= last:
        raise TraceError(f"the loop {s.loop!r} is not (first, last) iterations with first <= last")
    if last > s.last_iteration:
        by_iteration.setdefault(last, by_iteration[s.last_iteration])
        s.last_iteration = last


def _keep_if_violating(s: TraceSummary, line: dict) -> None:
    """Keep `line` in `s.violating_lines` when it belongs to the counterexample's violating step."""
    if s.violation is not None and line["iteration"] == s.violation.step:
        s.violating_lines.append(line)


def _reach_violating_step(s: TraceSummary, by_iteration: dict[int, dict[str, int]]) -> None:
    """Extend `s` to a counterexample's violating step (a step that took no transition leaves no line)."""
    step = s.violation.step if s.violation is not None else None
    if step is not None and step > s.last_iteration:
        by_iteration.setdefault(step, by_iteration[s.last_iteration])
        s.last_iteration = step


def _occupancy(line: dict, gpu_held: int) -> dict[str, int]:
    """The tiers after `line`: capacity, free, fenced and owned blocks of each, and `gpu_held` GPU blocks held by
    requests in held states (part of `gpu_owned`)."""
    out = {}
    for tier in ("gpu", "host"):
        capacity, free, fenced = line[f"{tier}_capacity"], line[f"{tier}_free"], line[f"{tier}_fenced"]
        out.update(
            {
                f"{tier}_capacity": capacity,
                f"{tier}_free": free,
                f"{tier}_fenced": fenced,
                f"{tier}_owned": capacity - free - fenced,
            }
        )
    out["gpu_held"] = gpu_held
    return out
