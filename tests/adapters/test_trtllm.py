"""TensorRT-LLM's own `KVCacheV2Scheduler`, read from a checkout, against the spec (docs/trtllm-findings.md).

The file is never part of this project: these tests run only where KVSTATE_TRTLLM_SRC names a TensorRT-LLM checkout
(or a directory holding its `tensorrt_llm/_torch/pyexecutor/scheduler/scheduler_v2.py`), and are skipped, saying so,
elsewhere. Which version is checked out decides what is pinned: a version with the recompute-pause path (it fills
`recompute_paused_requests`) follows its declared policy with a host tier and without one, and the kit finds
VICTIM-NOT-FINAL under the overlap executor within 50 derandomized examples; every version takes a
GENERATION_TO_COMPLETE request as a suspension victim in a fixed two-request replay. A pinned fuzzing failure is "a
failure of this kind within N derandomized examples", never one seed.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvstate.adapters.trtllm import SOURCE_ENV, CheckoutMissing, TrtllmAdapter, checkout
from kvstate.declared import preset, with_policy
from kvstate.errors import InvariantViolation
from kvstate.policy import Victim, check_pass
from kvstate.spec import default_spec
from kvstate.testing import conformance_machine

SOURCE = os.environ.get(SOURCE_ENV)
needs_checkout = pytest.mark.skipif(
    not SOURCE, reason=f"needs a TensorRT-LLM checkout: set {SOURCE_ENV} to its source tree (docs/trtllm-findings.md)"
)
SHAPE = dict(gpu_pages=6, tokens_per_block=2)
RUNS = settings(max_examples=100, stateful_step_count=30, database=None, derandomize=True, deadline=None)
FAILS = settings(RUNS, phases=[Phase.explicit, Phase.reuse, Phase.generate])


def has_recompute_pause() -> bool:
    """The checked-out scheduler recompute-pauses victims (it fills `recompute_paused_requests`)."""
    with checkout().open(encoding="utf-8") as source:
        return "_try_recompute_pause_for_gen" in source.read(1 << 20)  # the file is ~90 kB; read at most 1 MiB


def test_without_a_checkout_the_adapter_says_which_variable_to_set(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(SOURCE_ENV, raising=False)
    with pytest.raises(CheckoutMissing, match=f"set {SOURCE_ENV} to a TensorRT-LLM source tree"):
        checkout()
    with pytest.raises(CheckoutMissing, match=r"scheduler_v2\.py does not exist"):
        checkout(tmp_path)


@needs_checkout
@pytest.mark.parametrize("host_pages", [12, 0], ids=["host-tier", "gpu-only"])
def test_with_whole_prompts_it_follows_its_declared_policy(host_pages: int) -> None:
    """Every version with a host tier; GPU-only only where the recompute-pause path exists."""
    if not host_pages and not has_recompute_pause():
        pytest.skip("this checkout has no recompute-pause path: GPU-only runs stop in its deadlock detector")
    machine = conformance_machine(lambda: TrtllmAdapter(host_pages=host_pages, **SHAPE), name="TrtllmPolicy")
    assert machine.binding.policy_name == "preset 'trtllm'"
    run_state_machine_as_test(machine, settings=RUNS)


@needs_checkout
def test_a_recompute_paused_request_replays_to_the_reference_output() -> None:
    """The executor's reset carried out: a victim replays prompt + generated from position 0 and goes on."""
    if not has_recompute_pause():
        pytest.skip("this checkout has no recompute-pause path")
    adapter = TrtllmAdapter(host_pages=0, **SHAPE)
    submitted = [adapter.submit([i, i + 1], 8) for i in range(3)]
    paused: set[int] = set()
    for _ in range(60):
        adapter.step()
        for observed in adapter.take_passes():
            paused |= {listed.request_id for listed in observed.output.recompute_paused}
    assert paused, "no request was recompute-paused: the shape no longer puts the pool under pressure"
    outputs = adapter.outputs()
    for rid, prompt in zip(submitted, ([0, 1], [1, 2], [2, 3]), strict=True):
        assert adapter.states()[rid] == "done"
        assert outputs[rid] == adapter.reference(prompt, 8)


@needs_checkout
def test_the_overlap_executor_lets_a_request_about_to_complete_be_a_victim() -> None:
    """Every version: `_is_evictable` lacks the GENERATION_TO_COMPLETE exclusion, so a decode step that needs a
    page suspends the request behind it whose final token is in flight (the two-request replay of the findings)."""
    spec = with_policy(default_spec(), preset("trtllm"))
    adapter = TrtllmAdapter(host_pages=12, overlap=True, **SHAPE)
    adapter.submit([0], 5)
    adapter.submit([0, 0, 0, 0], 4)
    with pytest.raises(InvariantViolation) as caught:
        for _ in range(8):
            adapter.step()
            for observed in adapter.take_passes():
                check_pass(spec, observed.before, observed.record, observed.output)
    assert caught.value.invariant_id == "VICTIM-NOT-FINAL", caught.value


@needs_checkout
@pytest.mark.parametrize("host_pages", [12, 0], ids=["host-tier", "gpu-only"])
def test_fuzzing_the_overlap_executor_finds_it_within_50_examples(host_pages: int) -> None:
    """The kit finds the same failure unaided. A version without recompute-pause is skipped: its deadlock
    detector raises on the first pass that schedules and evicts nothing, which overlap runs reach first."""
    if not has_recompute_pause():
        pytest.skip("this checkout has no recompute-pause path: its deadlock detector stops overlap runs first")
    machine = conformance_machine(
        lambda: TrtllmAdapter(host_pages=host_pages, overlap=True, **SHAPE), name="TrtllmOverlap"
    )
    with pytest.raises(InvariantViolation) as caught:
        run_state_machine_as_test(machine, settings=settings(FAILS, max_examples=50))
    assert caught.value.invariant_id == "VICTIM-NOT-FINAL", caught.value


CHUNKED = dict(gpu_pages=8, tokens_per_block=2, chunk_unit_size=2, max_num_tokens=6)


def first_failure_is_a_deadlock(machine) -> None:
    """The first failure of derandomized fuzzing is the engine's own deadlock detector, or the kit's LIVE-DONE where
    its drain bound runs out before the detector's 1,000 idle passes: the same stall, and no other violation."""
    try:
        run_state_machine_as_test(machine, settings=settings(FAILS, max_examples=300, stateful_step_count=40))
    except RuntimeError as err:
        assert "V2 scheduler deadlock" in str(err), err
    except InvariantViolation as err:
        assert err.invariant_id == "LIVE-DONE", err
    else:
        pytest.fail("300 derandomized examples met no deadlock")


@needs_checkout
def test_with_chunked_prefill_and_a_host_tier_two_started_prompts_deadlock() -> None:
    """Finding 3 of the findings page: request 2's resume onboards its pages, its next chunk does not fit, and
    request 3, mid-prefill too, needs a page as well; with a tier below the GPU, `_try_preempt_for_pages` gives up
    at once and a failed resize suspends only a first chunk, so both keep their pages until the engine's own
    deadlock detector raises."""
    if not has_recompute_pause():
        pytest.skip("this checkout has no recompute-pause path: its deadlock detector fires on the first stall")
    adapter = TrtllmAdapter(host_pages=16, **CHUNKED)
    for prompt_len, max_new_tokens in ((1, 1), (1, 6), (15, 1), (6, 1)):
        adapter.submit([0] * prompt_len, max_new_tokens)
    with pytest.raises(RuntimeError, match="V2 scheduler deadlock"):
        for _ in range(1100):
            adapter.step()
            for observed in adapter.take_passes():
                stuck = observed.before.requests
    states = {r.request_id: (r.state, r.prefilling, r.gpu_blocks) for r in stuck}
    assert states == {2: ("running", True, 6), 3: ("running", True, 2)}, states


@needs_checkout
@pytest.mark.parametrize("host_pages", [16, 4], ids=["host-tier", "small-host-tier"])
def test_fuzzing_chunked_prefill_with_a_host_tier_meets_the_deadlock_first(host_pages: int) -> None:
    """The kit reports nothing before the engine's own detector stops a run: replays suspended mid-way resume
    replaying (the spec allows it), and a decode requester's victims are behind it (ahead_of_decoding_requester)."""
    if not has_recompute_pause():
        pytest.skip("this checkout has no recompute-pause path: host-tier runs meet its deadlock detector at once")
    first_failure_is_a_deadlock(
        conformance_machine(lambda: TrtllmAdapter(host_pages=host_pages, **CHUNKED), name="TrtllmChunked")
    )


@needs_checkout
def test_with_chunked_prefill_and_no_host_tier_a_self_suspension_deadlocks() -> None:
    """Finding 2 of the findings page: request 2 decodes behind request 1, which is mid-prefill; needing a page, it
    finds no victim behind it and suspends itself, which frees nothing without a tier below the GPU; request 1's
    context-phase preemption passes over it (it is no longer active), so neither moves until the engine's own
    deadlock detector raises."""
    if not has_recompute_pause():
        pytest.skip("this checkout has no recompute-pause path: its deadlock detector fires on the first stall")
    adapter = TrtllmAdapter(host_pages=0, **CHUNKED)
    for prompt_len, max_new_tokens in ((10, 2), (12, 1), (2, 6)):
        adapter.submit([0] * prompt_len, max_new_tokens)
    decisions: list[object] = []
    with pytest.raises(RuntimeError, match="V2 scheduler deadlock") as caught:
        for _ in range(1100):
            adapter.step()
            for observed in adapter.take_passes():
                decisions.extend(observed.record.decisions)
                stuck = observed.before.requests
    assert decisions == [Victim(requester=2, victim=2, event="suspend")], (decisions, caught.value)
    states = {r.request_id: (r.state, r.prefilling) for r in stuck}
    assert states == {1: ("running", True), 2: ("suspended", False)}, states


@needs_checkout
def test_fuzzing_chunked_prefill_without_a_host_tier_meets_the_deadlock_first() -> None:
    """Without a host tier too, the first failure within 300 derandomized examples is a deadlock."""
    if not has_recompute_pause():
        pytest.skip("this checkout has no recompute-pause path: its deadlock detector fires on the first stall")
    first_failure_is_a_deadlock(
        conformance_machine(lambda: TrtllmAdapter(host_pages=0, **CHUNKED), name="TrtllmChunkedGpuOnly")
    )
