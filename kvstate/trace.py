"""The lifecycle trace: one JSON object per line for every lifecycle transition (format: spec/TRACE.md).

Pure Python (no torch), so any scheduler driver can write traces that `kvstate validate` checks. This module owns
the format: `trace_line` (of a `FiredTransition`), `trace_record` and `TraceWriter` write it, `read_trace`
(`open_trace`, `trace_lines`, `parse_line`) reads it back within `TRACE_LIMITS`; `kvstate.checker.trace` holds
the lines it reads against the spec.

Invariants kept:
* one line per transition, its figures read when the scheduler took it (after the transition's effect ran), in
  the order the transitions happened; each line's (event, from, to) is an edge of spec/lifecycle.toml;
* block counts are read from the pool at that moment, so for every line
  ``gpu_free + gpu_fenced + (blocks held by all requests) == gpu_capacity`` (and likewise for the host tier);
* a counterexample trace (`kvstate check` writes it) starts with a header line naming the invariant it violates
  and its violating step (`counterexample_header`, `read_header`); only that step's lines may carry block counts
  below 0 (`read_trace`), and only in such a trace;
* every line is within `TRACE_LIMITS`: a request id the format cannot carry (`request_id_problem`: an integer of
  more than 19 digits, a string longer than `MAX_ID_BYTES` as JSON or one that is not Unicode text, such as a
  lone surrogate) is refused when the request is submitted, and again when a trace line holding one is read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, NamedTuple

from kvstate.errors import KVStateError
from kvstate.untrusted import Limits, UntrustedFileError, iter_lines, open_binary, parse_json, shown

if TYPE_CHECKING:  # annotations only: the trace format stays importable without the scheduler
    from kvstate.request import Request
    from kvstate.scheduler import Scheduler
    from kvstate.spec import Transition

TRACE_FIELDS = (
    "iteration",
    "request_id",
    "event",
    "from",
    "to",
    "gpu_blocks",
    "host_blocks",
    "gpu_free",
    "host_free",
    "gpu_fenced",
    "host_fenced",
    "gpu_capacity",
    "host_capacity",
    "generated",
    "computed_tokens",
    "done_reason",
)

# a trace line is about 300 bytes; request ids are the only free-form text
TRACE_LIMITS = Limits(max_bytes=1 << 30, max_line_bytes=1 << 16, max_depth=2, max_int_digits=19)
MAX_ID_BYTES = 1 << 12  # a request id as JSON (quotes and escapes included): far within a line's 64 KiB


def request_id_problem(request_id: object) -> str | None:
    """Why a trace line cannot carry `request_id` (None when it can): ids are integers of at most
    ``TRACE_LIMITS.max_int_digits`` digits and Unicode strings of at most `MAX_ID_BYTES` bytes as JSON."""
    if isinstance(request_id, bool) or not isinstance(request_id, (int, str)):
        return f"request ids are integers or strings, got {type(request_id).__name__}"
    if isinstance(request_id, int):
        if not -(10**TRACE_LIMITS.max_int_digits) < request_id < 10**TRACE_LIMITS.max_int_digits:
            return (
                f"request id {shown(request_id)} has more than {TRACE_LIMITS.max_int_digits} digits, more than a "
                "trace line carries; use a smaller integer or a string"
            )
        return None
    return _string_id_problem(request_id)


def _string_id_problem(request_id: str) -> str | None:
    if len(request_id) > MAX_ID_BYTES:  # at least as many bytes as JSON: refused before it is encoded
        return (
            f"request id {shown(request_id, 40)} has {len(request_id)} characters, more than the {MAX_ID_BYTES} "
            "bytes an id may take in a trace line; use a shorter id"
        )
    size = len(json.dumps(request_id))
    if size > MAX_ID_BYTES:
        return (
            f"request id {shown(request_id, 40)} takes {size} bytes in a trace line (JSON), more than the "
            f"{MAX_ID_BYTES} an id may; use a shorter id"
        )
    try:
        request_id.encode("utf-8")
    except UnicodeEncodeError as err:
        return (
            f"request id {shown(request_id, 40)} is not Unicode text (a lone surrogate at character {err.start}), "
            "which no UTF-8 trace or report can show; use text"
        )
    return None


class FiredTransition(NamedTuple):
    """A transition as the scheduler took it (`Scheduler.snapshot`), with the figures its trace line records, read
    right after its effect ran: the request's blocks and progress, the pool's free, fenced and total blocks per
    tier, and the done reason when it ended the request."""

    iteration: int
    request: Request
    transition: Transition
    gpu_blocks: int
    host_blocks: int
    gpu_free: int
    host_free: int
    gpu_fenced: int
    host_fenced: int
    gpu_capacity: int
    host_capacity: int
    generated: int
    computed_tokens: int
    done_reason: str | None


def trace_line(fired: FiredTransition) -> dict:
    """The trace object of one recorded transition (the fields of `TRACE_FIELDS`, in order)."""
    transition = fired.transition
    return {
        "iteration": fired.iteration,
        "request_id": fired.request.request_id,
        "event": transition.event,
        "from": transition.source,
        "to": transition.dest,
        "gpu_blocks": fired.gpu_blocks,
        "host_blocks": fired.host_blocks,
        "gpu_free": fired.gpu_free,
        "host_free": fired.host_free,
        "gpu_fenced": fired.gpu_fenced,
        "host_fenced": fired.host_fenced,
        "gpu_capacity": fired.gpu_capacity,
        "host_capacity": fired.host_capacity,
        "generated": fired.generated,
        "computed_tokens": fired.computed_tokens,
        "done_reason": fired.done_reason,
    }


def trace_record(scheduler: Scheduler, request: Request, transition: Transition) -> dict:
    """The trace object for `transition` of `request`, just taken in `scheduler` (for an `on_transition`
    listener)."""
    return trace_line(scheduler.snapshot(request, transition))


class TraceWriteError(KVStateError, OSError):
    """The trace file cannot be opened for writing; the message names it and says what to do."""


class TraceWriter:
    """Writes trace lines to a file (line-buffered, so a crashed run still leaves every line before it)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._file: IO[str] | None = self.path.open("w", encoding="utf-8", buffering=1)
        except OSError as err:
            parent = self.path.absolute().parent
            advice = (
                f"the directory {parent} does not exist: create it first"
                if not parent.is_dir()
                else "pass a writable file path"
            )
            raise TraceWriteError(f"cannot write the trace {self.path}: {err.strerror or err}; {advice}") from None
        self.lines = 0

    def write(self, fired: FiredTransition) -> None:
        """Write the line of one recorded transition (nothing once closed)."""
        if self._file is None:
            return
        self._file.write(json.dumps(trace_line(fired), separators=(",", ":")) + "\n")
        self.lines += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TraceError(UntrustedFileError):
    """The trace cannot be used: it cannot be opened or read, is over a limit of `TRACE_LIMITS`, or a line is not
    in the format of spec/TRACE.md. `line` and `field` locate the problem; `record` is the line's object when it
    parsed as one."""

    record: dict | None = None


def open_trace(path: str | Path):
    """`path` opened for `trace_lines`; raises `TraceError` (missing, a directory, no permission)."""
    return open_binary(path, "trace file", TraceError)


def trace_lines(handle, limits: Limits = TRACE_LIMITS, *, path: str | Path) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each line of an open trace, within `limits` (else `TraceError` naming the line).

    A counterexample trace's header (its first line, `parse_header`) is checked and left out; later lines keep
    their numbers in the file."""
    for number, raw in iter_lines(handle, limits, "trace", path=path, error=TraceError):
        if number == 1 and is_header(raw):
            parse_header(raw, number, path=path)
            continue
        yield number, raw


def parse_line(
    raw: str | bytes,
    number: int,
    *,
    path: str | Path | None = None,
    limits: Limits = TRACE_LIMITS,
    below_minimum: list[str] | None = None,
) -> dict:
    """One trace line as an object with exactly the fields of spec/TRACE.md, in order, each of its type.

    Raises `TraceError` naming the line and the field (with `record` set once the line parsed as an object). With
    a `below_minimum` list, a block count (`BLOCK_COUNT_FIELDS`) below 0 is appended to it instead of refused (a
    counterexample's violating step: `read_trace`).
    """
    if len(raw) > limits.max_line_bytes:
        raise TraceError(
            f"the line is longer than {limits.max_line_bytes} bytes; a trace line is far shorter",
            path=path,
            line=number,
        )
    line = parse_json(raw, limits, "trace line", path=path, line=number, error=TraceError)

    def refuse(message: str, field: str | None = None) -> TraceError:
        err = TraceError(message, path=path, line=number, field=field)
        err.record = line if isinstance(line, dict) else None
        return err

    if not isinstance(line, dict):
        raise refuse(
            f"the line is a JSON {type(line).__name__}, not an object; each line must be one object with "
            "the fields of spec/TRACE.md"
        )
    missing = [f for f in TRACE_FIELDS if f not in line]
    if missing:
        raise refuse(
            f"is missing (missing fields: {', '.join(missing)}); every line has all the fields of spec/TRACE.md",
            missing[0],
        )
    extra = [f for f in line if f not in TRACE_FIELDS]
    if extra:
        raise refuse(
            "is not a trace field; remove it or update spec/TRACE.md and the validator together",
            extra[0] if len(extra[0]) <= 40 else extra[0][:40] + "...",
        )
    if tuple(line) != TRACE_FIELDS:
        first = next(f for f, want in zip(line, TRACE_FIELDS, strict=True) if f != want)
        raise refuse(f"is out of order; keys come in the order {', '.join(TRACE_FIELDS)}", first)
    for field in TRACE_FIELDS:
        types, what, minimum = _TYPES.get(field, _COUNT)
        value = line[field]
        bad = isinstance(value, bool) or not isinstance(value, types)
        if not bad and minimum is not None and value < minimum:
            if below_minimum is not None and field in BLOCK_COUNT_FIELDS:
                below_minimum.append(field)
                continue
            bad = True
        if bad:
            raise refuse(f"is {shown(value)}; it must be {what}", field)
    problem = request_id_problem(line["request_id"])
    if problem is not None:
        raise refuse(problem, "request_id")
    return line


_NULL = type(None)
_TYPES: dict[str, tuple[tuple[type, ...], str, int | None]] = {
    # field -> (accepted types, description, minimum for ints)
    "iteration": ((int,), "an integer >= 0", 0),
    "request_id": ((int, str), "an integer or a string", None),
    "event": ((str,), "a string (an event name)", None),
    "from": ((str,), "a string (a state name)", None),
    "to": ((str,), "a string (a state name)", None),
    "gpu_capacity": ((int,), "an integer > 0", 1),
    "done_reason": ((str, _NULL), "a string or null", None),
}
_COUNT = ((int,), "an integer >= 0", 0)


# the counts a counterexample's violating step may carry out of range (below 0): the pool's and the request's blocks
BLOCK_COUNT_FIELDS = ("gpu_blocks", "host_blocks", "gpu_free", "host_free", "gpu_fenced", "host_fenced")
HEADER_FIELDS = ("trace", "invariant", "step", "message")  # a counterexample trace's first line, in this order
COUNTEREXAMPLE = "counterexample"  # the header's `trace` value
MAX_INVARIANT_CHARS = 64
MAX_HEADER_MESSAGE = 2000  # characters of the violation's message a header keeps


@dataclass(frozen=True, slots=True)
class CounterexampleHeader:
    """The first line of a counterexample trace (`kvstate check` writes it): the invariant violated, the iteration
    of the step that violates it (None for a lasso: no step violates it, a loop repeats forever) and the checker's
    message."""

    invariant: str
    step: int | None
    message: str


def counterexample_header(invariant: str, step: int | None, message: str) -> dict:
    """The header object of a counterexample trace (`HEADER_FIELDS`, in order), its message cut to
    `MAX_HEADER_MESSAGE` characters."""
    cut = message if len(message) <= MAX_HEADER_MESSAGE else message[: MAX_HEADER_MESSAGE - 1] + "…"
    return {"trace": COUNTEREXAMPLE, "invariant": invariant[:MAX_INVARIANT_CHARS], "step": step, "message": cut}


def is_header(raw: str | bytes) -> bool:
    """Whether `raw` is meant as a header line: a JSON object whose first key is ``"trace"`` (a trace line's is
    ``"iteration"``); `parse_header` then checks it. A line that is not JSON within `TRACE_LIMITS` is not one."""
    try:
        line = parse_json(raw, TRACE_LIMITS, "trace line", path=None, line=1, error=TraceError)
    except TraceError:
        return False
    return isinstance(line, dict) and next(iter(line), None) == "trace"


def parse_header(raw: str | bytes, number: int, *, path: str | Path | None = None) -> CounterexampleHeader:
    """A counterexample trace's header line; raises `TraceError` naming the line and field when it is not one."""
    line = parse_json(raw, TRACE_LIMITS, "trace header", path=path, line=number, error=TraceError)
    if not isinstance(line, dict) or tuple(line) != HEADER_FIELDS:
        keys = ", ".join(map(str, line)) if isinstance(line, dict) else type(line).__name__
        raise TraceError(
            f"a header line has exactly the keys {', '.join(HEADER_FIELDS)}, in that order; this one has "
            f"{shown(keys, 80)}",
            path=path,
            line=number,
        )
    step = line["step"]
    problems = {
        "trace": None if line["trace"] == COUNTEREXAMPLE else f'must be "{COUNTEREXAMPLE}"',
        "invariant": None
        if isinstance(line["invariant"], str) and 0 < len(line["invariant"]) <= MAX_INVARIANT_CHARS
        else f"must be an invariant id, a string of 1 to {MAX_INVARIANT_CHARS} characters",
        "step": None
        if step is None or (isinstance(step, int) and not isinstance(step, bool) and step >= 0)
        else "must be an iteration (an integer >= 0) or null",
        "message": None
        if isinstance(line["message"], str) and len(line["message"]) <= MAX_HEADER_MESSAGE
        else f"must be a string of at most {MAX_HEADER_MESSAGE} characters",
    }
    for field, problem in problems.items():
        if problem is not None:
            raise TraceError(f"is {shown(line[field], 40)}; it {problem}", path=path, line=number, field=field)
    return CounterexampleHeader(line["invariant"], step, line["message"])


def read_header(path: str | Path) -> CounterexampleHeader | None:
    """The header of a counterexample trace (its first line), or None for any other trace."""
    with open_trace(path) as handle:
        for number, raw in iter_lines(handle, TRACE_LIMITS, "trace", path=path, error=TraceError):
            return parse_header(raw, number, path=path) if is_header(raw) else None
    return None


def read_trace(
    path: str | Path, *, progress: Callable[[int, int], None] | None = None, every: int = 100_000
) -> Iterator[dict[str, Hashable]]:
    """The objects of a trace file, one per non-empty line, read within `TRACE_LIMITS` and checked
    against the format above (raises `TraceError`, a `ValueError`, naming the line and field). `progress`, when
    given, is told (lines read, bytes read) every `every` lines.

    A counterexample trace's header (`read_header`) is not yielded. Its lines may carry block counts below 0 only
    at the violating step the header names, and no line comes after that step; every other trace is read strictly.
    """
    header = read_header(path)
    step = header.step if header is not None else None
    with open_trace(path) as handle:
        for number, raw in trace_lines(handle, path=path):
            if progress is not None and number % every == 0:
                progress(number, handle.tell())
            if not raw.strip():
                continue
            low: list[str] | None = [] if step is not None else None
            line = parse_line(raw, number, path=path, below_minimum=low)
            if step is not None and line["iteration"] > step:
                raise TraceError(
                    f"is {line['iteration']}, after the violating step {step} the header names; a counterexample "
                    "trace ends at its violating step",
                    path=path,
                    line=number,
                    field="iteration",
                )
            if low and line["iteration"] != step:
                raise TraceError(
                    f"is {line[low[0]]}; it must be an integer >= 0 (a counterexample trace may carry a count below 0 "
                    f"only at its violating step, iteration {step})",
                    path=path,
                    line=number,
                    field=low[0],
                )
            yield line
