"""`SpecModel`: what the conformance machine derives from the spec, and the spec invariants it checks.

State names, the edge graph, terminal states, residencies and invariant statements all come from the spec, never
re-typed; a spec that lacks an invariant the machine checks, a terminal state or the cancel event is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstate.errors import InvariantViolation
from kvstate.roles import DROPPED, PENDING_RESET, RECOMPUTING
from kvstate.spec import Spec

__all__ = ["CHECKED_INVARIANTS", "POLICY_INVARIANTS", "RESET_INVARIANTS", "SpecModel", "replay_states"]

# Spec invariants this machine checks; each must exist in the spec the machine is built from.
CHECKED_INVARIANTS = (
    "CONS-GPU",
    "CONS-HOST",
    "RES-STATE",
    "NO-HOST-NO-OFFLOAD",
    "GEN-APPEND",
    "OUT-EQUIV",
    "LIVE-DONE",
    "LIVE-REFUSE",
)
# ... and, for an adapter that reports its passes, the policy's (`kvstate.policy.check_pass` raises these)
POLICY_INVARIANTS = (
    "VICTIM-TAIL",
    "VICTIM-ONCE",
    "VICTIM-NOT-FINAL",
    "PROMOTE-GATE",
    "SUSPEND-ROOM",
    "OFFLOAD-DEMAND",
    "ADMIT-ORDER",
    "ADMIT-HOLD",
    "WORK-CONSERVE",
)
# the RESET rules an OUT-EQUIV violation of a replayed request points to (`ConformanceMachine.replay_story`)
RESET_INVARIANTS = ("RESET-PROMPT", "RESET-BUDGET", "RESET-CLEARED")


def replay_states(spec: Spec) -> frozenset[str]:
    """The states in which a request that has produced tokens replays, or will, until it samples its next one."""
    return frozenset(s.name for s in spec.states if s.role in (RECOMPUTING, DROPPED, PENDING_RESET))


class SpecModel:
    """What the machine derives from the spec: states, the reachability closure of its edges, residencies (per
    tier, the states whose residency lets a request hold blocks there: `holding`), the destinations of the cancel
    event, and the invariants it checks.

    Every name it holds is the spec's. The spec it holds has a terminal state, the cancel event and every invariant
    of `CHECKED_INVARIANTS`; any other spec is refused with a `ValueError` that names what it lacks.
    """

    def __init__(self, spec: Spec, cancel_event: str) -> None:
        self.spec = spec
        self.states = frozenset(s.name for s in spec.states)
        self.terminal = frozenset(spec.terminal_states)
        self.state_names = tuple(s.name for s in spec.states)
        self.live_states = tuple(s.name for s in spec.states if not s.terminal)
        if not self.terminal:
            raise ValueError(f"spec {spec.name!r} has no terminal state; LIVE-DONE needs one")
        self.reach = {s: spec.reachable_from(s) for s in self.states}
        self.initial_reach = self.reach[spec.initial]
        self.successors = {s: sorted(spec.successors.get(s, ())) for s in self.states}
        self.gpu_states = frozenset(spec.states_with_residency("gpu"))  # KV locked on the GPU
        self.held_states = frozenset(spec.states_with_residency("held"))  # KV held: on the GPU, the host, or both
        self.holding = {tier: spec.states_holding(tier) for tier in ("gpu", "host")}
        self.replay_states = replay_states(spec)
        if cancel_event not in spec.event_by_name:
            raise ValueError(
                f"spec {spec.name!r} has no event {cancel_event!r}; pass cancel_event= naming the "
                f"event that cancels a request (events: {', '.join(spec.event_by_name)})"
            )
        self.cancel_event = cancel_event
        self.cancel_dests: dict[str, frozenset[str]] = {}
        for t in spec.event_by_name[cancel_event].transitions:
            self.cancel_dests[t.source] = self.cancel_dests.get(t.source, frozenset()) | {t.dest}
        by_id = {inv.id: inv for inv in spec.invariants}
        missing = [i for i in CHECKED_INVARIANTS if i not in by_id]
        if missing:
            raise ValueError(
                f"spec {spec.name!r} ({spec.source}) lacks invariants {', '.join(missing)} that the "
                "conformance machine checks; add them to the spec or use the packaged one"
            )
        self.invariants = by_id

    def require(self, ids: Sequence[str], why: str) -> None:
        """Refuse a spec that lacks any of the invariants `ids` (`why`: what checks them)."""
        missing = [i for i in ids if i not in self.invariants]
        if missing:
            raise ValueError(
                f"spec {self.spec.name!r} ({self.spec.source}) lacks invariants {', '.join(missing)} that {why} "
                "checks; add them to the spec or use the packaged one"
            )

    def violation(self, invariant_id: str, detail: str) -> InvariantViolation:
        statement = self.invariants[invariant_id].statement
        return InvariantViolation(invariant_id, f"{detail}. [{invariant_id}: {statement}]")
