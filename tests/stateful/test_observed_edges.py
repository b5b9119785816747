"""SPEC-EDGE from a black box: a change between two observations is admitted only along a path of spec edges whose
guards the observed counters leave possible, and a reported pass's lists are checked edge by edge."""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvstate import load_spec, roles
from kvstate.config import RequestRejected
from kvstate.declared import Listed, ObservedPass, PassOutput
from kvstate.policy import PassRecord, PassSnapshot, RequestSnapshot
from kvstate.sim import reference_output
from kvstate.testing import LifecycleViolation, conformance_machine
from kvstate.testing.observed_edges import ObservedRequest, admitted_path

SPEC = load_spec()
QUEUED, ACTIVE, OFFLOADED, DROPPED, RECOMPUTING, ENDED = (
    SPEC.role(r) for r in (roles.QUEUED, roles.ACTIVE, roles.OFFLOADED, roles.DROPPED, roles.RECOMPUTING, roles.ENDED)
)
FIND = settings(
    max_examples=50, stateful_step_count=20, database=None, derandomize=True, deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)  # fmt: skip


class ScriptedToy:
    """Every request follows one script, a state per step; a step in a computing state samples its next reference
    token. The script recompute-pauses each request after its first token and replays it; `catch_up_first` False
    returns it from replaying to running without sampling a token (the replay never caught up), True suspends it
    after its replay caught up in that step."""

    gpu_token_capacity, block_size = 16, 4

    def __init__(self, catch_up_first: bool) -> None:
        self.catch_up_first = catch_up_first
        tail = [OFFLOADED, ACTIVE] if catch_up_first else [RECOMPUTING, ACTIVE]
        self.script = [ACTIVE, DROPPED, *tail]
        self.requests: dict[int, dict] = {}
        self.passes: list[ObservedPass] = []

    def submit(self, prompt, max_new_tokens, stop_token_ids=()):
        if not prompt or len(prompt) + max_new_tokens > self.gpu_token_capacity:
            raise RequestRejected("does not fit")
        rid = len(self.requests)
        ref = reference_output(prompt, max_new_tokens, stop_token_ids)
        self.requests[rid] = {"state": QUEUED, "at": -1, "out": [], "ref": ref}
        return rid

    def step(self) -> None:
        for r in self.requests.values():
            if r["state"] == ENDED:
                continue
            was = r["state"]
            r["at"] = min(r["at"] + 1, len(self.script) - 1)
            r["state"] = self.script[r["at"]]
            caught_up = r["state"] == OFFLOADED and self.catch_up_first
            if (r["state"] == ACTIVE and was != RECOMPUTING) or caught_up:
                r["out"].append(r["ref"][len(r["out"])])  # decoded (or caught up): a token
            if len(r["out"]) == len(r["ref"]):
                r["state"] = ENDED

    def cancel(self, request_id) -> None:
        self.requests[request_id]["state"] = ENDED

    def states(self):
        return {rid: r["state"] for rid, r in self.requests.items()}

    def outputs(self):
        return {rid: list(r["out"]) for rid, r in self.requests.items()}

    def block_usage(self):
        return {"gpu_capacity": 4, "gpu_free": 4, **dict.fromkeys(
            ("gpu_held", "gpu_fenced", "host_capacity", "host_free", "host_held", "host_fenced"), 0)}  # fmt: skip

    def check_invariants(self) -> None:
        pass

    def set_host_capacity(self, blocks: int) -> bool:
        return False

    def reference(self, prompt, max_new_tokens, stop_token_ids=()):
        return reference_output(prompt, max_new_tokens, stop_token_ids)


def test_a_black_box_whose_replay_runs_again_without_a_token_fails_spec_edge() -> None:
    """Neither catch-up (no token sampled) nor suspension and resume (a replay that has not caught up resumes
    replaying) leads from replaying to running."""
    machine = conformance_machine(lambda: ScriptedToy(catch_up_first=False), name="ReplayRunner")
    with pytest.raises(LifecycleViolation) as caught:
        run_state_machine_as_test(machine, settings=FIND)
    message = str(caught.value)
    assert caught.value.invariant_id == "SPEC-EDGE"
    assert f"from {RECOMPUTING!r} to {ACTIVE!r}" in message, message
    assert "needs replay_complete, yet it sampled 0 token(s)" in message, message
    assert "needs gpu_room_for_offloaded_blocks, yet it was replaying with 1 token(s) produced" in message, message
    assert "[SPEC-EDGE:" in message


def test_a_replay_may_be_suspended_whether_or_not_it_caught_up() -> None:
    """replaying -> suspended is one edge; replaying -> running needs a sampled token, or a replay that was not
    under way (one of a request that produced nothing)."""
    machine = conformance_machine(lambda: ScriptedToy(catch_up_first=True), name="CaughtUpThenSuspended")
    run_state_machine_as_test(machine, settings=settings(FIND, max_examples=10))
    for sampled in (0, 1):
        observed = ObservedRequest("r", sampled, False, generated_before=1, replaying_before=True)
        assert [t.event for t in admitted_path(SPEC, RECOMPUTING, OFFLOADED, observed) or []] == ["suspend"]
    caught_up = ObservedRequest("r", 1, False, generated_before=1, replaying_before=True)
    assert [t.event for t in admitted_path(SPEC, RECOMPUTING, ACTIVE, caught_up) or []] == ["catch_up"]
    not_yet = ObservedRequest("r", 0, False, generated_before=1, replaying_before=True)
    assert admitted_path(SPEC, RECOMPUTING, ACTIVE, not_yet) is None
    nothing_produced = ObservedRequest("r", 0, False, generated_before=0, replaying_before=True)
    assert [t.event for t in admitted_path(SPEC, RECOMPUTING, ACTIVE, nothing_produced) or []] == [
        "suspend",
        "resume",
    ]


def test_finishing_needs_a_final_output() -> None:
    assert admitted_path(SPEC, ACTIVE, ENDED, ObservedRequest("r", 1, output_is_final=False)) is not None  # abort
    finish = admitted_path(SPEC, ACTIVE, ENDED, ObservedRequest("r", 1, output_is_final=True))
    assert finish is not None and len(finish) == 1


def test_a_reported_pass_that_suspends_a_recompute_paused_request_fails_spec_edge_exactly() -> None:
    machine = conformance_machine(lambda: ScriptedToy(catch_up_first=True), name="Listed", check_policy=False)()
    snapshot = RequestSnapshot(request_id=7, state=DROPPED, arrival=0, admission=0, prefilling=True,
                               about_to_finish=False, capped=False, kv_tokens=0, gpu_blocks=0)  # fmt: skip
    passed = ObservedPass(
        PassSnapshot((snapshot,), has_host_tier=True), PassRecord(), PassOutput(suspended=(Listed(7, OFFLOADED),))
    )
    with pytest.raises(LifecycleViolation, match=r"listed request 7 in 'suspended' \(event suspend\), but it was "):
        machine.check_listed_edges(passed)
    machine.teardown()
