"""The conformance machine as a module-level class: subclass it, inject the adapter, add checks."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import invariant, run_state_machine_as_test

from kvstate.config import SchedulerConfig
from kvstate.roles import RECOMPUTING
from kvstate.testing import ConformanceMachine, KVStateAdapter, MachineConfig, conformance_machine

SMALL = SchedulerConfig(gpu_blocks=8, host_blocks=0, block_size=2, prefill_chunk_size=3, max_num_tokens=16)
RUN = settings(
    max_examples=20,
    stateful_step_count=30,
    database=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)


class SmallMachine(ConformanceMachine):
    adapter_factory = staticmethod(lambda: KVStateAdapter(SMALL))
    config = MachineConfig(max_new_tokens=6)


class NeverReplaysCheck(SmallMachine):
    """A check of the user's own, added in a subclass: no request ever replays (false under pressure)."""

    @invariant()
    def nobody_replays(self) -> None:
        replaying = self.model.spec.role(RECOMPUTING)
        assert replaying not in self.last_states.values(), f"a request is {replaying}"


def test_a_subclass_with_an_adapter_factory_is_bound_and_runs() -> None:
    binding = SmallMachine.binding
    assert binding is not None and binding.capacity == SMALL.gpu_token_capacity
    assert binding.config.max_new_tokens == 6 and binding.initial_host == 0
    assert SmallMachine.TestCase.settings.deadline is None
    run_state_machine_as_test(SmallMachine, settings=RUN)


def test_a_check_added_in_a_subclass_runs_with_the_inherited_rules_and_binding() -> None:
    assert NeverReplaysCheck.binding is SmallMachine.binding  # it set neither adapter_factory nor config
    with pytest.raises(AssertionError, match="a request is") as caught:
        run_state_machine_as_test(NeverReplaysCheck, settings=RUN)
    assert "state = NeverReplaysCheck()" in "\n".join(getattr(caught.value, "__notes__", []))


def test_a_subclass_that_sets_only_config_is_bound_again() -> None:
    class Shorter(SmallMachine):
        config = dataclasses.replace(SmallMachine.config, max_new_tokens=1)

    assert Shorter.binding is not SmallMachine.binding and Shorter.binding.config.max_new_tokens == 1
    assert Shorter.binding.model.spec is SmallMachine.binding.model.spec


def test_the_unbound_class_refuses_to_run_and_says_how_to_bind_it() -> None:
    with pytest.raises(TypeError, match="set adapter_factory"):
        ConformanceMachine()


def test_bind_and_the_factory_make_the_same_kind_of_subclass() -> None:
    bound = ConformanceMachine.bind(lambda: KVStateAdapter(SMALL))
    assert issubclass(bound, ConformanceMachine) and bound.__name__ == "KVStateAdapterConformance"
    named = conformance_machine(lambda: KVStateAdapter(SMALL), name="Named", max_stop_tokens=0)
    assert named.__name__ == named.__qualname__ == "Named" and named.binding.config.max_stop_tokens == 0
    with pytest.raises(TypeError, match="unexpected keyword"):
        conformance_machine(lambda: KVStateAdapter(SMALL), no_such_option=1)
