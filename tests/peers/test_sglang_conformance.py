"""SGLang 0.5.23's real scheduling classes and KV pools against the spec, through `kvstate.adapters.sglang`.

Bounded runs of the conformance machine (its policy check included: SGLang's declared policy, "sglang") on a pool of
24 token slots shared by up to 4 running requests, so decode passes retract; and scripted workloads: a retraction
replays prompt + outputs with unchanged outputs, refusals change nothing, cancels end a request in every state.
All in one module, so that pytest pays SGLang's import (30-80 s on 2 cores) once.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

pytestmark = pytest.mark.peers
pytest.importorskip("sglang", reason="SGLang is an optional peer: run scripts/install-peers to install it")

from kvstate import load_spec, roles  # noqa: E402
from kvstate.adapters.sglang import SGLangAdapter  # noqa: E402
from kvstate.testing import SchedulerAdapter, conformance_machine  # noqa: E402

SPEC = load_spec()
SHAPE = dict(gpu_tokens=24, max_running_requests=4)
MAX_EXAMPLES = None if os.environ.get("KVSTATE_HYPOTHESIS_PROFILE") == "long" else 25

SGLangMachine = conformance_machine(lambda: SGLangAdapter(**SHAPE), name="SGLangMachine")
TestSGLang = SGLangMachine.TestCase
TestSGLang.settings = settings(
    TestSGLang.settings,
    stateful_step_count=30,
    **({} if MAX_EXAMPLES is None else {"max_examples": min(MAX_EXAMPLES, settings().max_examples)}),
)


def run_to_completion(adapter: SGLangAdapter, limit: int = 400) -> set[str]:
    seen: set[str] = set()
    for _ in range(limit):
        states = adapter.states()
        seen |= set(states.values())
        if all(s == SPEC.role(roles.ENDED) for s in states.values()):
            return seen
        adapter.step()
    raise AssertionError(f"not done after {limit} steps: {adapter.states()}")


def test_the_adapter_satisfies_the_protocol_and_checks_sglangs_policy() -> None:
    adapter = SGLangAdapter(**SHAPE)
    assert isinstance(adapter, SchedulerAdapter)
    assert (adapter.gpu_token_capacity, adapter.block_size) == (22, 1)  # PrefillAdder: total + overhead 1 < free
    assert SGLangMachine.binding.checks_policy and SGLangMachine.binding.policy_name == "preset 'sglang'"
    usage = adapter.block_usage()
    assert usage["gpu_capacity"] == usage["gpu_free"] == 24 and usage["host_capacity"] == 0
    assert adapter.set_host_capacity(8) is False


def test_retraction_replays_prompt_and_outputs_with_unchanged_outputs() -> None:
    adapter = SGLangAdapter(**SHAPE)
    prompts = [[i, 1, 2, 3] for i in range(4)]
    ids = [adapter.submit(p, 10, ()) for p in prompts]  # 4 x 13 slots at the end > 24: SGLang must retract
    seen = run_to_completion(adapter)
    assert SPEC.role(roles.DROPPED) in seen
    victims = [d for p in adapter.take_passes() for d in p.record.decisions]
    assert victims, "no decode pass retracted"
    assert [adapter.outputs()[i] for i in ids] == [adapter.reference(p, 10, ()) for p in prompts]
    assert adapter.block_usage()["gpu_held"] == 0


@pytest.mark.parametrize(
    "prompt, max_new_tokens, message",
    [([], 1, "empty prompt"), ([1000], 1, "outside the vocabulary"), ([1] * 20, 3, "exceeds 22")],
)
def test_refusals_are_value_errors_that_change_nothing(prompt, max_new_tokens, message) -> None:
    adapter = SGLangAdapter(**SHAPE)
    with pytest.raises(ValueError, match=message):
        adapter.submit(prompt, max_new_tokens, ())
    assert adapter.states() == {} and adapter.block_usage()["gpu_free"] == 24


def test_cancel_ends_a_waiting_and_a_running_request_and_frees_their_slots() -> None:
    adapter = SGLangAdapter(**SHAPE)
    running = adapter.submit([1, 2, 3], 8, ())
    adapter.step()
    waiting = adapter.submit([4, 5, 6], 8, ())
    assert adapter.states() == {running: SPEC.role(roles.ACTIVE), waiting: SPEC.role(roles.QUEUED)}
    adapter.cancel(waiting)
    adapter.cancel(running)
    adapter.cancel(running)  # a finished request: nothing happens
    assert set(adapter.states().values()) == {SPEC.role(roles.ENDED)}
    adapter.step()
    assert adapter.block_usage()["gpu_held"] == 0
    with pytest.raises(LookupError):
        adapter.cancel("no such id")
