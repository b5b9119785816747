"""What an `Engine` is built from (`EngineConfig`), and the checks made before anything is allocated.

What it keeps true:
* an `EngineConfig` that exists has fields of the right types and a supported dtype; pool sizes and budgets are
  checked by its `SchedulerConfig`;
* only the floating dtypes the paged attention runs in are accepted (`resolve_dtype`);
* pool sizes that cannot fit the device's or the machine's memory are refused (`check_memory`) before the cache is
  allocated;
* a reference run's config (`unpressured`) is the same engine with room for every token, no host tier, no trace,
  no faults and no checks;
* the lifecycle an engine runs is `EngineConfig.spec` (None: the packaged spec); `offload_spec` is a copy of one
  with another offload policy, refused unless the spec's policy vocabulary names it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch

from executor.decode_kv import DECODE_KV_BUDGET_BYTES
from executor.faults import FaultPlan
from executor.host_memory import physical_memory
from executor.kv_cache import block_shape
from executor.model import ModelConfig
from kvstate.config import ConfigError, SchedulerConfig
from kvstate.policy import VOCABULARY
from kvstate.spec import Spec, default_spec

OFFLOAD_POLICIES: tuple[str, ...] = tuple(VOCABULARY["offload"])  # the values of the spec's `[policy] offload`

_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """None: float64 on the CPU (the deterministic oracle), float32 on CUDA (with TF32 disabled by the engine).
    Only the floating dtypes of `_DTYPES` are accepted (`ConfigError` otherwise: float8, complex and integer
    dtypes have no paged-attention kernel here)."""
    if dtype is None:
        return torch.float64 if device.type == "cpu" else torch.float32
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, (str, torch.dtype)) else None
    if name not in _DTYPES:
        raise ConfigError(
            f"dtype must be one of {sorted(_DTYPES)} (a name or the torch.dtype), got {dtype!r}; "
            "float8, complex and integer dtypes are not supported"
        )
    return _DTYPES[name]


def check_memory(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse (`ConfigError`) pool sizes that cannot fit: the device tier against the CUDA device's free memory
    (or, on the CPU, both tiers against physical memory), the host tier against physical memory."""
    mc, sc = model_config, config.scheduler
    per_block = dtype.itemsize
    for n in block_shape(mc.num_layers, sc.block_size, mc.num_kv_heads, mc.head_dim):
        per_block *= n
    gpu, host, ram = sc.gpu_blocks * per_block, sc.host_blocks * per_block, physical_memory()
    gib = 1024**3
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if gpu > free:
            raise ConfigError(
                f"gpu_blocks={sc.gpu_blocks} needs {gpu / gib:.2f} GiB of device memory "
                f"({per_block} bytes per block) but {device} has {free / gib:.2f} GiB free; "
                "lower gpu_blocks or block_size"
            )
        needed, what = host, f"host_blocks={sc.host_blocks}"
    else:
        needed, what = gpu + host, f"gpu_blocks={sc.gpu_blocks} + host_blocks={sc.host_blocks}"
    if ram is not None and needed > ram:
        raise ConfigError(
            f"{what} needs {needed / gib:.2f} GiB of host memory ({per_block} bytes per block) but "
            f"this machine has {ram / gib:.2f} GiB; lower them"
        )


@dataclass(frozen=True)
class EngineConfig:
    """Everything an `Engine` is built from: the scheduler's pool sizes, budgets and policies (`scheduler`; its
    `host_blocks` is the host tier to allocate, 0 = none, and its `block_bytes` is set by the engine from the
    model), plus the model, device, dtype, sampling seed, trace and fault settings. `checkpoint` (a Hugging Face
    Llama directory or a GGUF file, `executor.checkpoint`) overrides `model`."""

    scheduler: SchedulerConfig = field(default_factory=lambda: SchedulerConfig(gpu_blocks=256))
    model: ModelConfig = field(default_factory=ModelConfig)
    checkpoint: str | None = None
    weights_seed: int = 0
    device: str = "auto"
    dtype: torch.dtype | str | None = None
    seed: int = 0  # sampling seed (SamplingParams.seed overrides it per request)
    trace_path: str | Path | None = None
    simulate_host_alloc_failure: bool = False  # tests: behave as if the host tier could not be allocated
    check_invariants: bool = False  # run Scheduler.check_invariants around every step (slow; for tests)
    faults: FaultPlan | None = None  # fault injection (executor.faults); None = no injected faults
    verify_host_checksums: bool = False  # CRC-32 every offloaded block; a mismatch on resume replays the request
    decode_kv_bytes: int = DECODE_KV_BUDGET_BYTES  # memory a reused decode plan keeps its keys and values in (DecodeKV)
    spec: Spec | None = None  # the lifecycle and policy the scheduler runs (None: the packaged spec; `offload_spec`)

    def __post_init__(self) -> None:
        """Refuse wrong types and unsupported dtypes here; pool sizes and budgets are checked by `SchedulerConfig`
        and against the device's memory when the `Engine` is built, before anything is allocated."""
        if not isinstance(self.scheduler, SchedulerConfig):
            raise ConfigError(
                f"EngineConfig.scheduler must be a kvstate.SchedulerConfig (pool sizes, budgets and "
                f"policies), got {type(self.scheduler).__name__}; build one with "
                "SchedulerConfig(gpu_blocks=..., host_blocks=..., block_size=...)"
            )
        if self.scheduler.pipeline_stages != 1:
            raise ConfigError(
                f"EngineConfig.scheduler.pipeline_stages is {self.scheduler.pipeline_stages}; keep it 1: "
                "an Engine is one stage, and executor.pipeline sets it to the number of stages it runs"
            )
        if self.faults is not None and not isinstance(self.faults, FaultPlan):
            raise ConfigError(
                f"EngineConfig.faults must be an executor.FaultPlan or None, got "
                f"{type(self.faults).__name__}; build one with FaultPlan.parse or FaultPlan.of"
            )
        _check_field_types(self)
        if not isinstance(self.device, (str, torch.device)):
            raise ConfigError(
                f"EngineConfig.device must be 'auto', 'cpu', 'cuda', 'cuda:N' or a torch.device, got "
                f"{type(self.device).__name__}"
            )
        if self.dtype is not None:
            resolve_dtype(self.dtype, torch.device("cpu"))
        if self.decode_kv_bytes < 0:
            raise ConfigError(
                f"EngineConfig.decode_kv_bytes must be >= 0, got {self.decode_kv_bytes}; 0 keeps nothing (every "
                "decode step gathers its blocks again)"
            )


def _check_field_types(config: EngineConfig) -> None:
    """Refuse (`ConfigError`) a field of `config` of the wrong type: flags, integers, classes and paths."""
    for f in fields(config):
        value, kind = getattr(config, f.name), _FIELD_KINDS.get(f.name)
        if kind is bool and not isinstance(value, bool):
            raise ConfigError(f"EngineConfig.{f.name} must be True or False, got {value!r}")
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"EngineConfig.{f.name} must be an int, got {type(value).__name__} {value!r}")
    for name, cls, how in _FIELD_CLASSES:
        value = getattr(config, name)
        if not isinstance(value, cls) and not (value is None and name == "spec"):
            raise ConfigError(f"EngineConfig.{name} must be {how}, got {type(value).__name__}")
    for name in ("checkpoint", "trace_path"):
        value = getattr(config, name)
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise ConfigError(
                f"EngineConfig.{name} must be a path (str or os.PathLike) or None, got {type(value).__name__}"
            )


def offload_spec(offload: str, spec: Spec | None = None) -> Spec:
    """`spec` (default: the packaged spec) with its policy's `offload` set to `offload` (`OFFLOAD_POLICIES`:
    ``on_demand`` moves held blocks only when an allocation needs the GPU room, ``eager`` moves all of a victim's
    blocks in the pass that suspends it); `spec` itself is returned when it already says so."""
    if offload not in OFFLOAD_POLICIES:
        raise ConfigError(f"offload policy {offload!r} is not one of {', '.join(OFFLOAD_POLICIES)}; pass one of those")
    spec = spec if spec is not None else default_spec()
    if spec.policy.offload == offload:
        return spec
    return replace(spec, policy=replace(spec.policy, offload=offload))


_FIELD_CLASSES = (
    ("model", ModelConfig, "an executor.ModelConfig"),
    ("spec", Spec, "a kvstate.Spec or None (the packaged spec); load one with kvstate.load_spec, or use offload_spec"),
)  # EngineConfig fields checked by class in __post_init__

_FIELD_KINDS = {
    **dict.fromkeys(("weights_seed", "seed", "decode_kv_bytes"), int),
    **dict.fromkeys(("simulate_host_alloc_failure", "check_invariants", "verify_host_checksums"), bool),
}  # EngineConfig fields checked by type in __post_init__ (the scheduler's: SchedulerConfig)


def unpressured(
    config: EngineConfig, *, gpu_blocks: int, max_batch_size: int, prefill_chunk_size: int, max_num_tokens: int
) -> EngineConfig:
    """`config` for a reference run: these sizes (room for every token, so it never preempts), no host tier, no
    trace, no faults, no checks; recompute-pause on (keeps the config valid)."""
    scheduler = replace(
        config.scheduler,
        gpu_blocks=gpu_blocks,
        host_blocks=0,
        max_batch_size=max_batch_size,
        prefill_chunk_size=prefill_chunk_size,
        max_num_tokens=max_num_tokens,
        enable_recompute_pause=True,
    )
    return replace(
        config,
        scheduler=scheduler,
        trace_path=None,
        simulate_host_alloc_failure=False,
        check_invariants=False,
        faults=None,
        verify_host_checksums=False,
    )
