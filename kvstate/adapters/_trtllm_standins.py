"""The project's own stand-ins for what TensorRT-LLM's `scheduler_v2.py` imports, so that the real file, read from a
user's checkout, runs on the CPU without TensorRT-LLM's C++ bindings (as NVIDIA's own scheduler tests run it, with
mocks). Nothing here is TensorRT-LLM code: each name is rebuilt from what the scheduler reads of it.

`install()` registers the modules under TensorRT-LLM's names (`tensorrt_llm.llmapi.llm_args`, `tensorrt_llm.logger`,
`tensorrt_llm._torch.pyexecutor.llm_request`, `...scheduler.scheduler`, and the three places versions of the file
import `KVCacheManagerV2` from), with every name the versions of the file import from them: the request-state enum
numbered as the engine numbers it, the cursor rewind after a dropped cache, the forced-chunk helpers.
Invariant: it never shadows a real TensorRT-LLM (it refuses when one is imported).
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
    """Numbered as the engine numbers its states, so the scheduler's range checks hold: schedulable is
    [CONTEXT_INIT, GENERATION_TO_COMPLETE), and the disaggregated-transfer states lie outside it."""

    UNKNOWN = 0
    ENCODER_INIT = 1
    DISAGG_CONTEXT_WAIT_SCHEDULER = 7
    DISAGG_GENERATION_INIT = 8
    DISAGG_GENERATION_TRANS_IN_PROGRESS = 9
    CONTEXT_INIT = 10
    DISAGG_CONTEXT_INIT_AND_TRANS = 11
    DISAGG_GENERATION_TRANS_COMPLETE = 12
    GENERATION_IN_PROGRESS = 13
    GENERATION_TO_COMPLETE = 14
    GENERATION_COMPLETE = 20
    DISAGG_CONTEXT_TRANS_IN_PROGRESS = 21
    DISAGG_CONTEXT_COMPLETE = 22


def rewind_context_after_cache_drop(req: Any, tokens_per_block: int) -> None:
    """After the scheduler dropped a request's cache, its prefill starts over: the cursor goes back to the first
    context token and the request is a context request again (nothing of its context is computed any more)."""
    req.context_current_position = 0
    req.context_chunk_size = req.context_remaining_length
    req.state = LlmRequestState.CONTEXT_INIT


def _settle_context_cursor(req: Any, reused_tokens: int, tokens_per_block: int) -> None:
    """The prefill resumes after the tokens a prefix match let the request reuse."""
    req.context_current_position = reused_tokens


def _forced_chunk_end(req: Any) -> int:
    """The first snapshot point beyond the request's cursor, or the end of its context when none is left."""
    position = req.context_current_position
    end = position + req.context_remaining_length
    ahead = [point for point in (req.expect_snapshot_points or ()) if position < point < end]
    return min(ahead, default=end)


def _get_forced_context_chunk_size(req: Any) -> int:
    """A forced chunk ends at the next snapshot point (or the end of the context)."""
    return _forced_chunk_end(req) - req.context_current_position


def _is_forced_context_chunk_boundary(req: Any, chunk_size: int) -> bool:
    """A chunk of `chunk_size` tokens ends exactly on a snapshot point."""
    return req.context_current_position + chunk_size in (req.expect_snapshot_points or ())


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
    kv = dict(
        KVCacheManagerV2=pool_class, BlockReusePolicy=BlockReusePolicy, _settle_context_cursor=_settle_context_cursor
    )
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
            rewind_context_after_cache_drop=rewind_context_after_cache_drop,
        ),
        _module(f"{PYEXECUTOR}.scheduler"),
        _module(
            f"{PYEXECUTOR}.scheduler.scheduler",
            RequestList=list,
            RequestScheduler=RequestScheduler,
            SchedulerOutput=SchedulerOutput,
            _get_lora_task_id=lambda req: getattr(req, "lora_task_id", None) or 0,
            _get_forced_context_chunk_size=_get_forced_context_chunk_size,
            _is_forced_context_chunk_boundary=_is_forced_context_chunk_boundary,
            drop_decoder_context_requests_waiting_for_encoder_output=lambda requests: requests,
        ),
        _module(f"{PYEXECUTOR}.resource_manager", **kv),
        _module(f"{PYEXECUTOR}.kv_cache_manager_v2", **kv),
        _module(f"{PYEXECUTOR}.kv_cache"),
        _module(f"{PYEXECUTOR}.kv_cache.kv_cache_manager_v2", **kv),
    ]
    for module in modules:
        sys.modules[module.__name__] = module
