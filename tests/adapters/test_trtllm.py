"""TensorRT-LLM's own `KVCacheV2Scheduler`, read from a checkout, against the spec (docs/trtllm-findings.md).

The file is never part of this project: these tests run only where KVSTATE_TRTLLM_SRC names a TensorRT-LLM checkout
(or a directory holding its `tensorrt_llm/_torch/pyexecutor/scheduler/scheduler_v2.py`), and are skipped, saying so,
elsewhere. What they pin: with a host tier it follows its declared policy; with the overlap executor it takes a
GENERATION_TO_COMPLETE request as a victim (VICTIM-NOT-FINAL); without a host tier it suspends, freeing nothing
(SUSPEND-ROOM: its held blocks have no tier to move to); with chunked prefill it can livelock (LIVE-DONE).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvstate.adapters.trtllm import SOURCE_ENV, CheckoutMissing, TrtllmAdapter, checkout
from kvstate.errors import InvariantViolation
from kvstate.testing import conformance_machine

SOURCE = os.environ.get(SOURCE_ENV)
needs_checkout = pytest.mark.skipif(
    not SOURCE, reason=f"needs a TensorRT-LLM checkout: set {SOURCE_ENV} to its source tree (docs/trtllm-findings.md)"
)
SHAPE = dict(gpu_pages=6, tokens_per_block=2)
RUNS = settings(max_examples=30, stateful_step_count=30, database=None, derandomize=True, deadline=None)
FAILS = settings(RUNS, phases=[Phase.explicit, Phase.reuse, Phase.generate])


def test_without_a_checkout_the_adapter_says_which_variable_to_set(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(SOURCE_ENV, raising=False)
    with pytest.raises(CheckoutMissing, match=f"set {SOURCE_ENV} to a TensorRT-LLM source tree"):
        checkout()
    with pytest.raises(CheckoutMissing, match=r"scheduler_v2\.py does not exist"):
        checkout(tmp_path)


@needs_checkout
def test_with_a_host_tier_it_follows_its_declared_policy() -> None:
    machine = conformance_machine(lambda: TrtllmAdapter(host_pages=12, **SHAPE), name="TrtllmHostTier")
    assert machine.binding.policy_name == "preset 'trtllm'"
    run_state_machine_as_test(machine, settings=RUNS)


@needs_checkout
def test_the_overlap_executor_lets_a_request_about_to_complete_be_a_victim() -> None:
    machine = conformance_machine(lambda: TrtllmAdapter(host_pages=12, overlap=True, **SHAPE), name="TrtllmOverlap")
    with pytest.raises(InvariantViolation) as caught:
        run_state_machine_as_test(machine, settings=FAILS)
    assert caught.value.invariant_id == "VICTIM-NOT-FINAL", caught.value


@needs_checkout
def test_without_a_host_tier_a_suspension_frees_nothing() -> None:
    machine = conformance_machine(lambda: TrtllmAdapter(host_pages=0, **SHAPE), name="TrtllmNoHost")
    with pytest.raises(InvariantViolation) as caught:
        run_state_machine_as_test(machine, settings=FAILS)
    assert caught.value.invariant_id == "SUSPEND-ROOM", caught.value


@needs_checkout
def test_chunked_prefills_that_cannot_grow_starve_a_generation_request_that_cannot_evict_them() -> None:
    """Mid-prefill context requests ahead of a generation request hold the pages it needs; their chunks are skipped
    when they cannot grow, and it may evict only requests behind it, so it suspends and resumes itself forever."""
    machine = conformance_machine(
        lambda: TrtllmAdapter(gpu_pages=8, host_pages=16, tokens_per_block=2, chunk_unit_size=2, max_num_tokens=6),
        name="TrtllmChunked",
    )
    with pytest.raises(InvariantViolation) as caught:  # rarer: found within 300 examples of 40 rules
        run_state_machine_as_test(machine, settings=settings(FAILS, max_examples=300, stateful_step_count=40))
    assert caught.value.invariant_id == "LIVE-DONE", caught.value
