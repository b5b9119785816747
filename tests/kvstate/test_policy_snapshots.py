"""Pass snapshots take keyword-only fields with defaults, and a VICTIM-TAIL failure names the one exclusion that
applies."""

from __future__ import annotations

import pytest

from kvstate import load_spec
from kvstate.declared import Listed, PassOutput
from kvstate.errors import InvariantViolation
from kvstate.policy import VOCABULARY, PassRecord, PassSnapshot, RequestSnapshot, Victim, check_pass

SPEC = load_spec()
RUNNING, PAUSED = SPEC.role("active"), SPEC.role("dropped")


def test_snapshot_fields_after_the_id_and_state_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        RequestSnapshot("r", RUNNING, 0)  # type: ignore[misc]
    with pytest.raises(TypeError):
        PassSnapshot((), 0)  # type: ignore[misc]
    snapshot = RequestSnapshot("r", RUNNING)
    assert not (snapshot.about_to_finish or snapshot.capped or snapshot.prefilling or snapshot.in_flight)


def test_a_victim_served_earlier_in_the_pass_names_only_that_exclusion() -> None:
    served_first = RequestSnapshot("v", RUNNING, arrival=0, admission=0, kv_tokens=4, gpu_blocks=1)
    requester = RequestSnapshot("r", RUNNING, arrival=1, admission=1, kv_tokens=4, gpu_blocks=1)
    output = PassOutput(
        generation=(Listed("v", RUNNING),), recompute_paused=(Listed("v", PAUSED),), chunk_tokens={"v": 1}
    )
    record = PassRecord([Victim("r", "v", "recompute_pause")])
    with pytest.raises(InvariantViolation) as caught:
        check_pass(SPEC, PassSnapshot((served_first, requester), has_host_tier=True), record, output)
    message = str(caught.value)
    assert caught.value.invariant_id == "VICTIM-TAIL"
    assert f"scheduled_this_pass excludes it: {VOCABULARY['victim_exclusions']['scheduled_this_pass']}" in message
    others = [name for name in SPEC.policy.victim_exclusions if name != "scheduled_this_pass"]
    assert others and not any(name in message for name in others), message


@pytest.mark.parametrize("requester_prefills", [False, True], ids=["decode-requester", "chunk-requester"])
def test_ahead_of_decoding_requester_spares_requests_ahead_of_a_decode_step_only(requester_prefills: bool) -> None:
    """The trtllm preset: a requester that needs room for a decode step searches behind it in the scan order, one
    that needs room for a chunk the whole order. Request "a", mid-prefill, is ahead of the requester in both."""
    from kvstate.declared import preset, with_policy

    spec = with_policy(SPEC, preset("trtllm"))
    assert "ahead_of_decoding_requester" in spec.policy.victim_exclusions
    ahead = RequestSnapshot("a", RUNNING, arrival=0, admission=0, prefilling=True, kv_tokens=6, gpu_blocks=3)
    requester = RequestSnapshot(
        "r", RUNNING, arrival=1, admission=1, prefilling=requester_prefills, kv_tokens=4, gpu_blocks=2
    )
    before = PassSnapshot((ahead, requester), serve_order=("r", "a"), scan_order=("a", "r"))
    output = PassOutput(recompute_paused=(Listed("r", PAUSED),))
    record = PassRecord([Victim("r", "r", "recompute_pause")])
    if not requester_prefills:
        check_pass(spec, before, record, output)  # "a" is ahead of a decode step: no victim of it
        return
    with pytest.raises(InvariantViolation) as caught:
        check_pass(spec, before, record, output)
    assert caught.value.invariant_id == "VICTIM-TAIL", caught.value
    assert "requester 'r' preempted itself although ['a'] were eligible victims" in str(caught.value)
