"""A world of the scheduler refinement: the real scheduler, the executor that drives it and what the environment may
still do, with the fingerprint that identifies worlds.

The refinement submits request `i` of a bound with id `i` (`bound_index`) and the concrete prompt `prompt_of(i, ...)`;
`BoundRequests` holds those prompts, their stop tokens and what each request generates alone with unlimited memory.

Two worlds with the same `fingerprint` behave alike from then on, but for when the no-progress detector (A4) stops them:
it holds the request states, token lists, block tables, free lists, KV contents of owned blocks at every pipeline stage,
what the later stages of the outputs in flight still write and read (and what their blocks hold there), copies in flight
and how long they may still take, outputs in flight, the order of admission numbers that later insertions into the
admission order compare with, the order in which held blocks are offloaded (least recently held first), what decides
whether a pass makes progress and how many passes the detector allows (A4), each request's preemption count up to the
cap (A3: beyond it only reaching the cap is read) and the environment budgets left. It leaves out iteration numbers (a
suspension's pass number among them: the promotion gate compares it only with the pass under way), plan ids, statistics
counters and the fields that are fixed by the request's place in the bound (prompt, budget, stop tokens, arrival), which
no later decision reads. `REQUEST_READS` and `REQUEST_FIELDS_NOT_READ` say, per field of a request, which.

The detector's counter (`Scheduler.idle_iterations`, passes since the last progress) is left out: the search
identifies worlds modulo it, so a loop of passes without progress closes a cycle of worlds, a lasso. The quotient
is sound because the counter is read only to raise `SchedulerStalled`, and the raise is monotone in it (a pass
raises when the counter reaches the limit plus an allowance the fingerprint determines): worlds equal but for the
counter take the same actions to the same successors, except that the one with the larger counter may stall
sooner. So the search keeps, per world, the largest counter it was reached with (and expands a world again when a
larger one reaches it: `kvstate.checker.world_graph.NoProgressCounts`); a stall is then reachable in the search
exactly when it is reachable with the counter in the fingerprint. A cycle of worlds through an unfinished request
is reported as a livelock: on the scheduler, its passes either make no progress, and the detector stops it, or
never end it, which LIVE-DONE forbids either way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from kvstate.checker.bounds import Bound
from kvstate.checker.observed import ObservedScheduler
from kvstate.config import SchedulerConfig
from kvstate.request import Request
from kvstate.sim import SimExecutor, reference_output
from kvstate.spec import Spec


def bound_index(request_id: Hashable) -> int:
    """The index in its bound of a request the refinement submitted (it submits request `i` with id `i`)."""
    if not isinstance(request_id, int):
        raise TypeError(f"request id {request_id!r}: the refinement submits the bound's requests with ids 0, 1, ...")
    return request_id


def prompt_of(index: int, length: int) -> list[int]:
    """The concrete prompt of request `index` of a bound (distinct per request)."""
    return [(index * 31 + k * 7) % 97 + 1 for k in range(length)]


@dataclass(frozen=True, slots=True)
class BoundRequests:
    """The concrete requests of a bound, by bound index: request `i` is submitted with `prompts[i]` and the stop
    tokens `stops[i]` (none, or the token its reference produces at the bound's `stop_at[i]`), and alone, with
    unlimited memory, generates `references[i]`."""

    prompts: tuple[list[int], ...]
    stops: tuple[tuple[int, ...], ...]
    references: tuple[list[int], ...]

    @classmethod
    def of(cls, bound: Bound) -> BoundRequests:
        prompts = [prompt_of(i, p) for i, (p, _) in enumerate(bound.requests)]
        stops = [
            (reference_output(prompts[i], m)[at],) if at >= 0 else ()
            for i, ((_, m), at) in enumerate(
                zip(bound.requests, bound.stop_at or [-1] * len(bound.requests), strict=True)
            )
        ]
        references = [reference_output(prompts[i], m, stops[i]) for i, (_, m) in enumerate(bound.requests)]
        return cls(tuple(prompts), tuple(stops), tuple(references))


def scheduler_config(bound: Bound) -> SchedulerConfig:
    """The scheduler configuration of `bound` (`Bound.scheduler_config`)."""
    return bound.scheduler_config()


def bound_spec(bound: Bound, spec: Spec) -> Spec:
    """The spec the scheduler of `bound` runs: `spec`, with the bound's offload rule in place of its own where the
    bound names one (the policy is the spec's to state; a bound only picks among its rules)."""
    if bound.offload is None or bound.offload == spec.policy.offload:
        return spec
    return dataclasses.replace(spec, policy=dataclasses.replace(spec.policy, offload=bound.offload))


@dataclass
class World:
    """The real scheduler, the executor that drives it, and what the environment may still do: `submitted`
    requests of the bound have arrived (in its order), and each `*_left` counts the actions of that kind left."""

    scheduler: ObservedScheduler
    sim: SimExecutor
    submitted: int = 0
    cancels_left: int = 0
    losses_left: int = 0
    aborts_left: int = 0
    failures_left: int = 0


def _preemptions_read(request: Request, cap: int | None) -> int:
    """What the preemption cap (A3) reads of a request's preemptions: their count up to the cap (0 without one)."""
    return min(request.num_suspensions + request.num_recompute_pauses, cap) if cap is not None else 0


# What a world's fingerprint holds of each active request, by what later decisions read: name -> (the request fields
# it reads, its value given the request and the preemption cap). Every other field of a request is in
# `REQUEST_FIELDS_NOT_READ`, with the reason no decision reads it beyond what the fingerprint holds.
REQUEST_READS: dict[str, tuple[tuple[str, ...], Callable[[Request, int | None], Hashable]]] = {
    "state": (("state",), lambda r, cap: r.state),
    "computed tokens": (("num_computed_tokens",), lambda r, cap: r.num_computed_tokens),
    "generated tokens": (("generated",), lambda r, cap: tuple(r.generated)),
    "prefill tokens": (("_prefill_tokens",), lambda r, cap: r.prefill_tokens),
    "termination reason": (("termination_reason",), lambda r, cap: r.termination_reason),
    "done reason": (("done_reason",), lambda r, cap: r.done_reason),
    "replay high water (A4: whether a replay chunk is progress)": (
        ("replay_high_water",),
        lambda r, cap: r.replay_high_water,
    ),
    "ever recompute-paused (A4: the replay allowance)": (
        ("num_recompute_pauses",),
        lambda r, cap: r.num_recompute_pauses > 0,
    ),
    "preemptions up to the cap (A3)": (("num_suspensions", "num_recompute_pauses"), _preemptions_read),
}

_FIXED_BY_BOUND = "fixed by the request's place in the bound: request i is submitted i-th with the bound's i-th values"
REQUEST_FIELDS_NOT_READ: dict[str, str] = {
    "request_id": "the key of the request's entry (its bound index)",
    "prompt": _FIXED_BY_BOUND,
    "max_new_tokens": _FIXED_BY_BOUND,
    "stop_token_ids": _FIXED_BY_BOUND,
    "arrival": _FIXED_BY_BOUND,
    "block_size": "one block size per bound",
    "num_prefill_tokens": "the length of the prefill tokens, which the fingerprint holds",
    "admission": "read only through the order of admission numbers, which the fingerprint holds (`admission_order`)",
    "num_gpu_blocks": "mirrors the pool's block table, which the fingerprint holds",
    "num_host_blocks": "mirrors the pool's block table, which the fingerprint holds",
    "num_recomputed_tokens": "a statistics counter",
    "suspended_in_pass": "compared only with the pass under way, which comes after every world's suspensions",
    "copy_in_flight": "true exactly while a plan of the request is in flight, which the fingerprint holds",
    "step_in_flight": "true exactly while the request is in the scheduler's in_flight, which the fingerprint holds",
    "final_token_produced": "follows from the generated tokens and the stop tokens",
    "last_token": "the last generated token",
}


def unclassified_fields(request_class: type = Request) -> set[str]:
    """The fields of `request_class` (a dataclass) that neither `REQUEST_READS` reads nor `REQUEST_FIELDS_NOT_READ`
    names: a field a decision might read that the fingerprint misses."""
    read = {name for fields, _ in REQUEST_READS.values() for name in fields}
    return {f.name for f in dataclasses.fields(request_class)} - read - REQUEST_FIELDS_NOT_READ.keys()


def request_key(request: Request, cap: int | None) -> tuple:
    """What the fingerprint holds of `request` (`REQUEST_READS`)."""
    return tuple(view(request, cap) for _, view in REQUEST_READS.values())


def fingerprint(world: World) -> tuple:
    """What identifies `world` among the worlds of one bound (the module's docstring says what it holds)."""
    s, sim = world.scheduler, world.sim
    pool = s.pool
    cap = s.config.max_preemptions_per_request
    active = []
    for rid in sorted(s.requests, key=bound_index):
        r = s.requests[rid]
        gpu, host = pool.gpu_blocks(rid), pool.host_blocks(rid)
        active.append(
            (
                rid,
                request_key(r, cap),
                gpu,
                host,
                tuple(tuple(tuple(slots[b]) for b in gpu) for slots in sim.gpu_stages),  # every stage's KV
                tuple(tuple(tuple(slots[b]) for b in host) for slots in sim.host_stages),
            )
        )
    finished = tuple(sorted((rid, r.done_reason, tuple(r.generated)) for rid, r in s.finished.items()))
    plans = tuple(sorted((p.request_id, p.direction, p.pairs) for p in pool.in_flight.values()))
    due = tuple((c.plan.request_id, c.due - s.iteration) for c in sim.copies)  # passes each copy may still take
    pipeline = tuple(
        (
            tuple(sorted(step.output.chunk_tokens.items())),
            tuple(sorted(sampled.items())),
            tuple((name, tuple(r.request_id for r in listed)) for name, listed in step.output.lists()),
        )
        for step, sampled in sim.pipeline
    )  # what lands, and which pauses still wait for it
    later = tuple(
        (work, tuple(tuple(tuple(slots[b]) for b in work.block_table) for slots in sim.gpu_stages[1:]))
        for works in sim.later_stages
        for work in works
    )  # what the later stages still write and read, and what their blocks hold there now
    return (
        tuple(active),
        finished,
        admission_order(s),
        tuple(pool.held_owners()),  # the offload order: the least recently held request's blocks move first
        pool.gpu.free_blocks(),
        pool.host.free_blocks(),
        tuple(sorted(pool.gpu.fenced)),
        tuple(sorted(pool.host.fenced)),
        plans,
        world.submitted,
        world.cancels_left,
        world.losses_left,
        world.aborts_left,
        world.failures_left,
        s.host_tier_fallback,
        pipeline,
        later,
        tuple(sorted(s.in_flight.items())),
        due,
    )


def admission_order(scheduler) -> tuple:
    """The computing requests and those whose next readmission keeps their admission number, in admission order:
    what decides victims (the latest admission first) and where such a readmission goes in that order."""
    spec = scheduler.spec
    keeping = {t.source for e in spec.policy.readmissions_keeping_admission for t in spec.event_by_name[e].transitions}
    ordered = set(map(id, scheduler.admitted))
    keepers = [r for r in scheduler.requests.values() if r.state in keeping and r.admission >= 0]
    listed = [*scheduler.admitted, *(r for r in keepers if id(r) not in ordered)]
    return tuple(r.request_id for r in sorted(listed, key=lambda r: r.admission))
