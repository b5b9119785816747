"""The scheduling policy's rule names: what each means (`VOCABULARY`), how the scheduler reads each victim exclusion
(`VICTIM_EXCLUSIONS`), and `policy_problems`, which holds a spec's `[policy]` against them.

Every rule name a spec may give is a key of `VOCABULARY`; the scheduler and the pass check (`kvstate.policy`) read
them by the constants below.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: kvstate.spec validates what it loads with `policy_problems`
    from kvstate.request import Request
    from kvstate.scheduler.core import SchedulerCore
    from kvstate.scheduler.scheduling_pass import SchedulingPass
    from kvstate.spec import Spec

# the rule names the scheduler and the pass check read by name (each is a key of VOCABULARY below)
CHUNK_IN_FLIGHT = "chunk_in_flight"
AHEAD_OF_REQUESTER = "ahead_of_requester"
AHEAD_OF_DECODING_REQUESTER = "ahead_of_decoding_requester"
CANNOT_BE_MOVED = "cannot_be_moved"
PREEMPTION_CAP_REACHED = "preemption_cap_reached"
CAP_SPARES_HEAD = "preemption_cap_reached_except_for_head"
WAIT_FOR_CHUNK_IN_FLIGHT = "wait_for_chunk_in_flight"
STOP_AT_FIRST_MISFIT = "stop_at_first_misfit"
NO_READMISSION_OF_VICTIMS = "no_readmission_of_victims"
HOLD_NEW_AFTER_PREEMPTION_OR_WAIT = "hold_new_after_preemption_or_wait"
HOLD_READMISSIONS_AFTER_PREEMPTION = "hold_readmissions_after_preemption"
READMIT_LATEST_VICTIM_FIRST = "readmit_latest_victim_first"
LATEST_ADMISSION_FIRST = "latest_admission_first"
HOST_TAKES_EVERY_HELD_BLOCK = "host_takes_every_held_block"
SUSPEND_ALWAYS = "always"
ON_DEMAND = "on_demand"
EAGER = "eager"

# rule vocabulary: every name the spec's [policy] may use, with its meaning
VOCABULARY: Mapping[str, Mapping[str, str]] = {
    "victim_order": {
        LATEST_ADMISSION_FIRST: "the eligible request with the greatest admission number",
        "fewest_outputs_first": (
            "the eligible request with the fewest generated tokens; ties: the longest prompt, then the latest "
            "admission (SGLang's retraction order)"
        ),
    },
    "victim_exclusions": {
        "the_requester": "a requester is not its own victim while another is eligible",
        "scheduled_this_pass": "a request already scheduled in the pass (its output list is never revised)",
        "waiting_this_pass": (
            "a requester already waiting in the pass for room on its way it reserved (otherwise a "
            "later, younger requester could take the older one's place: livelock)"
        ),
        "victim_this_pass": "a request already chosen in the pass (VICTIM-ONCE)",
        "about_to_finish": "a request whose next decode step produces its final token (VICTIM-NOT-FINAL)",
        PREEMPTION_CAP_REACHED: (
            "a request preempted max_preemptions_per_request times (A3), whoever asks; once every request that "
            "holds blocks is capped, each requester preempts itself, and two such requests can pause each other "
            "forever"
        ),
        CAP_SPARES_HEAD: (
            "a request preempted max_preemptions_per_request times (A3), unless the requester is the head of the "
            "pass, the first request it serves (SPEC.md 7.2), which may take it (VICTIM-CAP): the request the "
            "progress argument rests on sees the victims it would see without a cap"
        ),
        CHUNK_IN_FLIGHT: (
            "a request whose prefill or replay chunk is still in the pipeline (several micro-batches "
            "in flight); one whose decode step is in flight may be a victim: its token lands while it "
            "is suspended or awaits consensus (PP-TERMINATE)"
        ),
        CANNOT_BE_MOVED: (
            "a request the pass cannot move off the GPU: recompute-pause is disabled and it cannot be suspended now "
            "(suspend does not fire on it: it is replaying, or a copy of it is in flight; or the suspend rule "
            "refuses it, with the host room the pass's earlier suspensions left): a victim is a request the pass "
            "can move, and a requester the pass cannot move waits, reserving nothing, instead of preempting itself"
        ),
        "ahead_of_requester": (
            "a request ahead of the requester in the pass's serve order, served or not (victims are searched "
            "behind it only: TensorRT-LLM scans its active list from the tail down to the requester)"
        ),
        AHEAD_OF_DECODING_REQUESTER: (
            "a request ahead of the requester in the order the pass searches victims in (its serve order unless the "
            "engine reports its own scan order), served or not, when the requester asks for "
            "room for a decode step; a requester of a prompt or replay chunk searches every request (TensorRT-LLM's "
            "generation phase scans its active list from the tail down to the requester, its context phase the "
            "whole list)"
        ),
    },
    "no_eligible_victim": {
        "preempt_self": "a requester that finds no eligible victim preempts itself (by its victim path rule)",
        WAIT_FOR_CHUNK_IN_FLIGHT: (
            "a requester that finds no eligible victim waits, keeping its blocks and reserving nothing, while a "
            "request that chunk_in_flight alone excludes holds GPU blocks (that chunk lands within the micro-batches "
            "in flight, and then it is a victim again); otherwise it preempts itself (the progress rule, P1)"
        ),
    },
    "suspend_rule": {
        HOST_TAKES_EVERY_HELD_BLOCK: (
            "a victim is suspended only when the host tier has a free block for every block suspended requests hold "
            "on the GPU, its own included, so held blocks can always be offloaded; never without a host tier"
        ),
        SUSPEND_ALWAYS: (
            "a victim that can be suspended is suspended whatever the host tier can take (TensorRT-LLM's ladder): "
            "without room below, its blocks stay held on the GPU and free nothing"
        ),
    },
    "offload": {
        ON_DEMAND: (
            "held blocks move to the host tier only when an allocation needs GPU room, exactly as many as it needs, "
            "least recently held first"
        ),
        EAGER: "all of a victim's blocks move to the host tier in the pass that suspends it, as far as it has room",
    },
    "promotion_candidates": {"suspended_this_pass": "requests suspended earlier in the same pass"},
    "promotion_order": {"latest_suspension_first": "the most recently suspended candidate first"},
    "promotion_worth": {"fewer_kv_tokens_than_victim": "the promoted requests hold fewer KV tokens than the victim"},
    "admission_rules": {
        STOP_AT_FIRST_MISFIT: "admissions stop at the first candidate that does not fit (A2)",
        NO_READMISSION_OF_VICTIMS: "a victim of the pass is not readmitted in it",
        HOLD_NEW_AFTER_PREEMPTION_OR_WAIT: "no new request in a pass with a victim or a waiting requester (A1)",
        HOLD_READMISSIONS_AFTER_PREEMPTION: "no readmission in a pass with a victim (vLLM admits nothing then)",
        READMIT_LATEST_VICTIM_FIRST: (
            "readmission candidates of a class in order of their latest preemption, most recent first (the "
            "engine puts each victim back at the head of its queue); new requests in arrival order"
        ),
    },
    "room_on_its_way": {"reserved_per_requester": "a waiting requester reserves the pending blocks it counts on"},
    "progress": {
        "new_kv_position_or_end": (
            "a pass progresses when it computes a prompt chunk or a decode step, a "
            "replay chunk beyond every earlier replay of the same replay prompt, or "
            "ends a request"
        )
    },
}
_LISTED = ("victim_exclusions", "admission_rules")


def preemption_capped(request: Request, cap: int | None) -> bool:
    """`request` was preempted `cap` times already (A3); never with no cap."""
    return cap is not None and request.num_suspensions + request.num_recompute_pauses >= cap


# The scheduler's reading of each victim exclusion the spec's policy may name (their meaning: VOCABULARY above).
VICTIM_EXCLUSIONS: Mapping[str, Callable[[SchedulerCore, Request, SchedulingPass], bool]] = {
    "the_requester": lambda s, candidate, pass_: candidate is pass_.requester,
    "scheduled_this_pass": lambda s, candidate, pass_: candidate.request_id in pass_.output.chunk_tokens,
    "waiting_this_pass": lambda s, candidate, pass_: id(candidate) in pass_.waiting,
    "victim_this_pass": lambda s, candidate, pass_: id(candidate) in pass_.victims,
    "about_to_finish": lambda s, candidate, pass_: candidate.about_to_finish,
    PREEMPTION_CAP_REACHED: lambda s, candidate, pass_: preemption_capped(
        candidate, s.config.max_preemptions_per_request
    ),
    CAP_SPARES_HEAD: lambda s, candidate, pass_: (
        preemption_capped(candidate, s.config.max_preemptions_per_request)
        and pass_.requester is not s.head_of_pass(pass_)
    ),
    CHUNK_IN_FLIGHT: lambda s, candidate, pass_: candidate.request_id in s.in_flight and candidate.is_prefilling,
    CANNOT_BE_MOVED: lambda s, candidate, pass_: not s.victim_movable(candidate, pass_),
    AHEAD_OF_REQUESTER: lambda s, candidate, pass_: pass_.requester is not None and _ahead(candidate, pass_.requester),
    AHEAD_OF_DECODING_REQUESTER: lambda s, candidate, pass_: (
        pass_.requester is not None and not pass_.requester.is_prefilling and _ahead(candidate, pass_.requester)
    ),
}


def _ahead(candidate: Request, requester: Request) -> bool:
    """`candidate` comes before `requester` in the spec's serve order (SPEC.md 7.2: decode steps first, then
    prompt and replay chunks, each by arrival); the exclusions that read it are declared by third-party policies
    (kvstate.declared)."""
    return (candidate.is_prefilling, candidate.arrival) < (requester.is_prefilling, requester.arrival)


def policy_problems(spec: Spec) -> list[str]:
    """Every policy entry of `spec` that names no known rule or event (for `kvstate.validate`)."""
    policy = spec.policy  # the parser refuses a spec without [policy]
    found = []
    for key, meanings in VOCABULARY.items():
        values = getattr(policy, key)
        for value in values if key in _LISTED else (values,):
            if value not in meanings:
                found.append(
                    f"[policy] {key}: {value!r} has no meaning in kvstate.policy; use one of {sorted(meanings)}"
                )
    events = spec.event_by_name
    for key in ("admission_classes", "readmissions_keeping_admission"):
        for name in getattr(policy, key):
            if name not in events:
                found.append(f"[policy] {key}: {name!r} is not an event of the spec; use one of {sorted(events)}")
    return found
