"""The engine loop: carries out each `SchedulerOutput` on the real paged KV cache and model.

One `step()` runs the phases of a `kvstate.scheduler.Step` (as `kvstate.sim.SimExecutor` does) with tensors:

1. ``out = scheduler.schedule()``;
2. issue every migration plan of ``out`` (suspend: GPU -> host; resume: host -> GPU) on the copy stream
   (`PagedKVCache.execute`), and make the compute stream wait on the resumes' fences (only they write blocks the
   forward reads); a plan that cannot be copied is failed, and the step carries on with the amended output;
3. one forward pass (its `PagedBatch` from `BatchPlanner`, which reuses the decode plan while the batch is
   unchanged) over every scheduled request's chunk (prefill or replay: ``prefill_tokens[computed:
   computed + n]``; decode: the last generated token), writing K/V into its GPU block table, then sample a token
   for each request whose chunk completes its prefill or decodes (the model reads `kvstate.output.PlannedChunk`s
   as they are);
4. wait on the fences, then ``complete_migrations(out)`` (only now may fenced source blocks be reused);
5. ``complete_step(out, sampled)``.

Recompute-pause needs no executor action: the scheduler frees the blocks and resets the request, and its replay
is an ordinary chunked prefill of prompt + generated tokens.

Faults (`EngineConfig.faults`, a seeded `executor.faults.FaultPlan`; spec/SPEC.md "Faults"): a failed copy is
reported with `Scheduler.fail_migration` before the forward pass (a failed suspend takes `lose_host_copy`, a failed
resume `recompute_pause`; either replays), and the step carries on with ``out.amended(failure)`` (the output
`schedule()` returned is never changed), a host copy whose checksum no longer matches (`verify_host_checksums`)
is treated as a failed resume, and a lost host tier (`lose_host_tier`) replays every suspended request and leaves
the engine GPU-only. The engine keeps serving through all of them and every output still equals its reference.

Failures (an exception anywhere inside `step()`: the forward pass, sampling, a copy, the scheduler, a trace write,
an interrupt): the step is settled before the exception leaves it — every fence is waited on (the copy stream is
drained), every migration of the iteration is carried out and completed, or failed through
`Scheduler.fail_migration`, and the forward pass is discarded (the requests did not advance; the next step
computes the same chunks again). The original exception is then re-raised and the engine keeps serving. When that
is impossible — `complete_step` had applied part of the iteration, the scheduler's invariants no longer hold, or
the trace missed a transition — the engine is marked broken: `EngineBroken` names the step, the phase and the
cause, and every later call that drives it raises it (finished outputs can still be read and taken).

Invariants kept:
* OUT-EQUIV: every finished request's output equals `Engine.reference` of it (its unpressured run) — the model
  reads only the request's own blocks and the sampler depends only on (seed, request id, position);
* no block of a migration's source is reused before that migration's fence has completed;
* between two calls nothing is in flight: every fence has completed and `scheduler.pool.in_flight` is empty,
  also after a failed step and after `close()` (so the device cache may then be freed);
* every lifecycle transition is written to the trace (when `trace_path` is set) as it happens; an interruption
  (KeyboardInterrupt) inside the trace write marks the engine broken (the trace then misses lines) before it
  propagates, so a trace is either complete or its engine says it is not;
* a request id its trace could not carry (`kvstate.trace.request_id_problem`) is refused at submission;
* a refused call (bad request, unknown id, closed engine, re-entrant or concurrent misuse) raises a `ValueError`
  subclass and changes nothing;
* memory is bounded by the active requests plus the finished ones not yet handed over with `take_finished()`.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections import Counter
from collections.abc import Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from itertools import compress, count
from operator import add, attrgetter
from pathlib import Path

import torch

from executor.checkpoint import load_checkpoint
from executor.decode_kv import DECODE_KV_BUDGET_BYTES
from executor.decode_plan import BatchPlanner
from executor.faults import FaultInjector, FaultPlan
from executor.kv_cache import Fence, HostTierAllocationError, MigrationFailed, PagedKVCache, block_shape, resolve_device
from executor.model import LlamaModel, ModelConfig
from executor.sampler import GREEDY, SamplingParams, sample_batch
from executor.trace import TraceWriter
from kvstate.config import ConfigError, RequestRejected, SchedulerConfig, normalize_stop_token_ids
from kvstate.errors import KVStateError, PoolError
from kvstate.output import SchedulerOutput, planned_chunks
from kvstate.pool import TO_GPU, TO_HOST, MigrationPlan, ceil_div
from kvstate.request import Request
from kvstate.scheduler import Scheduler, Step, UnknownRequestId
from kvstate.stats import IterationStats
from kvstate.trace import request_id_problem

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


class EngineBusy(EngineMisuse):
    """A call the engine cannot serve now; nothing changed: a call that drives or changes the engine made from
    inside the engine on the same thread (an `on_transition` listener installed on its scheduler), or
    `step`/`run`/`stream` while a `stream()` is being consumed (the stream drives the engine)."""


class EngineBroken(KVStateError, RuntimeError):
    """A step failed and its effects could not be undone; the message names the step, the phase and the cause
    (also its `__cause__`). Every later call that drives the engine raises it; finished outputs can still be
    read (`outputs()`, `take_finished()`) and `close()` still works. Create a new `Engine` to continue."""


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """A finished request handed over by `Engine.take_finished`: its generated tokens and why it ended
    (`finished`, `cancelled` or `aborted`)."""

    tokens: list[int]
    reason: str


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


def _physical_memory() -> int | None:
    """Bytes of physical memory of this machine (Linux `sysconf`), or None where it cannot be read."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_memory(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse (`ConfigError`) pool sizes that cannot fit: the device tier against the CUDA device's free memory
    (or, on the CPU, both tiers against physical memory), the host tier against physical memory."""
    mc, sc = model_config, config.scheduler
    per_block = dtype.itemsize
    for n in block_shape(mc.num_layers, sc.block_size, mc.num_kv_heads, mc.head_dim):
        per_block *= n
    gpu, host, ram = sc.gpu_blocks * per_block, sc.host_blocks * per_block, _physical_memory()
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
    verify_host_checksums: bool = False  # CRC-32 every suspended block; a mismatch on resume replays the request
    decode_kv_bytes: int = DECODE_KV_BUDGET_BYTES  # memory a reused decode plan keeps its keys and values in (DecodeKV)

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
        for f in fields(self):
            value, kind = getattr(self, f.name), _FIELD_KINDS.get(f.name)
            if kind is bool and not isinstance(value, bool):
                raise ConfigError(f"EngineConfig.{f.name} must be True or False, got {value!r}")
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"EngineConfig.{f.name} must be an int, got {type(value).__name__} {value!r}")
        if not isinstance(self.model, ModelConfig):
            raise ConfigError(f"EngineConfig.model must be an executor.ModelConfig, got {type(self.model).__name__}")
        for name in ("checkpoint", "trace_path"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ConfigError(
                    f"EngineConfig.{name} must be a path (str or os.PathLike) or None, got {type(value).__name__}"
                )
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


_FIELD_KINDS = {
    **dict.fromkeys(("weights_seed", "seed", "decode_kv_bytes"), int),
    **dict.fromkeys(("simulate_host_alloc_failure", "check_invariants", "verify_host_checksums"), bool),
}  # EngineConfig fields checked by type in __post_init__ (the scheduler's: SchedulerConfig)


@dataclass
class RunTotals:
    """The run totals of an engine (`Engine.totals`): sums over every step since it was built, where
    `Engine.stats()` describes the last step only. Updated after each step and each call that fires lifecycle
    events (cancel, a lost host tier), so they are complete between calls.

    * work: `steps`, `generated_tokens`, `scheduled_tokens`, and `recomputed_tokens` (replayed after a
      recompute-pause: never counted as cache hits);
    * preemptions by path (`preemptions`): suspensions (KV copied to the host tier) and recompute-pauses (KV
      dropped, replayed later; a suspended request promoted to recompute-pause, or a resume whose copy failed,
      counts here too); every lifecycle event by name in `events`;
    * copies: `migrations` (suspend and resume copy plans carried out to completion), `blocks_migrated`,
      `bytes_migrated`;
    * failures (`failures`): copies that failed, host copies found corrupt, host copies lost, host tiers lost;
      injected faults by kind in `faults`.
    """

    steps: int = 0
    generated_tokens: int = 0
    recomputed_tokens: int = 0
    scheduled_tokens: int = 0
    migrations: int = 0  # migration plans whose copies completed
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

    @property
    def preemptions(self) -> dict[str, int]:
        """Preemptions by path: ``{"suspend": n, "recompute_pause": n}``."""
        return {"suspend": self.suspensions, "recompute_pause": self.recompute_pauses}

    @property
    def failures(self) -> dict[str, int]:
        """What failed and was recovered from, by kind (each replays the requests it hit)."""
        return {
            "failed_copies": self.failed_copies,
            "checksum_mismatches": self.checksum_mismatches,
            "lost_host_copies": self.events["lose_host_copy"],
            "host_tier_losses": self.host_tier_losses,
        }

    def to_dict(self) -> dict:
        """JSON-ready: every total, the preemptions and failures by kind, events and faults as plain dicts."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(events=dict(self.events), faults=dict(self.faults), preemptions=self.preemptions)
        d["failures"] = self.failures
        return d


@dataclass(frozen=True, slots=True)
class _Submission:
    prompt: tuple[int, ...]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    sampling: SamplingParams


class _Attempt:
    """How far one step got, so that a failure can settle it: the phase, the `Step` (its output, the fence of each
    issued plan, the plans already waited on; None before `schedule()` returned), and the scheduled requests'
    progress before `complete_step` (None until then)."""

    __slots__ = ("phase", "progress", "step")

    def __init__(self) -> None:
        self.phase = "start"
        self.step: Step[Fence] | None = None
        self.progress: list[tuple[int, str]] | None = None


def _progress(out: SchedulerOutput) -> list[tuple[int, str]]:
    """What `complete_step` changes of every scheduled request it applies (each advances its computed tokens)."""
    return list(map(_PROGRESS, out.scheduled))


_PROGRESS = attrgetter("num_computed_tokens", "state")
_REQUEST_ID = attrgetter("request_id")
_SAMPLING = attrgetter("sampling")


class Engine:
    """A paged-KV serving engine over the `kvstate` scheduler. Use as a context manager or call `close()`.

    Threading model: one engine may be shared by threads, and every call is serialized by one lock. The calls
    that drive or change it (`step`, each step of `run` and `stream`, `add_request`, `cancel`, `lose_host_tier`,
    `take_finished`, `close`) hold the lock for their duration, and `outputs` holds it while it copies; so a
    `cancel` from a second thread during `run()` takes effect between two steps, and two threads calling
    `step()` get two whole iterations one after the other. A call that drives or changes the engine from inside
    the engine on the same thread — from an `on_transition` hook, which runs inside `step` or `cancel` — raises
    `EngineBusy` and changes nothing (reading, e.g. `outputs()`, is allowed there); so do `step`, `run` and
    `stream` while a `stream()` generator is live (the stream drives the engine; `cancel` and `add_request`
    between its items are fine). Failures: see the module docstring (a failed step is settled and re-raised, or
    the engine is `EngineBroken`)."""

    def __init__(self, config: EngineConfig | None = None, *, model: LlamaModel | None = None) -> None:
        """`model` shares existing weights (it must already be on the configured device and dtype)."""
        self.config = config = config or EngineConfig()
        sc = config.scheduler
        self.device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, self.device)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        if model is None:
            if config.checkpoint is not None:
                model = load_checkpoint(config.checkpoint, dtype=dtype, device=self.device)
            else:
                model = LlamaModel.from_seed(config.model, config.weights_seed, dtype=dtype, device=self.device)
        elif model.device.type != self.device.type or model.dtype != dtype:
            raise ValueError(
                f"the shared model is {model.dtype} on {model.device}, the engine is configured for "
                f"{dtype} on {self.device}; move the model or change EngineConfig.device/dtype"
            )
        self.model = model
        check_memory(config, model.config, dtype, self.device)
        try:
            self.cache = PagedKVCache.for_model(model, sc.gpu_blocks, block_size=sc.block_size, device=self.device)
        except (RuntimeError, MemoryError) as err:  # torch's out-of-memory errors are RuntimeErrors
            raise ConfigError(
                f"could not allocate the device tier of gpu_blocks={sc.gpu_blocks} on "
                f"{self.device}: {err}; lower gpu_blocks"
            ) from err
        self.faults = FaultInjector(config.faults) if config.faults is not None else None
        host_blocks = self._attach_host_tier()
        self.scheduler = Scheduler(
            replace(sc, host_blocks=host_blocks, block_bytes=self.cache.block_bytes), record_transitions=True
        )
        self.scheduler.host_tier_fallback = host_blocks < sc.host_blocks
        spec = self.scheduler.spec
        self._host_states = frozenset(s.name for s in spec.states if spec.residency(s.name) == "host")
        self.trace = TraceWriter(config.trace_path) if config.trace_path is not None else None
        self.totals = RunTotals()
        self._produced: list[Request] = []  # the requests that produced a token in the last step (`last_produced`)
        self._submissions: dict[Hashable, _Submission] = {}
        self._checksums: dict[Hashable, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # id -> (host blocks, CRCs)
        self._closed = False
        self._broken: EngineBroken | None = None
        self._trace_failure: BaseException | None = None  # a trace write that failed (the engine breaks on it)
        self._lock = threading.Lock()  # serializes every call (class docstring: threading model)
        self._owner: int | None = None  # the thread inside a call that holds the lock, and the call's name
        self._owner_call = ""
        self._streaming = False  # a stream() generator is live
        # reuses the decode plan across steps, and keeps its gathered keys and values within `decode_kv_bytes`
        self._planner = BatchPlanner(sc.block_size, self.device, decode_kv_budget=config.decode_kv_bytes)
        if self.faults is not None:
            self.totals.faults = self.faults.injected  # one counter: what the injector fired, by kind

    def _attach_host_tier(self) -> int:
        """Allocate the configured host tier; returns its size in blocks, 0 when its allocation failed (the engine
        then falls back to GPU-only, with a `HostTierFallbackWarning`) or none is configured."""
        config = self.config
        host_blocks = config.scheduler.host_blocks
        if not host_blocks:
            return 0
        simulate = config.simulate_host_alloc_failure or (self.faults is not None and self.faults.fire("host_alloc", 0))
        try:
            self.cache.attach_host_tier(host_blocks, simulate_failure=simulate)
        except HostTierAllocationError as err:
            if not config.scheduler.enable_recompute_pause:
                raise ConfigError(
                    f"{err}, and enable_recompute_pause=False: without a host tier no victim could be evicted; "
                    "enable recompute-pause so the engine can fall back to GPU-only operation"
                ) from err
            warnings.warn(
                f"{err}; falling back to GPU-only operation (every eviction is a recompute-pause)",
                HostTierFallbackWarning,
                stacklevel=3,
            )
            return 0
        return host_blocks

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
        """Queue a request; returns its id. Raises `InvalidTokenId`, `RequestRejected`, `EngineClosed` or
        `EngineBusy` (all `ValueError`s; nothing queued, the engine keeps serving), or `EngineBroken`."""
        with self._exclusive("add_request"):
            return self._add_request(prompt_token_ids, max_new_tokens, stop_token_ids, sampling, request_id)

    def _add_request(
        self,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        stop_token_ids: Iterable[int],
        sampling: SamplingParams,
        request_id: Hashable | None,
    ) -> Hashable:
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
                    raise InvalidTokenId(
                        f"{what} has token id {bad[0]} but the model's vocabulary has {vocab} ids "
                        f"(0..{vocab - 1}); tokenize with the model's tokenizer"
                    )
        if not isinstance(sampling, SamplingParams):
            raise RequestRejected(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        limit = self.model.config.max_position_embeddings
        if (
            isinstance(prompt_token_ids, (list, tuple))
            and isinstance(max_new_tokens, int)
            and not isinstance(max_new_tokens, bool)
            and len(prompt_token_ids) + max_new_tokens > limit
        ):
            raise RequestRejected(
                f"prompt ({len(prompt_token_ids)}) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"model's max_position_embeddings={limit}; shorten the request"
            )
        # an id of another type (bool, float, ...) is the scheduler's to refuse; int and str subclasses are ids
        is_id = isinstance(request_id, (int, str)) and not isinstance(request_id, bool)
        if is_id and (problem := request_id_problem(request_id)) is not None:
            raise RequestRejected(f"{problem}; the trace format (spec/TRACE.md) could not carry it")
        request = self.scheduler.submit(prompt_token_ids, max_new_tokens, stop_token_ids=stop, request_id=request_id)
        self._submissions[request.request_id] = _Submission(request.prompt, max_new_tokens, stop, sampling)
        return request.request_id

    def cancel(self, request_id: Hashable) -> None:
        """Cancel an active request (its blocks are freed at once; its partial output stays in `outputs()`).
        Raises `RequestNotActive` (a `ValueError` and an `UnknownRequestId`; nothing changed) for an id that is
        unknown or already done. Safe from another thread during `run()` (it lands between two steps)."""
        with self._exclusive("cancel"):
            if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
                raise RequestNotActive(
                    f"cannot cancel {request_id!r}: request ids are str or int, got "
                    f"{type(request_id).__name__}; pass the id add_request returned"
                )
            try:
                self.scheduler.cancel(request_id)
            except UnknownRequestId as err:
                raise RequestNotActive(str(err)) from None
            finally:
                self._break_on_trace_failure("cancel")

    # ------------------------------------------------------------------------------------- call discipline
    @contextmanager
    def _exclusive(self, what: str, *, drives: bool = True, steps: bool = False) -> Iterator[None]:
        """Hold the engine lock for one call (class docstring: threading model). `drives`: refused on a closed
        or broken engine; `steps`: also refused while a `stream()` is live."""
        me = threading.get_ident()
        if self._owner == me:
            raise EngineBusy(
                f"{what}() was called from inside {self._owner_call}() on the same thread (from an "
                "on_transition hook); the engine cannot serve it there and nothing changed: note what "
                f"you need in the hook and call {what}() after {self._owner_call}() has returned"
            )
        with self._lock:
            self._owner, self._owner_call = me, what
            try:
                if drives:
                    self._check_usable(what)
                if steps and self._streaming:
                    raise EngineBusy(
                        f"{what}() was called while a stream() is being consumed; the stream drives the "
                        "engine (tokens of other steps would never reach it) and nothing changed: "
                        "consume the stream to its end or close it (generator.close()) first"
                    )
                yield
            finally:
                self._owner, self._owner_call = None, ""

    @contextmanager
    def _reading(self) -> Iterator[None]:
        """Hold the lock while reading, unless this thread already holds it (a hook reading the engine)."""
        if self._owner == threading.get_ident():
            yield
            return
        with self._lock:
            yield

    @property
    def last_produced(self) -> list[tuple[Hashable, int]]:
        """(request id, token) of every token the last step produced, in batch order (built when read: a request's
        last token stays its last until the next step)."""
        return [(r.request_id, r.generated[-1]) for r in self._produced]

    def _check_usable(self, what: str) -> None:
        if self._broken is not None:
            raise EngineBroken(self._broken.args[0]) from self._broken.__cause__
        if self._closed:
            raise EngineClosed(
                f"{what}() was called after close(); the engine can still be inspected (outputs(), "
                "stats(), totals) but not driven: create a new Engine to serve more requests"
            )

    # ------------------------------------------------------------------------------------------- stepping
    def step(self) -> IterationStats:
        """Schedule and carry out one iteration; `last_produced` lists the (request id, token) it produced.
        Injected faults (`EngineConfig.faults`) happen here; the iteration still completes. An exception inside
        the step is settled and re-raised, or becomes `EngineBroken` (module docstring)."""
        with self._exclusive("step", steps=True):
            return self._step()

    def _step(self) -> IterationStats:
        attempt = _Attempt()
        try:
            stats = self._carry_out(attempt)
        except BaseException as err:
            self._settle_failed(attempt, err)
            raise
        self._break_on_trace_failure(f"step {self.scheduler.iteration}")
        return stats

    def _carry_out(self, attempt: _Attempt) -> IterationStats:
        """The iteration itself (module docstring, 1-5: the phases of a `kvstate.scheduler.Step`); `attempt` records how
        far it got."""
        scheduler, check = self.scheduler, self.config.check_invariants
        iteration = scheduler.iteration + 1
        if self.faults is not None and scheduler.pool.has_host_tier and self.faults.fire("host_loss", iteration):
            attempt.phase = "host tier loss"
            self._lose_host_tier(f"injected fault host_loss at iteration {iteration}")
        attempt.phase = "schedule"
        step = attempt.step = Step.begin(scheduler)
        if check:
            scheduler.check_invariants(step.output)
        attempt.phase = "issue copies"
        for plan in step.to_issue():
            step.issued(plan, self._issue(plan))
        if step.failures and check:
            scheduler.check_invariants(step.output)
        attempt.phase = "forward"
        sampled = self._compute(step.output)
        attempt.phase = "complete migrations"
        self._settle(step)
        attempt.phase = "complete step"
        attempt.progress = _progress(step.output)
        produced = step.finish(sampled)
        attempt.phase = "after the step"
        self._produced = produced
        if check:
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

    def _settle(self, step: Step[Fence]) -> None:
        """Carry every migration of `step` to its end, then complete them: a plan a failure kept from being issued
        is issued now (or failed), and every fence is waited on (fenced source blocks become reusable only after
        their copy completed). Safe to call again: what was done is skipped."""
        for plan in step.to_issue():
            step.issued(plan, self._issue(plan))
        for plan, fence in step.to_wait():
            self._wait(plan, fence)
            step.waited(plan)
        step.complete_migrations()

    def _settle_failed(self, attempt: _Attempt, err: BaseException) -> None:
        """`err` interrupted a step: drain the copies, settle every migration, discard the forward pass, and
        return (the caller re-raises `err`) if the state is consistent; otherwise raise `EngineBroken`."""
        scheduler = self.scheduler
        self._produced = []
        iteration = scheduler.iteration
        problem = None
        try:
            step = attempt.step
            for fence in step.fences.values() if step is not None else ():
                fence.wait()
            self.cache.drain()
            if step is None and scheduler.pool.in_flight:  # schedule() planned copies, then failed
                plans = list(scheduler.pool.in_flight.values())
                owners = [scheduler.requests[p.request_id] for p in plans]
                step = attempt.step = Step(
                    scheduler,
                    SchedulerOutput(
                        migrations=plans,
                        suspended=[r for p, r in zip(plans, owners, strict=True) if p.direction == TO_HOST],
                        resumed=[r for p, r in zip(plans, owners, strict=True) if p.direction == TO_GPU],
                    ),
                )
            if step is not None:
                self._settle(step)
            if (
                step is not None
                and attempt.progress is not None
                and attempt.phase == "complete step"
                and attempt.progress != _progress(step.output)
            ):
                problem = "complete_step had already applied part of the iteration"
            scheduler.check_invariants()
            if scheduler.pool.in_flight:
                problem = problem or f"{len(scheduler.pool.in_flight)} migrations are still in flight"
        except BaseException as settling:
            problem = f"settling it failed too ({type(settling).__name__}: {settling})"
        self._take_transitions()
        if self._trace_failure is not None and problem is None:
            problem = f"the trace missed a transition ({type(self._trace_failure).__name__}: {self._trace_failure})"
        if problem is not None:
            self._break(
                f"step {iteration} failed in phase '{attempt.phase}' with {type(err).__name__}: {err}; "
                f"the engine could not restore a consistent state: {problem}",
                err,
            )
        done = (
            "the iteration itself had completed"
            if attempt.phase == "after the step"
            else "the forward pass was discarded (the next step computes it again)"
        )
        err.add_note(
            f"kvstate: step {iteration} failed in phase '{attempt.phase}' and was settled: every copy "
            f"completed or failed and nothing is in flight; {done}; the engine can keep stepping"
        )

    def _break(self, message: str, cause: BaseException) -> None:
        """Mark the engine broken (every later driving call raises this error) and raise it."""
        raise EngineBroken(self._mark_broken(message, cause).args[0]) from cause

    def _mark_broken(self, message: str, cause: BaseException) -> EngineBroken:
        """Mark the engine broken: every later driving call raises the error returned."""
        self._broken = EngineBroken(
            f"the engine is broken: {message}. Finished outputs can still be read "
            "(outputs(), take_finished()); create a new Engine to continue"
        )
        self._broken.__cause__ = cause
        return self._broken

    def _break_on_trace_failure(self, where: str) -> None:
        """Take the transitions of `where` (`_take_transitions`); if a trace write failed (the state is consistent,
        the trace is not), break the engine."""
        self._take_transitions()
        if self._trace_failure is not None:
            err = self._trace_failure
            path = None if self.trace is None else self.trace.path
            self._break(
                f"writing the trace {path} failed during {where} ({type(err).__name__}: {err}); "
                "the trace now misses transitions, so the engine stopped",
                err,
            )

    def _issue(self, plan: MigrationPlan) -> Fence | None:
        """Issue `plan`'s copies; None when they failed (or its host copy is corrupt) and it must be failed. A
        resume's fence orders the compute stream after its copies: resumed blocks are in place before attention
        reads them (a suspend's copies are not waited for there: the forward never reads host blocks, and their
        sources are freed only after `_wait`)."""
        iteration = self.scheduler.iteration
        if plan.direction == TO_GPU and self.config.verify_host_checksums and not self._host_copy_intact(plan):
            self.totals.checksum_mismatches += 1
            return None
        kind = "copy_to_host" if plan.direction == TO_HOST else "copy_to_gpu"
        inject = self.faults is not None and self.faults.fire(kind, iteration, plan.request_id)
        try:
            fence = self.cache.migrate(plan, fail_after=len(plan.runs()) // 2 if inject else None)
        except MigrationFailed:
            self.totals.failed_copies += 1
            return None
        if plan.direction == TO_GPU:
            fence.order_before(torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None)
        return fence

    def _wait(self, plan: MigrationPlan, fence: Fence) -> None:
        """`plan`'s copies completed (its fenced sources may be reused once the scheduler is told)."""
        fence.wait()
        self.totals.migrations += 1
        if plan.direction == TO_HOST:
            self._after_suspend(plan, self.scheduler.iteration)

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
        with self._exclusive("lose_host_tier"):
            lost = self._lose_host_tier(reason)
            self._break_on_trace_failure("lose_host_tier")
            return lost

    def _lose_host_tier(self, reason: str) -> list[Hashable]:
        if not self.scheduler.pool.has_host_tier:
            return []
        try:
            lost = self.scheduler.set_host_capacity(0)
        except PoolError as err:
            raise HostTierLossRefused(f"{reason}: {err}") from err
        self.cache.detach_host_tier()
        self._checksums.clear()
        self.totals.host_tier_losses += 1
        warnings.warn(
            f"{reason}; {len(lost)} suspended requests will be replayed and the engine runs GPU-only "
            "from now on (every eviction is a recompute-pause)",
            HostTierFallbackWarning,
            stacklevel=3,
        )
        return [r.request_id for r in lost]

    def _compute(self, out: SchedulerOutput) -> dict[Hashable, int]:
        """The forward pass of `out` (the model reads the planned chunks as they are) and the tokens sampled by
        the requests whose chunk produces one."""
        chunks = planned_chunks(out, self.scheduler.pool)
        if not chunks:
            return {}
        logits = self.model.forward_paged(self._planner.plan(chunks), self.cache)
        requests, starts, inputs = chunks.requests, chunks.starts, chunks.tokens  # read column by column
        if not all(chunks.produces_token):  # some chunk is not the last of its prefill: keep the rows that sample
            producing = list(compress(count(), chunks.produces_token))
            if not producing:
                return {}
            requests = [requests[i] for i in producing]
            starts = [starts[i] for i in producing]
            inputs = [inputs[i] for i in producing]
        ids = list(map(_REQUEST_ID, requests))  # whole-list operations: a steady step runs no loop body per request
        params = list(map(_SAMPLING, map(self._submissions.__getitem__, ids)))
        positions = list(map(add, starts, map(len, inputs)))
        tokens = sample_batch(logits, params, seed=self.config.seed, request_ids=ids, positions=positions)
        return dict(zip(ids, tokens, strict=True))

    def run(self, max_steps: int | None = None) -> dict[Hashable, list[int]]:
        """Step until every request is done (or `max_steps`); returns `outputs()`. The lock is taken per step,
        so other threads' `cancel` and `add_request` land between steps."""
        steps = 0
        while True:
            with self._exclusive("run", steps=True):
                if not self.scheduler.has_unfinished or (max_steps is not None and steps >= max_steps):
                    return self._outputs()
                self._step()
            steps += 1

    def stream(self) -> Iterator[tuple[Hashable, int]]:
        """Step until every request is done, yielding (request id, token) for each token as it is produced.
        The consumer may `cancel` or `add_request` between items; `step`, `run` or another `stream` while this
        one is live raise `EngineBusy` (their tokens would never reach it)."""
        with self._exclusive("stream", steps=True):
            self._streaming = True
        try:
            while True:
                with self._exclusive("stream"):
                    if not self.scheduler.has_unfinished:
                        return
                    self._step()
                    produced = list(self.last_produced)
                yield from produced
        finally:
            self._streaming = False

    def outputs(self) -> dict[Hashable, list[int]]:
        """{id: generated tokens} of every finished request (finished, cancelled or aborted) not yet taken."""
        with self._reading():
            return self._outputs()

    def _outputs(self) -> dict[Hashable, list[int]]:
        return {rid: list(r.generated) for rid, r in self.scheduler.finished.items()}

    def take_finished(self) -> dict[Hashable, FinishedRequest]:
        """Hand over every finished request (finished, cancelled or aborted) and forget it: it leaves
        `outputs()`, the scheduler's `finished` and the engine's records, so a long-running engine's memory stays
        bounded by its active requests; its id may be used again. Works on a closed or broken engine too."""
        with self._exclusive("take_finished", drives=False):
            taken = self.scheduler.forget_finished(list(self.scheduler.finished))
            for request in taken:
                self._submissions.pop(request.request_id, None)
                self._checksums.pop(request.request_id, None)
            return {r.request_id: FinishedRequest(list(r.generated), r.end_reason) for r in taken}

    def stats(self) -> IterationStats:
        """Statistics of the last iteration (`host_tier_fallback` reflects the engine even before any step)."""
        stats = self.scheduler.stats()
        if stats.host_tier_fallback != self.scheduler.host_tier_fallback:
            stats = replace(stats, host_tier_fallback=self.scheduler.host_tier_fallback)
        return stats

    # ------------------------------------------------------------------------------------------ reference
    def reference(
        self,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        *,
        stop_token_ids: Iterable[int] = (),
        sampling: SamplingParams = GREEDY,
        request_id: Hashable = 0,
    ) -> list[int]:
        """The oracle: the output of this one request run alone on the same weights, with GPU blocks for all its
        tokens, no host tier and its whole prompt in one chunk. Pass the request's id when it samples."""
        prompt = list(prompt_token_ids.tolist() if hasattr(prompt_token_ids, "tolist") else prompt_token_ids)
        blocks = ceil_div(len(prompt) + max_new_tokens, self.config.scheduler.block_size)
        config = self._unpressured(
            gpu_blocks=max(blocks, 1),
            max_batch_size=1,
            prefill_chunk_size=max(len(prompt), 1),
            max_num_tokens=max(len(prompt), 1),
        )
        with Engine(config, model=self.model) as alone:
            rid = alone.add_request(
                prompt, max_new_tokens, stop_token_ids=stop_token_ids, sampling=sampling, request_id=request_id
            )
            return alone.run()[rid]

    def reference_outputs(self, request_ids: Iterable[Hashable] | None = None) -> dict[Hashable, list[int]]:
        """`reference` of each submitted request (default: all), using the arguments it was submitted with."""
        result = {}
        for rid, sub in self._submitted(request_ids):
            result[rid] = self.reference(
                sub.prompt, sub.max_new_tokens, stop_token_ids=sub.stop_token_ids, sampling=sub.sampling, request_id=rid
            )
        return result

    def batched_reference_outputs(
        self, request_ids: Iterable[Hashable] | None = None, *, batch_size: int = 256
    ) -> dict[Hashable, list[int]]:
        """`reference_outputs`, computed `batch_size` requests at a time on one unpressured engine: GPU blocks
        for every token of the batch, no host tier, each prompt in one chunk, no faults. Equal to running each
        request alone, because a request's logits depend only on its own tokens and blocks and its sampling only
        on (seed, request id, position) — the same property OUT-EQUIV rests on. For soaks of thousands."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        submitted = self._submitted(request_ids)
        result: dict[Hashable, list[int]] = {}
        size = self.config.scheduler.block_size
        for start in range(0, len(submitted), batch_size):
            group = submitted[start : start + batch_size]
            blocks = sum(ceil_div(len(sub.prompt) + sub.max_new_tokens, size) for _, sub in group)
            longest = max(len(sub.prompt) for _, sub in group)
            config = self._unpressured(
                gpu_blocks=blocks,
                max_batch_size=len(group),
                prefill_chunk_size=longest,
                max_num_tokens=max(longest * len(group), 1),
            )
            with Engine(config, model=self.model) as alone:
                for rid, sub in group:
                    alone.add_request(
                        sub.prompt,
                        sub.max_new_tokens,
                        stop_token_ids=sub.stop_token_ids,
                        sampling=sub.sampling,
                        request_id=rid,
                    )
                outputs = alone.run()
            result.update((rid, outputs[rid]) for rid, _ in group)
        return result

    def _unpressured(
        self, *, gpu_blocks: int, max_batch_size: int, prefill_chunk_size: int, max_num_tokens: int
    ) -> EngineConfig:
        """This engine's config for a reference run: these sizes (room for every token, so it never preempts), no
        host tier, no trace, no faults, no checks; recompute-pause on (keeps the config valid)."""
        scheduler = replace(
            self.config.scheduler,
            gpu_blocks=gpu_blocks,
            host_blocks=0,
            max_batch_size=max_batch_size,
            prefill_chunk_size=prefill_chunk_size,
            max_num_tokens=max_num_tokens,
            enable_recompute_pause=True,
        )
        return replace(
            self.config,
            scheduler=scheduler,
            trace_path=None,
            simulate_host_alloc_failure=False,
            check_invariants=False,
            faults=None,
            verify_host_checksums=False,
        )

    def _submitted(self, request_ids: Iterable[Hashable] | None) -> list[tuple[Hashable, _Submission]]:
        """(id, submission) of these requests (default: every one not yet taken), in order."""
        with self._reading():
            ids = list(self._submissions) if request_ids is None else list(request_ids)
            unknown = [rid for rid in ids if rid not in self._submissions]
            if unknown:
                raise EngineMisuse(
                    f"no submission recorded for request ids {unknown[:5]}: they are unknown or were "
                    "handed over by take_finished(); compute references before taking them"
                )
            return [(rid, self._submissions[rid]) for rid in ids]

    # ---------------------------------------------------------------------------------------- lifecycle
    def _take_transitions(self) -> None:
        """Take the transitions the scheduler recorded since the last call (after every call that may fire one):
        count each event, forget a dropped host copy's checksums, write the trace lines. A failed trace write is
        kept, not raised, so that a failing step is still settled; `_break_on_trace_failure` then breaks the
        engine once its state is consistent. An interruption (KeyboardInterrupt, or any other BaseException)
        anywhere in here, the trace write included, leaves lines unwritten: the engine is marked broken at once
        (naming it) and the interruption goes on, so the trace is never silently short."""
        events, host_states = self.totals.events, self._host_states
        try:
            for fired in self.scheduler.take_fired():
                transition = fired.transition
                events[transition.event] += 1
                if transition.source in host_states and transition.event != "resume":
                    self._checksums.pop(fired.request.request_id, None)  # the host copy is gone (lost, ...)
                if self.trace is not None and self._trace_failure is None:
                    try:
                        self.trace.write(fired)
                    except Exception as err:
                        self._trace_failure = err
        except BaseException as interrupt:
            self._trace_failure = self._trace_failure or interrupt
            path = None if self.trace is None else self.trace.path
            broken = self._mark_broken(
                f"{type(interrupt).__name__} interrupted taking the lifecycle transitions, so they were not all "
                f"recorded (the trace {path} misses lines)",
                interrupt,
            )
            interrupt.add_note(f"kvstate: {broken}")
            raise

    def close(self) -> None:
        """Drain the copy stream (every fence completes, so the device cache may then be freed), close the trace
        file and refuse further driving (`EngineClosed`). The engine may still be inspected afterwards (outputs,
        stats, totals, take_finished). Closing twice, or closing a broken engine, is harmless."""
        with self._exclusive("close", drives=False):
            if self._closed:
                return
            self._closed = True
            self.cache.drain()
            if self.trace is not None:
                try:
                    self.trace.close()
                except OSError:
                    if self._trace_failure is None:  # else already reported: the engine broke on it
                        raise

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
