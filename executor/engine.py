"""The engine loop: carries out each `SchedulerOutput` on the real paged KV cache and model.

The engine is built from an `executor.engine_config.EngineConfig`, refuses what `executor.submission` refuses,
serializes its calls with `executor.call_guard.CallGuard` and counts its work in `executor.run_totals.RunTotals`.
One `step()` runs the phases of a `kvstate.scheduler.Step` (as `kvstate.sim.SimExecutor` does) with tensors:

1. ``out = scheduler.schedule()``;
2. issue every migration plan of ``out`` (offload: held GPU blocks -> host; resume: host -> GPU) on the copy
   stream (`executor.host_tier.HostTier`, `PagedKVCache.execute`), and make the compute stream wait on the resumes'
   fences (only they write blocks the forward reads); a plan that cannot be copied is failed, and the step carries
   on with the amended output;
3. one forward pass (its `PagedBatch` from `BatchPlanner`, which reuses the decode plan while the batch is
   unchanged) over every scheduled request's chunk (prefill or replay: ``prefill_tokens[computed:
   computed + n]``; decode: the last generated token), writing K/V into its GPU block table, then sample a token
   for each request whose chunk completes its prefill or decodes (the model reads `kvstate.output.PlannedChunk`s
   as they are);
4. wait on the fences, then ``complete_migrations(out)`` (only now may fenced source blocks be reused);
5. ``complete_step(out, sampled)``.

Suspension is lazy (the spec's `suspend` copies nothing): a suspended request's blocks stay in the device cache,
held, until the scheduler plans an offload of some of them for an allocation that needs the GPU room (or of all of
them at once, under the spec's `eager` offload policy: `EngineConfig.spec`, `offload_spec`); a resume re-locks the
blocks still on the GPU with no copy and copies up only its host blocks, which the pool places before them in the
request's block table.

Recompute-pause needs no executor action: the scheduler frees the blocks and resets the request, and its replay
is an ordinary chunked prefill of prompt + generated tokens.

Faults (`EngineConfig.faults`, a seeded `executor.faults.FaultPlan`; spec/SPEC.md "Faults"): a failed copy is
reported with `Scheduler.fail_migration` before the forward pass (a failed offload takes `lose_host_copy`, a failed
resume `recompute_pause`; either replays), and the step carries on with ``out.amended(failure)`` (the output
`schedule()` returned is never changed), a host block whose checksum no longer matches (`verify_host_checksums`)
fails the resume that reads it, and a lost host tier (`lose_host_tier`) replays every suspended request holding
host blocks (those held wholly on the GPU stay suspended) and leaves the engine GPU-only. The engine keeps
serving through all of them and every output still equals its reference.

Failures (an exception anywhere inside `step()`: the forward pass, sampling, a copy, the scheduler, a trace write,
an interrupt): the step is settled before the exception leaves it (`executor.step_attempt`): every fence is
waited on (the copy stream is drained), every migration of the iteration is carried out and completed, or failed
through `Scheduler.fail_migration`, and the forward pass is discarded (the requests did not advance; the next step
computes the same chunks again). The original exception is then re-raised and the engine keeps serving. When that
is impossible — `complete_step` had applied part of the iteration, the scheduler's invariants no longer hold, or
the trace missed a transition — the engine is marked broken: `EngineBroken` names the step, the phase and the
cause, and every later call that drives it raises it (finished outputs can still be read and taken).

Invariants kept:
* OUT-EQUIV: every finished request's output equals `Engine.reference` of it (its unpressured run) — the model
  reads only the request's own blocks and the sampler depends only on (seed, request id, position);
* no block of a migration's source is reused before that migration's fence has completed: an offload's GPU
  sources are given to another request only after their copy down is complete;
* between two calls nothing is in flight: every fence has completed and `scheduler.pool.in_flight` is empty,
  also after a failed step and after `close()` (so the device cache may then be freed);
* every lifecycle transition is written to the trace (when `trace_path` is set) as it happens; an interruption
  (KeyboardInterrupt) inside the trace write marks the engine broken (the trace then misses lines) before it
  propagates, so a trace is either complete or its engine says it is not; a KeyboardInterrupt during a step
  that could be settled carries a note that says where it was interrupted, not that the step failed;
* a request id its trace could not carry (`kvstate.trace.request_id_problem`) is refused at submission;
* a refused call (bad request, unknown id, closed engine, re-entrant or concurrent misuse) raises a `ValueError`
  subclass and changes nothing;
* memory is bounded by the active requests plus the finished ones not yet handed over with `take_finished()`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import compress, count
from operator import add, attrgetter

import torch

from executor.call_guard import CallGuard
from executor.checkpoint import load_checkpoint
from executor.decode_plan import BatchPlanner
from executor.engine_config import EngineConfig, check_memory, resolve_dtype, unpressured
from executor.engine_errors import EngineBroken, EngineMisuse, RequestNotActive
from executor.faults import FaultInjector
from executor.host_tier import HostTier
from executor.kv_cache import PagedKVCache, resolve_device
from executor.model import LlamaModel
from executor.run_totals import RunTotals, resume_copies
from executor.sampler import GREEDY, SamplingParams, sample_batch
from executor.step_attempt import StepAttempt, settle_interrupted, step_progress
from executor.submission import Submission, checked_request
from kvstate.config import ConfigError
from kvstate.output import SchedulerOutput, planned_chunks
from kvstate.pool import ceil_div
from kvstate.request import Request
from kvstate.scheduler import Scheduler, Step, UnknownRequestId
from kvstate.stats import IterationStats
from kvstate.trace import TraceWriter

HELD = "held"  # the spec's residency of states whose KV is held: on the GPU, the host tier or both


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """A finished request handed over by `Engine.take_finished`: its generated tokens and why it ended
    (`finished`, `cancelled` or `aborted`)."""

    tokens: list[int]
    reason: str


_REQUEST_ID = attrgetter("request_id")
_SAMPLING = attrgetter("sampling")


class Engine:
    """A paged-KV serving engine over the `kvstate` scheduler. Use as a context manager or call `close()`.

    Threading model (`executor.call_guard.CallGuard`): one engine may be shared by threads, and every call is
    serialized by one lock. The calls that drive or change it (`step`, each step of `run` and `stream`,
    `add_request`, `cancel`, `lose_host_tier`, `take_finished`, `close`) hold the lock for their duration, and
    `outputs` holds it while it copies; so a `cancel` from a second thread during `run()` takes effect between two
    steps, and two threads calling `step()` get two whole iterations one after the other. A call that drives or
    changes the engine from inside the engine on the same thread (from an `on_transition` hook, which runs inside
    `step` or `cancel`) raises `EngineBusy` and changes nothing (reading, e.g. `outputs()`, is allowed there); so
    do `step`, `run` and `stream` while a `stream()` generator is live (the stream drives the engine; `cancel` and
    `add_request` between its items are fine). Failures: see the module docstring (a failed step is settled and
    re-raised, or the engine is `EngineBroken`)."""

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
        self.totals = RunTotals()
        self._host_tier = HostTier(self.cache, self.device, self.totals, self.faults, config.verify_host_checksums)
        host_blocks = self._host_tier.attach(config)
        self.scheduler = Scheduler(
            replace(sc, host_blocks=host_blocks, block_bytes=self.cache.block_bytes),
            spec=config.spec,
            record_transitions=True,
        )
        self.scheduler.host_tier_fallback = host_blocks < sc.host_blocks
        spec = self.scheduler.spec
        # the states a request may hold host blocks in (the rest hold none: RES-STATE)
        self._host_states = frozenset(s.name for s in spec.states if spec.residency(s.name) == HELD)
        self.trace = TraceWriter(config.trace_path) if config.trace_path is not None else None
        self._produced: list[Request] = []  # the requests that produced a token in the last step (`last_produced`)
        self._submissions: dict[Hashable, Submission] = {}
        self._trace_failure: BaseException | None = None  # a trace write that failed (the engine breaks on it)
        self._calls = CallGuard()  # serializes every call (class docstring: threading model)
        # reuses the decode plan across steps, and keeps its gathered keys and values within `decode_kv_bytes`
        self._planner = BatchPlanner(sc.block_size, self.device, decode_kv_budget=config.decode_kv_bytes)
        if self.faults is not None:
            self.totals.faults = self.faults.injected  # one counter: what the injector fired, by kind

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
        with self._calls.exclusive("add_request"):
            return self._add_request(prompt_token_ids, max_new_tokens, stop_token_ids, sampling, request_id)

    def _add_request(
        self,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        stop_token_ids: Iterable[int],
        sampling: SamplingParams,
        request_id: Hashable | None,
    ) -> Hashable:
        prompt, stop = checked_request(
            prompt_token_ids, max_new_tokens, stop_token_ids, sampling, request_id, self.model.config
        )
        request = self.scheduler.submit(prompt, max_new_tokens, stop_token_ids=stop, request_id=request_id)
        self._submissions[request.request_id] = Submission(request.prompt, max_new_tokens, stop, sampling)
        return request.request_id

    def cancel(self, request_id: Hashable) -> None:
        """Cancel an active request (its blocks are freed at once; its partial output stays in `outputs()`).
        Raises `RequestNotActive` (a `ValueError` and an `UnknownRequestId`; nothing changed) for an id that is
        unknown or already done. Safe from another thread during `run()` (it lands between two steps)."""
        with self._calls.exclusive("cancel"):
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

    # ------------------------------------------------------------------------------------------- stepping
    @property
    def last_produced(self) -> list[tuple[Hashable, int]]:
        """(request id, token) of every token the last step produced, in batch order (built when read: a request's
        last token stays its last until the next step)."""
        return [(r.request_id, r.generated[-1]) for r in self._produced]

    def step(self) -> IterationStats:
        """Schedule and carry out one iteration; `last_produced` lists the (request id, token) it produced.
        Injected faults (`EngineConfig.faults`) happen here; the iteration still completes. An exception inside
        the step is settled and re-raised, or becomes `EngineBroken` (module docstring)."""
        with self._calls.exclusive("step", steps=True):
            return self._step()

    def _step(self) -> IterationStats:
        attempt = StepAttempt()
        try:
            stats = self._carry_out(attempt)
        except BaseException as err:
            self._settle_failed(attempt, err)
            raise
        self._break_on_trace_failure(f"step {self.scheduler.iteration}")
        return stats

    def _carry_out(self, attempt: StepAttempt) -> IterationStats:
        """The iteration itself (module docstring, 1-5: the phases of a `kvstate.scheduler.Step`); `attempt` records how
        far it got."""
        scheduler, check = self.scheduler, self.config.check_invariants
        iteration = scheduler.iteration + 1
        if self.faults is not None and scheduler.pool.has_host_tier and self.faults.fire("host_loss", iteration):
            attempt.phase = "host tier loss"
            self._host_tier.lose(scheduler, f"injected fault host_loss at iteration {iteration}")
        attempt.phase = "schedule"
        step = attempt.step = Step.begin(scheduler)
        if check:
            scheduler.check_invariants(step.output)
        attempt.phase = "issue copies"
        self._host_tier.issue_all(step)
        if step.failures and check:
            scheduler.check_invariants(step.output)
        attempt.phase = "forward"
        sampled = self._compute(step.output)
        attempt.phase = "complete migrations"
        self._host_tier.settle(step)
        resumes = resume_copies(step.output)  # before complete_step: resumed requests are not scheduled yet
        attempt.phase = "complete step"
        attempt.progress = step_progress(step.output)
        produced = step.finish(sampled)
        attempt.phase = "after the step"
        self._produced = produced
        if check:
            scheduler.check_invariants()
        stats = self.stats()
        self.totals.add_step(stats, resumes)
        return stats

    def _settle_failed(self, attempt: StepAttempt, err: BaseException) -> None:
        """`err` interrupted a step: drain the copies, settle every migration, discard the forward pass, and
        return (the caller re-raises `err`) if the state is consistent; otherwise raise `EngineBroken`."""
        self._produced = []
        iteration = self.scheduler.iteration
        problem = settle_interrupted(attempt, self.scheduler, self.cache, self._host_tier)
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
        if isinstance(err, KeyboardInterrupt):  # the user stopped the run: nothing failed
            err.add_note(
                f"kvstate: interrupted at step {iteration} (in phase '{attempt.phase}'); the step was settled: "
                f"nothing is in flight and {done}"
            )
            return
        err.add_note(
            f"kvstate: step {iteration} failed in phase '{attempt.phase}' and was settled: every copy "
            f"completed or failed and nothing is in flight; {done}; the engine can keep stepping"
        )

    def _break(self, message: str, cause: BaseException) -> None:
        """Mark the engine broken (every later driving call raises this error) and raise it."""
        raise EngineBroken(self._mark_broken(message, cause).args[0]) from cause

    def _mark_broken(self, message: str, cause: BaseException) -> EngineBroken:
        """Mark the engine broken: every later driving call raises the error returned."""
        broken = EngineBroken(
            f"the engine is broken: {message}. Finished outputs can still be read "
            "(outputs(), take_finished()); create a new Engine to continue"
        )
        broken.__cause__ = cause
        self._calls.broken = broken
        return broken

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

    def lose_host_tier(self, reason: str = "the host tier became unusable") -> list[Hashable]:
        """The host tier is gone (call between steps): every suspended request holding host blocks takes
        `lose_host_copy` and will be replayed (those held wholly on the GPU stay suspended), the host tensor is
        dropped, and the engine keeps serving GPU-only (`host_tier_fallback`).
        Returns the ids of the requests that lost their host copy. Raises `HostTierLossRefused` (nothing
        changed) when recompute-pause is disabled, since nothing could be evicted afterwards."""
        with self._calls.exclusive("lose_host_tier"):
            lost = self._host_tier.lose(self.scheduler, reason)
            self._break_on_trace_failure("lose_host_tier")
            return lost

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
            with self._calls.exclusive("run", steps=True):
                if not self.scheduler.has_unfinished or (max_steps is not None and steps >= max_steps):
                    return self._outputs()
                self._step()
            steps += 1

    def stream(self) -> Iterator[tuple[Hashable, int]]:
        """Step until every request is done, yielding (request id, token) for each token as it is produced.
        The consumer may `cancel` or `add_request` between items; `step`, `run` or another `stream` while this
        one is live raise `EngineBusy` (their tokens would never reach it)."""
        with self._calls.exclusive("stream", steps=True):
            self._calls.streaming = True
        try:
            while True:
                with self._calls.exclusive("stream"):
                    if not self.scheduler.has_unfinished:
                        return
                    self._step()
                    produced = list(self.last_produced)
                yield from produced
        finally:
            self._calls.streaming = False

    def outputs(self) -> dict[Hashable, list[int]]:
        """{id: generated tokens} of every finished request (finished, cancelled or aborted) not yet taken."""
        with self._calls.reading():
            return self._outputs()

    def _outputs(self) -> dict[Hashable, list[int]]:
        return {rid: list(r.generated) for rid, r in self.scheduler.finished.items()}

    def take_finished(self) -> dict[Hashable, FinishedRequest]:
        """Hand over every finished request (finished, cancelled or aborted) and forget it: it leaves
        `outputs()`, the scheduler's `finished` and the engine's records, so a long-running engine's memory stays
        bounded by its active requests; its id may be used again. Works on a closed or broken engine too."""
        with self._calls.exclusive("take_finished", drives=False):
            taken = self.scheduler.forget_finished(list(self.scheduler.finished))
            for request in taken:
                self._submissions.pop(request.request_id, None)
                self._host_tier.forget(request.request_id)
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
        config = unpressured(
            self.config,
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
            config = unpressured(
                self.config,
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

    def _submitted(self, request_ids: Iterable[Hashable] | None) -> list[tuple[Hashable, Submission]]:
        """(id, submission) of these requests (default: every one not yet taken), in order."""
        with self._calls.reading():
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
        count each event, forget the checksums of a request that left the states holding host blocks (its host
        copy was read by a resume, lost or released), write the trace lines. A failed trace write is
        kept, not raised, so that a failing step is still settled; `_break_on_trace_failure` then breaks the
        engine once its state is consistent. An interruption (KeyboardInterrupt, or any other BaseException)
        anywhere in here, the trace write included, leaves lines unwritten: the engine is marked broken at once
        (naming it) and the interruption goes on, so the trace is never silently short."""
        events, host_states = self.totals.events, self._host_states
        try:
            for fired in self.scheduler.take_fired():
                transition = fired.transition
                events[transition.event] += 1
                if transition.source in host_states and transition.dest not in host_states:
                    self._host_tier.forget(fired.request.request_id)  # it holds no host block now (RES-STATE)
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
        with self._calls.exclusive("close", drives=False):
            if self._calls.closed:
                return
            self._calls.closed = True
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
