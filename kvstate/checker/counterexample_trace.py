"""A counterexample of `kvstate check`, written as a lifecycle trace (spec/TRACE.md) that `kvstate report` draws.

`write_abstract` replays an abstract-model counterexample on the model and writes one line per spec transition its
steps take (the step's number is the line's iteration; requests are named r0, r1, ... in bound order, as the printed
steps name them; the figures are the model's: blocks, free and fenced per tier, generated and computed tokens).
`write_refinement` replays a refinement counterexample on a fresh world of the same scheduler class and writes
the trace the real scheduler records (`Scheduler.snapshot`) while it takes the path. For a lasso (a livelock or a
LIVE-DONE cycle) `CounterexampleTrace.loop` holds the first and last iteration of the part that repeats forever;
`kvstate report --loop FIRST:LAST` marks it.

Invariants kept: the trace's first line is its header (`kvstate.trace.counterexample_header`: the invariant, the
iteration of the violating step, none for a lasso, and the message), then only lines in the format of spec/TRACE.md
(`kvstate.trace.trace_line` and `TRACE_FIELDS`), in the order the transitions were taken, with non-decreasing
iterations, none after the violating step; writing never raises on the violation the counterexample shows (the
replay stops at it, and the lines before it are kept).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvstate.errors import InvariantViolation, KVStateError
from kvstate.trace import TRACE_FIELDS, counterexample_header, trace_line

if TYPE_CHECKING:
    from kvstate.checker.bounds import Bound
    from kvstate.checker.explore import Violation
    from kvstate.checker.model import AbstractModel
    from kvstate.checker.refinement import RefinementResult
    from kvstate.spec import Spec


@dataclass(frozen=True, slots=True)
class CounterexampleTrace:
    """A counterexample written as a trace: `lines` lines in `path`; `loop` the (first, last) iteration that repeats
    forever, for a lasso (None for a finite counterexample)."""

    path: Path
    lines: int
    loop: tuple[int, int] | None = None

    def report_command(self, out: Path) -> str:
        loop = f" --loop {self.loop[0]}:{self.loop[1]}" if self.loop else ""
        return f"kvstate report {self.path} --out {out}{loop}"


def trace_path(directory: Path, stem: str) -> Path:
    return directory / f"{stem}.ndjson"


def _write(path: Path, header: dict, lines: list[dict]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in (header, *lines))
        path.write_text(text, encoding="utf-8")
    except OSError as err:
        raise KVStateError(f"cannot write {path}: {err.strerror}; pass a writable --counterexample-dir") from err


def write_abstract(path: Path, spec: Spec, model: AbstractModel, violation: Violation) -> CounterexampleTrace:
    """The trace of an abstract-model counterexample, replayed step by step on `model`, written to `path`."""
    from kvstate.checker.records import AbstractRequest

    bound = model.bound
    state = model.initial()
    unsorted = tuple(
        AbstractRequest(bound.group_of(i), "", 0, 0, 0, 0, "", p, 0) for i, (p, _) in enumerate(bound.requests)
    )
    names = model.canonical_order(unsorted)  # canonical slot -> request index
    lines: list[dict] = []
    loop_first = None
    for number, (action, _) in enumerate(violation.path, 1):
        if violation.loop_start is not None and number - 1 == violation.loop_start:
            loop_first = number
        step = model.apply(state, action)
        if step is None:  # cannot happen for a path the search produced
            break
        if action[1] is not None:
            before, after = step.before.requests[action[1]], step.after_requests[action[1]]
            for transition in step.taken:
                lines.append(
                    abstract_line(
                        spec, bound, number, f"r{names[action[1]]}", transition, before=before, after=after, step=step
                    )
                )
        order = model.canonical_order(step.after_requests)
        names = [names[k] for k in order]
        state = model.canonical(step.after_requests, step.after_pool)
    violating = len(violation.path) if violation.loop_start is None else None  # a lasso has no violating step
    _write(path, counterexample_header(violation.invariant, violating, violation.message), lines)
    loop = (loop_first, len(violation.path)) if loop_first is not None else None
    return CounterexampleTrace(path, len(lines), loop)


def abstract_line(spec, bound: Bound, iteration: int, rid: str, transition, *, before, after, step) -> dict:
    """One trace line of a transition the abstract model took in step `iteration`, with the step's figures."""
    pool = step.after_pool
    terminal = spec.state_by_name[transition.dest].terminal
    reason = spec.event_by_name[transition.event].done_reason or before.deferred or None
    values = {
        "iteration": iteration,
        "request_id": rid,
        "event": transition.event,
        "from": transition.source,
        "to": transition.dest,
        "gpu_blocks": after.gpu,
        "host_blocks": after.host,
        "gpu_free": pool.gpu_free,
        "host_free": pool.host_free,
        "gpu_fenced": pool.gpu_fenced,
        "host_fenced": pool.host_fenced,
        "gpu_capacity": bound.gpu_blocks,
        "host_capacity": bound.host_blocks,
        "generated": after.generated,
        "computed_tokens": after.computed,
        "done_reason": reason if terminal else None,
    }
    return {field: values[field] for field in TRACE_FIELDS}


def write_refinement(
    path: Path, bound: Bound, spec: Spec, result: RefinementResult, scheduler_class: type
) -> CounterexampleTrace | None:
    """The trace the real scheduler records along a refinement counterexample, written to `path`; None when the
    counterexample has no steps (a request refused at submission)."""
    from kvstate.checker.refinement import Refinement

    if not result.path:
        return None
    refinement = Refinement(bound, spec, None, scheduler_class)
    world = refinement.initial()
    world.scheduler.fired = []  # record every transition with its trace figures (as `record_transitions` does)
    lines: list[dict] = []
    loop_first = None
    for number, (action, _) in enumerate(result.path):
        if result.loop_start is not None and number == result.loop_start:
            loop_first = world.scheduler.iteration + 1
        try:
            refinement.apply(world, tuple(action))
        except (InvariantViolation, KVStateError):
            lines += [trace_line(fired) for fired in world.scheduler.take_fired()]
            break  # the violation the counterexample shows: the lines up to it are the trace
        lines += [trace_line(fired) for fired in world.scheduler.take_fired()]
    violating = world.scheduler.iteration if result.loop_start is None else None
    _write(path, counterexample_header(result.violation_id or "unnamed", violating, result.message), lines)
    last = max(world.scheduler.iteration, loop_first or 0)
    return CounterexampleTrace(path, len(lines), (loop_first, last) if loop_first is not None else None)
