"""vLLM 0.33.0's real v1 scheduler and KV cache manager against the spec, through `kvstate.adapters.vllm`.

Bounded runs of the reusable conformance machine: prefix caching off and on; chunked prefill (token budget 8,
prompts up to 32 tokens); memory pressure that forces preemption (8 blocks of 4 tokens, bursts of arrivals);
cancels in every state (a rule of the machine). Examples per run: the active profile's count, capped at
`MAX_EXAMPLES` so that `.ci/run` stays short; KVSTATE_HYPOTHESIS_PROFILE=long lifts the cap (a soak).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

pytestmark = pytest.mark.peers
pytest.importorskip("vllm", reason="vLLM is an optional peer: run scripts/install-peers to install it")

from kvstate.adapters.vllm import VLLMAdapter  # noqa: E402
from kvstate.testing import SchedulerAdapter, conformance_machine  # noqa: E402

MAX_EXAMPLES = None if os.environ.get("KVSTATE_HYPOTHESIS_PROFILE") == "long" else 40
STEPS = 40

# 8 blocks of 4 tokens (32-token requests fit alone), a token budget of 8 per step: prompts longer than 8 tokens
# are prefilled in chunks, and two or three requests exhaust the blocks, so vLLM preempts.
SHAPE = dict(gpu_blocks=8, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)

NoPrefixCacheMachine = conformance_machine(lambda: VLLMAdapter(**SHAPE), name="NoPrefixCacheMachine")
PrefixCacheMachine = conformance_machine(lambda: VLLMAdapter(prefix_caching=True, **SHAPE), name="PrefixCacheMachine")

TestNoPrefixCache = NoPrefixCacheMachine.TestCase
TestPrefixCache = PrefixCacheMachine.TestCase
for _case in (TestNoPrefixCache, TestPrefixCache):
    _case.settings = settings(
        _case.settings,
        stateful_step_count=STEPS,
        **({} if MAX_EXAMPLES is None else {"max_examples": min(MAX_EXAMPLES, settings().max_examples)}),
    )
del _case


def test_the_adapter_satisfies_the_protocol_and_reports_vllm_block_pool() -> None:
    adapter = VLLMAdapter(**SHAPE)
    assert isinstance(adapter, SchedulerAdapter)
    assert (adapter.gpu_token_capacity, adapter.block_size, adapter.vocab_size) == (32, 4, 1000)
    usage = adapter.block_usage()
    assert usage["gpu_capacity"] == 8 and usage["gpu_free"] == 8 and usage["gpu_held"] == 0
    assert usage["host_capacity"] == 0 and adapter.set_host_capacity(8) is False
