# The names `executor` exports, and their modules: read by type checkers, and by `lazy_loader.attach_stub` in
# `__init__.py`, which imports each module the first time one of its names is used.

from .batch import PagedBatch, SeqChunk
from .checkpoint import load_checkpoint
from .checkpoint_files import CheckpointError
from .decode_kv import DecodeKV
from .decode_plan import BatchPlanner
from .engine import Engine, IterationStats  # kvstate.IterationStats: what Engine.step() and stats() return
from .engine_config import OFFLOAD_POLICIES, EngineConfig, offload_spec, resolve_dtype
from .engine_errors import (
    EngineClosed,
    EngineMisuse,
    HostTierFallbackWarning,
    HostTierLossRefused,
    InvalidTokenId,
    RequestNotActive,
)
from .faults import FAULT_KINDS, FaultInjector, FaultPlan, FaultPlanError, FaultSpec
from .gguf_llama import load_gguf_llama
from .hf import load_hf_llama, save_hf_llama
from .kv_cache import (
    CompletedFence,
    EventFence,
    Fence,
    HostTierAllocationError,
    MigrationFailed,
    PagedKVCache,
    resolve_device,
)
from .model import LlamaModel, ModelConfig
from .run_totals import RunTotals
from .sampler import GREEDY, SamplingParams, draw_seed, sample_token

__all__ = [
    "FAULT_KINDS",
    "GREEDY",
    "OFFLOAD_POLICIES",
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
    "IterationStats",
    "LlamaModel",
    "MigrationFailed",
    "ModelConfig",
    "PagedBatch",
    "PagedKVCache",
    "RequestNotActive",
    "RunTotals",
    "SamplingParams",
    "SeqChunk",
    "draw_seed",
    "load_checkpoint",
    "load_gguf_llama",
    "load_hf_llama",
    "offload_spec",
    "resolve_device",
    "resolve_dtype",
    "sample_token",
    "save_hf_llama",
]
