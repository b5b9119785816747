"""vLLM's real v1 `Scheduler` as a benchmark peer: `VLLMDriver` steps it through a `stepping.Workload`.

The scheduler is built by `kvstate.adapters.vllm.VLLMAdapter`, the conformance tests' setup (vLLM's CPU platform
selected before its config is built, a tiny Llama `config.json` written locally as the model, `HF_HUB_OFFLINE=1`,
`skip_tokenizer_init`, a `KVCacheConfig` of one `FullAttentionSpec` group without tensors; every request passes
vLLM's own input processing), and then driven directly, without the adapter's KV simulation: `schedule()`, then
`update_from_output()` with the `ModelRunnerOutput` a model runner returns (one sampled token for each request
whose every known token now has KV, none for a prefill chunk that is not the last). vLLM preempts by recompute
only. Importing this module needs vLLM 0.33.0 (`scripts/install-peers`); `executor.bench.peers` reports its
absence as "not installed".
"""

from __future__ import annotations

import logging
import os

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # before vLLM's first import: no configuration chatter
logging.getLogger("vllm").setLevel(logging.ERROR)  # also where vLLM leaves its logging unconfigured

# The adapter first (it selects vLLM's CPU platform before any other vLLM module is imported).
from kvstate.adapters.vllm import VLLM_VERSION, VLLMAdapter  # noqa: E402, I001
from executor.bench.stepping import BLOCK_SIZE, CLOCK, TOKEN, Driver, Workload  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402


class VLLMDriver(Driver):
    """vLLM's scheduler on a workload, settled into its regime; every `step()` is one full iteration
    (`stepping.Driver`)."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        longest = max(len(p) for p in workload.prompts) + workload.max_new_tokens
        adapter = VLLMAdapter(
            gpu_blocks=workload.gpu_blocks,
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=workload.token_budget,
            max_num_seqs=workload.size,
            max_model_len=longest,
            deep_checks=False,
        )
        for prompt in workload.prompts:
            adapter.submit(prompt, workload.max_new_tokens)
        self.scheduler = adapter.scheduler
        self.settle()

    def step(self) -> None:
        scheduler = self.scheduler
        start = CLOCK()
        out = scheduler.schedule()
        scheduled = CLOCK()
        reply = self._model_reply(out)
        replied = CLOCK()
        scheduler.update_from_output(out, reply)
        end = CLOCK()
        self.record(
            scheduled - start,
            (scheduled - start) + (end - replied),
            len(out.num_scheduled_tokens),
            len(out.preempted_req_ids or ()),
        )

    def _model_reply(self, out) -> ModelRunnerOutput:
        """What the model runner returns for `out` (schedule() has already advanced the computed tokens)."""
        requests = self.scheduler.requests
        ids = list(out.num_scheduled_tokens)
        sampled = [[TOKEN] if requests[i].num_computed_tokens >= requests[i].num_tokens else [] for i in ids]
        return ModelRunnerOutput(
            req_ids=ids, req_id_to_index={i: n for n, i in enumerate(ids)}, sampled_token_ids=sampled
        )


__all__ = ["VLLM_VERSION", "VLLMDriver"]
