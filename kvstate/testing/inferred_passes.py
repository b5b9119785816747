"""The scheduling pass of one step, inferred from the state changes an adapter without `take_passes()` shows.

A black-box step shows which requests became victims (their path of spec edges starts with an event that feeds the
`suspended` or `recompute_paused` list from a victim state), which were admitted (the path starts with an event of
the policy's admission classes) and which kept computing; it does not show the requester of each victim, the order of
the victims, nor the order in which the pass served its requests. `InferredStep` builds every reading of the step
those unknowns allow, each an `ObservedPass`, and holds the pass to the policy's victim and admission rules
(`kvstate.policy.check_observable`, the model checker's own): the step breaks the policy only when every reading
breaks it. Only policies whose victim exclusions the observation decides are checked (`OBSERVABLE_EXCLUSIONS`);
prefilling, preemption caps, chunks in flight and waits are not observed. One step is taken to run one pass.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import permutations, product

from kvstate.declared import Listed, ObservedPass, PassOutput
from kvstate.errors import InvariantViolation
from kvstate.policy import PassRecord, PassSnapshot, RequestSnapshot, Victim, admission_candidates, check_observable
from kvstate.roles import PENDING_RESET
from kvstate.spec import Spec, Transition
from kvstate.testing.observed_edges import ObservedRequest, admitted_path
from kvstate.testing.spec_model import replay_states

__all__ = [
    "MAX_READINGS",
    "OBSERVABLE_EXCLUSIONS",
    "AdmissionBook",
    "InferredStep",
    "InferredViolation",
    "Observation",
    "infer_step",
    "observable_policy",
]

# victim exclusions whose reading needs only what a black-box step shows (the requester and the serve order are
# enumerated; about_to_finish is read from the output and the reference)
OBSERVABLE_EXCLUSIONS = frozenset(
    {"the_requester", "scheduled_this_pass", "victim_this_pass", "about_to_finish", "ahead_of_requester"}
)
MAX_READINGS = 4096  # a step with more readings than this is not checked (several victims among many requests)


def observable_policy(spec: Spec) -> bool:
    """`spec`'s policy can be checked from state changes alone: every victim exclusion it declares is observable."""
    return set(spec.policy.victim_exclusions) <= OBSERVABLE_EXCLUSIONS


@dataclass
class AdmissionBook:
    """The admission number and latest preemption the machine has seen each request take, counted as the spec's
    policy counts them: an admission takes the next number unless its event keeps the request's earlier one
    (`readmissions_keeping_admission`); requests admitted in one step are numbered in the policy's admission order."""

    admission: dict[Hashable, int] = field(default_factory=dict)
    last_preemption: dict[Hashable, int] = field(default_factory=dict)
    counter: int = 0
    preemptions: int = 0

    def admit(self, spec: Spec, admitted: Sequence[tuple[Hashable, str]]) -> None:
        """Number `admitted` ((request, event) pairs, in admission order)."""
        for rid, event in admitted:
            if event in spec.policy.readmissions_keeping_admission and rid in self.admission:
                continue
            self.counter += 1
            self.admission[rid] = self.counter

    def preempt(self, victims: Sequence[Hashable]) -> None:
        for rid in victims:
            self.preemptions += 1
            self.last_preemption[rid] = self.preemptions


@dataclass(frozen=True)
class RequestChange:
    """One request across a step: its state and output length before, its state after, the path it took."""

    request_id: Hashable
    before: str
    after: str
    outputs_before: int
    path: tuple[Transition, ...]
    about_to_finish: bool
    arrival: int
    prompt_tokens: int


class InferredStep:
    """Every reading of one black-box step as a scheduling pass, and the policy check of them all."""

    def __init__(
        self, spec: Spec, changes: Sequence[RequestChange], book: AdmissionBook, has_host: bool, room_coming: bool
    ) -> None:
        self.spec, self.changes, self.book, self.has_host = spec, changes, book, has_host
        self.room_coming = room_coming
        events = spec.event_by_name
        self.victims = [
            c for c in changes if c.path and c.before in spec.victim_states and events[c.path[0].event].feeds in
            ("suspended", "recompute_paused") and events[c.path[0].event].origin == "scheduler"
        ]  # fmt: skip
        classes = set(spec.policy.admission_classes)
        self.admitted = [c for c in changes if c.path and c.path[0].event in classes]
        victim_ids = {c.request_id for c in self.victims}
        self.computing = [c for c in changes if c.before in spec.computing_states]
        # every computing request the pass did not preempt counts as served (a finished one was; one that waited or
        # computed a chunk that samples nothing cannot be told apart, and counting it served excuses more)
        self.kept = [c for c in self.computing if c.request_id not in victim_ids]

    def snapshot(self, serve_order: tuple[Hashable, ...]) -> PassSnapshot:
        requests = tuple(
            RequestSnapshot(
                request_id=c.request_id,
                state=c.before,
                arrival=c.arrival,
                admission=self.book.admission.get(c.request_id, -1),
                about_to_finish=c.about_to_finish,
                num_output_tokens=c.outputs_before,
                prompt_tokens=c.prompt_tokens,
                last_preemption=self.book.last_preemption.get(c.request_id, -1),
            )
            for c in self.changes
            if c.before not in self.spec.terminal_states
        )
        return PassSnapshot(requests, has_host_tier=self.has_host, serve_order=serve_order)

    def output(self) -> PassOutput:
        events = self.spec.event_by_name
        lists: dict[str, list[Listed]] = {}
        for c in [*self.victims, *self.admitted]:
            lists.setdefault(events[c.path[0].event].feeds or "", []).append(Listed(c.request_id, c.path[0].dest))
        generation = tuple(Listed(c.request_id, c.after) for c in self.kept)
        return PassOutput(
            context=tuple(lists.get("context", ())),
            replay=tuple(lists.get("replay", ())),
            resumed=tuple(lists.get("resumed", ())),
            suspended=tuple(lists.get("suspended", ())),
            recompute_paused=tuple(lists.get("recompute_paused", ())),
            generation=generation,
            chunk_tokens=dict.fromkeys([c.request_id for c in self.kept], 1),
        )

    def serve_orders(self) -> list[tuple[Hashable, ...]]:
        """The orders the pass may have served its computing requests in: by arrival, or by admission."""
        ids = list(self.computing)
        by_arrival = tuple(c.request_id for c in sorted(ids, key=lambda c: c.arrival))
        by_admission = tuple(c.request_id for c in sorted(ids, key=lambda c: self.book.admission.get(c.request_id, -1)))
        return list(dict.fromkeys((by_arrival, by_admission)))

    def readings(self) -> Iterator[ObservedPass]:
        """Every pass the step may have been: a serve order, an order of its victims, a requester for each."""
        output = self.output()
        requesters = [c.request_id for c in self.computing]
        for order in self.serve_orders():
            before = self.snapshot(order)
            for victims in permutations(self.victims):
                for chosen_by in product(requesters, repeat=len(victims)):
                    if not self.in_serve_order(order, chosen_by, victims):
                        continue
                    record = PassRecord(
                        [Victim(r, v.request_id, v.path[0].event) for r, v in zip(chosen_by, victims, strict=True)]
                    )
                    yield ObservedPass(before, record, output)

    def in_serve_order(
        self, order: tuple[Hashable, ...], chosen_by: Sequence[Hashable], victims: Sequence[RequestChange]
    ) -> bool:
        """The pass serves its requesters in `order`, so they choose in that order; and, with no room on its way (no
        fenced block, no request awaiting consensus), no request waits (a `Wait` is for room on its way), so a
        request whose turn came before its requester's was served or preempted itself then, and is no victim of a
        later requester."""
        place = {rid: i for i, rid in enumerate(order)}
        turns = [place[r] for r in chosen_by]
        if turns != sorted(turns):
            return False
        return self.room_coming or all(
            v.request_id == r or place[v.request_id] > place[r] for r, v in zip(chosen_by, victims, strict=True)
        )

    def reading_count(self) -> int:
        count = len(self.serve_orders()) * len(self.computing) ** len(self.victims)
        for n in range(2, len(self.victims) + 1):
            count *= n
        return count

    def check(self) -> None:
        """Raise the `InvariantViolation` of the first reading when every reading of the step breaks the policy."""
        if not (self.victims or self.admitted) or self.reading_count() > MAX_READINGS:
            return
        first: tuple[InvariantViolation, ObservedPass] | None = None
        readings = 0
        for reading in self.readings():
            readings += 1
            try:
                check_observable(self.spec, reading.before, reading.record, reading.output)
            except InvariantViolation as err:
                first = first or (err, reading)
                continue
            return
        if first is not None:
            raise InferredViolation(first[0], first[1], readings)

    def admit_in_order(self) -> list[tuple[Hashable, str]]:
        """The step's admissions in the policy's admission order, with the event each took."""
        taken = {c.request_id: c.path[0].event for c in self.admitted}
        order = admission_candidates(self.spec, self.snapshot(()))
        return [(rid, taken[rid]) for rid in order if rid in taken]


class InferredViolation(Exception):
    """Every reading of a black-box step breaks the policy: `error` is the first reading's, `reading` that pass."""

    def __init__(self, error: InvariantViolation, reading: ObservedPass, readings: int) -> None:
        super().__init__(str(error))
        self.error, self.reading, self.readings = error, reading, readings


@dataclass(frozen=True)
class Observation:
    """Every request's state and output at one moment, as the machine observed them."""

    states: Mapping[Hashable, str]
    outputs: Mapping[Hashable, Sequence[int]]
    gpu_fenced: int = 0


def infer_step(
    spec: Spec,
    before: Observation,
    after: Observation,
    requests: Mapping[Hashable, tuple[int, Sequence[int]]],
    book: AdmissionBook,
    has_host: bool,
) -> None:
    """Hold the pass inferred from one step (`before` and `after` it) to `spec`'s policy, then count its admissions
    and victims in `book`. `requests`: each request's prompt length and unpressured reference output."""
    changes: list[RequestChange] = []
    replaying = replay_states(spec)
    for rid, old in before.states.items():
        new, done = after.states[rid], len(before.outputs[rid])
        prompt_tokens, reference = requests[rid]
        sampled = len(after.outputs[rid]) - done
        final = len(after.outputs[rid]) >= len(reference)
        observed = ObservedRequest(rid, sampled, final, generated_before=done, replaying_before=old in replaying)
        path = admitted_path(spec, old, new, observed) if old != new else []
        facts = {"about_to_finish": done + 1 >= len(reference), "arrival": len(changes), "prompt_tokens": prompt_tokens}
        changes.append(change_of(rid, old, new, done, path or (), facts))
    pending = spec.role(PENDING_RESET)
    room_coming = before.gpu_fenced > 0 or any(s == pending for s in before.states.values())
    step = InferredStep(spec, changes, book, has_host, room_coming)
    step.check()
    book.admit(spec, step.admit_in_order())
    book.preempt([c.request_id for c in step.victims])


def change_of(
    rid: Hashable,
    before: str,
    after: str,
    outputs_before: int,
    path: Sequence[Transition],
    facts: Mapping[str, int | bool],
) -> RequestChange:
    """A `RequestChange` from what the machine observed of request `rid` (`facts`: about_to_finish, arrival,
    prompt_tokens)."""
    return RequestChange(
        rid,
        before,
        after,
        outputs_before,
        tuple(path),
        bool(facts["about_to_finish"]),
        int(facts["arrival"]),
        int(facts["prompt_tokens"]),
    )
