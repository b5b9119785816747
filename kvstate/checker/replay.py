"""Replaying counterexamples: the functions the generated regression tests call (`replay_abstract` on the abstract
model, `replay_refinement` on the real scheduler), and step-list formatting."""

from __future__ import annotations

from collections import deque

from kvstate.checker.bounds import Bound
from kvstate.checker.explore import Violation, deadlock, is_environment
from kvstate.checker.invariants import STATE_PREDICATES, STEP_PREDICATES
from kvstate.checker.model import AbstractModel
from kvstate.checker.records import AbstractRequest, AbstractState, Action
from kvstate.checker.refinement import Refinement
from kvstate.errors import InvariantViolation
from kvstate.spec import load_spec


def _check_state(model: AbstractModel, state: AbstractState) -> None:
    for inv_id, predicate in STATE_PREDICATES.items():
        message = predicate(model, state)
        if message:
            raise InvariantViolation(inv_id, message)


def replay_abstract(
    bound: Bound | dict, steps: list[tuple], *, invariant: str | None = None, spec_path: str | None = None
) -> bool:
    """Replay `steps` on the abstract model with the real guards and effects; raise InvariantViolation (an
    AssertionError) when an invariant fails. Returns False when a step is no longer enabled (the counterexample
    is not feasible any more: the bug is fixed), True when the whole path replayed cleanly."""
    if isinstance(bound, dict):
        bound = Bound.from_dict(bound)
    model = AbstractModel(bound, load_spec(spec_path) if spec_path else None)
    state = model.initial()
    _check_state(model, state)
    for action in steps:
        step = model.apply(state, Action(*action))
        if step is None:
            return False
        for inv_id, predicate in STEP_PREDICATES.items():
            message = predicate(model, step)
            if message:
                raise InvariantViolation(inv_id, message)
        state = model.canonical(step.after_requests, step.after_pool)
        _check_state(model, state)
    if invariant == "DEADLOCK":
        after = (model.canonical(s.after_requests, s.after_pool) for s in _fair_successors(model, state))
        others = [n for n in after if n != state]
        if (message := deadlock(model, state, others)) is not None:
            raise InvariantViolation("DEADLOCK", message)
    if invariant == "LIVE-DONE" and not _final_reachable(model, state):
        raise InvariantViolation("LIVE-DONE", "no final state is reachable from the end of the counterexample")
    return True


def replay_refinement(
    bound: Bound | dict, actions: list[tuple], *, invariant: str | None = None, spec_path: str | None = None
) -> None:
    """Replay a refinement counterexample; raises (AssertionError) when the violation is still there."""
    if isinstance(bound, dict):
        bound = Bound.from_dict(bound)
    refinement = Refinement(bound, load_spec(spec_path) if spec_path else None)
    world = refinement.initial()
    refinement.checks.refusal()
    for action in actions:
        refinement.apply(world, tuple(action))
    if invariant == "LIVE-DONE":
        for _ in range(1000):
            if not world.scheduler.has_unfinished:
                return
            refinement.apply(world, ("step",))
        raise InvariantViolation("LIVE-DONE", "requests still unfinished after 1000 scheduler steps")


def _fair_successors(model: AbstractModel, state: AbstractState):
    """The steps out of `state` other than environment events (never a way out under fairness: explore.py)."""
    environment = model.spec.environment_events
    return (s for s in model.successors(state) if not is_environment(s.action, environment))


def _final_reachable(model: AbstractModel, start: AbstractState) -> bool:
    seen, queue = {start}, deque([start])
    while queue:
        state = queue.popleft()
        if model.is_final(state):
            return True
        for step in _fair_successors(model, state):
            nxt = model.canonical(step.after_requests, step.after_pool)
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return False


def format_abstract_path(model: AbstractModel, violation: Violation) -> list[str]:
    """The counterexample as numbered steps; requests keep their names r0, r1, ... (bound order) throughout."""
    state = model.initial()
    unsorted = tuple(
        AbstractRequest(model.bound.group_of(i), "", 0, 0, 0, 0, "", p, 0)
        for i, (p, _) in enumerate(model.bound.requests)
    )
    perm = model.canonical_order(unsorted)  # canonical slot -> request index
    lines = ["0. initial: " + model.describe_pool(state)]
    for n, (action, after) in enumerate(violation.path, 1):
        if violation.loop_start is not None and n - 1 == violation.loop_start:
            lines.append("   -- the following steps repeat forever --")
        step = model.apply(state, action)
        if step is None:  # cannot happen for a path the search produced
            lines.append(f"{n}. {action} (not enabled on replay)")
            break
        slot = action[1]
        if slot is None:
            lines.append(f"{n}. {model.describe_action(action, '')}; {model.describe_pool(after)}")
        else:
            name = f"r{perm[slot]}"
            edges = ", ".join(f"{t.event}: {t.source} -> {t.dest}" for t in step.taken)
            lines.append(
                f"{n}. {model.describe_action(action, name)}"
                + (f" [{edges}]" if edges else "")
                + f"; {name} now {model.describe_request(step.after_requests[slot])}; {model.describe_pool(after)}"
            )
        order = model.canonical_order(step.after_requests)
        perm = [perm[k] for k in order]
        state = model.canonical(step.after_requests, step.after_pool)
    return lines
