"""`kvstate.adapters.vllm.VLLMAdapter` on scripted workloads: refusals, the status mapping under preemption, cancels."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.peers
pytest.importorskip("vllm", reason="vLLM is an optional peer: run scripts/install-peers to install it")

from kvstate import load_spec, roles  # noqa: E402
from kvstate.adapters.vllm import VLLMAdapter  # noqa: E402

SPEC = load_spec()
SHAPE = dict(gpu_blocks=8, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)


def run_to_completion(adapter: VLLMAdapter, limit: int = 400) -> set[str]:
    """Step until every request is done, checking the adapter's invariants each step; return the states seen."""
    seen: set[str] = set()
    for _ in range(limit):
        states = adapter.states()
        seen |= set(states.values())
        if all(s == SPEC.role(roles.ENDED) for s in states.values()):
            return seen
        adapter.step()
        adapter.check_invariants()
    raise AssertionError(f"not done after {limit} steps: {adapter.states()}")


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_memory_pressure_preempts_and_replays_with_unchanged_outputs(prefix_caching: bool) -> None:
    adapter = VLLMAdapter(prefix_caching=prefix_caching, **SHAPE)
    prompts = [[0, 1, 2, 3, 4, 5, 6, 7 + i] for i in range(3)]  # a shared 7-token stem: one shared full block
    ids = [adapter.submit(p, 16, ()) for p in prompts]  # 3 x 6 blocks at the end > 8 blocks: vLLM must preempt
    seen = run_to_completion(adapter)
    assert {SPEC.role(roles.DROPPED), SPEC.role(roles.RECOMPUTING)} <= seen
    assert SPEC.role(roles.OFFLOADED) not in seen and SPEC.role(roles.PENDING_RESET) not in seen
    assert [adapter.outputs()[i] for i in ids] == [adapter.reference(p, 16, ()) for p in prompts]
    assert adapter.block_usage()["gpu_held"] == 0


def test_the_models_default_eos_is_not_a_stop_token() -> None:
    """Token 2 is Llama's default EOS; vLLM would stop there unless told to ignore it (the reference does not)."""
    adapter = VLLMAdapter(**SHAPE)
    prompt = next([i] for i in range(1000) if 2 in adapter.reference([i], 12, ())[:11])
    request_id = adapter.submit(prompt, 12, ())
    run_to_completion(adapter)
    output = adapter.outputs()[request_id]
    assert output == adapter.reference(prompt, 12, ()) and len(output) == 12


def test_stop_tokens_end_a_request_after_the_stop_token() -> None:
    adapter = VLLMAdapter(**SHAPE)
    reference = adapter.reference([5, 6], 10, ())
    request_id = adapter.submit([5, 6], 10, (reference[3],))
    run_to_completion(adapter)
    assert adapter.outputs()[request_id] == reference[: reference.index(reference[3]) + 1]


@pytest.mark.parametrize(
    "prompt, max_new_tokens, message",
    [
        ([], 1, "prompt cannot be empty"),
        ([1000], 1, "out of vocabulary"),
        ([1] * 32, 1, "exceeds vLLM's max_model_len=32"),
        ([1] * 30, 3, "exceeds vLLM's max_model_len=32"),
    ],
)
def test_refusals_are_value_errors_that_change_nothing(prompt, max_new_tokens, message) -> None:
    adapter = VLLMAdapter(**SHAPE)
    with pytest.raises(ValueError, match=message):
        adapter.submit(prompt, max_new_tokens, ())
    assert adapter.states() == {} and adapter.block_usage()["gpu_free"] == 8


def test_cancel_ends_a_request_in_any_live_state_and_is_a_no_op_once_done() -> None:
    adapter = VLLMAdapter(**SHAPE)
    waiting, running = adapter.submit([1, 2, 3], 4, ()), adapter.submit([4, 5, 6], 20, ())
    adapter.cancel(waiting)
    adapter.step()
    assert adapter.states()[running] == SPEC.role(roles.ACTIVE)
    adapter.cancel(running)
    assert adapter.states() == {waiting: SPEC.role(roles.ENDED), running: SPEC.role(roles.ENDED)}
    adapter.cancel(running)
    assert adapter.block_usage()["gpu_held"] == 0
    with pytest.raises(LookupError):
        adapter.cancel("no such id")
