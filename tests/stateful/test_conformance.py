"""Our scheduler, driven by the slot-level simulator, against the spec through the reusable conformance machine.

One machine class per configuration; each runs as a unittest `TestCase` with 50 rules per case and as many
cases as the active Hypothesis profile says (KVSTATE_HYPOTHESIS_PROFILE: ci 200, dev 100, long 5000). A failure
prints the step list; it replays as plain Python after `from tests.stateful.test_conformance import *` and
`from kvstate.testing import Submission`.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import settings

from kvstate import load_spec
from kvstate.config import SchedulerConfig
from kvstate.testing import KVStateAdapter, SchedulerAdapter, Submission, conformance_machine

STEPS = settings(stateful_step_count=50)

# GPU 16 blocks x 4 tokens, a host tier as large, prefill chunks of 6 tokens (not a multiple of the block size)
DEFAULT = SchedulerConfig(gpu_blocks=16, host_blocks=16, block_size=4, prefill_chunk_size=6, max_num_tokens=32)
NO_HOST = SchedulerConfig(gpu_blocks=16, host_blocks=0, block_size=4, prefill_chunk_size=6, max_num_tokens=32)
BLOCK_SIZE_1 = SchedulerConfig(gpu_blocks=16, host_blocks=8, block_size=1, prefill_chunk_size=3, max_num_tokens=16)
PIPELINE_2 = SchedulerConfig(
    gpu_blocks=16, host_blocks=16, block_size=4, prefill_chunk_size=6, max_num_tokens=32, pipeline_stages=2
)
NO_EVICT = SchedulerConfig(
    gpu_blocks=16,
    host_blocks=16,
    block_size=4,
    prefill_chunk_size=6,
    max_num_tokens=32,
    capacity_policy="guaranteed_no_evict",
)
# small everything: host smaller than most requests, token budget below the chunk, few batch slots, two stages
TIGHT = SchedulerConfig(
    gpu_blocks=6,
    host_blocks=3,
    block_size=2,
    prefill_chunk_size=3,
    max_num_tokens=4,
    max_batch_size=3,
    pipeline_stages=2,
)

# the packaged spec with the `eager` offload policy: every block of a victim moves down in the pass that suspends it
EAGER_OFFLOAD = load_spec()
EAGER_OFFLOAD = dataclasses.replace(EAGER_OFFLOAD, policy=dataclasses.replace(EAGER_OFFLOAD.policy, offload="eager"))

DefaultMachine = conformance_machine(lambda: KVStateAdapter(DEFAULT), name="DefaultMachine")
NoHostMachine = conformance_machine(lambda: KVStateAdapter(NO_HOST), name="NoHostMachine")
BlockSize1Machine = conformance_machine(lambda: KVStateAdapter(BLOCK_SIZE_1), name="BlockSize1Machine")
Pipeline2Machine = conformance_machine(lambda: KVStateAdapter(PIPELINE_2), name="Pipeline2Machine")
NoEvictMachine = conformance_machine(lambda: KVStateAdapter(NO_EVICT), name="NoEvictMachine")
TightMachine = conformance_machine(lambda: KVStateAdapter(TIGHT), name="TightMachine")
EagerOffloadMachine = conformance_machine(
    lambda: KVStateAdapter(DEFAULT, spec=EAGER_OFFLOAD), spec=EAGER_OFFLOAD, name="EagerOffloadMachine"
)

TestDefault = DefaultMachine.TestCase
TestNoHost = NoHostMachine.TestCase
TestBlockSize1 = BlockSize1Machine.TestCase
TestPipeline2 = Pipeline2Machine.TestCase
TestNoEvict = NoEvictMachine.TestCase
TestTight = TightMachine.TestCase
TestEagerOffload = EagerOffloadMachine.TestCase
for _case in (TestDefault, TestNoHost, TestBlockSize1, TestPipeline2, TestNoEvict, TestTight, TestEagerOffload):
    _case.settings = STEPS
del _case


def test_kvstate_adapter_satisfies_the_protocol() -> None:
    adapter = KVStateAdapter(DEFAULT)
    assert isinstance(adapter, SchedulerAdapter)
    assert adapter.gpu_token_capacity == 64 and adapter.block_size == 4


def test_a_printed_step_list_replays_as_plain_python() -> None:
    """The lines Hypothesis prints for a failing case run outside any test, with the same checks."""
    state = DefaultMachine()
    state.conforms()
    requests_0 = state.submit(request=Submission(prompt=(1, 2, 3, 4, 5), max_new_tokens=3, stop_token_ids=()))
    state.conforms()
    state.submit_invalid(request=Submission(prompt=(), max_new_tokens=1))
    state.step(iterations=2)
    state.cancel(in_state="running", nth=0)
    state.conforms()
    state.teardown()
    assert state.last_states == {requests_0: load_spec().terminal_states[0]}


def test_the_factory_refuses_a_spec_without_the_checked_invariants() -> None:
    import dataclasses

    spec = load_spec()
    stripped = dataclasses.replace(spec, invariants=tuple(i for i in spec.invariants if i.id != "OUT-EQUIV"))
    with pytest.raises(ValueError, match="lacks invariants OUT-EQUIV"):
        conformance_machine(lambda: KVStateAdapter(DEFAULT), spec=stripped)


def test_the_factory_refuses_an_object_that_is_not_an_adapter() -> None:
    with pytest.raises(TypeError, match=r"lacks .*submit"):
        conformance_machine(object)
