"""What rank 0 broadcasts each iteration, and how the other ranks mirror the requests it names.

A message is a plain picklable dict (broadcast with `broadcast_object_list`):

* ``iteration``: the scheduler iteration it carries (``Scheduler.iteration`` after `schedule()`);
* ``stop`` / ``error``: the run is over (every rank leaves the loop), with rank 0's error if it failed;
* ``new``: data of requests submitted since the last message (id, prompt, budget, stop ids, sampling), so the
  other ranks can create mirror records before any output names them;
* ``transitions``: the trace records (spec/TRACE.md fields) of every lifecycle transition rank 0 fired since the
  last message, in order; each rank applies them to its mirrors and writes them to its own trace;
* ``output``: `SchedulerOutput.to_dict()` (request ids), rebuilt on every rank with `from_dict(d, mirrors)`;
* ``chunks``: the flattened batch, one ``[id, start, tokens, block_table, samples]`` per scheduled request;
* ``held``: ``[id, gpu_blocks]`` of each request this output put in `awaiting_consensus`.

Invariants kept:
* a mirror changes state only along a spec edge (`(event, from, to)` of `load_spec().transitions`) whose
  `from` is its current state; anything else raises `MirrorDiverged` naming the record;
* every id an output names is a known mirror (`from_dict` raises `UnknownRequestId` otherwise).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import Any

from executor.sampler import SamplingParams
from kvstate.errors import KVStateError
from kvstate.lifecycle import TransitionTable
from kvstate.output import SchedulerOutput, planned_chunks
from kvstate.pool import TieredBlockPool
from kvstate.request import STATE_ATTRIBUTE, Request, new_request
from kvstate.roles import PENDING_RESET
from kvstate.spec import Spec


class MirrorDiverged(KVStateError, RuntimeError):
    """A rank's mirror of a request disagrees with rank 0's transition record (or the record is not a spec edge)."""


def new_request_data(
    request_id: Hashable,
    prompt: Iterable[int],
    max_new_tokens: int,
    stop_token_ids: Iterable[int],
    sampling: SamplingParams,
) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "prompt": tuple(prompt),
        "max_new_tokens": max_new_tokens,
        "stop_token_ids": tuple(stop_token_ids),
        "sampling": sampling,
    }


def batch_chunks(out: SchedulerOutput, pool: TieredBlockPool) -> list[list]:
    """The flattened batch of `out`: what each scheduled request computes (as in `Engine._compute`)."""
    return [
        [c.request.request_id, c.start, list(c.tokens), list(c.block_table), c.produces_token]
        for c in planned_chunks(out, pool)
    ]


def held_blocks(out: SchedulerOutput, pool: TieredBlockPool, spec: Spec) -> list[list]:
    """``[id, gpu blocks]`` of each request `out` put in the state awaiting consensus (it keeps them until then)."""
    pending = spec.role(PENDING_RESET)
    return [[r.request_id, list(pool.gpu_blocks(r.request_id))] for r in out.recompute_paused if r.state == pending]


class MirrorBook:
    """Mirror request records on a rank other than 0: enough for `SchedulerOutput.from_dict` and sampling."""

    def __init__(self, spec: Spec, capacities: Mapping[str, int] | None = None) -> None:
        """`capacities`: this rank's blocks per tier ("gpu", "host"), which bound the block ids of an output."""
        self.capacities = capacities
        self.lifecycle = TransitionTable(spec)
        self.spec = self.lifecycle.spec
        self.edges = {(t.event, t.source, t.dest) for t in self.spec.transitions}
        self.requests: dict[Hashable, Request] = {}

    def add(self, data: Mapping[str, Any]) -> Request:
        rid = data["request_id"]
        if rid in self.requests:
            raise MirrorDiverged(f"request {rid!r} was announced twice; request ids must be unique per run")
        request = new_request(rid, data["prompt"], data["max_new_tokens"], stop_token_ids=data["stop_token_ids"])
        self.lifecycle.start(request)
        self.requests[rid] = request
        return request

    def apply(self, record: Mapping[str, Any]) -> Request:
        """Take rank 0's transition `record` on the mirror; raises `MirrorDiverged` unless it is a spec edge
        from the mirror's current state."""
        rid, edge = record["request_id"], (record["event"], record["from"], record["to"])
        request = self.requests.get(rid)
        if request is None:
            raise MirrorDiverged(f"transition {edge} names request {rid!r}, which this rank never received")
        if edge not in self.edges:
            raise MirrorDiverged(f"transition {edge} of request {rid!r} is not an edge of the spec")
        if request.state != record["from"]:
            raise MirrorDiverged(
                f"request {rid!r} is {request.state} here but rank 0 moved it from "
                f"{record['from']} ({record['event']} -> {record['to']})"
            )
        setattr(request, STATE_ATTRIBUTE, record["to"])
        if record["to"] in self.spec.terminal_states:
            request.done_reason = record["done_reason"]
        return request

    def output(self, d: Mapping) -> SchedulerOutput:
        """`SchedulerOutput.from_dict` against the mirrors; checks the listed states (OUT-STATE) on this rank."""
        out = SchedulerOutput.from_dict(d, self.requests, capacities=self.capacities)
        for name, requests in out.lists():
            for request in requests:
                if request.state not in self.spec.terminal_states and request.state not in self.spec.list_states[name]:
                    raise MirrorDiverged(
                        f"output list {name!r} names {request.request_id!r}, which is {request.state} on this rank"
                    )
        return out
