"""A scheduler's policy declared in the spec's own terms, and the passes the conformance machine checks against it.

Engines choose their victims and admissions differently on purpose: vLLM preempts the tail of its running queue,
SGLang retracts the request with the fewest output tokens, TensorRT-LLM scans its active list from the tail. An
adapter declares its engine's policy as a `kvstate.spec.Policy` value, the same shape as the spec's `[policy]`,
whose rule names `kvstate.policy.VOCABULARY` gives meaning to (`preset(name)` builds the named ones), and reports
every scheduling pass its `step()` ran as an `ObservedPass`: what the policy reads of the active requests just
before the pass (`kvstate.policy.PassSnapshot`), the decisions its output does not show, in the order they were
taken (`kvstate.policy.PassRecord`: victims and promotions), and the output itself (`PassOutput`, or this package's
own `SchedulerOutput`). The conformance machine checks each pass with `kvstate.policy.check_pass` against the spec
with the declared policy in place of its `[policy]` (`with_policy`): the step simulation's own checks, so each rule
has one meaning everywhere.

Invariants: a declared policy names only rules `kvstate.policy` gives meaning to and only events of the spec
(`with_policy` refuses any other, naming the entry); presets are derived from the spec they are asked for, so a spec
whose states or events are renamed gets the same rules.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any

from kvstate.policy import PassRecord, PassSnapshot, policy_problems
from kvstate.roles import OFFLOADED
from kvstate.spec import Policy, Spec, default_spec

__all__ = ["PRESETS", "Listed", "ObservedPass", "PassOutput", "preset", "with_policy"]

# rules every preset keeps from the spec's policy (VICTIM-ONCE: no engine chooses a request twice in one pass)
_ONCE = ("victim_this_pass",)

# what each preset changes in the spec's [policy]; readmission classes are kept only where the engine has the edge
PRESETS: Mapping[str, Mapping[str, Any]] = {
    # ours: the spec's [policy] as it is
    "ours": {},
    # vLLM v1: pops the tail of its running queue, the requester itself when it is the tail (never one served
    # earlier in the pass: the queue is served in order); no host tier; a pass that preempted admits nothing; a
    # victim goes back to the head of the waiting queue
    "vllm": {
        "victim_order": "latest_admission_first",
        "victim_exclusions": ("the_requester", "scheduled_this_pass", *_ONCE),
        "admission_without": (OFFLOADED,),
        "admission_rules": (
            "stop_at_first_misfit",
            "no_readmission_of_victims",
            "hold_new_after_preemption_or_wait",
            "hold_readmissions_after_preemption",
            "readmit_latest_victim_first",
        ),
        "work_conservation": False,
    },
    # SGLang: retract_decode retracts the running request with the fewest output tokens (ties: the longest prompt),
    # never the last one left; retraction happens in decode passes, which admit nothing; no host tier on the CPU
    "sglang": {
        "victim_order": "fewest_outputs_first",
        "victim_exclusions": ("the_requester", *_ONCE),
        "admission_without": (OFFLOADED,),
        "admission_rules": ("no_readmission_of_victims", "hold_readmissions_after_preemption"),
        "work_conservation": False,
    },
    # TensorRT-LLM's KVCacheV2Scheduler: victims tail-first over its active list, never one served earlier in the
    # pass, never twice, never a request about to complete (GENERATION_TO_COMPLETE); a generation requester scans
    # only the requests behind it, a context requester (context-phase preemption, without a tier below the GPU)
    # every started request, those ahead of it included (ahead_of_decoding_requester); lazy suspension
    # whatever the host can take (its ladder: suspend, then recompute-pause, then suspend itself), held pages
    # offloaded on demand; it recompute-pauses suspended requests, those of earlier passes included, in
    # suspension order, which the lifecycle's promotion_gate allows and no promotion rule of the policy names
    "trtllm": {
        "victim_order": "latest_admission_first",
        "victim_exclusions": ("scheduled_this_pass", "about_to_finish", "ahead_of_decoding_requester", *_ONCE),
        "suspend_rule": "always",
        "admission_rules": ("no_readmission_of_victims",),
        "work_conservation": False,
    },
}


def preset(name: str, spec: Spec | None = None) -> Policy:
    """The policy named `name` (one of `PRESETS`) in the terms of `spec` (default: the packaged spec)."""
    if name not in PRESETS:
        raise ValueError(f"no policy preset {name!r}; use one of {', '.join(PRESETS)} or build a kvstate.spec.Policy")
    spec = spec if spec is not None else default_spec()
    changes = dict(PRESETS[name])
    without = {spec.role(role) for role in changes.pop("admission_without", ())}
    sources = {t.event: t.source for t in spec.transitions}
    if without:
        changes["admission_classes"] = tuple(e for e in spec.policy.admission_classes if sources[e] not in without)
    return replace(spec.policy, **changes)


def with_policy(spec: Spec, policy: Policy) -> Spec:
    """`spec` with `policy` in place of its `[policy]`; a `ValueError` names every entry it gives no meaning."""
    declared = replace(spec, policy=policy)
    problems = policy_problems(declared)
    if problems:
        raise ValueError(
            "the declared policy names rules or events that have no meaning: "
            + "; ".join(problems).replace("[policy]", "policy")
        )
    return declared


@dataclass(frozen=True, slots=True)
class Listed:
    """A request in one list of a pass's output, with the spec state it is in right after the pass."""

    request_id: Hashable
    state: str


@dataclass(frozen=True)
class PassOutput:
    """What `check_pass` reads of a third-party pass's output: the spec's output lists (`kvstate.roles.LIST_NAMES`)
    as `Listed` requests, and the tokens each scheduled request computes."""

    context: tuple[Listed, ...] = ()
    generation: tuple[Listed, ...] = ()
    replay: tuple[Listed, ...] = ()
    resumed: tuple[Listed, ...] = ()
    suspended: tuple[Listed, ...] = ()
    recompute_paused: tuple[Listed, ...] = ()
    chunk_tokens: Mapping[Hashable, int] = field(default_factory=dict)

    @property
    def scheduled(self) -> list[Listed]:
        """Requests that compute in the pass, as `SchedulerOutput.scheduled` orders them."""
        return list(chain(self.context, self.replay, self.generation))


@dataclass(frozen=True)
class ObservedPass:
    """One scheduling pass of an adapter's engine: the snapshot just before it, its decisions, its output."""

    before: PassSnapshot
    record: PassRecord
    output: Any  # a PassOutput, or a kvstate.output.SchedulerOutput
