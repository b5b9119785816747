"""The names the spec's data refers to and the code gives meaning to, below the spec so that its validator can hold
a spec against them.

* The roles a lifecycle state can play. The spec gives every state one role (`[[states]] role = ...`), each role
  names exactly one state, and code finds states through `Spec.role(ROLE)`, never by their names: a spec whose
  states are all renamed runs unchanged.
* The request lists of a scheduler output (`LIST_NAMES`): the spec's `[[output_lists]]` declare each exactly once,
  with the states a request in each may be in once the pass is over (OUT-STATE, `Spec.list_states`).
"""

from __future__ import annotations

from collections.abc import Mapping

QUEUED = "queued"
ACTIVE = "active"
OFFLOADED = "offloaded"
PENDING_RESET = "pending_reset"
DROPPED = "dropped"
RECOMPUTING = "recomputing"
ENDED = "ended"

ROLES: Mapping[str, str] = {
    QUEUED: "submitted and never admitted; new requests are admitted from it",
    ACTIVE: "admitted and producing tokens: prefilling its prompt or decoding",
    OFFLOADED: "its KV lives in the host tier; readmitted by resume",
    PENDING_RESET: "a recompute-pause awaiting every pipeline stage's consensus; keeps its GPU blocks",
    DROPPED: "its KV is gone; readmitted by replay of prompt + generated",
    RECOMPUTING: "re-prefilling its replay prompt; produces no new token until it catches up",
    ENDED: "terminal",
}

# The request lists of a scheduler output (`kvstate.output.SchedulerOutput`), in serialization order.
LIST_NAMES: tuple[str, ...] = ("context", "generation", "replay", "resumed", "suspended", "recompute_paused")
