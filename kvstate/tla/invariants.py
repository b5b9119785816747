"""The TLA+ meaning of every invariant predicate our checker evaluates on the abstract model.

`STATE` holds the TLA+ state predicate of each id of `kvstate.checker.invariants.STATE_PREDICATES`, `STEP` the
TLA+ action of each id of `STEP_PREDICATES` (TLC checks it as the property `[][action]_vars` on every step), and
`DEADLOCK` the one of `kvstate.checker.explore.deadlock`. Each reads the variables and operators of the exported
lifecycle module (`kvstate.tla.module`): `requests[r]` (the abstract request record), `counts` (the pool counts),
`Held(S, field)`, `Residency(state)`, `StepTaken(r, event)` (the transitions a step of request r by `event`
took, as `kvstate.checker.records.Edge.taken`), `Resets(r)`, `FairStepEnabled` and the actions `Compute(r)`,
`ComputeStop(r)` and `Complete(r)`.

`checked_ids` is the list both engines check, in our checker's order; the export refuses an id our checker
evaluates without a TLA+ meaning here, so the two engines always check the same invariants.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvstate.spec import Spec
from kvstate.tla.names import TlaExportError

STATE: Mapping[str, str] = {
    "CONS-GPU": r"""/\ Held(Requests, "fenced_gpu") = counts.gpu_fenced
    /\ counts.gpu_free + Held(Requests, "gpu") + counts.gpu_fenced = GpuBlocks""",
    "CONS-HOST": r"""/\ Held(Requests, "fenced_host") = counts.host_fenced
    /\ counts.host_free + Held(Requests, "host") + counts.host_fenced = HostBlocks""",
    "OWN-EXCL": r"""/\ counts.gpu_free >= 0 /\ counts.host_free >= 0
    /\ counts.gpu_fenced >= 0 /\ counts.host_fenced >= 0
    /\ \A r \in Requests : requests[r].gpu >= 0 /\ requests[r].host >= 0
    /\ Held(Requests, "gpu") + counts.gpu_fenced <= GpuBlocks
    /\ Held(Requests, "host") + counts.host_fenced <= HostBlocks""",
    "RES-STATE": r"""\A r \in Requests :
        LET q == requests[r]
            residency == Residency(q.state)
        IN  /\ residency = "none" => q.gpu = 0 /\ q.host = 0
            /\ residency = "gpu" => q.host = 0 /\ q.gpu >= ceil_div(q.computed, BlockSize)
            /\ residency = "held" => q.gpu + q.host >= ceil_div(q.computed, BlockSize)""",
    "HOST-CAP": 'Held({r \\in Requests : Residency(requests[r].state) = "held"}, "host") <= HostBlocks',
    "NO-HOST-NO-OFFLOAD": r"HostBlocks = 0 => \A r \in Requests : requests[r].host = 0 /\ requests[r].fenced_host = 0",
    "PP-HOLD": r"""\A r \in Requests :
        requests[r].state = PendingReset
            => requests[r].gpu # 0 /\ requests[r].gpu >= ceil_div(requests[r].computed, BlockSize)""",
}

STEP: Mapping[str, str] = {
    "GEN-APPEND": r"""\A r \in Requests :
        requests'[r].state \notin Terminal
            => LET grew == requests'[r].generated - requests[r].generated
               IN  grew \in {0, 1} /\ (grew = 1 => Compute(r) \/ ComputeStop(r))""",
    "FENCE": r"""counts.gpu_fenced # 0 \/ counts.host_fenced # 0
        => /\ \A r \in Requests :
                  requests'[r].fenced_gpu < requests[r].fenced_gpu \/ requests'[r].fenced_host < requests[r].fenced_host
                      => Complete(r)
           /\ counts'.gpu_fenced < counts.gpu_fenced \/ counts'.host_fenced < counts.host_fenced
                  => \E r \in Requests : Complete(r)""",
    "RESET-PROMPT": r"""\A r \in Requests :
        Resets(r) => requests'[r].prefill = requests[r].prompt_len + requests[r].generated""",
    "RESET-BUDGET": r"\A r \in Requests : Resets(r) => requests'[r].generated = requests[r].generated",
    "RESET-CLEARED": r"""\A r \in Requests :
        Resets(r) => requests'[r].computed = 0 /\ requests'[r].gpu = 0 /\ requests'[r].host = 0""",
    "RESET-NO-TRUNCATE": r"""\A r \in Requests :
        Resets(r) => requests'[r].prefill >= requests[r].prompt_len + requests[r].generated""",
    "RESET-TERMINATED": r"\A r \in Requests : Resets(r) => requests[r].deferred = NoReason",
    "PROMOTE-GATE": r"""\A r \in Requests : \A k \in StepTaken(r, "recompute_pause") :
        Transitions[k].event = "recompute_pause" /\ Residency(Transitions[k].source) = "held"
            => /\ PoolView(counts).pass_number # NoPass
               /\ ~RequestView(requests[r]).step_in_flight
               /\ RequestView(requests[r]).suspended_in_pass # PoolView(counts).pass_number \/ HostBlocks > 0""",
    "RESUME-COPY": r"""\A r \in Requests : \A k \in StepTaken(r, "resume") :
        Residency(Transitions[k].source) = "held" /\ Residency(Transitions[k].dest) = "gpu"
            => LET b == requests[r]
                   a == requests'[r]
               IN  /\ a.host = 0 /\ a.gpu = b.gpu + b.host
                   /\ a.incoming - b.incoming = b.host /\ a.fenced_host - b.fenced_host = b.host
                   /\ a.fenced_gpu = b.fenced_gpu""",
    "PP-TERMINATE": r"""\A r \in Requests : \A k \in StepTaken(r, "consensus") :
        Transitions[k].event = "consensus"
            => (requests[r].deferred # NoReason <=> Transitions[k].dest \in Terminal)""",
}

DEADLOCK_ID = "DEADLOCK"
# kvstate.checker.explore.deadlock: a state that is not final has a step other than an environment event that
# leads to another state
DEADLOCK = r"AllDone \/ FairStepEnabled"


def checked_ids(spec: Spec) -> tuple[list[str], list[str]]:
    """(state ids, step ids) both engines check on `spec`: the ids our checker evaluates (its predicates, filtered
    by the invariants the spec states, in its order); refuses an id without a TLA+ meaning here."""
    from kvstate.checker.invariants import STATE_PREDICATES, STEP_PREDICATES

    stated = {inv.id for inv in spec.invariants}
    chosen = []
    for predicates, meanings in ((STATE_PREDICATES, STATE), (STEP_PREDICATES, STEP)):
        ids = [i for i in predicates if i in stated]
        missing = [i for i in ids if i not in meanings]
        if missing:
            raise TlaExportError(
                f"invariant(s) {', '.join(missing)} are checked by kvstate check (kvstate.checker.invariants) but "
                "have no TLA+ meaning in kvstate.tla.invariants; add one there so both engines check them"
            )
        chosen.append(ids)
    return chosen[0], chosen[1]
