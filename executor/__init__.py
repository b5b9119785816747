"""executor: the torch side of kvstate — paged KV cache with a device and a host tier, a small Llama-style
model with paged attention, a deterministic sampler, and the engine loop that carries out the scheduler's plan.

`import kvstate` never imports this package (or torch); import `executor` explicitly.
"""

from executor.engine import (
    Engine,
    EngineClosed,
    EngineConfig,
    EngineMisuse,
    HostTierFallbackWarning,
    HostTierLossRefused,
    InvalidTokenId,
    RequestNotActive,
    RunTotals,
    resolve_dtype,
)
from executor.faults import FAULT_KINDS, FaultInjector, FaultPlan, FaultPlanError, FaultSpec
from executor.hf import CheckpointError, load_hf_llama, save_hf_llama
from executor.kv_cache import (
    CompletedFence,
    EventFence,
    Fence,
    HostTierAllocationError,
    MigrationFailed,
    PagedKVCache,
    resolve_device,
)
from executor.model import BatchPlanner, DecodeKV, LlamaModel, ModelConfig, PagedBatch, SeqChunk
from executor.sampler import GREEDY, SamplingParams, draw_seed, sample_token
from executor.trace import TRACE_FIELDS, TraceWriter, read_trace, trace_record

__all__ = [
    "FAULT_KINDS",
    "GREEDY",
    "TRACE_FIELDS",
    "BatchPlanner",
    "CheckpointError",
    "CompletedFence",
    "DecodeKV",
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "EngineMisuse",
    "EventFence",
    "FaultInjector",
    "FaultPlan",
    "FaultPlanError",
    "FaultSpec",
    "Fence",
    "HostTierAllocationError",
    "HostTierFallbackWarning",
    "HostTierLossRefused",
    "InvalidTokenId",
    "LlamaModel",
    "MigrationFailed",
    "ModelConfig",
    "PagedBatch",
    "PagedKVCache",
    "RequestNotActive",
    "RunTotals",
    "SamplingParams",
    "SeqChunk",
    "TraceWriter",
    "draw_seed",
    "load_hf_llama",
    "read_trace",
    "resolve_device",
    "resolve_dtype",
    "sample_token",
    "save_hf_llama",
    "trace_record",
]
