"""The engine loop: carries out each `SchedulerOutput` on the real paged KV cache and model.

One `step()` mirrors `kvstate.sim.SimExecutor.step` with tensors:

1. ``out = scheduler.schedule()``;
2. issue every migration plan of ``out`` (suspend: GPU -> host; resume: host -> GPU) on the copy stream, one
   slice copy per run of consecutive block ids, and make the compute stream wait on their fences;
3. one forward pass over every scheduled request's chunk (prefill or replay: ``prefill_tokens[computed:
   computed + n]``; decode: the last generated token), writing K/V into its GPU block table, then sample a token
   for each request whose chunk completes its prefill or decodes;
4. wait on the fences, then ``complete_migrations(out)`` (only now may fenced source blocks be reused);
5. ``complete_step(out, sampled)``.

Recompute-pause needs no executor action: the scheduler frees the blocks and resets the request, and its replay
is an ordinary chunked prefill of prompt + generated tokens.

Faults (`EngineConfig.faults`, a seeded `executor.faults.FaultPlan`; spec/SPEC.md "Faults"): a failed copy is
reported with `Scheduler.fail_migration` before the forward pass (a failed suspend takes `lose_host_copy`, a failed
resume `recompute_pause`; either replays), a host copy whose checksum no longer matches (`verify_host_checksums`)
is treated as a failed resume, and a lost host tier (`lose_host_tier`) replays every suspended request and leaves
the engine GPU-only. The engine keeps serving through all of them and every output still equals its reference.

Invariants kept:
* OUT-EQUIV: every finished request's output equals `Engine.reference` of it (its unpressured run) — the model
  reads only the request's own blocks and the sampler depends only on (seed, request id, position);
* no block of a migration's source is reused before that migration's fence has completed;
* every lifecycle transition is written to the trace (when `trace_path` is set) as it happens;
* a refused call (bad request, unknown id, closed engine) raises a `ValueError` subclass and changes nothing.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from executor.faults import FaultInjector, FaultPlan
from executor.hf import load_hf_llama
from executor.kv_cache import Fence, HostTierAllocationError, MigrationFailed, PagedKVCache, resolve_device
from executor.model import LlamaModel, ModelConfig, PagedBatch, SeqChunk
from executor.sampler import GREEDY, SamplingParams, sample_batch
from executor.trace import TraceWriter
from kvstate.config import ConfigError, RequestRejected, SchedulerConfig, normalize_stop_token_ids
from kvstate.errors import KVStateError, PoolError
from kvstate.output import SchedulerOutput, planned_chunks
from kvstate.pool import TO_GPU, TO_HOST, MigrationPlan
from kvstate.request import Request
from kvstate.scheduler import Scheduler, UnknownRequestId
from kvstate.spec import Transition
from kvstate.stats import IterationStats

_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class InvalidTokenId(RequestRejected):
    """A prompt or stop token id is outside the model's vocabulary; nothing was submitted."""


class HostTierFallbackWarning(RuntimeWarning):
    """The host tier could not be allocated, or was lost mid-run; the engine runs GPU-only (every eviction is a
    recompute-pause)."""


class EngineMisuse(KVStateError, ValueError):
    """The engine's API was called in a way it cannot serve (closed engine, unknown id); nothing changed."""


class EngineClosed(EngineMisuse):
    """`step`, `run`, `stream`, `add_request` or `cancel` was called after `close()`."""


class RequestNotActive(EngineMisuse, UnknownRequestId):
    """`cancel` named a request id that is unknown or already done (also an `UnknownRequestId`)."""


class HostTierLossRefused(EngineMisuse):
    """The host tier was lost while recompute-pause is disabled: no victim could be evicted any more."""


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """None: float64 on the CPU (the deterministic oracle), float32 on CUDA (with TF32 disabled by the engine)."""
    if dtype is None:
        return torch.float64 if device.type == "cpu" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or a torch.dtype, got {dtype!r}") from None


@dataclass(frozen=True)
class EngineConfig:
    """Everything an `Engine` is built from. `checkpoint` (a Hugging Face Llama directory) overrides `model`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    checkpoint: str | None = None
    weights_seed: int = 0
    device: str = "auto"
    dtype: torch.dtype | str | None = None
    gpu_blocks: int = 256
    host_blocks: int = 0  # 0 = no host tier
    block_size: int = 16
    max_batch_size: int = 64
    max_num_tokens: int = 2048
    prefill_chunk_size: int = 512
    enable_recompute_pause: bool = True
    max_preemptions_per_request: int | None = None
    no_progress_limit: int = 64
    seed: int = 0  # sampling seed (SamplingParams.seed overrides it per request)
    trace_path: str | Path | None = None
    simulate_host_alloc_failure: bool = False  # tests: behave as if the host tier could not be allocated
    check_invariants: bool = False  # run Scheduler.check_invariants around every step (slow; for tests)
    faults: FaultPlan | None = None  # fault injection (executor.faults); None = no injected faults
    verify_host_checksums: bool = False  # CRC-32 every suspended block; a mismatch on resume replays the request

    def __post_init__(self) -> None:
        if self.faults is not None and not isinstance(self.faults, FaultPlan):
            raise ConfigError(f"EngineConfig.faults must be an executor.FaultPlan or None, got "
                              f"{type(self.faults).__name__}; build one with FaultPlan.parse or FaultPlan.of")


@dataclass
class RunTotals:
    """Sums over every step of an engine (for summaries)."""

    steps: int = 0
    generated_tokens: int = 0
    recomputed_tokens: int = 0
    scheduled_tokens: int = 0
    blocks_migrated: int = 0
    bytes_migrated: int = 0
    events: Counter = field(default_factory=Counter)  # lifecycle event name -> transitions fired
    faults: Counter = field(default_factory=Counter)  # fault kind -> faults injected (executor.faults)
    failed_copies: int = 0  # migration plans reported failed with Scheduler.fail_migration
    checksum_mismatches: int = 0  # host copies found corrupt on resume (verify_host_checksums)
    host_tier_losses: int = 0  # times the host tier was dropped mid-run (lose_host_tier)

    @property
    def suspensions(self) -> int:
        return self.events["suspend"]

    @property
    def recompute_pauses(self) -> int:
        return self.events["recompute_pause"]


@dataclass(frozen=True, slots=True)
class _Submission:
    prompt: tuple[int, ...]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    sampling: SamplingParams


class Engine:
    """A paged-KV serving engine over the `kvstate` scheduler. Use as a context manager or call `close()`."""

    def __init__(self, config: EngineConfig | None = None, *, model: LlamaModel | None = None) -> None:
        """`model` shares existing weights (it must already be on the configured device and dtype)."""
        self.config = config = config or EngineConfig()
        self._scheduler_config(config.host_blocks, 0)  # refuse bad sizes before allocating anything
        self.device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, self.device)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        if model is None:
            if config.checkpoint is not None:
                model = load_hf_llama(config.checkpoint, dtype=dtype, device=self.device)
            else:
                model = LlamaModel.from_seed(config.model, config.weights_seed, dtype=dtype, device=self.device)
        elif model.device.type != self.device.type or model.dtype != dtype:
            raise ValueError(f"the shared model is {model.dtype} on {model.device}, the engine is configured for "
                             f"{dtype} on {self.device}; move the model or change EngineConfig.device/dtype")
        self.model = model
        mc = model.config
        self.cache = PagedKVCache(config.gpu_blocks, num_layers=mc.num_layers, block_size=config.block_size,
                                  num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, dtype=dtype, device=self.device)
        self.faults = FaultInjector(config.faults) if config.faults is not None else None
        host_blocks, fallback = config.host_blocks, False
        if host_blocks:
            simulate = config.simulate_host_alloc_failure or (
                self.faults is not None and self.faults.fire("host_alloc", 0))
            try:
                self.cache.attach_host_tier(host_blocks, simulate_failure=simulate)
            except HostTierAllocationError as err:
                if not config.enable_recompute_pause:
                    raise ConfigError(
                        f"{err}, and enable_recompute_pause=False: without a host tier no victim could be evicted; "
                        "enable recompute-pause so the engine can fall back to GPU-only operation"
                    ) from err
                warnings.warn(f"{err}; falling back to GPU-only operation (every eviction is a recompute-pause)",
                              HostTierFallbackWarning, stacklevel=2)
                host_blocks, fallback = 0, True
        scheduler_config = self._scheduler_config(host_blocks, self.cache.block_bytes)
        self.scheduler = Scheduler(scheduler_config, on_transition=self._on_transition)
        self.scheduler.host_tier_fallback = fallback
        self.trace = TraceWriter(config.trace_path, self.scheduler) if config.trace_path is not None else None
        self.totals = RunTotals()
        self.last_produced: list[tuple[Hashable, int]] = []
        self._submissions: dict[Hashable, _Submission] = {}
        self._checksums: dict[Hashable, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # id -> (host blocks, CRCs)
        self._closed = False
        if self.faults is not None:
            self.totals.faults = self.faults.injected  # one counter: what the injector fired, by kind

    def _scheduler_config(self, host_blocks: int, block_bytes: int) -> SchedulerConfig:
        c = self.config
        return SchedulerConfig(
            gpu_blocks=c.gpu_blocks, host_blocks=host_blocks, block_size=c.block_size,
            max_batch_size=c.max_batch_size, max_num_tokens=c.max_num_tokens,
            prefill_chunk_size=c.prefill_chunk_size, enable_recompute_pause=c.enable_recompute_pause,
            max_preemptions_per_request=c.max_preemptions_per_request,
            no_progress_limit=c.no_progress_limit, block_bytes=block_bytes,
        )

    # ------------------------------------------------------------------------------------------- requests
    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        *,
        stop_token_ids: Iterable[int] = (),
        sampling: SamplingParams = GREEDY,
        request_id: Hashable | None = None,
    ) -> Hashable:
        """Queue a request; returns its id. Raises `InvalidTokenId`, `RequestRejected` or `EngineClosed`
        (all `ValueError`s; nothing queued, the engine keeps serving)."""
        self._check_open("add_request")
        if hasattr(prompt_token_ids, "tolist"):
            prompt_token_ids = prompt_token_ids.tolist()
        if hasattr(stop_token_ids, "tolist"):
            stop_token_ids = stop_token_ids.tolist()
        stop = normalize_stop_token_ids(stop_token_ids)
        vocab = self.model.config.vocab_size
        for what, ids in (("prompt", prompt_token_ids), ("stop_token_ids", stop)):
            if isinstance(ids, (list, tuple)):
                bad = [t for t in ids if isinstance(t, int) and not isinstance(t, bool) and t >= vocab]
                if bad:
                    raise InvalidTokenId(f"{what} has token id {bad[0]} but the model's vocabulary has {vocab} ids "
                                         f"(0..{vocab - 1}); tokenize with the model's tokenizer")
        if not isinstance(sampling, SamplingParams):
            raise RequestRejected(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        limit = self.model.config.max_position_embeddings
        if isinstance(prompt_token_ids, (list, tuple)) and isinstance(max_new_tokens, int) \
                and not isinstance(max_new_tokens, bool) and len(prompt_token_ids) + max_new_tokens > limit:
            raise RequestRejected(f"prompt ({len(prompt_token_ids)}) + max_new_tokens ({max_new_tokens}) exceeds the "
                                  f"model's max_position_embeddings={limit}; shorten the request")
        request = self.scheduler.submit(prompt_token_ids, max_new_tokens, stop_token_ids=stop, request_id=request_id)
        self._submissions[request.request_id] = _Submission(request.prompt, max_new_tokens, stop, sampling)
        return request.request_id

    def cancel(self, request_id: Hashable) -> None:
        """Cancel an active request (its blocks are freed at once; its partial output stays in `outputs()`).
        Raises `RequestNotActive` (a `ValueError` and an `UnknownRequestId`; nothing changed) for an id that is
        unknown or already done."""
        self._check_open("cancel")
        if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
            raise RequestNotActive(f"cannot cancel {request_id!r}: request ids are str or int, got "
                                   f"{type(request_id).__name__}; pass the id add_request returned")
        try:
            self.scheduler.cancel(request_id)
        except UnknownRequestId as err:
            raise RequestNotActive(str(err)) from None

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise EngineClosed(f"{what}() was called after close(); the engine can still be inspected (outputs(), "
                               "stats(), totals) but not driven: create a new Engine to serve more requests")

    # ------------------------------------------------------------------------------------------- stepping
    def step(self) -> IterationStats:
        """Schedule and carry out one iteration; `last_produced` lists the (request id, token) it produced.
        Injected faults (`EngineConfig.faults`) happen here; the iteration still completes."""
        self._check_open("step")
        scheduler = self.scheduler
        iteration = scheduler.iteration + 1
        if self.faults is not None and scheduler.pool.has_host_tier and self.faults.fire("host_loss", iteration):
            self.lose_host_tier(f"injected fault host_loss at iteration {iteration}")
        out = scheduler.schedule()
        if self.config.check_invariants:
            scheduler.check_invariants(out)
        issued: list[tuple[MigrationPlan, Fence]] = []
        failed = 0
        for plan in list(out.migrations):
            fence = self._issue(plan, iteration)
            if fence is None:
                scheduler.fail_migration(out, plan)
                failed += 1
            else:
                issued.append((plan, fence))
        if failed and self.config.check_invariants:
            scheduler.check_invariants(out)
        compute_stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        for _, fence in issued:
            fence.order_before(compute_stream)  # resumed blocks are in place before attention reads them
        sampled = self._compute(out)
        for plan, fence in issued:
            fence.wait()  # fenced source blocks become reusable only after their copy completed
            if plan.direction == TO_HOST:
                self._after_suspend(plan, iteration)
        scheduler.complete_migrations(out)
        produced = scheduler.complete_step(out, sampled)
        self.last_produced = [(r.request_id, r.generated[-1]) for r in produced]
        if self.config.check_invariants:
            scheduler.check_invariants()
        stats = self.stats()
        totals = self.totals
        totals.steps += 1
        totals.generated_tokens += stats.generated_tokens
        totals.recomputed_tokens += stats.recomputed_tokens
        totals.scheduled_tokens += stats.scheduled_tokens
        totals.blocks_migrated += stats.blocks_migrated
        totals.bytes_migrated += stats.bytes_migrated
        return stats

    def _issue(self, plan: MigrationPlan, iteration: int) -> Fence | None:
        """Issue `plan`'s copies; None when they failed (or its host copy is corrupt) and it must be failed."""
        if plan.direction == TO_GPU and self.config.verify_host_checksums and not self._host_copy_intact(plan):
            self.totals.checksum_mismatches += 1
            return None
        kind = "copy_to_host" if plan.direction == TO_HOST else "copy_to_gpu"
        inject = self.faults is not None and self.faults.fire(kind, iteration, plan.request_id)
        try:
            return self.cache.migrate(plan, fail_after=len(plan.runs()) // 2 if inject else None)
        except MigrationFailed:
            self.totals.failed_copies += 1
            return None

    def _after_suspend(self, plan: MigrationPlan, iteration: int) -> None:
        """A suspend's copies completed: record its checksums, then let a `corrupt_host` fault hit the copy."""
        hosts = tuple(dst for _, dst in plan.pairs)
        if self.config.verify_host_checksums:
            self._checksums[plan.request_id] = (hosts, self.cache.host_checksums(hosts))
        if self.faults is not None and self.faults.fire("corrupt_host", iteration, plan.request_id):
            self.cache.corrupt_host_block(hosts[0])

    def _host_copy_intact(self, plan: MigrationPlan) -> bool:
        """The host blocks a resume reads still have the checksums recorded when they were written."""
        recorded = self._checksums.pop(plan.request_id, None)
        hosts = tuple(src for src, _ in plan.pairs)
        return recorded is not None and recorded[0] == hosts and recorded[1] == self.cache.host_checksums(hosts)

    def lose_host_tier(self, reason: str = "the host tier became unusable") -> list[Hashable]:
        """The host tier is gone (call between steps): every suspended request takes `lose_host_copy` and will be
        replayed, the host tensor is dropped, and the engine keeps serving GPU-only (`host_tier_fallback`).
        Returns the ids of the requests that lost their host copy. Raises `HostTierLossRefused` (nothing
        changed) when recompute-pause is disabled, since nothing could be evicted afterwards."""
        self._check_open("lose_host_tier")
        if not self.scheduler.pool.has_host_tier:
            return []
        try:
            lost = self.scheduler.set_host_capacity(0)
        except PoolError as err:
            raise HostTierLossRefused(f"{reason}: {err}") from err
        self.cache.detach_host_tier()
        self._checksums.clear()
        self.totals.host_tier_losses += 1
        warnings.warn(f"{reason}; {len(lost)} suspended requests will be replayed and the engine runs GPU-only "
                      "from now on (every eviction is a recompute-pause)", HostTierFallbackWarning, stacklevel=2)
        return [r.request_id for r in lost]

    def _compute(self, out: SchedulerOutput) -> dict[Hashable, int]:
        """The forward pass of `out` and the tokens sampled by the requests that produce one."""
        planned = planned_chunks(out, self.scheduler.pool)
        chunks = [SeqChunk(c.tokens, c.start, c.block_table, c.produces_token) for c in planned]
        samplers = [c.request for c in planned if c.produces_token]
        positions = [c.start + len(c.tokens) for c in planned if c.produces_token]
        if not chunks:
            return {}
        batch = PagedBatch.build(chunks, self.cache.block_size, self.device)
        logits = self.model.forward_paged(batch, self.cache)
        if not samplers:
            return {}
        ids = [r.request_id for r in samplers]
        tokens = sample_batch(logits, [self._submissions[rid].sampling for rid in ids], seed=self.config.seed,
                              request_ids=ids, positions=positions)
        return dict(zip(ids, tokens))

    def run(self, max_steps: int | None = None) -> dict[Hashable, list[int]]:
        """Step until every request is done (or `max_steps`); returns `outputs()`."""
        self._check_open("run")
        steps = 0
        while self.scheduler.has_unfinished and (max_steps is None or steps < max_steps):
            self.step()
            steps += 1
        return self.outputs()

    def stream(self) -> Iterator[tuple[Hashable, int]]:
        """Step until every request is done, yielding (request id, token) for each token as it is produced.
        The consumer may `cancel` or `add_request` between items."""
        self._check_open("stream")
        while self.scheduler.has_unfinished:
            self.step()
            yield from list(self.last_produced)

    def outputs(self) -> dict[Hashable, list[int]]:
        """{id: generated tokens} of every finished request (finished, cancelled or aborted)."""
        return {rid: list(r.generated) for rid, r in self.scheduler.finished.items()}

    def stats(self) -> IterationStats:
        """Statistics of the last iteration (`host_tier_fallback` reflects the engine even before any step)."""
        stats = self.scheduler.stats()
        if stats.host_tier_fallback != self.scheduler.host_tier_fallback:
            stats = replace(stats, host_tier_fallback=self.scheduler.host_tier_fallback)
        return stats

    # ------------------------------------------------------------------------------------------ reference
    def reference(self, prompt_token_ids: Sequence[int], max_new_tokens: int, *, stop_token_ids: Iterable[int] = (),
                  sampling: SamplingParams = GREEDY, request_id: Hashable = 0) -> list[int]:
        """The oracle: the output of this one request run alone on the same weights, with GPU blocks for all its
        tokens, no host tier and its whole prompt in one chunk. Pass the request's id when it samples."""
        prompt = list(prompt_token_ids.tolist() if hasattr(prompt_token_ids, "tolist") else prompt_token_ids)
        blocks = -(-(len(prompt) + max_new_tokens) // self.config.block_size)
        config = replace(
            self.config, gpu_blocks=max(blocks, 1), host_blocks=0, max_batch_size=1,
            prefill_chunk_size=max(len(prompt), 1), max_num_tokens=max(len(prompt), 1),
            trace_path=None, simulate_host_alloc_failure=False, check_invariants=False, faults=None,
            verify_host_checksums=False, enable_recompute_pause=True,  # never preempts; keeps the config valid
        )
        with Engine(config, model=self.model) as alone:
            rid = alone.add_request(prompt, max_new_tokens, stop_token_ids=stop_token_ids, sampling=sampling,
                                    request_id=request_id)
            return alone.run()[rid]

    def reference_outputs(self, request_ids: Iterable[Hashable] | None = None) -> dict[Hashable, list[int]]:
        """`reference` of each submitted request (default: all), using the arguments it was submitted with."""
        ids = list(self._submissions) if request_ids is None else list(request_ids)
        result = {}
        for rid in ids:
            sub = self._submissions[rid]
            result[rid] = self.reference(sub.prompt, sub.max_new_tokens, stop_token_ids=sub.stop_token_ids,
                                         sampling=sub.sampling, request_id=rid)
        return result

    def batched_reference_outputs(self, request_ids: Iterable[Hashable] | None = None, *,
                                  batch_size: int = 256) -> dict[Hashable, list[int]]:
        """`reference_outputs`, computed `batch_size` requests at a time on one unpressured engine: GPU blocks
        for every token of the batch, no host tier, each prompt in one chunk, no faults. Equal to running each
        request alone, because a request's logits depend only on its own tokens and blocks and its sampling only
        on (seed, request id, position) — the same property OUT-EQUIV rests on. For soaks of thousands."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        ids = list(self._submissions) if request_ids is None else list(request_ids)
        result: dict[Hashable, list[int]] = {}
        size = self.config.block_size
        for start in range(0, len(ids), batch_size):
            group = [(rid, self._submissions[rid]) for rid in ids[start:start + batch_size]]
            blocks = sum(-(-(len(sub.prompt) + sub.max_new_tokens) // size) for _, sub in group)
            longest = max(len(sub.prompt) for _, sub in group)
            config = replace(
                self.config, gpu_blocks=blocks, host_blocks=0, max_batch_size=len(group),
                prefill_chunk_size=longest, max_num_tokens=max(longest * len(group), 1), trace_path=None,
                simulate_host_alloc_failure=False, check_invariants=False, faults=None, verify_host_checksums=False,
                enable_recompute_pause=True,  # never preempts (room for every token); keeps the config valid
            )
            with Engine(config, model=self.model) as alone:
                for rid, sub in group:
                    alone.add_request(sub.prompt, sub.max_new_tokens, stop_token_ids=sub.stop_token_ids,
                                      sampling=sub.sampling, request_id=rid)
                outputs = alone.run()
            result.update((rid, outputs[rid]) for rid, _ in group)
        return result

    # ---------------------------------------------------------------------------------------- lifecycle
    def _on_transition(self, request: Request, transition: Transition) -> None:
        self.totals.events[transition.event] += 1
        if transition.source == "suspended" and transition.event != "resume":
            self._checksums.pop(request.request_id, None)  # the host copy is gone (lost, promoted, cancelled)
        if self.trace is not None:
            self.trace(request, transition)

    def close(self) -> None:
        """Close the trace file and refuse further driving (`EngineClosed`). The engine may still be inspected
        afterwards (outputs, stats, totals). Closing twice is harmless."""
        self._closed = True
        if self.trace is not None:
            self.trace.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
