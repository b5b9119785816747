"""The scheduling policy as checks of one real scheduling pass; with the rule names (`kvstate.policy_rules`) and
the pass's snapshot and record (`kvstate.pass_record`), which it re-exports.

`spec/lifecycle.toml` states the policy as rule names (`[policy]`); `policy_problems` holds them against the names
given meaning in `kvstate.policy_rules`, and `check_pass` checks one pass of a scheduler against them: from a
`PassSnapshot` taken just before `schedule()` and the pass's `PassRecord` (victims, promotions and waits in decision
order), it computes what the policy allows and raises `InvariantViolation` with the invariant id of the first rule
the pass broke. It does not trust the scheduler's bookkeeping: eligibility, admission order and the room on its way
are recomputed from the snapshot and the output, so a scheduler that picks the wrong victim, promotes the wrong
request, skips a request that fits or admits out of order fails here (the model checker's step simulation runs it on
every pass).

The rules (SPEC.md section 7) apply to the `max_utilization` capacity policy.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, NoReturn

from kvstate.errors import InvariantViolation
from kvstate.pass_record import (
    UNLIMITED,
    Offload,
    PassRecord,
    PassSnapshot,
    Promotion,
    RequestSnapshot,
    Victim,
    Wait,
    snapshot,
)
from kvstate.policy_rules import (
    AHEAD_OF_DECODING_REQUESTER,
    AHEAD_OF_REQUESTER,
    CANNOT_BE_MOVED,
    CAP_SPARES_HEAD,
    CHUNK_IN_FLIGHT,
    EAGER,
    HOLD_NEW_AFTER_PREEMPTION_OR_WAIT,
    HOLD_READMISSIONS_AFTER_PREEMPTION,
    HOST_TAKES_EVERY_HELD_BLOCK,
    LATEST_ADMISSION_FIRST,
    NO_READMISSION_OF_VICTIMS,
    ON_DEMAND,
    PREEMPTION_CAP_REACHED,
    READMIT_LATEST_VICTIM_FIRST,
    STOP_AT_FIRST_MISFIT,
    SUSPEND_ALWAYS,
    VICTIM_EXCLUSIONS,
    VOCABULARY,
    WAIT_FOR_CHUNK_IN_FLIGHT,
    policy_problems,
    preemption_capped,
)
from kvstate.pool import TO_HOST
from kvstate.roles import DROPPED, OFFLOADED, PENDING_RESET, QUEUED

if TYPE_CHECKING:
    from kvstate.spec import Spec

__all__ = [
    "CANNOT_BE_MOVED",
    "CAP_SPARES_HEAD",
    "CHUNK_IN_FLIGHT",
    "EAGER",
    "HOLD_NEW_AFTER_PREEMPTION_OR_WAIT",
    "HOLD_READMISSIONS_AFTER_PREEMPTION",
    "HOST_TAKES_EVERY_HELD_BLOCK",
    "LATEST_ADMISSION_FIRST",
    "NO_READMISSION_OF_VICTIMS",
    "ON_DEMAND",
    "PREEMPTION_CAP_REACHED",
    "READMIT_LATEST_VICTIM_FIRST",
    "STOP_AT_FIRST_MISFIT",
    "SUSPEND_ALWAYS",
    "UNLIMITED",
    "VICTIM_EXCLUSIONS",
    "VOCABULARY",
    "WAIT_FOR_CHUNK_IN_FLIGHT",
    "Offload",
    "PassRecord",
    "PassSnapshot",
    "Promotion",
    "RequestSnapshot",
    "Victim",
    "Wait",
    "admission_candidates",
    "check_observable",
    "check_pass",
    "policy_problems",
    "preemption_capped",
    "snapshot",
]


def check_pass(spec: Spec, before: PassSnapshot, record: PassRecord, output) -> None:
    """Raise `InvariantViolation` unless the pass that produced `output` (a `SchedulerOutput`) follows `spec`'s
    policy."""
    _PassCheck(spec, before, record, output).run()


def check_observable(spec: Spec, before: PassSnapshot, record: PassRecord, output) -> None:
    """`check_pass` restricted to the rules a pass inferred from state changes alone can be held to: the victim
    rules (VICTIM-*) and the admission rules (ADMIT-*). Room, offloads and work conservation read block counts and
    waits that such a pass does not know."""
    check = _PassCheck(spec, before, record, output)
    check.check_victims()
    check.check_admissions()


def admission_candidates(spec: Spec, before: PassSnapshot) -> list[Hashable]:
    """The requests of `before` that `spec`'s policy may admit, in the order it admits them (ADMIT-ORDER)."""
    return _PassCheck(spec, before, PassRecord(), _NO_OUTPUT).candidates()


class _NoOutput:
    scheduled: tuple = ()


_NO_OUTPUT = _NoOutput()


# how each victim order ranks the eligible requests: the victim is the greatest
_VICTIM_RANK: Mapping[str, Callable[[RequestSnapshot], tuple[int, ...]]] = {
    LATEST_ADMISSION_FIRST: lambda r: (r.admission,),
    "fewest_outputs_first": lambda r: (-r.num_output_tokens, r.prompt_tokens, r.admission),
}


def _ranked(r: RequestSnapshot) -> str:
    return f"admission {r.admission}, {r.num_output_tokens} generated, prompt {r.prompt_tokens}"


class _PassCheck:
    def __init__(self, spec: Spec, before: PassSnapshot, record: PassRecord, output) -> None:
        self.spec, self.policy, self.before, self.record, self.out = spec, spec.policy, before, record, output
        self.by_id = {r.request_id: r for r in before.requests}
        self.scheduled = [r.request_id for r in output.scheduled]
        self.victims = [d.victim for d in record.decisions if isinstance(d, Victim)]
        # requesters in the order the pass serves them (SPEC.md 7.2): decode steps, then chunks, each by arrival
        computing = [r for r in before.requests if r.state in spec.computing_states and not (r.in_flight or r.copying)]
        if before.serve_order is None:
            self.order = [r.request_id for r in sorted(computing, key=lambda r: (r.prefilling, r.arrival))]
        else:
            serving = {r.request_id for r in computing}
            self.order = [rid for rid in before.serve_order if rid in serving]

    def run(self) -> None:
        self.check_victims()
        self.check_promotions()
        self.check_held_blocks()
        self.check_admissions()
        if self.policy.work_conservation:
            self.check_work_conservation()

    def fail(self, invariant: str, message: str) -> NoReturn:
        raise InvariantViolation(invariant, message)

    # ---- victims
    def served_before(self, requester: Hashable) -> set[Hashable]:
        """Requests scheduled by the pass before it served `requester`."""
        if requester not in self.order:
            return set(self.scheduled)
        earlier = set(self.order[: self.order.index(requester)])
        return {rid for rid in self.scheduled if rid in earlier}

    def eligible(
        self,
        requester: Hashable,
        chosen: set[Hashable],
        waiting: set[Hashable],
        host_room: int,
        ignoring: frozenset[str] = frozenset(),
    ) -> list[RequestSnapshot]:
        """The eligible victims at a choice of `requester` (the policy's exclusions but those in `ignoring`), with
        `host_room` host blocks free beyond the held ones (`host_room_before`)."""
        excluded = set(self.policy.victim_exclusions) - ignoring
        scheduled = self.served_before(requester) if "scheduled_this_pass" in excluded else set()
        if "waiting_this_pass" in excluded:
            scheduled |= waiting
        if AHEAD_OF_REQUESTER in excluded or (
            AHEAD_OF_DECODING_REQUESTER in excluded and not self.prefilling(requester)
        ):  # in the engine's whole order: a suspended requester is in it too
            whole = self.before.scan_order if self.before.scan_order is not None else self.before.serve_order
            order = list(whole) if whole is not None else self.order
            if requester in order:
                scheduled |= set(order[: order.index(requester)])
        return [
            r
            for r in self.before.requests
            if r.state in self.spec.victim_states
            and not ("the_requester" in excluded and r.request_id == requester)
            and r.request_id not in scheduled
            and not ("victim_this_pass" in excluded and r.request_id in chosen)
            and not ("about_to_finish" in excluded and r.about_to_finish)
            and not (r.capped and self.cap_protects_from(requester, excluded))
            and not (CHUNK_IN_FLIGHT in excluded and r.in_flight and r.prefilling)
            and not (CANNOT_BE_MOVED in excluded and not self.movable(r, host_room))
        ]

    def movable(self, r: RequestSnapshot, host_room: int) -> bool:
        """The pass can move `r` off the GPU (`cannot_be_moved`): recompute-pause is enabled, or `suspend` fires on
        it and the suspend rule lets it be suspended with `host_room` host blocks free beyond the held ones."""
        if self.before.recompute_pause:
            return True
        if not r.suspend_fires:
            return False
        if self.policy.suspend_rule != HOST_TAKES_EVERY_HELD_BLOCK:
            return True
        return self.before.has_host_tier and host_room >= r.gpu_blocks

    def host_room_before(self) -> list[int]:
        """Per decision of the pass, the host tier's free blocks beyond those suspended requests hold on the GPU
        just before it, replayed from the snapshot (SUSPEND-ROOM's measure): a suspension adds its victim's GPU
        blocks to the held ones, a promotion frees its request's host and held blocks, an offload moves held
        blocks to the host one for one."""
        room = self.before.host_free - sum(r.gpu_blocks for r in self.before.requests if r.held_rank >= 0)
        found = []
        for d in self.record.decisions:
            found.append(room)
            if isinstance(d, Victim) and d.event == "suspend":
                room -= self.by_id[d.victim].gpu_blocks
            elif isinstance(d, Promotion):
                room += self.by_id[d.promoted].host_blocks + self.by_id[d.promoted].gpu_blocks
        return found

    def prefilling(self, requester: Hashable) -> bool:
        """`requester` asks for room for a prompt or replay chunk, not for a decode step."""
        snapshot = self.by_id.get(requester)
        return snapshot is not None and snapshot.prefilling

    @property
    def head(self) -> Hashable | None:
        """The request the pass serves first (SPEC.md 7.2), if any."""
        return self.order[0] if self.order else None

    def cap_protects_from(self, requester: Hashable, excluded: set[str] | frozenset[str]) -> bool:
        """A request past the preemption cap is no eligible victim of `requester` under the exclusions `excluded`:
        `preemption_cap_reached` protects it from everyone, `preemption_cap_reached_except_for_head` from everyone
        but the head of the pass (VICTIM-CAP)."""
        if PREEMPTION_CAP_REACHED in excluded:
            return True
        return CAP_SPARES_HEAD in excluded and requester != self.head

    def check_victims(self) -> None:
        chosen: set[Hashable] = set()
        waiting: set[Hashable] = set()
        for d, host_room in zip(self.record.decisions, self.host_room_before(), strict=True):
            if isinstance(d, Wait):
                waiting.add(d.requester)
            if not isinstance(d, Victim):
                continue
            if d.victim in chosen:
                self.fail("VICTIM-ONCE", f"request {d.victim!r} was chosen as a victim twice in one pass")
            eligible = self.eligible(d.requester, chosen, waiting, host_room)
            self.check_cap(d, eligible)
            if d.victim == d.requester:
                others = [r.request_id for r in eligible if r.request_id != d.requester]
                if others:
                    self.fail(
                        "VICTIM-TAIL",
                        f"requester {d.requester!r} preempted itself although {others!r} were eligible victims",
                    )
                self.check_self_preemption(d.requester, chosen, waiting, host_room)
                chosen.add(d.victim)
                continue
            chosen.add(d.victim)
            victim = self.by_id.get(d.victim)
            if victim is not None and victim.about_to_finish and "about_to_finish" in self.policy.victim_exclusions:
                self.fail(
                    "VICTIM-NOT-FINAL",
                    f"request {d.victim!r} was chosen as a victim although its next step produces its final token",
                )
            if victim is None or victim not in eligible:
                self.fail(
                    "VICTIM-TAIL",
                    f"request {d.victim!r} was chosen as {d.requester!r}'s victim but is not an "
                    f"eligible victim ({self.why_not_eligible(d, victim, chosen - {d.victim}, waiting, host_room)})",
                )
            order = self.policy.victim_order
            tail = max(eligible, key=_VICTIM_RANK[order])
            if tail.request_id == d.victim:
                continue
            if order == LATEST_ADMISSION_FIRST:
                self.fail(
                    "VICTIM-TAIL",
                    f"request {d.victim!r} (admission {victim.admission}) was chosen as "
                    f"{d.requester!r}'s victim, but {tail.request_id!r} (admission {tail.admission}) was admitted "
                    "later and is eligible: victims are taken tail-first",
                )
            self.fail(
                "VICTIM-TAIL",
                f"request {d.victim!r} ({_ranked(victim)}) was chosen as {d.requester!r}'s victim, but "
                f"{tail.request_id!r} ({_ranked(tail)}) is eligible and comes first in victim_order {order!r}: "
                f"{VOCABULARY['victim_order'][order]}",
            )

    def why_not_eligible(
        self, d: Victim, victim: RequestSnapshot | None, chosen: set[Hashable], waiting: set[Hashable], host_room: int
    ) -> str:
        """The one reason `victim` is no eligible victim of `d.requester`: each exclusion that alone excludes it."""
        if victim is None:
            return "it is not an active request just before the pass"
        if victim.state not in self.spec.victim_states:
            return f"it is {victim.state!r}, and only {sorted(self.spec.victim_states)} requests are victims"
        declared = set(self.policy.victim_exclusions)
        excluding = [
            name
            for name in self.policy.victim_exclusions
            if victim not in self.eligible(d.requester, chosen, waiting, host_room, frozenset(declared - {name}))
        ]
        if not excluding:
            return "the declared exclusions together exclude it"
        return "; ".join(f"{name} excludes it: {VOCABULARY['victim_exclusions'][name]}" for name in excluding)

    def check_cap(self, d: Victim, eligible: list[RequestSnapshot]) -> None:
        """VICTIM-CAP: a request past the preemption cap is taken by no requester but the head of the pass, and the
        head neither preempts itself nor skips such a request while it is the eligible victim its order names."""
        if CAP_SPARES_HEAD not in self.policy.victim_exclusions:
            return
        victim = self.by_id.get(d.victim)
        if d.requester != self.head:
            if d.victim != d.requester and victim is not None and victim.capped:
                self.fail(
                    "VICTIM-CAP",
                    f"request {d.victim!r}, preempted as often as the preemption cap allows, was taken by "
                    f"{d.requester!r}, which is not the head of the pass ({self.head!r}): only the head may take it",
                )
            return
        capped = [r for r in eligible if r.capped and r.request_id != d.requester]
        if not capped:
            return
        tail = max(eligible, key=_VICTIM_RANK[self.policy.victim_order])
        if d.victim == d.requester or (tail.capped and tail.request_id != d.victim):
            given = "preempted itself" if d.victim == d.requester else f"took {d.victim!r}"
            self.fail(
                "VICTIM-CAP",
                f"the head of the pass {d.requester!r} {given} although {[r.request_id for r in capped]!r}, past "
                "the preemption cap, could give way: the cap never protects a request from the head of the pass "
                "(else requests past the cap preempt themselves in turn, forever)",
            )

    def check_self_preemption(
        self, requester: Hashable, chosen: set[Hashable], waiting: set[Hashable], host_room: int
    ) -> None:
        """VICTIM-SELF: under `wait_for_chunk_in_flight`, a requester preempts itself only when no request that
        `chunk_in_flight` alone excludes could give up its blocks once its chunk lands."""
        if self.policy.no_eligible_victim != WAIT_FOR_CHUNK_IN_FLIGHT:
            return
        eligible = self.eligible(requester, chosen, waiting, host_room, ignoring=frozenset({CHUNK_IN_FLIGHT}))
        landing = [r for r in eligible if r.request_id != requester]
        if landing and all(r.capped for r in landing) and self.head == requester:
            self.fail(
                "VICTIM-CAP",
                f"the head of the pass {requester!r} preempted itself although {[r.request_id for r in landing]!r}, "
                "past the preemption cap and excluded only because a chunk of theirs is in flight, could give up "
                "blocks once it lands: the cap never protects a request from the head of the pass, which waits for "
                "that chunk (wait_for_chunk_in_flight)",
            )
        if landing:
            self.fail(
                "VICTIM-SELF",
                f"requester {requester!r} preempted itself although {[r.request_id for r in landing]!r}, excluded "
                "only because a prompt or replay chunk of theirs is in flight, could give up blocks once it lands: "
                "it must wait for that chunk (wait_for_chunk_in_flight), or two requests may pause each other "
                "forever",
            )

    # ---- promotions
    def check_promotions(self) -> None:
        suspended: list[Hashable] = []  # suspended in this pass and not yet promoted, in suspension order
        groups: dict[Hashable, list[Hashable]] = {}
        for d in self.record.decisions:
            if isinstance(d, Victim) and d.event == "suspend":
                suspended.append(d.victim)
            elif isinstance(d, Promotion):
                if not self.before.has_host_tier:
                    self.fail("PROMOTE-GATE", f"request {d.promoted!r} was promoted without a host tier")
                if self.by_id[d.promoted].in_flight:
                    self.fail(
                        "PROMOTE-GATE",
                        f"request {d.promoted!r} was promoted while its step of an earlier pass was in the pipeline: "
                        "the promotion releases its blocks at once, and that step's later stages still use them",
                    )
                if not suspended or suspended[-1] != d.promoted:
                    self.fail(
                        "PROMOTE-GATE",
                        f"request {d.promoted!r} was promoted, but the most recent request "
                        f"suspended earlier in this pass and not yet promoted is "
                        f"{suspended[-1] if suspended else 'none'!r}: only requests suspended earlier in the "
                        "same pass are promoted, most recent first",
                    )
                suspended.pop()
                groups.setdefault(d.victim, []).append(d.promoted)
        for victim, promoted in groups.items():
            worth = sum(self.by_id[p].kv_tokens for p in promoted)
            if worth >= self.by_id[victim].kv_tokens:
                self.fail(
                    "PROMOTE-GATE",
                    f"requests {promoted!r} (KV worth {worth} tokens) were promoted to make host "
                    f"room for {victim!r}, whose KV is worth only {self.by_id[victim].kv_tokens}: promotion must "
                    "throw away less KV than it saves",
                )
        suspended_victims = {d.victim for d in self.record.decisions if isinstance(d, Victim) and d.event == "suspend"}
        for victim, promoted in groups.items():
            if victim not in suspended_victims:
                self.fail(
                    "PROMOTE-GATE",
                    f"requests {promoted!r} were promoted to make host room for {victim!r}, which was then not "
                    "suspended: a promotion is only for a victim it lets suspend (SPEC.md 7.3), never wasted",
                )

    # ---- suspensions and offloads
    def check_held_blocks(self) -> None:
        """SUSPEND-ROOM and OFFLOAD-DEMAND, replaying the pass's decisions on the host tier's free blocks and each
        request's held GPU blocks from the snapshot: a suspension under `host_takes_every_held_block` finds room
        for every held block; an offload takes the least recently held request it may take, for a requester of the
        pass, no more blocks than that requester's allocation takes; under `eager`, each suspension is followed by
        the offload of its victim, unless the victim's step is still in flight."""
        held = {r.request_id: r.gpu_blocks for r in self.before.requests if r.held_rank >= 0}
        order = sorted(held, key=lambda rid: self.by_id[rid].held_rank)
        host_free, offloaded_for, moved = self.before.host_free, dict[Hashable, int](), set[Hashable]()
        decisions = self.record.decisions
        for index, d in enumerate(decisions):
            if isinstance(d, Victim) and d.event == "suspend":
                self.check_suspension(d, host_free, sum(held.values()))
                gpu = self.by_id[d.victim].gpu_blocks
                if gpu:
                    held[d.victim] = gpu
                    order.append(d.victim)
                if self.policy.offload == EAGER:
                    following = decisions[index + 1] if index + 1 < len(decisions) else None
                    in_flight = self.by_id[d.victim].in_flight  # its step's later stages still write its blocks
                    offloaded = isinstance(following, Offload) and following.request == d.victim
                    if gpu and host_free and not in_flight and not offloaded:
                        self.fail("OFFLOAD-DEMAND", f"victim {d.victim!r} was suspended but not offloaded at once")
            elif isinstance(d, Promotion):
                host_free += self.by_id[d.promoted].host_blocks + self.offloaded_in_pass(d.promoted)
                held.pop(d.promoted, None)
            elif isinstance(d, Offload):
                self.check_offload(d, order, held, offloaded_for, moved)
                moved.add(d.request)
                held[d.request] -= d.blocks
                host_free -= d.blocks
                if not held[d.request]:
                    del held[d.request]

    def offloaded_in_pass(self, request: Hashable) -> int:
        return sum(d.blocks for d in self.record.decisions if isinstance(d, Offload) and d.request == request)

    def check_suspension(self, d: Victim, host_free: int, held: int) -> None:
        if self.policy.suspend_rule != HOST_TAKES_EVERY_HELD_BLOCK:
            return
        gpu = self.by_id[d.victim].gpu_blocks
        if not self.before.has_host_tier or host_free - held < gpu:
            self.fail(
                "SUSPEND-ROOM",
                f"request {d.victim!r} was suspended holding {gpu} GPU blocks while the host tier had {host_free} "
                f"free for {held} blocks already held{'' if self.before.has_host_tier else ' (no host tier)'}: a "
                "suspension that the host tier cannot take frees nothing; recompute-pause the victim instead",
            )

    def check_offload(
        self,
        d: Offload,
        order: list[Hashable],
        held: dict[Hashable, int],
        offloaded_for: dict[Hashable, int],
        moved: set[Hashable],
    ) -> None:
        if d.request not in held or d.blocks < 1 or d.blocks > held[d.request]:
            self.fail("OFFLOAD-DEMAND", f"{d.blocks} blocks of {d.request!r} were offloaded, which it does not hold")
        if self.policy.offload == EAGER:
            return
        # skipped: the requester, requests with a step or a copy in flight (one planned by an offload of this pass)
        skippable = {r.request_id for r in self.before.requests if r.in_flight or r.copy_in_flight} | {d.requester}
        skippable |= moved
        if d.requester not in self.order:  # an admission's: the resumes of the pass came before it
            skippable |= {r.request_id for r in self.out.resumed}
        first = next((rid for rid in order if rid in held and rid not in skippable), None)
        if first != d.request:
            self.fail(
                "OFFLOAD-DEMAND",
                f"{d.request!r}'s held blocks were offloaded before {first!r}'s, which were held longer: held blocks "
                "move down least recently held first",
            )
        requester = self.by_id.get(d.requester)
        offloaded_for[d.requester] = offloaded_for.get(d.requester, 0) + d.blocks
        takes = None if requester is None else requester.next_step_blocks
        if requester is not None and requester.state == self.spec.role(OFFLOADED):
            # a resume copies every host block, those offloaded in this pass included; an engine that grows the
            # request in the same allocation reports the growth too (next_step_blocks)
            takes = max(requester.host_blocks, requester.next_step_blocks) + self.offloaded_in_pass(d.requester)
        if takes is None or offloaded_for[d.requester] > takes:
            need = "no allocation" if takes is None else f"{takes} blocks"
            self.fail(
                "OFFLOAD-DEMAND",
                f"{offloaded_for[d.requester]} held blocks were offloaded for {d.requester!r}, whose allocation "
                f"takes {need}: an offload moves only what an allocation needs",
            )

    # ---- admissions
    def admitted(self) -> list[Hashable]:
        """Requests readmitted or admitted by the pass, in candidate order."""
        role = self.spec.role
        came_from = {"resumed": role(OFFLOADED), "replay": role(DROPPED), "context": role(QUEUED)}
        found = set()
        for name, source in came_from.items():
            found |= {
                r.request_id
                for r in getattr(self.out, name)
                if r.request_id in self.by_id and self.by_id[r.request_id].state == source
            }
        return [rid for rid in self.candidates() if rid in found]

    def candidates(self) -> list[Hashable]:
        """Admission candidates in the policy's order: classes in order, each in arrival order."""
        sources = {t.event: t.source for t in self.spec.transitions}
        latest_victim_first = READMIT_LATEST_VICTIM_FIRST in self.policy.admission_rules
        queued = self.spec.role(QUEUED)
        out = []
        for event in self.policy.admission_classes:
            pool = [r for r in self.before.requests if r.state == sources[event]]
            if latest_victim_first and sources[event] != queued:
                pool.sort(key=lambda r: (-r.last_preemption, r.arrival))
            else:
                pool.sort(key=lambda r: r.arrival)
            out += [r.request_id for r in pool]
        return out

    def check_admissions(self) -> None:
        rules = set(self.policy.admission_rules)
        admitted = self.admitted()
        victims = set(self.victims)
        if NO_READMISSION_OF_VICTIMS in rules:
            for rid in admitted:
                if rid in victims:
                    self.fail("ADMIT-ORDER", f"request {rid!r} was readmitted in the pass that chose it as a victim")
        candidates = [rid for rid in self.candidates() if rid not in victims]
        if STOP_AT_FIRST_MISFIT in rules and admitted != candidates[: len(admitted)]:
            skipped = next(rid for rid in candidates if rid not in admitted)
            later = next(rid for rid in admitted if candidates.index(rid) > candidates.index(skipped))
            self.fail(
                "ADMIT-ORDER",
                f"request {later!r} was admitted although {skipped!r}, ahead of it in the "
                f"policy's order ({' > '.join(self.policy.admission_classes)}, each by arrival), was not: "
                "admission stops at the first request that does not fit",
            )
        if HOLD_READMISSIONS_AFTER_PREEMPTION in rules and self.victims:
            readmitted = [rid for rid in admitted if self.by_id[rid].state != self.spec.role(QUEUED)]
            if readmitted:
                self.fail(
                    "ADMIT-HOLD",
                    f"request(s) {readmitted!r} were readmitted in a pass that chose victims {self.victims!r}: "
                    "the policy readmits nothing in a pass that preempted (hold_readmissions_after_preemption)",
                )
        if HOLD_NEW_AFTER_PREEMPTION_OR_WAIT in rules:
            new = [rid for rid in admitted if self.by_id[rid].state == self.spec.role(QUEUED)]
            held = self.victims or self.left_waiting()
            if new and held:
                why = f"it chose victims {self.victims!r}" if self.victims else f"{self.left_waiting()!r} waited"
                self.fail(
                    "ADMIT-HOLD",
                    f"new request(s) {new!r} were admitted in a pass in which {why}: no new "
                    "request may take the room a preempted or waiting request needs (A1)",
                )

    def left_waiting(self) -> list[Hashable]:
        """Computing requests the pass neither served nor preempted."""
        served = set(self.scheduled) | set(self.victims)
        return [rid for rid in self.order if rid not in served]

    # ---- work conservation
    def room_on_its_way(self) -> int:
        pending = self.spec.role(PENDING_RESET)
        room = self.before.gpu_fenced + sum(r.gpu_blocks for r in self.before.requests if r.state == pending)
        room += sum(p.num_blocks for p in self.out.migrations if p.direction == TO_HOST)  # offloads' GPU sources
        # a promotion frees its request's GPU blocks at once, the sources of its withdrawn offloads included
        room += sum(self.by_id[d.promoted].gpu_blocks for d in self.record.decisions if isinstance(d, Promotion))
        for r in self.out.recompute_paused:
            if r.state == pending and r.request_id in self.by_id and self.by_id[r.request_id].state != pending:
                room += self.by_id[r.request_id].gpu_blocks
        return room

    def check_work_conservation(self) -> None:
        waits = [d for d in self.record.decisions if isinstance(d, Wait)]
        reserved = sum(w.reserved for w in waits)
        room = self.room_on_its_way()
        if reserved > room:
            self.fail(
                "WORK-CONSERVE",
                f"waiting requesters {[w.requester for w in waits]!r} counted on {reserved} "
                f"blocks on their way, but only {room} are (fenced or awaiting consensus): room on its way "
                "must be reserved by one requester, not counted by each",
            )
        waiting = {w.requester for w in waits}
        slots, tokens = self.before.max_batch_size, self.before.max_num_tokens
        chunk = dict(self.out.chunk_tokens)
        for rid in self.order:
            if rid in self.scheduled:
                slots, tokens = slots - 1, tokens - chunk.get(rid, 0)
                continue
            if rid in self.victims or rid in waiting:
                continue
            if slots > 0 and tokens > 0:
                self.fail(
                    "WORK-CONSERVE",
                    f"request {rid!r} was neither scheduled, preempted nor waiting for room on "
                    f"its way although {slots} batch slots and {tokens} tokens were left when its turn came",
                )
