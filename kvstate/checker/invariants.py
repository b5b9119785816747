"""Predicates for the spec's invariants, keyed by invariant id, and which layer checks each invariant.

`STATE_PREDICATES[id](model, state)` and `STEP_PREDICATES[id](model, edge)` return None when the invariant holds,
otherwise a message ("step" is the spec's word for the scope; the predicates are checked on each `Edge` of the
graph). Every spec invariant of scope `state` must have a state predicate: `plan_invariants` refuses to run
otherwise. Step-scope invariants are checked on every abstract edge where a predicate exists;
the others (scope pass, run, liveness) are listed with the layer that checks them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from kvstate.checker.effects import PoolState, RequestState
from kvstate.checker.model import AbstractModel
from kvstate.checker.records import ABSENT, AbstractRequest, AbstractState, Edge, abstract_state
from kvstate.errors import KVStateError
from kvstate.pool import ceil_div
from kvstate.spec import Spec, Transition


class CheckerError(KVStateError):
    """The checker cannot run as asked (e.g. a state invariant of the spec has no predicate)."""


def _who(model: AbstractModel, r: AbstractRequest) -> str:
    prompt, new = model.bound.groups[r.group]
    return f"[prompt {prompt}, max_new {new}]"


def _tier_sums(state: AbstractState) -> tuple[int, int]:
    reqs = state.requests
    return sum(r.gpu for r in reqs), sum(r.host for r in reqs)


def _conservation(tier: str, free: int, held: int, fenced: int, capacity: int) -> str | None:
    if free + held + fenced != capacity:
        return f"{tier} tier: free {free} + held {held} + fenced {fenced} != capacity {capacity}"
    return None


def _on_records(predicate: Callable[[AbstractModel, AbstractState], str | None]):
    """Let a state predicate be called with a plain tuple of the same layout too (the scheduler refinement
    builds its abstraction so); the model's own states are records already and pass through unchanged."""

    @functools.wraps(predicate)
    def check(model: AbstractModel, state: AbstractState) -> str | None:
        return predicate(model, state if type(state) is AbstractState else abstract_state(state))

    return check


@_on_records
def cons_gpu(model: AbstractModel, state: AbstractState) -> str | None:
    held, _ = _tier_sums(state)
    copies = sum(r.fenced_gpu for r in state.requests)
    if copies != state.gpu_fenced:
        return f"GPU tier: {state.gpu_fenced} blocks fenced, but the requests' copies fence {copies}"
    return _conservation("GPU", state.gpu_free, held, state.gpu_fenced, model.bound.gpu_blocks)


@_on_records
def cons_host(model: AbstractModel, state: AbstractState) -> str | None:
    _, held = _tier_sums(state)
    copies = sum(r.fenced_host for r in state.requests)
    if copies != state.host_fenced:
        return f"host tier: {state.host_fenced} blocks fenced, but the requests' copies fence {copies}"
    return _conservation("host", state.host_free, held, state.host_fenced, model.bound.host_blocks)


@_on_records
def own_excl(model: AbstractModel, state: AbstractState) -> str | None:
    """Counting form of exclusive ownership: no count is negative and owners never claim more blocks than exist."""
    gpu_held, host_held = _tier_sums(state)
    _, gf, hf, gfe, hfe = state
    if min(gf, hf, gfe, hfe) < 0 or any(r.gpu < 0 or r.host < 0 for r in state.requests):
        return f"a block count is negative (gpu free {gf}, host free {hf}, fenced {gfe}/{hfe})"
    if gpu_held + gfe > model.bound.gpu_blocks:
        return f"GPU owners claim {gpu_held} held + {gfe} fenced blocks of {model.bound.gpu_blocks}"
    if host_held + hfe > model.bound.host_blocks:
        return f"host owners claim {host_held} held + {hfe} fenced blocks of {model.bound.host_blocks}"
    return None


@_on_records
def res_state(model: AbstractModel, state: AbstractState) -> str | None:
    """Each request holds blocks only where its state's residency allows (gpu: GPU only; held: either tier or both;
    none: nothing), and enough of them for the tokens it computed (in either tier, when held)."""
    block_size = model.bound.block_size
    for r in state.requests:
        residency = "none" if r.state == ABSENT else model.spec.residency(r.state)
        if (residency == "none" and (r.gpu or r.host)) or (residency == "gpu" and r.host):
            return (
                f"request {_who(model, r)} in {r.state or 'absent'} (residency {residency}) holds {r.gpu} GPU "
                f"and {r.host} host blocks"
            )
        owned = r.gpu + r.host if residency == "held" else r.gpu
        if residency != "none" and owned < ceil_div(r.computed, block_size):
            where = "GPU and host" if residency == "held" else "GPU"
            return (
                f"request {_who(model, r)} in {r.state} computed {r.computed} tokens but holds only {owned} {where} "
                "blocks"
            )
    return None


@_on_records
def host_cap(model: AbstractModel, state: AbstractState) -> str | None:
    held = sum(r.host for r in state.requests if r.state != ABSENT and model.spec.residency(r.state) == "held")
    if held > model.bound.host_blocks:
        return f"suspended requests hold {held} host blocks, capacity {model.bound.host_blocks}"
    return None


@_on_records
def no_host_no_offload(model: AbstractModel, state: AbstractState) -> str | None:
    if model.bound.host_blocks == 0:
        holding = [r for r in state.requests if r.host or r.fenced_host]
        if holding:
            r = holding[0]
            return (
                f"request {_who(model, r)} in {r.state or 'absent'} holds {r.host} host blocks (its copy fences "
                f"{r.fenced_host}) but there is no host tier"
            )
    return None


@_on_records
def pp_hold(model: AbstractModel, state: AbstractState) -> str | None:
    for r in state.requests:
        if r.state == model.pending_reset and (r.gpu == 0 or r.gpu < ceil_div(r.computed, model.bound.block_size)):
            return f"request {_who(model, r)} awaits consensus with {r.gpu} GPU blocks for {r.computed} computed tokens"
    return None


STATE_PREDICATES: dict[str, Callable[[AbstractModel, AbstractState], str | None]] = {
    "CONS-GPU": cons_gpu,
    "CONS-HOST": cons_host,
    "OWN-EXCL": own_excl,
    "RES-STATE": res_state,
    "HOST-CAP": host_cap,
    "NO-HOST-NO-OFFLOAD": no_host_no_offload,
    "PP-HOLD": pp_hold,
}


# ------------------------------------------------------------------------------------------------ edge scope
def _acting(edge: Edge) -> tuple[AbstractRequest, AbstractRequest] | None:
    """The acting request before and after `edge`, or None for an edge of no request."""
    slot = edge.action[1]
    if slot is None:
        return None
    return edge.before.requests[slot], edge.after_requests[slot]


def _resets(edge: Edge) -> bool:
    """The edge takes a reset for replay (most edges take no transition at all: checked first, it is cheap)."""
    return bool(edge.taken) and any(t.effect == "release_kv_and_reset" for t in edge.taken)


def gen_append(model: AbstractModel, edge: Edge) -> str | None:
    pair = _acting(edge)
    if pair is None or pair[1].state in model.terminal:
        return None
    before, after = pair
    grew = after.generated - before.generated
    if grew < 0 or grew > 1:
        return f"generated count went {before.generated} -> {after.generated} on {edge.action}"
    kind, _, name = edge.action[:3]
    if grew and kind != "compute":
        return f"event {name} produced a token"
    return None


def fence(model: AbstractModel, edge: Edge) -> str | None:
    """Only a copy's completion ends its fences, and only its own: no other edge lowers a request's fenced counts."""
    if not (edge.before.gpu_fenced or edge.before.host_fenced):
        return None  # nothing was fenced: nothing can leave a fence
    completed = edge.action[1] if edge.action[0] == "complete" else None
    for k, (before, after) in enumerate(zip(edge.before.requests, edge.after_requests, strict=True)):
        if k != completed and (after.fenced_gpu < before.fenced_gpu or after.fenced_host < before.fenced_host):
            return (
                f"the copy of request {_who(model, before)} lost fenced blocks without completing "
                f"({before.fenced_gpu}/{before.fenced_host} -> {after.fenced_gpu}/{after.fenced_host} GPU/host)"
            )
    if completed is None and (
        edge.after_pool.gpu_fenced < edge.before.gpu_fenced or edge.after_pool.host_fenced < edge.before.host_fenced
    ):
        return (
            f"fenced blocks freed without a completed copy ({edge.before.gpu_fenced}/{edge.before.host_fenced} -> "
            f"{edge.after_pool.gpu_fenced}/{edge.after_pool.host_fenced})"
        )
    return None


def _reset_check(check: Callable[[AbstractRequest, AbstractRequest, int], str | None]):
    def predicate(model: AbstractModel, edge: Edge) -> str | None:
        if not _resets(edge) or (pair := _acting(edge)) is None:
            return None
        before, after = pair
        prompt, _ = model.bound.groups[before.group]
        return check(before, after, prompt)

    return predicate


@_reset_check
def reset_prompt(before: AbstractRequest, after: AbstractRequest, prompt: int) -> str | None:
    if after.prefill != prompt + before.generated:
        return f"replay prompt has {after.prefill} tokens, expected prompt {prompt} + generated {before.generated}"
    return None


@_reset_check
def reset_budget(before: AbstractRequest, after: AbstractRequest, prompt: int) -> str | None:
    if after.generated != before.generated:
        return (
            f"the reset changed the generated count {before.generated} -> {after.generated} (budget must shrink by it)"
        )
    return None


@_reset_check
def reset_cleared(before: AbstractRequest, after: AbstractRequest, prompt: int) -> str | None:
    if after.computed or after.gpu or after.host:
        return f"after the reset computed={after.computed} gpu={after.gpu} host={after.host} (all must be 0)"
    return None


@_reset_check
def reset_no_truncate(before: AbstractRequest, after: AbstractRequest, prompt: int) -> str | None:
    if after.prefill < prompt + before.generated:
        return f"replay prompt truncated to {after.prefill} of {prompt + before.generated} tokens"
    return None


def reset_terminated(model: AbstractModel, edge: Edge) -> str | None:
    if _resets(edge) and (pair := _acting(edge)) is not None and pair[0].deferred:
        return f"a request whose {pair[0].deferred} arrived before its reset was replayed, not terminated"
    return None


def promotion_gate_clauses(
    suspended_in_pass: int | None, pass_number: int | None, has_host_tier: bool, *, step_in_flight: bool = False
) -> str | None:
    """What is wrong with a promotion (a suspended request recompute-paused) by the promotion gate's pass and
    pipeline clauses, read from the request's suspension pass, the pass under way, the host tier and whether a step
    of the request was in the pipeline (None: nothing)."""
    if pass_number is None:
        return "a suspended request was promoted to recompute-pause outside a scheduling pass"
    if step_in_flight:
        return (
            "a suspended request was promoted to recompute-pause while a step of it was in the pipeline: the "
            "promotion releases its blocks at once, and that step's later stages still read and write them"
        )
    if suspended_in_pass == pass_number and not has_host_tier:
        return (
            f"a request suspended in pass {pass_number} was promoted to recompute-pause in the same pass without a "
            "host tier (it waits a pass)"
        )
    return None


def _promotions(model: AbstractModel, edge: Edge) -> list[Transition]:
    return [t for t in edge.taken if t.event == "recompute_pause" and model.spec.residency(t.source) == "held"]


def promote_gate(model: AbstractModel, edge: Edge) -> str | None:
    """The promotion gate's pass clauses, on what the abstract model has of passes: every suspension counts as one of
    a pass before the one under way (`kvstate.checker.effects`), so the gate is open here; the scheduler refinement
    checks the same clauses on the real passes (`RefinementChecks.transition`) and the policy's rules on every pass."""
    if not edge.taken or not _promotions(model, edge):
        return None
    pair = _acting(edge)
    in_flight = pair is not None and bool(pair[0].in_flight)
    return promotion_gate_clauses(
        RequestState.suspended_in_pass, PoolState.pass_number, model.bound.host_blocks > 0, step_in_flight=in_flight
    )


def resume_copy(model: AbstractModel, edge: Edge) -> str | None:
    """A resume (a held state left for a gpu state) is all-or-nothing and copies exactly the request's host blocks:
    afterwards every block is on the GPU, its host blocks are the new copy's sources and destinations, and no GPU
    block it held is copied (they are locked again where they are)."""
    if not edge.taken or (pair := _acting(edge)) is None:
        return None
    spec = model.spec
    if not any(spec.residency(t.source) == "held" and spec.residency(t.dest) == "gpu" for t in edge.taken):
        return None
    before, after = pair
    if after.host or after.gpu != before.gpu + before.host:
        return (
            f"a resume left {after.gpu} GPU and {after.host} host blocks of {before.gpu} GPU + {before.host} host "
            "(all-or-nothing: every block on the GPU)"
        )
    copied = (after.incoming - before.incoming, after.fenced_host - before.fenced_host)
    if copied != (before.host, before.host) or after.fenced_gpu != before.fenced_gpu:
        return (
            f"a resume of a request with {before.host} host and {before.gpu} held GPU blocks copied "
            f"{copied[0]} blocks up from {copied[1]} fenced host sources and fenced "
            f"{after.fenced_gpu - before.fenced_gpu} GPU blocks: it copies exactly its host blocks"
        )
    return None


def pp_terminate(model: AbstractModel, edge: Edge) -> str | None:
    if not edge.taken:
        return None
    pair = _acting(edge)
    for t in edge.taken:
        if t.event == "consensus" and pair is not None:
            deferred = pair[0].deferred
            if deferred and t.dest not in model.terminal:
                return f"consensus replayed a request whose {deferred} was deferred"
            if not deferred and t.dest in model.terminal:
                return "consensus terminated a request nothing ended"
    return None


STEP_PREDICATES: dict[str, Callable[[AbstractModel, Edge], str | None]] = {
    "GEN-APPEND": gen_append,
    "FENCE": fence,
    "RESET-PROMPT": reset_prompt,
    "RESET-BUDGET": reset_budget,
    "RESET-CLEARED": reset_cleared,
    "RESET-NO-TRUNCATE": reset_no_truncate,
    "RESET-TERMINATED": reset_terminated,
    "PROMOTE-GATE": promote_gate,
    "RESUME-COPY": resume_copy,
    "PP-TERMINATE": pp_terminate,
}

# What the scheduler refinement (kvstate.checker.refinement) checks beyond the abstract predicates.
REFINEMENT_CHECKS: dict[str, str] = {
    "OUT-EQUIV": "every finished output equals reference_output; a cancelled one is a prefix of it",
    "VICTIM-ONCE": "no request is passed to Scheduler._preempt twice in one pass",
    "OUT-DISJOINT": "Scheduler.check_invariants(output) after every pass",
    "OUT-STATE": "Scheduler.check_invariants(output) after every pass",
    "LIVE-DONE": (
        "no cycle with an unfinished request, nor a stall (A4), under every executor timing of the bound: copies "
        "completing up to copy_delay passes late or failing, micro-batches landing early, cancels and lost copies"
    ),
    "LIVE-REFUSE": "a request that cannot fit alone is refused at submission",
    "SPEC-EDGE": "the checker's own table, with the real guards reading the same pass, resolves every edge fired",
    "REFINES": (
        "every scheduler action maps to a sequence of abstract actions (or a stutter), and every scheduler state "
        "abstracts to a state the abstract model reaches"
    ),
    # the step simulation: kvstate.policy.check_pass on every real pass, against the spec's [policy]
    "VICTIM-TAIL": "step simulation: each victim is the latest-admitted eligible request at its choice",
    "VICTIM-NOT-FINAL": "step simulation: no victim was about to produce its final token",
    "VICTIM-SELF": "step simulation: no self-preemption while a request only chunk_in_flight excludes could give way",
    "VICTIM-CAP": "step simulation: a capped victim only of the pass's head; the head takes one before itself",
    "PROMOTE-GATE": (
        "every promotion the scheduler takes: in a pass, and one of the pass's own suspensions only with a host "
        "tier; step simulation: promotions only of this pass's suspensions, most recent first, worth less"
    ),
    "RESUME-COPY": "every resume the scheduler takes plans one copy of exactly its host blocks, none without any",
    "SUSPEND-ROOM": "step simulation: a suspension only as the policy's suspend rule allows (host room for it)",
    "OFFLOAD-DEMAND": (
        "step simulation: held blocks move only for an allocation that needs them, least recently held first, "
        "no more than it takes (or all of a victim's at once under the eager offload)"
    ),
    "ADMIT-ORDER": "step simulation: admissions are a prefix of the candidates in the policy's class order",
    "ADMIT-HOLD": "step simulation: no new request in a pass with a victim or a waiting requester",
    "WORK-CONSERVE": "step simulation: reserved room within what is on its way; nobody left while budget remained",
}
LIVENESS_CHECKS: dict[str, str] = {
    "LIVE-DONE": (
        "abstract model: no trap (all-done reachable from every reachable state without environment events; a trap "
        "breaks LIVE-DONE under every fairness); under weak fairness alone (F1-F3) the policy-free model has fair "
        "lassos, reported as information: LIVE-DONE itself is the scheduler refinement's (the policy's) to prove"
    ),
    "DEADLOCK": "abstract model: every reachable non-final state has an action other than an environment event",
}


@dataclass(frozen=True)
class InvariantPlan:
    """Which invariant is checked where; `left` maps an id to the reason it is left to other layers."""

    state: tuple[str, ...]
    step: tuple[str, ...]
    refinement: tuple[str, ...]
    liveness: tuple[str, ...]
    left: dict[str, str]

    def lines(self) -> list[str]:
        out = [
            f"abstract model, every state: {', '.join(self.state) or '-'}",
            f"abstract model, every edge: {', '.join(self.step) or '-'}",
            f"scheduler refinement: {', '.join(self.refinement) or '-'}",
            f"scheduler refinement, every transition the scheduler takes: {', '.join(self.step) or '-'}",
            f"liveness, abstract model: {', '.join(self.liveness) or '-'} ({LIVENESS_CHECKS['LIVE-DONE']})",
            f"liveness, scheduler refinement: LIVE-DONE ({REFINEMENT_CHECKS['LIVE-DONE']})",
        ]
        if self.left:
            out.append("left to other layers: " + ", ".join(f"{i} ({why})" for i, why in self.left.items()))
        return out


def plan_invariants(spec: Spec, state_predicates=STATE_PREDICATES, step_predicates=STEP_PREDICATES) -> InvariantPlan:
    """Sort the spec's invariants by the layer that checks them; refuse a state invariant without a predicate."""
    missing = [inv.id for inv in spec.invariants if inv.scope == "state" and inv.id not in state_predicates]
    if missing:
        raise CheckerError(
            f"{spec.source}: state invariant(s) {', '.join(missing)} have no predicate in "
            "kvstate.checker.invariants.STATE_PREDICATES; the checker refuses to report 'holds' for an invariant "
            "it cannot check: add a predicate keyed by the invariant id"
        )
    state, step, refinement, liveness, left = [], [], [], [], {}
    for inv in spec.invariants:
        if inv.scope == "state":
            state.append(inv.id)
        elif inv.id in step_predicates:
            step.append(inv.id)
        elif inv.scope == "liveness" and inv.id in LIVENESS_CHECKS:
            liveness.append(inv.id)
        if inv.id in REFINEMENT_CHECKS:
            refinement.append(inv.id)
        if (
            inv.scope != "state"
            and inv.id not in step_predicates
            and inv.id not in REFINEMENT_CHECKS
            and inv.id not in LIVENESS_CHECKS
        ):
            left[inv.id] = f"scope {inv.scope}"
    return InvariantPlan(tuple(state), tuple(step), tuple(refinement), tuple(liveness), left)
