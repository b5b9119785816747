"""The project's own stand-ins for what TensorRT-LLM's `scheduler_v2.py` imports, so that the real file, read from a
user's checkout, runs on the CPU without TensorRT-LLM's C++ bindings (as NVIDIA's own scheduler tests run it, with
mocks). Nothing here is TensorRT-LLM code: each name is rebuilt from what the scheduler reads of it.

`install()` registers the modules under TensorRT-LLM's names (`tensorrt_llm.llmapi.llm_args`, `tensorrt_llm.logger`,
`tensorrt_llm._torch.pyexecutor.llm_request`, `...scheduler.scheduler`, and the three places versions of the file
import `KVCacheManagerV2` from). Invariant: it never shadows a real TensorRT-LLM (it refuses when one is imported).
"""

from __future__ import annotations

import enum
import logging
import sys
import types
from dataclasses import dataclass, field
from typing import Any

from kvstate.errors import KVStateError

ROOT = "tensorrt_llm"
PYEXECUTOR = f"{ROOT}._torch.pyexecutor"
_MARK = "__kvstate_standin__"


class CapacitySchedulerPolicy(enum.Enum):
    MAX_UTILIZATION = "MAX_UTILIZATION"
    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
    STATIC_BATCH = "STATIC_BATCH"


class ContextChunkingPolicy(enum.Enum):
    FIRST_COME_FIRST_SERVED = "FIRST_COME_FIRST_SERVED"
    EQUAL_PROGRESS = "EQUAL_PROGRESS"
    FORCE_CHUNK = "FORCE_CHUNK"


class BlockReusePolicy(enum.Enum):
    ALL_REUSABLE = "ALL_REUSABLE"
    PER_REQUEST = "PER_REQUEST"


class LlmRequestState(enum.Enum):
    """Ordered as the scheduler's range checks need: schedulable is [CONTEXT_INIT, GENERATION_TO_COMPLETE)."""

    UNKNOWN = 0
    ENCODER_INIT = 1
    CONTEXT_INIT = 2
    GENERATION_IN_PROGRESS = 3
    GENERATION_TO_COMPLETE = 4
    GENERATION_COMPLETE = 5
    DISAGG_GENERATION_INIT = 8


class RequestScheduler:
    """The base class the scheduler derives from."""


@dataclass
class SchedulerOutput:
    """The scheduler's output: every list the versions of `scheduler_v2.py` fill, by keyword."""

    context_requests: list = field(default_factory=list)
    generation_requests: list = field(default_factory=list)
    paused_requests: list = field(default_factory=list)
    fitting_disagg_gen_init_requests: list = field(default_factory=list)
    num_fitting_requests: int = 0
    encoder_requests: list = field(default_factory=list)
    recompute_paused_requests: list = field(default_factory=list)


class StandinError(KVStateError, RuntimeError):
    """The stand-ins cannot be installed (a real TensorRT-LLM is imported)."""


def _module(name: str, **names: Any) -> types.ModuleType:
    module = types.ModuleType(name, "kvstate's stand-in (kvstate.adapters._trtllm_standins)")
    module.__path__ = []  # every stand-in is a package: relative imports of the loaded file resolve through it
    setattr(module, _MARK, True)
    module.__dict__.update(names)
    return module


def install(request_class: type, pool_class: type) -> None:
    """Register the stand-in modules; `request_class` is `LlmRequest`, `pool_class` is `KVCacheManagerV2`."""
    present = sys.modules.get(ROOT)
    if present is not None and not getattr(present, _MARK, False):
        raise StandinError(
            "a real tensorrt_llm is imported in this process; kvstate.adapters.trtllm runs scheduler_v2.py on its "
            "own stand-ins for TensorRT-LLM's bindings, which would shadow it: run it in a process without it"
        )
    kv = dict(KVCacheManagerV2=pool_class, BlockReusePolicy=BlockReusePolicy)
    modules = [
        _module(ROOT),
        _module(f"{ROOT}.llmapi"),
        _module(
            f"{ROOT}.llmapi.llm_args",
            CapacitySchedulerPolicy=CapacitySchedulerPolicy,
            ContextChunkingPolicy=ContextChunkingPolicy,
        ),
        _module(f"{ROOT}.logger", logger=logging.getLogger("kvstate.trtllm")),
        _module(f"{ROOT}._torch"),
        _module(PYEXECUTOR),
        _module(
            f"{PYEXECUTOR}.llm_request",
            LlmRequest=request_class,
            LlmRequestState=LlmRequestState,
            get_draft_token_length=lambda req: 0,
        ),
        _module(f"{PYEXECUTOR}.scheduler"),
        _module(
            f"{PYEXECUTOR}.scheduler.scheduler",
            RequestList=list,
            RequestScheduler=RequestScheduler,
            SchedulerOutput=SchedulerOutput,
            _get_lora_task_id=lambda req: getattr(req, "lora_task_id", None) or 0,
            drop_decoder_context_requests_waiting_for_encoder_output=lambda requests: requests,
        ),
        _module(f"{PYEXECUTOR}.resource_manager", **kv),
        _module(f"{PYEXECUTOR}.kv_cache_manager_v2", **kv),
        _module(f"{PYEXECUTOR}.kv_cache"),
        _module(f"{PYEXECUTOR}.kv_cache.kv_cache_manager_v2", **kv),
    ]
    for module in modules:
        sys.modules[module.__name__] = module
