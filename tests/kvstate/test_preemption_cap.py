"""The preemption cap (A3) and its exception for the head of the pass (VICTIM-CAP), on the real scheduler with every
pass held against the spec's policy by `kvstate.policy.check_pass`.

A request preempted `max_preemptions_per_request` times is no victim of a requester other than the head of the pass
(the request the pass serves first); the head may still take it. The workloads thrash a GPU tier that holds about two
of their requests, so both sides of the rule are exercised; disabling the exception in the scheduler (the head then
treats capped requests as protected too) makes `check_pass` report VICTIM-CAP.
"""

from __future__ import annotations

import random

import pytest

import kvstate.policy as policy_module
from kvstate import policy
from kvstate.config import SchedulerConfig
from kvstate.errors import InvariantViolation
from kvstate.policy import CAP_SPARES_HEAD, PREEMPTION_CAP_REACHED, preemption_capped
from kvstate.scheduler import Scheduler
from kvstate.sim import SimExecutor, reference_output

SEEDS = range(6)


class PolicyCheckedScheduler(Scheduler):
    """Checks every pass against the spec's policy (as the model checker's step simulation does) and counts the
    capped victims taken by the head of their pass and by other requesters."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.capped_taken_by_head = 0
        self.capped_taken_by_others = 0

    def schedule(self):
        before = policy.snapshot(self)
        out = super().schedule()
        policy.check_pass(self.spec, before, self.last_pass.record, out)
        return out

    def _preempt(self, victim, pass_) -> None:
        requester = pass_.requester
        if victim is not requester and preemption_capped(victim, self.config.max_preemptions_per_request):
            if requester is self.head_of_pass(pass_):
                self.capped_taken_by_head += 1
            else:
                self.capped_taken_by_others += 1
        super()._preempt(victim, pass_)


def thrash(seed: int, host_blocks: int, cap: int = 1) -> PolicyCheckedScheduler:
    """Ten long requests on a GPU tier of 12 blocks of 2 tokens, run to the end; every output is its reference."""
    sched = PolicyCheckedScheduler(
        SchedulerConfig(
            gpu_blocks=12,
            host_blocks=host_blocks,
            block_size=2,
            prefill_chunk_size=8,
            max_num_tokens=32,
            max_preemptions_per_request=cap,
        )
    )
    rng = random.Random(seed)
    for _ in range(10):
        prompt = rng.randint(4, 14)
        sched.submit([rng.randrange(1000) for _ in range(prompt)], rng.randint(4, 24 - prompt))
    SimExecutor(sched).run(20_000)  # checks every invariant after every step
    assert not sched.has_unfinished, "LIVE-DONE: a request never finished"
    for request in sched.finished.values():
        assert request.generated == reference_output(request.prompt, request.max_new_tokens)
    return sched


def test_the_spec_names_the_cap_with_its_exception_for_the_head() -> None:
    exclusions = Scheduler(SchedulerConfig(gpu_blocks=4)).policy.victim_exclusions
    assert CAP_SPARES_HEAD in exclusions and PREEMPTION_CAP_REACHED not in exclusions


@pytest.mark.parametrize("host_blocks", [0, 6])
def test_only_the_head_takes_a_capped_victim_and_every_pass_follows_the_policy(host_blocks: int) -> None:
    runs = [thrash(seed, host_blocks) for seed in SEEDS]
    assert sum(s.capped_taken_by_head for s in runs) > 0  # the exception is exercised
    assert all(s.capped_taken_by_others == 0 for s in runs)


@pytest.mark.parametrize("host_blocks", [0, 6])
def test_a_head_that_treats_capped_requests_as_protected_breaks_victim_cap(
    monkeypatch: pytest.MonkeyPatch, host_blocks: int
) -> None:
    """The rule disabled in the scheduler (the cap protects capped requests from the head too), the spec unchanged:
    the head preempts itself, or passes over a capped request, where the policy lets it take that request."""
    monkeypatch.setitem(
        policy_module.VICTIM_EXCLUSIONS, CAP_SPARES_HEAD, policy_module.VICTIM_EXCLUSIONS[PREEMPTION_CAP_REACHED]
    )
    with pytest.raises(InvariantViolation) as caught:
        for seed in SEEDS:
            thrash(seed, host_blocks)
    assert caught.value.invariant_id == "VICTIM-CAP" and "head of the pass" in str(caught.value)


def test_a_requester_other_than_the_head_that_takes_a_capped_request_breaks_victim_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cap disabled in the scheduler (no capped request is protected), the spec unchanged: some requester other
    than the head takes a capped request, which the policy forbids (the cap still caps)."""
    monkeypatch.setitem(policy_module.VICTIM_EXCLUSIONS, CAP_SPARES_HEAD, lambda s, candidate, pass_: False)
    with pytest.raises(InvariantViolation) as caught:
        for seed in SEEDS:
            thrash(seed, 0)
    assert caught.value.invariant_id == "VICTIM-CAP" and "not the head of the pass" in str(caught.value)
