"""Predicates for the spec's invariants, keyed by invariant id, and which layer checks each invariant.

`STATE_PREDICATES[id](model, state)` and `STEP_PREDICATES[id](model, step)` return None when the invariant holds,
otherwise a message. Every spec invariant of scope `state` must have a state predicate: `plan_invariants`
refuses to run otherwise. Step-scope invariants are checked on every abstract edge where a predicate exists;
the others (scope pass, run, liveness) are listed with the layer that checks them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvstate.checker.model import (
    ABSENT, COMPUTED, DEFERRED, GENERATED, GPU, HOST, PREFILL, STATE, AbstractModel, AState, Step, blocks_for,
)
from kvstate.errors import KVStateError
from kvstate.spec import Spec


class CheckerError(KVStateError):
    """The checker cannot run as asked (e.g. a state invariant of the spec has no predicate)."""


def _who(model: AbstractModel, r: tuple) -> str:
    prompt, new = model.bound.groups[r[0]]
    return f"[prompt {prompt}, max_new {new}]"


def _tier_sums(model: AbstractModel, state: AState) -> tuple[int, int]:
    reqs = state[0]
    return sum(r[GPU] for r in reqs), sum(r[HOST] for r in reqs)


def _conservation(tier: str, free: int, held: int, fenced: int, capacity: int) -> str | None:
    if free + held + fenced != capacity:
        return f"{tier} tier: free {free} + held {held} + fenced {fenced} != capacity {capacity}"
    return None


def cons_gpu(model: AbstractModel, state: AState) -> str | None:
    held, _ = _tier_sums(model, state)
    return _conservation("GPU", state[1], held, state[3], model.bound.gpu_blocks)


def cons_host(model: AbstractModel, state: AState) -> str | None:
    _, held = _tier_sums(model, state)
    return _conservation("host", state[2], held, state[4], model.bound.host_blocks)


def own_excl(model: AbstractModel, state: AState) -> str | None:
    """Counting form of exclusive ownership: no count is negative and owners never claim more blocks than exist."""
    gpu_held, host_held = _tier_sums(model, state)
    _, gf, hf, gfe, hfe = state
    if min(gf, hf, gfe, hfe) < 0 or any(r[GPU] < 0 or r[HOST] < 0 for r in state[0]):
        return f"a block count is negative (gpu free {gf}, host free {hf}, fenced {gfe}/{hfe})"
    if gpu_held + gfe > model.bound.gpu_blocks:
        return f"GPU owners claim {gpu_held} held + {gfe} fenced blocks of {model.bound.gpu_blocks}"
    if host_held + hfe > model.bound.host_blocks:
        return f"host owners claim {host_held} held + {hfe} fenced blocks of {model.bound.host_blocks}"
    return None


def res_state(model: AbstractModel, state: AState) -> str | None:
    for k, r in enumerate(state[0]):
        residency = "none" if r[STATE] == ABSENT else model.spec.residency(r[STATE])
        if (residency != "gpu" and r[GPU]) or (residency != "host" and r[HOST]):
            return f"request {_who(model, r)} in {r[STATE] or 'absent'} (residency {residency}) holds {r[GPU]} GPU and {r[HOST]} host blocks"
        if residency == "gpu" and r[GPU] < blocks_for(r[COMPUTED], model.bound.block_size):
            return f"request {_who(model, r)} in {r[STATE]} computed {r[COMPUTED]} tokens but holds only {r[GPU]} GPU blocks"
        if residency == "host" and r[HOST] < blocks_for(r[COMPUTED], model.bound.block_size):
            return f"request {_who(model, r)} in {r[STATE]} computed {r[COMPUTED]} tokens but holds only {r[HOST]} host blocks"
    return None


def host_cap(model: AbstractModel, state: AState) -> str | None:
    held = sum(r[HOST] for r in state[0] if r[STATE] != ABSENT and model.spec.residency(r[STATE]) == "host")
    if held > model.bound.host_blocks:
        return f"suspended requests hold {held} host blocks, capacity {model.bound.host_blocks}"
    return None


def no_host_no_suspend(model: AbstractModel, state: AState) -> str | None:
    if model.bound.host_blocks == 0 and any(r[STATE] != ABSENT and model.spec.residency(r[STATE]) == "host"
                                            for r in state[0]):
        return "a request is suspended but there is no host tier"
    return None


def pp_hold(model: AbstractModel, state: AState) -> str | None:
    for k, r in enumerate(state[0]):
        if r[STATE] == model.pending_reset and (r[GPU] == 0 or r[GPU] < blocks_for(r[COMPUTED], model.bound.block_size)):
            return f"request {_who(model, r)} awaits consensus with {r[GPU]} GPU blocks for {r[COMPUTED]} computed tokens"
    return None


STATE_PREDICATES: dict[str, Callable[[AbstractModel, AState], str | None]] = {
    "CONS-GPU": cons_gpu,
    "CONS-HOST": cons_host,
    "OWN-EXCL": own_excl,
    "RES-STATE": res_state,
    "HOST-CAP": host_cap,
    "NO-HOST-NO-SUSPEND": no_host_no_suspend,
    "PP-HOLD": pp_hold,
}


# ------------------------------------------------------------------------------------------------ step scope
def _acting(step: Step) -> tuple[tuple, tuple] | None:
    if step.slot is None:
        return None
    return step.before[0][step.slot], step.after_requests[step.slot]


def _resets(step: Step) -> bool:
    return any(t.effect == "release_kv_and_reset" for t in step.taken)


def gen_append(model: AbstractModel, step: Step) -> str | None:
    pair = _acting(step)
    if pair is None or pair[1][STATE] in model.terminal:
        return None
    before, after = pair
    grew = after[GENERATED] - before[GENERATED]
    if grew < 0 or grew > 1:
        return f"generated count went {before[GENERATED]} -> {after[GENERATED]} on {step.action}"
    if grew and step.action[0] != "compute":
        return f"event {step.action[2]} produced a token"
    return None


def fence(model: AbstractModel, step: Step) -> str | None:
    if step.action[0] == "complete":
        return None
    before, after = step.before, step.after_pool
    if after[2] < before[3] or after[3] < before[4]:
        return f"fenced blocks freed without a completed copy ({before[3]}/{before[4]} -> {after[2]}/{after[3]})"
    return None


def _reset_check(check: Callable[[tuple, tuple, int], str | None]):
    def predicate(model: AbstractModel, step: Step) -> str | None:
        pair = _acting(step)
        if pair is None or not _resets(step):
            return None
        before, after = pair
        prompt, _ = model.bound.groups[before[0]]
        return check(before, after, prompt)

    return predicate


@_reset_check
def reset_prompt(before, after, prompt) -> str | None:
    if after[PREFILL] != prompt + before[GENERATED]:
        return f"replay prompt has {after[PREFILL]} tokens, expected prompt {prompt} + generated {before[GENERATED]}"
    return None


@_reset_check
def reset_budget(before, after, prompt) -> str | None:
    if after[GENERATED] != before[GENERATED]:
        return f"the reset changed the generated count {before[GENERATED]} -> {after[GENERATED]} (budget must shrink by it)"
    return None


@_reset_check
def reset_cleared(before, after, prompt) -> str | None:
    if after[COMPUTED] or after[GPU] or after[HOST]:
        return f"after the reset computed={after[COMPUTED]} gpu={after[GPU]} host={after[HOST]} (all must be 0)"
    return None


@_reset_check
def reset_no_truncate(before, after, prompt) -> str | None:
    if after[PREFILL] < prompt + before[GENERATED]:
        return f"replay prompt truncated to {after[PREFILL]} of {prompt + before[GENERATED]} tokens"
    return None


def reset_terminated(model: AbstractModel, step: Step) -> str | None:
    pair = _acting(step)
    if pair is not None and _resets(step) and pair[0][DEFERRED]:
        return f"a request whose {pair[0][DEFERRED]} arrived before its reset was replayed, not terminated"
    return None


def promote_gate(model: AbstractModel, step: Step) -> str | None:
    for t in step.taken:
        if t.event == "recompute_pause" and model.spec.residency(t.source) == "host" and model.bound.host_blocks == 0:
            return "a suspended request was promoted to recompute-pause without a host tier"
    return None


def pp_terminate(model: AbstractModel, step: Step) -> str | None:
    pair = _acting(step)
    for t in step.taken:
        if t.event == "consensus" and pair is not None:
            deferred = pair[0][DEFERRED]
            if deferred and t.dest not in model.terminal:
                return f"consensus replayed a request whose {deferred} was deferred"
            if not deferred and t.dest in model.terminal:
                return "consensus terminated a request nothing ended"
    return None


STEP_PREDICATES: dict[str, Callable[[AbstractModel, Step], str | None]] = {
    "GEN-APPEND": gen_append,
    "FENCE": fence,
    "RESET-PROMPT": reset_prompt,
    "RESET-BUDGET": reset_budget,
    "RESET-CLEARED": reset_cleared,
    "RESET-NO-TRUNCATE": reset_no_truncate,
    "RESET-TERMINATED": reset_terminated,
    "PROMOTE-GATE": promote_gate,
    "PP-TERMINATE": pp_terminate,
}

# What the scheduler refinement (kvstate.checker.refinement) checks beyond the abstract predicates.
REFINEMENT_CHECKS: dict[str, str] = {
    "OUT-EQUIV": "every finished output equals reference_output; a cancelled one is a prefix of it",
    "VICTIM-ONCE": "no request is passed to Scheduler._preempt twice in one pass",
    "OUT-DISJOINT": "Scheduler.check_invariants(output) after every pass",
    "OUT-STATE": "Scheduler.check_invariants(output) after every pass",
    "LIVE-DONE": "no cycle of scheduler steps with an unfinished request (arrivals stopped)",
    "LIVE-REFUSE": "a request that cannot fit alone is refused at submission",
    "SPEC-EDGE": "the checker's own table, with the real guards reading the same pass, resolves every edge fired",
    "REFINES": "every scheduler state abstracts to a state the abstract model reaches",
    # the step simulation: kvstate.policy.check_pass on every real pass, against the spec's [policy]
    "VICTIM-TAIL": "step simulation: each victim is the latest-admitted eligible request at its choice",
    "VICTIM-NOT-FINAL": "step simulation: no victim was about to produce its final token",
    "PROMOTE-GATE": "step simulation: promotions only of this pass's suspensions, most recent first, worth less",
    "ADMIT-ORDER": "step simulation: admissions are a prefix of the candidates in the policy's class order",
    "ADMIT-HOLD": "step simulation: no new request in a pass with a victim or a waiting requester",
    "WORK-CONSERVE": "step simulation: reserved room within what is on its way; nobody left while budget remained",
}
LIVENESS_CHECKS: dict[str, str] = {
    "LIVE-DONE": "abstract model: every reachable bottom SCC of the fair graph (environment events are no way out) "
                 "is all-done (strong fairness); scheduler: no livelock",
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
            f"liveness (SCC): {', '.join(self.liveness) or '-'}",
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
        if inv.scope != "state" and inv.id not in step_predicates and inv.id not in REFINEMENT_CHECKS \
                and inv.id not in LIVENESS_CHECKS:
            left[inv.id] = f"scope {inv.scope}"
    return InvariantPlan(tuple(state), tuple(step), tuple(refinement), tuple(liveness), left)
