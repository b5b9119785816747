"""TLC's error traces in our terms: each TLC state as an abstract state, each step as one of our model's actions,
and the whole trace as lifecycle trace lines (spec/TRACE.md) that `kvstate report` draws.

`tlc_steps(model, trace)` replays TLC's trace on our abstract model: the first TLC state must be our initial state,
and every later one the result of exactly one action of ours from the one before (equal up to the order of
interchangeable requests, since TLC may print any member of a symmetry class). A TLC step that no action of ours
takes is a `TraceMismatch`, naming the step: the TLA+ and the Python meanings differ there.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeGuard

from kvstate.checker.model import AbstractModel
from kvstate.checker.records import STOP, AbstractRequest, AbstractState, Action, Edge, PoolCounts
from kvstate.errors import KVStateError
from kvstate.tla.models import request_name
from kvstate.tla.tlc import TlcState
from kvstate.tla.values import ModelValue
from kvstate.trace import TRACE_FIELDS

# besides state and deferred, in AbstractRequest's order
REQUEST_NUMBERS = (
    "computed",
    "generated",
    "gpu",
    "host",
    "prefill",
    "in_flight",
    "fenced_gpu",
    "fenced_host",
    "incoming",
)


class TraceMismatch(KVStateError):
    """A TLC trace step that our abstract model does not take (or a state it cannot read)."""


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a translated trace: our edge from the state before, and `ids[slot]`, the bound's request index of
    each slot of that state (TLC may print interchangeable requests in another order than ours)."""

    edge: Edge
    ids: tuple[int, ...]


def abstract_of(model: AbstractModel, state: TlcState) -> AbstractState:
    """TLC's state as our abstract state, requests in bound order (r0, r1, ...)."""
    bound = model.bound

    def refuse(what: str) -> TraceMismatch:
        return TraceMismatch(
            f"TLC's state {state.number} is not a state of bound {bound.name} as the exported module writes it "
            f"({what}); export the model again with `kvstate export tla`"
        )

    records, counts = state.values.get("requests"), state.values.get("counts")
    if not isinstance(records, dict) or not isinstance(counts, dict):
        raise refuse("no requests and counts variables")
    requests = []
    for i, (prompt, new) in enumerate(bound.requests):
        record = records.get(ModelValue(request_name(i)))
        if not isinstance(record, dict) or (record.get("prompt_len"), record.get("max_new_tokens")) != (prompt, new):
            raise refuse(f"no record of request {request_name(i)} [{prompt}, {new}]")
        state_name, deferred = record.get("state"), record.get("deferred")
        numbers = [record.get(f) for f in REQUEST_NUMBERS]
        if not isinstance(state_name, str) or not isinstance(deferred, str) or not _integers(numbers):
            raise refuse(f"request {request_name(i)} has fields of other types")
        computed, generated, gpu, host, prefill, in_flight, fenced_gpu, fenced_host, incoming = numbers
        requests.append(
            AbstractRequest(
                bound.group_of(i),
                state_name,
                computed,
                generated,
                gpu,
                host,
                deferred,
                prefill,
                in_flight,
                fenced_gpu,
                fenced_host,
                incoming,
            )
        )
    pool = [counts.get(f) for f in PoolCounts._fields]
    if not _integers(pool):
        raise refuse("the pool counts are not integers")
    return AbstractState(tuple(requests), *pool)


def _integers(values: list[object]) -> TypeGuard[list[int]]:
    return all(type(v) is int for v in values)


def _candidates(model: AbstractModel, state: AbstractState) -> Iterator[Action]:
    """Every action of our model from `state`, each request slot on its own (no twin is skipped), the scheduler's and
    executor's before the environment's (where two lead to the same state, the trace names the former); an offload
    with every block count."""
    environment = model.spec.environment_events
    for fair in (True, False):
        for k, request in enumerate(state.requests):
            if fair:
                yield Action("arrive", k, None)
                yield Action("compute", k, None)
                if model.stop_tokens:
                    yield Action("compute", k, STOP)
                yield Action("complete", k, None)
            for event in model.events_from.get(request.state, ()):
                if (event not in environment) != fair:
                    continue
                if event in model.limited_events:  # an offload, with each block count it may move
                    yield from (Action("event", k, event, None, n) for n in range(1, model.bound.gpu_blocks + 1))
                else:
                    yield Action("event", k, event)


def _relabel(after: tuple[AbstractRequest, ...], target: tuple[AbstractRequest, ...]) -> list[int] | None:
    """perm with after[perm[i]] == target[i] for every slot, or None when the two differ as multisets."""
    left = list(range(len(after)))
    perm = []
    for wanted in target:
        match = next((j for j in left if after[j] == wanted), None)
        if match is None:
            return None
        left.remove(match)
        perm.append(match)
    return perm


def _step_to(model: AbstractModel, state: AbstractState, target: AbstractState) -> tuple[Edge, list[int]] | None:
    """The edge of ours from `state` to `target` and the permutation relabelling it (identity when the slots agree),
    preferring an exact match; None when no action of ours leads there."""
    relabelled = None
    for action in _candidates(model, state):
        edge = model.apply(state, action)
        if edge is None or edge.after_pool != PoolCounts(*target[1:]):
            continue
        if edge.after_requests == target.requests:
            return edge, list(range(len(target.requests)))
        perm = _relabel(edge.after_requests, target.requests)
        if perm is not None and relabelled is None:
            relabelled = (edge, perm)
    return relabelled


def tlc_steps(model: AbstractModel, trace: list[TlcState]) -> list[Step]:
    """TLC's trace as our steps (see the module docstring); raises `TraceMismatch` at the first step we cannot take."""
    if not trace:
        return []
    state = abstract_of(model, trace[0])
    if state != AbstractState(model.unarrived(), model.bound.gpu_blocks, model.bound.host_blocks, 0, 0):
        raise TraceMismatch("TLC's trace does not start in our initial state (every request not arrived, pool free)")
    ids = tuple(range(len(state.requests)))
    steps = []
    for tlc_state in trace[1:]:
        target = abstract_of(model, tlc_state)
        found = _step_to(model, state, target)
        if found is None:
            raise TraceMismatch(
                f"TLC's step to state {tlc_state.number} ({tlc_state.action or 'an action'}) is no step of our "
                f"abstract model from state {tlc_state.number - 1}: the TLA+ meaning and the Python meaning of some "
                "guard, effect or action differ there"
            )
        edge, perm = found
        steps.append(Step(edge, ids))
        state, ids = target, tuple(ids[p] for p in perm)
    return steps


def trace_lines(model: AbstractModel, steps: list[Step]) -> tuple[list[dict], str]:
    """The translated trace as lifecycle trace lines (spec/TRACE.md): one line per spec transition a step took, with
    iteration = the step's number and request_id = the bound's request index; figures after the step. A trace line
    holds no negative count, so the lines stop before the first step that makes one (a counterexample of OWN-EXCL
    ends so); the second value says so ("" when every step is written)."""
    lines: list[dict] = []
    bound = model.bound
    for number, step in enumerate(steps, 1):
        edge = step.edge
        if edge.slot is None:
            continue
        before, after = edge.before.requests[edge.slot], edge.after_requests[edge.slot]
        ended = after.state in model.terminal  # an ended request's record drops its history (model.py)
        produced = 1 if edge.action.kind == "compute" and ended else 0
        for t in edge.taken:
            reason = (t.done_reason or before.deferred or None) if t.dest in model.terminal else None
            values = (
                number,
                step.ids[edge.slot],
                t.event,
                t.source,
                t.dest,
                after.gpu,
                after.host,
                edge.after_pool.gpu_free,
                edge.after_pool.host_free,
                edge.after_pool.gpu_fenced,
                edge.after_pool.host_fenced,
                bound.gpu_blocks,
                bound.host_blocks,
                before.generated + produced if ended else after.generated,
                before.computed if ended else after.computed,
                reason,
            )
            if any(isinstance(v, int) and v < 0 for v in values):
                return lines, (
                    f"the trace stops before step {number} ({t.event} of r{values[1]}): it leaves a negative block "
                    "count, which no trace line can hold"
                )
            lines.append(dict(zip(TRACE_FIELDS, values, strict=True)))
    return lines, ""
