"""Whether a world key (the fingerprint, or a variant of it) identifies only worlds that behave alike: a check that it
is a bisimulation on the worlds of a bound, one step at a time.

`congruence_mismatch` explores the worlds of a bound breadth first, told apart by the key and by every field of
every request (so worlds that the key merges are each explored with their own future); every world is compared with
the first world found under its key: what the policy reads of both (`kvstate.policy.snapshot`, with arrival and
admission numbers as ranks: only their order is read), the actions enabled in both and, per action, the key of the
world it leads to, or the invariant it violates. A key under which two reachable worlds differ there merges worlds
whose futures differ: it misses something the scheduler or the policy reads.

Both worlds are compared with the no-progress counter (A4) cleared: the fingerprint leaves it out on purpose and the
refinement accounts for it apart (`kvstate.checker.world`).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from kvstate.checker.bounds import Bound
from kvstate.checker.environment import NotEnabled
from kvstate.checker.observed import ObservedScheduler
from kvstate.checker.refinement import Refinement
from kvstate.checker.world import World, fingerprint
from kvstate.errors import InvariantViolation
from kvstate.policy import PassSnapshot, snapshot
from kvstate.spec import Spec

__all__ = ["Mismatch", "congruence_mismatch", "every_request_field"]

Behaviour = tuple[PassSnapshot, tuple[tuple[tuple, Hashable], ...]]


@dataclass(frozen=True, slots=True)
class Mismatch:
    """Two worlds under one key that behave differently: `path` leads to the second (actions from the initial
    world), `first` and `again` are what each does (the policy's snapshot, then (action, outcome) pairs)."""

    path: tuple[tuple, ...]
    first: Behaviour
    again: Behaviour

    def describe(self) -> str:
        if self.first[0] != self.again[0]:
            return f"the policy reads different requests: {self.first[0]} and {self.again[0]}"
        one, other = dict(self.first[1]), dict(self.again[1])
        differ = sorted((a for a in one.keys() | other.keys() if one.get(a) != other.get(a)), key=repr)
        return f"the actions {differ} lead to different worlds, or are enabled in one world only"


def _ranked(before: PassSnapshot) -> PassSnapshot:
    """`before` with each request's arrival and admission numbers replaced by their ranks."""
    arrivals = sorted(r.arrival for r in before.requests)
    admissions = sorted(r.admission for r in before.requests)
    requests = tuple(
        dataclasses.replace(r, arrival=arrivals.index(r.arrival), admission=admissions.index(r.admission))
        for r in before.requests
    )
    return dataclasses.replace(before, requests=requests)


def _behaviour(
    refinement: Refinement, world: World, key: Callable[[World], Hashable]
) -> tuple[Behaviour, list[tuple[tuple, World]]]:
    """What `world` does (with its no-progress counter cleared), and the worlds its actions lead to."""
    world = refinement.clone(world)
    world.scheduler._idle_iterations = 0
    outcomes: list[tuple[tuple, Hashable]] = []
    children = []
    for action in refinement.environment.actions(world):
        nxt = refinement.clone(world)
        try:
            refinement.apply(nxt, action)
        except NotEnabled:
            outcomes.append((action, "not enabled"))
            continue
        except InvariantViolation as err:
            outcomes.append((action, err.invariant_id))
            continue
        outcomes.append((action, key(nxt)))
        children.append((action, nxt))
    return (_ranked(snapshot(world.scheduler)), tuple(outcomes)), children


def every_request_field(world: World) -> tuple:
    """Every field of every active request of `world`: worlds that differ there, but not under the key, are
    compared."""
    return tuple(
        tuple(_hashable(getattr(r, f.name)) for f in dataclasses.fields(r))
        for r in sorted(world.scheduler.requests.values(), key=lambda r: repr(r.request_id))
    )


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


def congruence_mismatch(
    bound: Bound,
    spec: Spec | None = None,
    *,
    key: Callable[[World], Hashable] = fingerprint,
    scheduler_class: type = ObservedScheduler,
    max_states: int = 20_000,
) -> Mismatch | None:
    """The first world of `bound` (breadth first) that behaves unlike the first world found under its key, or None
    when every world reached behaves like it. The search tells worlds apart by their key and every field of their
    requests (`every_request_field`), so worlds the key merges are reached, and compared, each with its own future;
    it stops after `max_states` worlds. `scheduler_class` is the observed scheduler the worlds run (a subclass plants
    a read)."""
    refinement = Refinement(bound, spec, scheduler_class=scheduler_class)
    first = refinement.initial()
    behaviours: dict[Hashable, Behaviour] = {}
    found = {(key(first), every_request_field(first))}
    queue: deque[tuple[World, tuple[tuple, ...]]] = deque([(first, ())])
    while queue and len(found) < max_states:
        world, path = queue.popleft()
        behaviour, children = _behaviour(refinement, world, key)
        known = behaviours.setdefault(key(world), behaviour)
        if known != behaviour:
            return Mismatch(path, known, behaviour)
        for action, child in children:
            fine = (key(child), every_request_field(child))
            if fine not in found:
                found.add(fine)
                queue.append((child, (*path, action)))
    return None
