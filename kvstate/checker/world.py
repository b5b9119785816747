"""A world of the scheduler refinement: the real scheduler, the executor that drives it and what the environment may
still do, with the fingerprint that identifies worlds.

The refinement submits request `i` of a bound with id `i` (`bound_index`) and the concrete prompt `prompt_of(i, ...)`;
`BoundRequests` holds those prompts, their stop tokens and what each request generates alone with unlimited memory.

Two worlds with the same `fingerprint` behave alike from then on: it holds the request states, token lists, block
tables, free lists, KV contents of owned blocks at every pipeline stage, what the later stages of the outputs in
flight still write and read (and what their blocks hold there), copies in flight and how long they may still take,
outputs in flight, the admission order, the order in which held blocks are offloaded (least recently held first),
what the no-progress detector (A4) and the preemption cap (A3) read and the environment budgets left; it leaves out
iteration numbers (a suspension's pass number among them: the promotion gate compares it only with the pass under
way), plan ids and statistics counters, which no later decision reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from dataclasses import dataclass

from kvstate.checker.bounds import Bound
from kvstate.checker.observed import ObservedScheduler
from kvstate.config import SchedulerConfig
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


def fingerprint(world: World) -> tuple:
    """What identifies `world` among the worlds of one bound (the module's docstring says what it holds)."""
    s, sim = world.scheduler, world.sim
    pool = s.pool
    cap = s.config.max_preemptions_per_request
    active = []
    for rid in sorted(s.requests, key=bound_index):
        r = s.requests[rid]
        gpu, host = pool.gpu_blocks(rid), pool.host_blocks(rid)
        preempted = r.num_suspensions + r.num_recompute_pauses
        active.append(
            (
                rid,
                r.state,
                r.num_computed_tokens,
                tuple(r.generated),
                r.prefill_tokens,
                gpu,
                host,
                r.termination_reason,
                r.replay_high_water,  # what the no-progress detector (A4) reads, with idle_iterations below
                r.num_recompute_pauses > 0,  # the detector's allowance for replays reads it too
                min(preempted, cap) if cap is not None else 0,  # the preemption cap (A3): whether it is reached
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
        tuple(r.request_id for r in s.admitted),
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
        s.idle_iterations,  # what the no-progress detector (A4) reads; last: `shape` leaves it out
    )


def shape(world: World) -> tuple:
    """A world's fingerprint without the no-progress counter: worlds equal but for that counter share a shape."""
    return fingerprint(world)[:-1]
