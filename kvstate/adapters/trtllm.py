"""A `kvstate.testing.SchedulerAdapter` around TensorRT-LLM's own `KVCacheV2Scheduler`, read from a user's checkout.

TensorRT-LLM is not installable from PyPI, and nothing of it is copied here: `load_scheduler(source)` loads
`tensorrt_llm/_torch/pyexecutor/scheduler/scheduler_v2.py` from the checkout named by `source` or the environment
variable `KVSTATE_TRTLLM_SRC`, over the project's own stand-ins for what it imports
(`kvstate.adapters._trtllm_standins`): its enums and logger, the request (`TrtRequest`, the ~20 attributes the
scheduler reads) and `KVCacheManagerV2`, played by `PagePool`, a page pool with a GPU tier and an optional host
tier whose pages hold the token each KV slot computed.

`step()` is one iteration: `schedule_request(active_requests, set())`; every scheduled context chunk writes its
tokens into the request's GPU pages, a chunk that ends the prompt and every generation step "samples"
`kvstate.sim.next_token` of the context *read back* from the pages, a request that reaches its budget or a stop
token completes (`free_resources`). With `overlap=True` the executor is TensorRT-LLM's overlap executor as the
scheduler sees it: a request whose final token was produced stays `GENERATION_TO_COMPLETE`, with its pages, through
the next `schedule_request`, and is completed after it.

`PagePool` semantics (the project's, chosen to match what the scheduler's docstrings and its deadlock message
say of the real manager): `suspend_request` moves a request's pages to the host tier when it exists and has room
for all of them (the eager schedule of the spec's lazy suspension: the real manager holds them on the GPU and moves
them down when an allocation needs the room), and otherwise leaves them on the GPU, held (the request is suspended
but frees nothing);
`prepare_context` / `try_allocate_generation` resume a suspended request first (its pages back to the GPU, or
reactivated in place) and fail when the GPU lacks room; `resize_context` / `try_allocate_generation` grow a cache
page by page and fail, changing nothing, when the GPU lacks room.

Mapping onto the spec (roles): no cache yet -> queued; a suspended cache -> offloaded (the scheduler put it in its
paused list), wherever its pages are (the held residency allows either tier); an active cache -> active;
`GENERATION_COMPLETE` -> ended. The policy declared is `"trtllm"` (`kvstate.declared.PRESETS`); victims are
reported with their requester, the request whose allocation was being tried, and each pass's snapshot carries the
host tier's free pages, every request's host pages and the order of those held on the GPU, so a suspension the host
tier cannot take (one that frees nothing, as every suspension without a host tier) breaks the declared SUSPEND-ROOM.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Hashable, Sequence
from pathlib import Path
from types import ModuleType

from kvstate import roles
from kvstate.adapters import _trtllm_standins as standins
from kvstate.adapters._trtllm_standins import LlmRequestState
from kvstate.config import RequestRejected
from kvstate.declared import Listed, ObservedPass, PassOutput
from kvstate.errors import KVStateError
from kvstate.policy import PassRecord, PassSnapshot, RequestSnapshot, Victim
from kvstate.pool import ceil_div
from kvstate.sim import DEFAULT_VOCAB, next_token, reference_output
from kvstate.spec import Spec, default_spec

__all__ = ["SCHEDULER_FILE", "SOURCE_ENV", "PagePool", "TrtRequest", "TrtllmAdapter", "load_scheduler"]

SOURCE_ENV = "KVSTATE_TRTLLM_SRC"
SCHEDULER_FILE = "tensorrt_llm/_torch/pyexecutor/scheduler/scheduler_v2.py"
_MODULE = "tensorrt_llm._torch.pyexecutor.scheduler.scheduler_v2"


class CheckoutMissing(KVStateError, LookupError):
    """No TensorRT-LLM checkout was named, or it has no scheduler_v2.py."""


def checkout(source: str | os.PathLike | None = None) -> Path:
    """The scheduler file of the checkout `source` (default: `$KVSTATE_TRTLLM_SRC`)."""
    root = source if source is not None else os.environ.get(SOURCE_ENV)
    if not root:
        raise CheckoutMissing(
            f"no TensorRT-LLM checkout named: set {SOURCE_ENV} to a TensorRT-LLM source tree (one holding "
            f"{SCHEDULER_FILE}) or pass source="
        )
    path = Path(root) / SCHEDULER_FILE
    if not path.is_file():
        raise CheckoutMissing(f"{path} does not exist: {SOURCE_ENV} (or source=) must name a TensorRT-LLM checkout")
    return path


def load_scheduler(source: str | os.PathLike | None = None) -> ModuleType:
    """The checkout's `scheduler_v2` module, loaded over the stand-ins (once per file per process)."""
    path = checkout(source)
    loaded = sys.modules.get(_MODULE)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return loaded
    standins.install(TrtRequest, PagePool)
    spec = importlib.util.spec_from_file_location(_MODULE, path)
    if spec is None or spec.loader is None:
        raise CheckoutMissing(f"{path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MODULE] = module
    spec.loader.exec_module(module)
    return module


class TrtRequest:
    """What `KVCacheV2Scheduler` reads of an `LlmRequest`, for one request of the adapter."""

    def __init__(self, request_id: int, prompt: Sequence[int], max_new: int, stops: Sequence[int]) -> None:
        self.request_id = self.py_request_id = request_id
        self.prompt, self.max_new, self.stops = list(prompt), max_new, tuple(stops)
        self.generated: list[int] = []
        self.state = LlmRequestState.CONTEXT_INIT
        self.context_current_position = 0
        self.context_chunk_size = len(self.prompt)
        self.lora_task_id = None
        self.py_batch_idx = None
        self.py_multimodal_data = None
        self.encoder_output_len = None

    @property
    def state_value(self) -> int:
        return self.state.value

    @property
    def is_context_init_state(self) -> bool:
        return self.state == LlmRequestState.CONTEXT_INIT

    @property
    def is_generation_in_progress_state(self) -> bool:
        return self.state in (LlmRequestState.GENERATION_IN_PROGRESS, LlmRequestState.GENERATION_TO_COMPLETE)

    @property
    def is_generation_to_complete_state(self) -> bool:
        return self.state == LlmRequestState.GENERATION_TO_COMPLETE

    @property
    def is_first_context_chunk(self) -> bool:
        return self.context_current_position == 0

    @property
    def is_last_context_chunk(self) -> bool:
        return self.context_current_position + self.context_chunk_size >= len(self.prompt)

    @property
    def context_remaining_length(self) -> int:
        return len(self.prompt) - self.context_current_position

    def get_beam_width_by_iter(self, for_next_iteration: bool = False) -> int:
        return 1

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated


class _Cache:
    def __init__(self) -> None:
        self.capacity = 0  # tokens
        self.gpu: list[int] = []  # page ids
        self.host: list[int] = []
        self.active = True


class PagePool:
    """`KVCacheManagerV2` for the scheduler: pages of `tokens_per_block` slots in a GPU tier and an optional host
    tier (see the module docstring). Invariants: a page is free or in exactly one cache; a cache's pages are all in
    one tier; a slot holds the token whose KV it stores (-1: never written)."""

    enable_block_reuse = False
    kv_connector_manager = None
    _has_cp_helix = False
    enable_joint_kv_cache_reuse = False
    block_reuse_policy = standins.BlockReusePolicy.PER_REQUEST

    def __init__(self, gpu_pages: int, host_pages: int, tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        self.free_gpu = list(range(gpu_pages))
        self.free_host = list(range(host_pages))
        self.gpu_slots = [[-1] * tokens_per_block for _ in range(gpu_pages)]
        self.host_slots = [[-1] * tokens_per_block for _ in range(host_pages)]
        self.kv_cache_map: dict[int, _Cache] = {}
        self.gpu_capacity, self.host_capacity = gpu_pages, host_pages
        self.asking: TrtRequest | None = None  # the request whose allocation the scheduler is trying
        self.suspensions: list[tuple[int, int]] = []  # (requester, victim) in the order the scheduler suspended them

    @property
    def can_evict(self) -> bool:
        return self.host_capacity > 0

    has_cache_tier_below_gpu = can_evict

    # ---- the scheduler's API
    def prepare_context(self, req: TrtRequest, reuse_limit: int | None = None) -> bool:
        cache = self.kv_cache_map.setdefault(req.py_request_id, _Cache())
        return self._resume(cache)

    def resize_context(self, req: TrtRequest, num_tokens: int) -> bool:
        return self._grow(self.kv_cache_map[req.py_request_id], req.context_current_position + num_tokens)

    def try_allocate_generation(self, req: TrtRequest) -> bool:
        self.asking = req
        cache = self.kv_cache_map[req.py_request_id]
        return self._resume(cache) and self._grow(cache, len(req.tokens))

    def revert_allocate_generation(self, req: TrtRequest) -> None:
        cache = self.kv_cache_map[req.py_request_id]
        cache.capacity -= 1
        while len(cache.gpu) > ceil_div(cache.capacity, self.tokens_per_block):
            self.free_gpu.append(cache.gpu.pop())

    def suspend_request(self, req: TrtRequest) -> None:
        requester = self.asking.py_request_id if self.asking is not None else req.py_request_id
        self.suspensions.append((requester, req.py_request_id))
        cache = self.kv_cache_map[req.py_request_id]
        cache.active = False
        if cache.gpu and len(self.free_host) >= len(cache.gpu):
            cache.host = [self.free_host.pop() for _ in cache.gpu]
            for src, dst in zip(cache.gpu, cache.host, strict=True):
                self.host_slots[dst] = list(self.gpu_slots[src])
            self.free_gpu += cache.gpu
            cache.gpu = []

    @property
    def held(self) -> list[int]:
        """The suspended requests whose pages are still on the GPU (held there), in the order they were suspended."""
        return [rid for rid, cache in self.kv_cache_map.items() if not cache.active and cache.gpu]

    def is_request_active(self, request_id: int) -> bool:
        cache = self.kv_cache_map.get(request_id)
        return cache is not None and cache.active

    def has_active_cache(self, req: TrtRequest) -> bool:
        return self.is_request_active(req.py_request_id)

    def free_resources(self, req: TrtRequest) -> None:
        cache = self.kv_cache_map.pop(req.py_request_id, None)
        if cache is not None:
            self.free_gpu += cache.gpu
            self.free_host += cache.host

    preempt_request = free_resources

    # ---- helpers
    def _resume(self, cache: _Cache) -> bool:
        if cache.active:
            return True
        if cache.host:
            if len(self.free_gpu) < len(cache.host):
                return False
            cache.gpu = [self.free_gpu.pop() for _ in cache.host]
            for src, dst in zip(cache.host, cache.gpu, strict=True):
                self.gpu_slots[dst] = list(self.host_slots[src])
            self.free_host += cache.host
            cache.host = []
        cache.active = True
        return True

    def _grow(self, cache: _Cache, tokens: int) -> bool:
        missing = ceil_div(tokens, self.tokens_per_block) - len(cache.gpu)
        if missing > len(self.free_gpu):
            return False
        cache.gpu += [self.free_gpu.pop() for _ in range(max(missing, 0))]
        cache.capacity = max(cache.capacity, tokens)
        return True

    def write(self, req: TrtRequest, position: int, token: int) -> None:
        page = self.kv_cache_map[req.py_request_id].gpu[position // self.tokens_per_block]
        self.gpu_slots[page][position % self.tokens_per_block] = token

    def context(self, req: TrtRequest, length: int) -> list[int]:
        pages = self.kv_cache_map[req.py_request_id].gpu
        size = self.tokens_per_block
        return [self.gpu_slots[pages[p // size]][p % size] for p in range(length)]


class TrtllmAdapter:
    """`SchedulerAdapter` + `PassReporting` over the checkout's `KVCacheV2Scheduler` on a `PagePool`.

    Args:
        gpu_pages, host_pages, tokens_per_block: the pool (host_pages 0: no tier below the GPU).
        max_batch_size, max_num_tokens: the scheduler's budgets.
        chunk_unit_size: context chunking (`ctx_chunk_config=(FCFS, unit)`); None: whole prompts.
        overlap: model the overlap executor (a finished request stays GENERATION_TO_COMPLETE for one more pass).
        source: the TensorRT-LLM checkout (default `$KVSTATE_TRTLLM_SRC`).
    """

    policy = "trtllm"

    def __init__(  # noqa: PLR0913 - keyword-only, one per scheduler or pool setting the tests vary
        self,
        *,
        gpu_pages: int = 8,
        host_pages: int = 8,
        tokens_per_block: int = 4,
        max_batch_size: int = 8,
        max_num_tokens: int | None = 16,
        chunk_unit_size: int | None = None,
        overlap: bool = False,
        vocab_size: int = DEFAULT_VOCAB,
        source: str | os.PathLike | None = None,
        spec: Spec | None = None,
    ) -> None:
        module = load_scheduler(source)
        self.spec = spec if spec is not None else default_spec()
        self._state_of_role = {r: self.spec.role(r) for r in (roles.QUEUED, roles.ACTIVE, roles.OFFLOADED)}
        self._ended = self.spec.role(roles.ENDED)
        self.pool = PagePool(gpu_pages, host_pages, tokens_per_block)
        chunking = (
            None
            if chunk_unit_size is None
            else (standins.ContextChunkingPolicy.FIRST_COME_FIRST_SERVED, chunk_unit_size)
        )
        self.scheduler = module.KVCacheV2Scheduler(
            max_batch_size=max_batch_size,
            max_num_tokens=max_num_tokens,
            kv_cache_manager=self.pool,
            scheduler_policy=standins.CapacitySchedulerPolicy.MAX_UTILIZATION,
            ctx_chunk_config=chunking,
        )
        self.block_size, self.vocab_size, self.overlap = tokens_per_block, vocab_size, overlap
        # a request fits alone when its whole context fits the GPU pages and one pass can prefill its prompt
        self.gpu_token_capacity = gpu_pages * tokens_per_block
        self.max_num_tokens = max_num_tokens
        self.requests: dict[int, TrtRequest] = {}
        self.active: list[TrtRequest] = []
        self._passes: list[ObservedPass] = []

    def __repr__(self) -> str:
        return f"TrtllmAdapter(gpu_pages={self.pool.gpu_capacity}, host_pages={self.pool.host_capacity})"

    # ------------------------------------------------------------------------------------ protocol
    def submit(self, prompt: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = ()) -> Hashable:
        if not prompt or max_new_tokens < 1 or len(prompt) + max_new_tokens > self.gpu_token_capacity:
            raise RequestRejected(
                f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} does not fit "
                f"{self.gpu_token_capacity} GPU token slots (or is empty)"
            )
        if (
            self.max_num_tokens is not None
            and self.scheduler.chunk_unit_size == 0
            and len(prompt) > self.max_num_tokens
        ):
            raise RequestRejected(f"a prompt of {len(prompt)} tokens exceeds max_num_tokens={self.max_num_tokens}")
        rid = len(self.requests)
        request = TrtRequest(rid, prompt, max_new_tokens, stop_token_ids)
        self.requests[rid] = request
        self.active.append(request)
        return rid

    def step(self) -> None:
        before = self._snapshot()
        self.pool.suspensions.clear()
        completing = [r for r in self.active if r.is_generation_to_complete_state]
        out = self.scheduler.schedule_request(list(self.active), set())
        self.pool.asking = None
        for req in out.context_requests:
            chunk = req.context_chunk_size
            for position in range(req.context_current_position, req.context_current_position + chunk):
                self.pool.write(req, position, req.prompt[position])
            req.context_current_position += chunk
            if req.context_current_position >= len(req.prompt):
                req.state = LlmRequestState.GENERATION_IN_PROGRESS
                self._sampled(req)
        for req in out.generation_requests:
            self.pool.write(req, len(req.tokens) - 1, req.tokens[-1])
            self._sampled(req)
        for req in completing:
            self._complete(req)
        record = PassRecord([Victim(a, v, "suspend") for a, v in self.pool.suspensions])
        self._passes.append(ObservedPass(before, record, self._pass_output(before, out)))

    def cancel(self, request_id: Hashable) -> None:
        req = self.requests.get(request_id) if isinstance(request_id, int) else None
        if req is None:
            raise LookupError(f"no request {request_id!r} was submitted to this adapter")
        if req.state != LlmRequestState.GENERATION_COMPLETE:
            self._complete(req)

    def states(self) -> dict[Hashable, str]:
        return {rid: self._state(req) for rid, req in self.requests.items()}

    def outputs(self) -> dict[Hashable, list[int]]:
        return {rid: list(req.generated) for rid, req in self.requests.items()}

    def block_usage(self) -> dict[str, int]:
        pool = self.pool
        return {
            "gpu_capacity": pool.gpu_capacity,
            "gpu_free": len(pool.free_gpu),
            "gpu_held": pool.gpu_capacity - len(pool.free_gpu),
            "gpu_fenced": 0,
            "host_capacity": pool.host_capacity,
            "host_free": len(pool.free_host),
            "host_held": pool.host_capacity - len(pool.free_host),
            "host_fenced": 0,
        }

    def check_invariants(self) -> None:
        pass  # the machine's block and output checks read the pool

    def set_host_capacity(self, blocks: int) -> bool:
        return False  # the host tier is fixed at construction

    def reference(self, prompt: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = ()) -> list[int]:
        return reference_output(prompt, max_new_tokens, stop_token_ids, self.vocab_size)

    def take_passes(self) -> list[ObservedPass]:
        passes, self._passes = self._passes, []
        return passes

    # ------------------------------------------------------------------------------------- helpers
    def _sampled(self, req: TrtRequest) -> None:
        token = next_token(self.pool.context(req, len(req.tokens)), self.vocab_size)
        req.generated.append(token)
        if len(req.generated) >= req.max_new or token in req.stops:
            if self.overlap:
                req.state = LlmRequestState.GENERATION_TO_COMPLETE
            else:
                self._complete(req)

    def _complete(self, req: TrtRequest) -> None:
        req.state = LlmRequestState.GENERATION_COMPLETE
        self.pool.free_resources(req)
        self.active.remove(req)

    def _state(self, req: TrtRequest) -> str:
        if req.state == LlmRequestState.GENERATION_COMPLETE:
            return self._ended
        cache = self.pool.kv_cache_map.get(req.py_request_id)
        if cache is None or (req.is_context_init_state and not cache.gpu and not cache.host):
            return self._state_of_role[roles.QUEUED]
        if not cache.active:  # suspended: its pages on the host, or (no room there) still on the GPU
            return self._state_of_role[roles.OFFLOADED]
        return self._state_of_role[roles.ACTIVE]

    def _snapshot(self) -> PassSnapshot:
        """The requests and the pool just before a pass; a suspended request whose pages stayed on the GPU is held
        there, in the order it was suspended (`PagePool.held`)."""
        held = {rid: rank for rank, rid in enumerate(self.pool.held)}
        requests = tuple(
            RequestSnapshot(
                req.py_request_id,
                self._state(req),
                arrival=req.py_request_id,
                admission=position,
                prefilling=req.is_context_init_state,
                about_to_finish=req.is_generation_to_complete_state,  # its final step is under way (overlap)
                kv_tokens=len(req.tokens),
                gpu_blocks=len(cache.gpu) if (cache := self.pool.kv_cache_map.get(req.py_request_id)) else 0,
                num_output_tokens=len(req.generated),
                prompt_tokens=len(req.prompt),
                host_blocks=len(cache.host) if cache else 0,
                held_rank=held.get(req.py_request_id, -1),
            )
            for position, req in enumerate(self.active)
        )
        return PassSnapshot(
            requests,
            has_host_tier=self.pool.can_evict,
            max_batch_size=self.scheduler.max_num_requests,
            max_num_tokens=self.max_num_tokens or 1 << 30,
            serve_order=tuple(req.py_request_id for req in self.active),
            host_free=len(self.pool.free_host),
        )

    def _pass_output(self, before: PassSnapshot, out) -> PassOutput:
        was = {r.request_id: r.state for r in before.requests}
        offloaded = self._state_of_role[roles.OFFLOADED]

        def listed(reqs) -> tuple[Listed, ...]:
            return tuple(Listed(r.py_request_id, self._state(r)) for r in reqs)

        scheduled = [*out.context_requests, *out.generation_requests]
        return PassOutput(
            context=listed(r for r in out.context_requests if was.get(r.py_request_id) != offloaded),
            generation=listed(r for r in out.generation_requests if was.get(r.py_request_id) != offloaded),
            resumed=listed(r for r in scheduled if was.get(r.py_request_id) == offloaded),
            suspended=listed(out.paused_requests),
            recompute_paused=listed(getattr(out, "recompute_paused_requests", [])),
            chunk_tokens={r.py_request_id: 1 for r in scheduled},
        )
