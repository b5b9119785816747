"""The invariants vLLM's scheduler breaks, as replayable regression tests (docs/vllm-findings.md).

Each finding is the step list Hypothesis printed, replayed as plain Python and marked `xfail(strict=True)`: it must
keep failing with the same invariant; if vLLM (or the adapter) changes so that it passes, the strict xfail fails
and the finding must be revisited.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.peers
pytest.importorskip("vllm", reason="vLLM is an optional peer: run scripts/install-peers to install it")

from kvstate.adapters.vllm import VLLMAdapter  # noqa: E402  (first: it selects vLLM's CPU platform)
from kvstate.errors import InvariantViolation  # noqa: E402
from kvstate.testing import Submission, conformance_machine  # noqa: E402

SHAPE = dict(gpu_blocks=8, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)

# Finding 1: vLLM accepts prompt + max_tokens > max_model_len and stops the request there (a design difference).
CappedMachine = conformance_machine(lambda: VLLMAdapter(refuse_capped=False, **SHAPE), name="CappedMachine")


def expect_violation(invariant_id: str, steps) -> None:
    """Run `steps`; re-raise the `InvariantViolation` they raise only if it names `invariant_id`."""
    try:
        steps()
    except InvariantViolation as err:
        assert err.invariant_id == invariant_id, err
        raise


@pytest.mark.xfail(
    raises=InvariantViolation,
    strict=True,
    reason="LIVE-REFUSE, design difference: vLLM caps at max_model_len instead of refusing",
)
def test_finding_1_vllm_accepts_a_request_over_max_model_len() -> None:
    def steps() -> None:  # as Hypothesis printed it (docs/vllm-findings.md)
        state = CappedMachine()
        state.conforms()
        state.submit_invalid(request=Submission(prompt=(0,), max_new_tokens=32, stop_token_ids=()))
        state.teardown()

    expect_violation("LIVE-REFUSE", steps)


def test_finding_1_what_vllm_does_instead_is_cut_the_output_short() -> None:
    adapter = VLLMAdapter(refuse_capped=False, **SHAPE)
    request_id = adapter.submit([0], 32, ())
    for _ in range(64):
        adapter.step()
    request = adapter._requests[request_id]
    assert request.status.name == "FINISHED_LENGTH_CAPPED"
    assert adapter.outputs()[request_id] == adapter.reference([0], 32, ())[:31]  # 1 + 31 = max_model_len 32
    with pytest.raises(ValueError, match="exceeds vLLM's max_model_len=32"):
        VLLMAdapter(**SHAPE).submit([0], 32, ())
