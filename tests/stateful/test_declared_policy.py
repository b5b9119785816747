"""The conformance kit checks a scheduler's victim and admission choices against the policy it declares.

A toy continuous-batching scheduler (below) is correct in every other respect (spec edges, blocks, outputs): with
tail-first victims it passes under the vLLM preset it declares; with head-first victims it fails, naming VICTIM-TAIL.
The same holds for our own scheduler (`KVStateAdapter` reports its passes, checked against the spec's `[policy]`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvstate import load_spec, roles
from kvstate.config import RequestRejected, SchedulerConfig
from kvstate.declared import PRESETS, Listed, ObservedPass, PassOutput, preset, with_policy
from kvstate.errors import InvariantViolation
from kvstate.policy import PassRecord, PassSnapshot, RequestSnapshot, Victim
from kvstate.pool import ceil_div
from kvstate.sim import next_token, reference_output
from kvstate.testing import AdapterContractError, KVStateAdapter, conformance_machine

SPEC = load_spec()
QUEUED, ACTIVE, DROPPED, ENDED = (SPEC.role(r) for r in (roles.QUEUED, roles.ACTIVE, roles.DROPPED, roles.ENDED))
RUNS = settings(max_examples=20, stateful_step_count=20, database=None, derandomize=True, deadline=None)
# What it failed on, unshrunk: fast. Up to 100 examples (a failing run stops at its first failure); tests/conftest.py
# keeps the derandomized search the same in any test order and install.
FAILS = settings(RUNS, max_examples=100, phases=[Phase.explicit, Phase.reuse, Phase.generate])


@dataclass
class ToyRequest:
    prompt: list[int]
    max_new: int
    stops: tuple[int, ...]
    arrival: int
    state: str = QUEUED
    generated: list[int] = field(default_factory=list)
    blocks: int = 0
    preempted_at: int = -1

    @property
    def context(self) -> list[int]:
        return self.prompt + self.generated


class ToyScheduler:
    """Recompute-only continuous batching over `gpu_blocks` blocks: every step, each running request (in admission
    order) computes its whole context and samples one token, taking a victim when no block is free (the tail of the
    running queue, or with `head_first` its head); waiting requests are admitted in queue order, victims first, in a
    pass that preempted nothing. Each pass is kept as an `ObservedPass`."""

    def __init__(self, gpu_blocks: int, block_size: int, head_first: bool) -> None:
        self.gpu_blocks, self.block_size, self.head_first = gpu_blocks, block_size, head_first
        self.requests: dict[int, ToyRequest] = {}
        self.running: list[int] = []
        self.waiting: deque[int] = deque()
        self.passes: list[ObservedPass] = []
        self.preemptions = 0

    @property
    def free(self) -> int:
        return self.gpu_blocks - sum(r.blocks for r in self.requests.values())

    def needs(self, request: ToyRequest) -> int:
        return ceil_div(len(request.context), self.block_size) - request.blocks

    def step(self) -> None:
        before, record = self.snapshot(), PassRecord()
        served: list[int] = []
        for rid in list(self.running):
            if rid not in self.running:
                continue  # a victim of this pass
            request = self.requests[rid]
            while self.needs(request) > self.free:
                others = [o for o in self.running if o != rid and o not in served]
                victim = (others[0] if self.head_first else others[-1]) if others else rid
                record.decisions.append(Victim(rid, victim, "recompute_pause"))
                self.preempt(victim)
                if victim == rid:
                    break
            if request.state == ACTIVE:
                request.blocks += self.needs(request)
                served.append(rid)
        admitted = []
        while not record.decisions and self.waiting and self.needs(self.requests[self.waiting[0]]) <= self.free:
            rid = self.waiting.popleft()
            admitted.append((rid, self.requests[rid].state))
            self.requests[rid].state = ACTIVE
            self.requests[rid].blocks += self.needs(self.requests[rid])
            self.running.append(rid)
            served.append(rid)
        for rid in served:
            self.compute(self.requests[rid])
        states = {rid: r.state for rid, r in self.requests.items()}
        output = PassOutput(
            context=tuple(Listed(rid, states[rid]) for rid, was in admitted if was == QUEUED),
            replay=tuple(Listed(rid, states[rid]) for rid, was in admitted if was == DROPPED),
            generation=tuple(Listed(rid, states[rid]) for rid in served if rid not in dict(admitted)),
            recompute_paused=tuple(Listed(d.victim, states[d.victim]) for d in record.decisions),
            chunk_tokens=dict.fromkeys(served, 1),
        )
        self.passes.append(ObservedPass(before, record, output))

    def compute(self, request: ToyRequest) -> None:
        token = next_token(request.context)
        request.generated.append(token)
        if len(request.generated) == request.max_new or token in request.stops:
            self.end(request)

    def preempt(self, rid: int) -> None:
        request = self.requests[rid]
        request.state, request.blocks = DROPPED, 0
        self.preemptions += 1
        request.preempted_at = self.preemptions
        self.running.remove(rid)
        self.waiting.appendleft(rid)

    def end(self, request: ToyRequest) -> None:
        rid = request.arrival
        request.state, request.blocks = ENDED, 0
        for queue in (self.running, self.waiting):
            if rid in queue:
                queue.remove(rid)

    def snapshot(self) -> PassSnapshot:
        position = {rid: i for i, rid in enumerate(self.running)}
        return PassSnapshot(
            tuple(
                RequestSnapshot(
                    rid,
                    r.state,
                    arrival=rid,
                    admission=position.get(rid, -1),
                    about_to_finish=len(r.generated) + 1 >= r.max_new,
                    kv_tokens=len(r.context),
                    gpu_blocks=r.blocks,
                    num_output_tokens=len(r.generated),
                    prompt_tokens=len(r.prompt),
                    last_preemption=r.preempted_at,
                )
                for rid, r in self.requests.items()
                if r.state != ENDED
            ),
            max_batch_size=len(self.requests) + 1,
            max_num_tokens=1 << 20,
            serve_order=tuple(self.running),
        )


class ToyAdapter:
    """`SchedulerAdapter` + `PassReporting` over `ToyScheduler`; declares vLLM's policy (tail-first victims)."""

    policy = "vllm"

    def __init__(self, head_first: bool, gpu_blocks: int = 6, block_size: int = 2) -> None:
        self.toy = ToyScheduler(gpu_blocks, block_size, head_first)
        self.gpu_token_capacity, self.block_size = gpu_blocks * block_size, block_size

    def submit(self, prompt, max_new_tokens, stop_token_ids=()):
        if not prompt or len(prompt) + max_new_tokens > self.gpu_token_capacity:
            raise RequestRejected(f"a prompt of {len(prompt)} tokens + {max_new_tokens} does not fit")
        rid = len(self.toy.requests)
        self.toy.requests[rid] = ToyRequest(list(prompt), max_new_tokens, tuple(stop_token_ids), rid)
        self.toy.waiting.append(rid)
        return rid

    def step(self) -> None:
        self.toy.step()

    def cancel(self, request_id) -> None:
        self.toy.end(self.toy.requests[request_id])

    def states(self):
        return {rid: r.state for rid, r in self.toy.requests.items()}

    def outputs(self):
        return {rid: list(r.generated) for rid, r in self.toy.requests.items()}

    def block_usage(self):
        held = self.toy.gpu_blocks - self.toy.free
        return {
            "gpu_capacity": self.toy.gpu_blocks,
            "gpu_free": self.toy.free,
            "gpu_held": held,
            "gpu_fenced": 0,
            **dict.fromkeys(("host_capacity", "host_free", "host_held", "host_fenced"), 0),
        }

    def check_invariants(self) -> None:
        pass

    def set_host_capacity(self, blocks: int) -> bool:
        return False

    def reference(self, prompt, max_new_tokens, stop_token_ids=()):
        return reference_output(prompt, max_new_tokens, stop_token_ids)

    def take_passes(self) -> list[ObservedPass]:
        passes, self.toy.passes = self.toy.passes, []
        return passes


def test_the_toy_scheduler_with_tail_first_victims_passes_under_the_policy_it_declares() -> None:
    machine = conformance_machine(lambda: ToyAdapter(head_first=False), name="TailFirstToy")
    assert machine.binding.checks_policy and machine.binding.policy_name == "preset 'vllm'"
    run_state_machine_as_test(machine, settings=RUNS)


def test_the_toy_scheduler_with_head_first_victims_fails_naming_victim_tail() -> None:
    machine = conformance_machine(lambda: ToyAdapter(head_first=True), name="HeadFirstToy")
    with pytest.raises(InvariantViolation) as caught:
        run_state_machine_as_test(machine, settings=FAILS)
    assert caught.value.invariant_id == "VICTIM-TAIL", caught.value
    assert "victims are taken tail-first" in str(caught.value) and "policy: preset 'vllm'" in str(caught.value)


def test_a_policy_passed_to_the_machine_overrides_the_adapters() -> None:
    """SGLang's policy (fewest outputs first, any running request) is not the toy's: the toy fails it."""
    machine = conformance_machine(lambda: ToyAdapter(head_first=False), name="SGLangToy", policy="sglang")
    with pytest.raises(InvariantViolation) as caught:
        run_state_machine_as_test(machine, settings=FAILS)
    assert caught.value.invariant_id == "VICTIM-TAIL" and "policy: preset 'sglang'" in str(caught.value)


def test_our_scheduler_reports_its_passes_and_follows_the_specs_policy() -> None:
    config = SchedulerConfig(gpu_blocks=8, host_blocks=4, block_size=2, prefill_chunk_size=4, max_num_tokens=8)
    machine = conformance_machine(lambda: KVStateAdapter(config), name="OursDeclared")
    assert machine.binding.policy_name == "the spec's [policy]"
    run_state_machine_as_test(machine, settings=RUNS)


def test_presets_are_policies_of_the_specs_own_rules() -> None:
    assert preset("ours") == SPEC.policy
    for name in PRESETS:
        with_policy(SPEC, preset(name))  # every rule name has a meaning in kvstate.policy
    assert "resume" not in preset("vllm").admission_classes  # no host tier: no resume edge to admit by
    with pytest.raises(ValueError, match="no policy preset 'lifo'"):
        preset("lifo")
    with pytest.raises(ValueError, match="victim_order: 'head_first' has no meaning"):
        with_policy(SPEC, replace(SPEC.policy, victim_order="head_first"))


class BlackBoxToy(ToyAdapter):
    """The toy without `take_passes`: the machine sees only its states, outputs and block usage."""

    take_passes = None  # type: ignore[assignment]


def test_without_passes_the_head_first_toy_fails_victim_tail_from_its_state_changes() -> None:
    machine = conformance_machine(lambda: BlackBoxToy(head_first=True), name="HeadFirstBlackBox")
    assert not machine.binding.checks_policy and machine.binding.inferred_spec is not None
    with pytest.raises(InvariantViolation) as caught:
        run_state_machine_as_test(machine, settings=FAILS)
    message = str(caught.value)
    assert caught.value.invariant_id == "VICTIM-TAIL", message
    assert "victims are taken tail-first" in message and "inferred from step" in message, message


def test_without_passes_the_tail_first_toy_passes_under_its_declared_policy() -> None:
    machine = conformance_machine(lambda: BlackBoxToy(head_first=False), name="TailFirstBlackBox")
    run_state_machine_as_test(machine, settings=RUNS)


def test_a_policy_declared_without_passes_is_checked_only_where_it_is_observable() -> None:
    """vLLM's exclusions are all observable; the spec's own policy excludes requests past the preemption cap and
    with a chunk in flight, which no state change shows: declared without passes, it is a contract error."""
    with pytest.raises(
        AdapterContractError, match=r"declares the declared policy, whose victim exclusions .*chunk_in_flight"
    ):
        conformance_machine(lambda: BlackBoxToy(head_first=False), name="NoPasses", policy=SPEC.policy)
    unchecked = conformance_machine(lambda: BlackBoxToy(head_first=True), name="NotInferred", infer_policy=False)
    assert unchecked.binding.inferred_spec is None and not unchecked.binding.checks_policy
