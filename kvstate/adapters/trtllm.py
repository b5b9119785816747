"""A `kvstate.testing.SchedulerAdapter` around TensorRT-LLM's own `KVCacheV2Scheduler`, read from a user's checkout.

TensorRT-LLM is not installable from PyPI, and nothing of it is copied here: `load_scheduler(source)` loads
`tensorrt_llm/_torch/pyexecutor/scheduler/scheduler_v2.py` from the checkout named by `source` or the environment
variable `KVSTATE_TRTLLM_SRC`, over the project's own stand-ins for what it imports
(`kvstate.adapters._trtllm_standins`): its enums and logger, the request (`TrtRequest`, the ~20 attributes the
scheduler reads) and `KVCacheManagerV2`, played by `PagePool`, a page pool with a GPU tier and an optional host
tier whose pages hold the token each KV slot computed.

`step()` is one iteration: `schedule_request(active_requests, set())`; then, as the engine's executor does, every
request in `recompute_paused_requests` has what is left of its cache freed and is reset for recompute (its prefill
starts over at position 0 on the prompt and every token generated so far); every scheduled context chunk writes its
tokens into the request's GPU pages, a chunk that ends the context and every generation step "samples"
`kvstate.sim.next_token` of the context *read back* from the pages, a request that reaches its budget or a stop
token completes (`free_resources`). With `overlap=True` the executor is TensorRT-LLM's overlap executor as the
scheduler sees it: a request whose final token was produced stays `GENERATION_TO_COMPLETE`, with its pages, through
the next `schedule_request`, and is completed after it.

`PagePool` semantics (the project's, chosen to match the spec's lazy suspension, which the scheduler's comments
describe of the real manager: suspension "keeps the pages"): `suspend_request` leaves a request's pages where they
are, held on the GPU; an allocation that lacks GPU room first offloads held pages of other suspended requests to the
host tier, least recently suspended first, exactly as many as it lacks (each request's once a pass), and fails,
moving nothing, when the host tier cannot take them; `prepare_context` / `try_allocate_generation` resume a
suspended request first (its offloaded pages back to the GPU), `try_allocate_generation` resume and growth all or
nothing; `resize_context` grows a cache page by page; `free_resources` / `preempt_request` release both tiers.

Mapping onto the spec (roles): no cache yet -> queued, or dropped after a recompute-pause; a suspended cache ->
offloaded (the spec's suspended state, whose blocks may be held on the GPU, offloaded, or both); an active cache ->
active, or recomputing while a reset request re-prefills; `GENERATION_COMPLETE` -> ended. The policy declared is
`"trtllm"` (`kvstate.declared.PRESETS`). Each pass reports its decisions in order: suspensions with their requester
(the request whose allocation was being tried), offloads, and recompute-pauses of requests that were computing; a
recompute-pause of a suspended request is no victim choice, and is checked as the edge its output list shows.
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
from kvstate.policy import Offload, PassRecord, PassSnapshot, RequestSnapshot, Victim
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
    """What `KVCacheV2Scheduler` reads of an `LlmRequest`, for one request of the adapter.

    `context` is what its prefill computes: the prompt, or after `reset_for_recompute` the prompt and every token
    generated so far (a replay, which lasts until its last chunk samples a token)."""

    def __init__(self, request_id: int, prompt: Sequence[int], max_new: int, stops: Sequence[int]) -> None:
        self.request_id = self.py_request_id = request_id
        self.prompt, self.max_new, self.stops = list(prompt), max_new, tuple(stops)
        self.generated: list[int] = []
        self.context = list(self.prompt)
        self.replaying = False
        self.state = LlmRequestState.CONTEXT_INIT
        self.context_current_position = 0
        self.context_chunk_size = len(self.context)
        self.lora_task_id = None
        self.py_batch_idx = None
        self.py_multimodal_data = None
        self.encoder_output_len = None
        self.expect_snapshot_points: list[int] = []

    def reset_for_recompute(self) -> None:
        """The executor's reset of a recompute-paused request: its prefill starts over, at position 0, on the prompt
        and every token generated so far."""
        self.context = self.prompt + self.generated
        self.replaying = True
        self.state = LlmRequestState.CONTEXT_INIT
        self.context_current_position = 0
        self.context_chunk_size = len(self.context)
        self.py_batch_idx = None

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
        return self.context_current_position + self.context_chunk_size >= len(self.context)

    @property
    def context_remaining_length(self) -> int:
        return len(self.context) - self.context_current_position

    def get_beam_width_by_iter(self, for_next_iteration: bool = False) -> int:
        return 1

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated


GPU, HOST = "gpu", "host"


class _Cache:
    def __init__(self) -> None:
        self.capacity = 0  # tokens
        self.pages: list[tuple[str, int]] = []  # (tier, page id) of each page, in token order
        self.active = True

    def on(self, tier: str) -> list[int]:
        return [page for where, page in self.pages if where == tier]


class PagePool:
    """`KVCacheManagerV2` for the scheduler: pages of `tokens_per_block` slots in a GPU tier and an optional host
    tier, with lazy suspension (see the module docstring). Invariants: a page is free or in exactly one cache; an
    active cache's pages are all on the GPU; a suspended cache keeps its pages (held on the GPU, or offloaded); a
    slot holds the token whose KV it stores (-1: never written). `decisions` lists, in order, the suspensions and
    offloads since `begin_pass`, and every cache released since then, as a provisional recompute-pause victim of the
    request that was asking (the adapter keeps those the pass's output lists)."""

    enable_block_reuse = False
    kv_connector_manager = None
    _has_cp_helix = False
    enable_joint_kv_cache_reuse = False
    block_reuse_policy = standins.BlockReusePolicy.PER_REQUEST

    def __init__(self, gpu_pages: int, host_pages: int, tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        self.free = {GPU: list(range(gpu_pages)), HOST: list(range(host_pages))}
        self.slots = {
            tier: [[-1] * tokens_per_block for _ in range(n)] for tier, n in ((GPU, gpu_pages), (HOST, host_pages))
        }
        self.kv_cache_map: dict[int, _Cache] = {}
        self.gpu_capacity, self.host_capacity = gpu_pages, host_pages
        self.asking: TrtRequest | None = None  # the request whose allocation the scheduler is trying
        self.suspended_order: list[int] = []  # suspended requests, least recently suspended first
        self.decisions: list[Victim | Offload] = []

    @property
    def free_gpu(self) -> list[int]:
        return self.free[GPU]

    @property
    def free_host(self) -> list[int]:
        return self.free[HOST]

    @property
    def can_evict(self) -> bool:
        return self.host_capacity > 0

    has_cache_tier_below_gpu = can_evict

    def begin_pass(self) -> None:
        self.decisions, self.asking = [], None

    # ---- the scheduler's API
    def prepare_context(self, req: TrtRequest, reuse_limit: int | None = None) -> bool:
        self.asking = req
        cache = self.kv_cache_map.setdefault(req.py_request_id, _Cache())
        return self._resume(req, cache)

    def resize_context(self, req: TrtRequest, num_tokens: int) -> bool:
        self.asking = req
        return self._grow(req, req.context_current_position + num_tokens)

    def try_allocate_generation(self, req: TrtRequest) -> bool:
        """Resume (when suspended) and grow by the decode step, all or nothing: a refused allocation moves no page
        of the request."""
        self.asking = req
        cache = self.kv_cache_map[req.py_request_id]
        growth = max(0, ceil_div(len(req.tokens), self.tokens_per_block) - len(cache.pages))
        if not self._make_room(req, growth + (0 if cache.active else len(cache.on(HOST)))):
            return False
        return self._resume(req, cache) and self._grow(req, len(req.tokens))

    def revert_allocate_generation(self, req: TrtRequest) -> None:
        cache = self.kv_cache_map[req.py_request_id]
        cache.capacity -= 1
        while len(cache.pages) > ceil_div(cache.capacity, self.tokens_per_block):
            self.free[GPU].append(cache.pages.pop()[1])

    def suspend_request(self, req: TrtRequest) -> None:
        """Lazy suspension: the cache stops being active and keeps its pages on the GPU (held)."""
        requester = self.asking.py_request_id if self.asking is not None else req.py_request_id
        self.decisions.append(Victim(requester, req.py_request_id, "suspend"))
        cache = self.kv_cache_map[req.py_request_id]
        if cache.active:
            cache.active = False
            self.suspended_order.append(req.py_request_id)

    @property
    def held(self) -> list[int]:
        """The suspended requests with pages still on the GPU, least recently suspended first (the offload order)."""
        return [rid for rid in self.suspended_order if self.kv_cache_map[rid].on(GPU)]

    def is_request_active(self, request_id: int) -> bool:
        cache = self.kv_cache_map.get(request_id)
        return cache is not None and cache.active

    def has_active_cache(self, req: TrtRequest) -> bool:
        return self.is_request_active(req.py_request_id)

    def free_resources(self, req: TrtRequest) -> None:
        cache = self.kv_cache_map.pop(req.py_request_id, None)
        if cache is None:
            return
        requester = self.asking.py_request_id if self.asking is not None else req.py_request_id
        self.decisions.append(Victim(requester, req.py_request_id, "recompute_pause"))
        for tier, page in cache.pages:
            self.free[tier].append(page)
        if req.py_request_id in self.suspended_order:
            self.suspended_order.remove(req.py_request_id)

    preempt_request = free_resources

    # ---- helpers
    def _make_room(self, req: TrtRequest, pages: int) -> bool:
        """At least `pages` free GPU pages, offloading held pages of other suspended requests, least recently
        suspended first, exactly as many as missing, each request's once a pass (the storage manager's copy is
        asynchronous); nothing moves when the host tier cannot take them all."""
        missing = pages - len(self.free[GPU])
        if missing <= 0:
            return True
        offloaded = {d.request for d in self.decisions if isinstance(d, Offload)}  # one copy per request and pass
        donors = [rid for rid in self.held if rid != req.py_request_id and rid not in offloaded]
        movable = sum(len(self.kv_cache_map[rid].on(GPU)) for rid in donors)
        if min(movable, len(self.free[HOST])) < missing:
            return False
        for rid in donors:
            if missing == 0:
                break
            moved = self._offload(self.kv_cache_map[rid], missing)
            self.decisions.append(Offload(req.py_request_id, rid, moved))
            missing -= moved
        return True

    def _offload(self, cache: _Cache, most: int) -> int:
        """Move up to `most` of `cache`'s GPU pages (its last ones first) to the host tier; how many moved."""
        moved = 0
        for index in reversed(range(len(cache.pages))):
            tier, page = cache.pages[index]
            if tier != GPU or moved == most:
                continue
            cache.pages[index] = self._copy(page, GPU, HOST)
            moved += 1
        return moved

    def _copy(self, page: int, src: str, dst: str) -> tuple[str, int]:
        target = self.free[dst].pop()
        self.slots[dst][target] = list(self.slots[src][page])
        self.free[src].append(page)
        return dst, target

    def _resume(self, req: TrtRequest, cache: _Cache) -> bool:
        if cache.active:
            return True
        if not self._make_room(req, len(cache.on(HOST))):
            return False
        cache.pages = [self._copy(page, HOST, GPU) if tier == HOST else (tier, page) for tier, page in cache.pages]
        cache.active = True
        self.suspended_order.remove(req.py_request_id)
        return True

    def _grow(self, req: TrtRequest, tokens: int) -> bool:
        cache = self.kv_cache_map[req.py_request_id]
        missing = ceil_div(tokens, self.tokens_per_block) - len(cache.pages)
        if missing > 0 and not self._make_room(req, missing):
            return False
        cache.pages += [(GPU, self.free[GPU].pop()) for _ in range(max(missing, 0))]
        cache.capacity = max(cache.capacity, tokens)
        return True

    def write(self, req: TrtRequest, position: int, token: int) -> None:
        tier, page = self.kv_cache_map[req.py_request_id].pages[position // self.tokens_per_block]
        self.slots[tier][page][position % self.tokens_per_block] = token

    def context(self, req: TrtRequest, length: int) -> list[int]:
        pages = self.kv_cache_map[req.py_request_id].pages
        size = self.tokens_per_block
        return [self.slots[pages[p // size][0]][pages[p // size][1]][p % size] for p in range(length)]


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
        self._state_of_role = {
            r: self.spec.role(r)
            for r in (roles.QUEUED, roles.ACTIVE, roles.OFFLOADED, roles.DROPPED, roles.RECOMPUTING)
        }
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
        self.pool.begin_pass()
        completing = [r for r in self.active if r.is_generation_to_complete_state]
        out = self.scheduler.schedule_request(list(self.active), set())
        self.pool.asking = None
        record = self._record(before, out)
        for req in out.recompute_paused_requests:  # the executor frees what is left, then resets for recompute
            self.pool.free_resources(req)
            req.reset_for_recompute()
        for req in out.context_requests:
            chunk = req.context_chunk_size
            for position in range(req.context_current_position, req.context_current_position + chunk):
                self.pool.write(req, position, req.context[position])
            req.context_current_position += chunk
            if req.context_current_position >= len(req.context):
                req.state = LlmRequestState.GENERATION_IN_PROGRESS
                req.replaying = False
                self._sampled(req)
        for req in out.generation_requests:
            self.pool.write(req, len(req.tokens) - 1, req.tokens[-1])
            self._sampled(req)
        for req in completing:
            self._complete(req)
        self._passes.append(ObservedPass(before, record, self._pass_output(before, out)))

    def _record(self, before: PassSnapshot, out) -> PassRecord:
        """The pass's decisions in order: suspensions and offloads as the pool saw them, and each recompute-pause of
        a request that was computing just before the pass and not suspended in it (a victim of the request that
        asked for the pages). A recompute-pause of a suspended request is no victim choice: the output lists it,
        and its edge (the lifecycle's promotion, `promotion_gate`) is checked there. A released cache the output
        does not list (a failed first chunk dropping its own cache) is no decision."""
        computing = {r.request_id for r in before.requests if r.state in self.spec.victim_states}
        paused = {r.py_request_id for r in out.recompute_paused_requests}
        kept: list[Victim | Offload] = []
        for d in self.pool.decisions:
            if isinstance(d, Victim) and d.event == "recompute_pause":
                suspended = any(isinstance(k, Victim) and k.victim == d.victim for k in kept)
                if d.victim not in paused or d.victim not in computing or suspended:
                    continue
            kept.append(d)
        return PassRecord(list(kept))

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
        if cache is None or (req.is_context_init_state and not cache.pages):
            return self._state_of_role[roles.DROPPED if req.replaying else roles.QUEUED]
        if not cache.active:  # suspended: its pages held on the GPU, offloaded, or both
            return self._state_of_role[roles.OFFLOADED]
        return self._state_of_role[roles.RECOMPUTING if req.replaying else roles.ACTIVE]

    def _next_step_pages(self, req: TrtRequest, cache: _Cache | None) -> int:
        """The GPU pages `req`'s next allocation takes: the pages its decode step or the rest of its prefill adds (a
        chunk takes at most that), and for a suspended request also its offloaded pages: the engine resumes it and
        grows it in the same pass (`try_allocate_generation` in one call, `prepare_context` then `resize_context`)."""
        tokens = len(req.tokens) if not req.is_context_init_state else len(req.context)
        growth = max(0, ceil_div(tokens, self.block_size) - (len(cache.pages) if cache else 0))
        if cache is not None and not cache.active:
            return len(cache.on(HOST)) + growth
        return growth

    def _snapshot(self) -> PassSnapshot:
        """The requests and the pool just before a pass; a suspended request with pages on the GPU is held there,
        ranked by when it was suspended (`PagePool.held`, the offload order)."""
        held = {rid: rank for rank, rid in enumerate(self.pool.held)}
        requests = []
        for position, req in enumerate(self.active):
            cache = self.pool.kv_cache_map.get(req.py_request_id)
            requests.append(
                RequestSnapshot(
                    req.py_request_id,
                    self._state(req),
                    arrival=req.py_request_id,
                    admission=position,
                    prefilling=req.is_context_init_state,
                    about_to_finish=req.is_generation_to_complete_state,  # its final step is under way (overlap)
                    kv_tokens=len(req.tokens),
                    gpu_blocks=len(cache.on(GPU)) if cache else 0,
                    num_output_tokens=len(req.generated),
                    prompt_tokens=len(req.prompt),
                    host_blocks=len(cache.on(HOST)) if cache else 0,
                    held_rank=held.get(req.py_request_id, -1),
                    next_step_blocks=self._next_step_pages(req, cache),
                )
            )
        return PassSnapshot(
            tuple(requests),
            has_host_tier=self.pool.can_evict,
            max_batch_size=self.scheduler.max_num_requests,
            max_num_tokens=self.max_num_tokens or 1 << 30,
            serve_order=self._serve_order(),
            scan_order=tuple(req.py_request_id for req in self.active),
            host_free=len(self.pool.free_host),
        )

    def _serve_order(self) -> tuple[int, ...]:
        """The order `_schedule_loop` serves requests in: its first phase takes every request but context ones in
        active-list order, its second the context requests it deferred, in the same order."""
        first = [req.py_request_id for req in self.active if not req.is_context_init_state]
        deferred = [req.py_request_id for req in self.active if req.is_context_init_state]
        return (*first, *deferred)

    def _pass_output(self, before: PassSnapshot, out) -> PassOutput:
        was = {r.request_id: r.state for r in before.requests}
        offloaded = self._state_of_role[roles.OFFLOADED]
        replaying = {self._state_of_role[roles.DROPPED], self._state_of_role[roles.RECOMPUTING]}

        def listed(reqs) -> tuple[Listed, ...]:
            return tuple(Listed(r.py_request_id, self._state(r)) for r in reqs)

        scheduled = [*out.context_requests, *out.generation_requests]
        fresh = [r for r in out.context_requests if was.get(r.py_request_id) not in {offloaded, *replaying}]
        return PassOutput(
            context=listed(fresh),
            replay=listed(r for r in out.context_requests if was.get(r.py_request_id) in replaying),
            generation=listed(r for r in out.generation_requests if was.get(r.py_request_id) != offloaded),
            resumed=listed(r for r in scheduled if was.get(r.py_request_id) == offloaded),
            suspended=listed(out.paused_requests),
            recompute_paused=listed(out.recompute_paused_requests),
            chunk_tokens={r.py_request_id: 1 for r in scheduled},
        )
