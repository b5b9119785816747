"""The scheduler: one `schedule()` call per iteration decides who computes, who moves and who is preempted.

`Scheduler` combines the parts of `kvstate.scheduler` (preemption, admission, landing a step, copy reports, each
derived from `SchedulerCore`) and plans each pass: decode steps of the resident requests in arrival order, then
prompt and replay chunks, then admissions in the policy's order.

Invariants kept (ids from the spec; the policy's rules are the spec's `[policy]`, given meaning in
`kvstate.policy`, which the model checker's step simulation holds every pass against):
* output lists are disjoint (OUT-DISJOINT); requests' block counts mirror the pool (RES-STATE), checked by
  `check_invariants`;
* steady-state decode costs O(1) per running request: no lifecycle event fires unless a state changes, and a step
  walks only the requests it schedules; a pass that follows a decode-only pass of every resident request, with no
  transition since, repeats its decode list without a walk (`DecodeRun`), exactly as the walk would list it;
* a pass schedules nothing whose step of an earlier pass is still in flight, and, with several micro-batches in
  flight, at most its share of the active requests.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from kvstate.config import RequestRejected, normalize_stop_token_ids
from kvstate.errors import SchedulerStalled, UnknownRequestId
from kvstate.output import SchedulerOutput
from kvstate.pool import ceil_div
from kvstate.request import Request, new_request
from kvstate.scheduler.admission import Admission
from kvstate.scheduler.copies import CopyReports
from kvstate.scheduler.decode_run import DecodeRun
from kvstate.scheduler.invariants import check_scheduler
from kvstate.scheduler.landing import StepLanding
from kvstate.scheduler.preemption import Preemption
from kvstate.scheduler.scheduling_pass import SchedulingPass
from kvstate.scheduler.statistics import figures_now, stats_of
from kvstate.stats import IterationStats
from kvstate.untrusted import shown

__all__ = ["Scheduler"]


class Scheduler(Preemption, Admission, StepLanding, CopyReports):
    """Continuous batching over a `TieredBlockPool` with suspend and recompute-pause preemption."""

    def submit(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        stop_token_ids: Iterable[int] = (),
        request_id: Hashable | None = None,
    ) -> Request:
        """Queue a new request; raises `RequestRejected` (nothing changed) when it is invalid or can never fit."""
        stop = normalize_stop_token_ids(stop_token_ids)
        self.config.check_submission(prompt, max_new_tokens, stop)
        if request_id is None:
            request_id = self._next_free_id()
        elif not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
            raise RequestRejected(f"request_id must be a str or an int, got {type(request_id).__name__}")
        if request_id in self.requests or request_id in self.finished:
            raise RequestRejected(f"request id {shown(request_id)} is already in use; pick a fresh id or pass None")
        request = new_request(
            request_id,
            prompt,
            max_new_tokens,
            stop_token_ids=stop,
            arrival=next(self._arrivals),
            block_size=self.config.block_size,
        )
        self.lifecycle.start(request)
        self.requests[request_id] = request
        self.tally.added(request)
        self.waiting.append(request)
        return request

    def _next_free_id(self) -> int:
        while (rid := next(self._auto_ids)) in self.requests or rid in self.finished:
            pass
        return rid

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def idle_iterations(self) -> int:
        """Passes since the last one that made progress (what the no-progress detector, A4, reads)."""
        return self._idle_iterations

    def cancel(self, request_id: Hashable) -> Request:
        """Cancel an active request from any state (deferred while it awaits consensus)."""
        return self._terminate(request_id, "cancel")

    def abort(self, request_id: Hashable) -> Request:
        """Abort an active request (engine-side failure) from any state."""
        return self._terminate(request_id, "abort")

    def _terminate(self, request_id: Hashable, event: str) -> Request:
        request = self.requests.get(request_id)
        if request is None:
            where = "has already finished" if request_id in self.finished else "is unknown"
            raise UnknownRequestId(
                f"cannot {event} request {shown(request_id)}: it {where}; only active requests can be ended"
            )
        self._fire(request, event, self._idle)
        return request

    def schedule(self) -> SchedulerOutput:
        """Plan one iteration. Raises `SchedulerStalled` after `no_progress_limit` passes without progress."""
        self._watch_progress()
        self.iteration += 1
        pass_ = SchedulingPass(self.config, self.iteration)
        pass_.pending_free = self._room_on_its_way()
        pass_.slots_left = self.slots_per_pass()
        run, self._decode_run, self._repeated = self._decode_run, None, None
        try:
            continuing = [] if run is not None and self._repeat_decodes(run, pass_) else self._schedule_decoding(pass_)
            for request in continuing:  # then prompt and replay chunks, in arrival order
                if pass_.slots_left == 0 or pass_.tokens_left == 0:
                    break
                if id(request) not in pass_.victims and request.state in self._computing:
                    self._schedule_resident(request, pass_)
            if self.config.capacity_policy == "max_utilization":
                self._admit(pass_)
            else:
                self._admit_class("admit", self.waiting, pass_)
        finally:
            self.last_pass = pass_
        out = pass_.output
        out.num_fitting_requests = out.num_scheduled
        self._planned = out
        if self.micro_batches > 1:
            self._enter_pipeline(out.chunk_tokens, pass_.chunk_blocks)
        return out

    def track_in_flight(self, micro_batches: int) -> None:
        """Let `micro_batches` outputs be in flight at once (pipeline parallelism): from now on a request scheduled
        by a pass stays in `in_flight` until `complete_step` lands that pass's output, later passes skip it, and a
        decoding victim among them keeps the token its step lands (`_land_preempted`); each pass takes at most its
        share of the active requests
        (`slots_per_pass`), so the micro-batches balance. Without this call every output is completed before the
        next pass (one micro-batch in flight) and `in_flight` stays empty."""
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.micro_batches = micro_batches

    def must_land(self, outputs_in_flight: int) -> bool:
        """The oldest of `outputs_in_flight` outputs must land before the next pass: `micro_batches` are in flight,
        or every unfinished request is (the pass would schedule nothing), or a request whose step is in flight has
        released its GPU blocks (ended, or reset for replay): the later stages of that step still write and read
        them, so no copy the next pass issues may refill them first."""
        return outputs_in_flight > 0 and (
            outputs_in_flight >= self.micro_batches
            or len(self.in_flight) >= len(self.requests)
            or any(self._released_in_flight(rid) for rid in self.in_flight)
        )

    def _released_in_flight(self, request_id: Hashable) -> bool:
        request = self.requests.get(request_id)
        return request is None or request.state == self._dropped

    def slots_per_pass(self) -> int:
        """Batch slots of the next pass: `max_batch_size`, and with several micro-batches in flight at most an
        equal share of the active requests (rounded up)."""
        if self.micro_batches == 1:
            return self.config.max_batch_size
        return min(self.config.max_batch_size, max(1, ceil_div(len(self.requests), self.micro_batches)))

    def _room_on_its_way(self) -> int:
        """GPU blocks that free without further preemption: fenced by copies, or held awaiting consensus."""
        return len(self.pool.gpu.fenced) + self.tally.gpu_blocks[self._pending_reset]

    def _schedule_decoding(self, pass_: SchedulingPass) -> list[Request]:
        """Decode steps of the resident requests in arrival order, in one walk that also returns the resident
        requests with prompt or replay tokens left (scheduled next, by the caller, in arrival order; once the budget
        is spent the walk stops, and so would the caller). A request whose step is in flight is skipped. The steady
        state — an active request whose last block still has room — costs a few attribute reads: no lifecycle
        event, no pool call, no Python call; a step that opens a new block takes a free one directly, and only a
        step that finds none goes through `_schedule_resident` (which may preempt)."""
        out, block_size, active, pool = pass_.output, self.config.block_size, self._active, self.pool
        decode_list = getattr(out, self._decode_list)
        chunk_tokens, victims = out.chunk_tokens, pass_.victims  # the pass's own containers, filled in place
        in_flight, continuing = self.not_ready(), []
        decodes = 0  # decode steps taken by the fast path below and not yet charged to the pass's budgets
        opening: list[Request] = []  # decode steps listed that open a new block, not yet given it (`_open_blocks`)
        room = min(pass_.slots_left, pass_.tokens_left)  # decode steps the budgets allow (each takes 1 slot, 1 token)
        unmoved_victims = pass_.unmoved_victims  # victims that may still be active (the others left that state)
        for request in tuple(self.resident):  # a copy: a victim taken on the way leaves `resident`
            if in_flight and request.request_id in in_flight:
                continue  # its step is still in the pipeline (a request is in one micro-batch in flight at most), or
                # its resume copy is: it computes once its KV is back
            computed = request.num_computed_tokens
            if computed < request.num_prefill_tokens:
                continuing.append(request)
                continue
            if decodes == room:
                break
            if request.state != active or (unmoved_victims and id(request) in victims):
                continue
            if computed == request.num_gpu_blocks * block_size:  # its step opens a new block
                if not pool.can_allocate(len(opening) + 1):  # none is left: room is made, or waited for, by the
                    self._open_blocks(opening, pass_)  # general path, once the pass's blocks and budgets are exact
                    opening = []
                    pass_.charge(decodes, decodes)
                    decodes = 0
                    self._schedule_resident(request, pass_)
                    room = min(pass_.slots_left, pass_.tokens_left)
                    unmoved_victims = pass_.unmoved_victims
                    continue
                opening.append(request)
            decode_list.append(request)
            chunk_tokens[request.request_id] = 1
            decodes += 1
        self._open_blocks(opening, pass_)
        pass_.charge(decodes, decodes)
        return continuing

    def _open_blocks(self, opening: list[Request], pass_: SchedulingPass) -> None:
        """Give each decode step of `opening` the new block it writes, in one pool call (the blocks, and their
        order, `_allocate_chunk_blocks(request, 1, pass_)` for each in turn would give)."""
        if not opening:
            return
        self.pool.allocate_one_each([request.request_id for request in opening])
        chunk_blocks = pass_.chunk_blocks
        for request in opening:
            request.num_gpu_blocks += 1
            chunk_blocks[request.request_id] = 1

    def _repeat_decodes(self, run: DecodeRun, pass_: SchedulingPass) -> bool:
        """List `run`'s decode steps in `pass_`, as `_schedule_decoding`'s walk would (`DecodeRun`), giving the
        steps that open a block their blocks; False (nothing changed) when the walk must decide: the budgets (a
        share of the requests, once several micro-batches may be in flight) or the free blocks no longer take every
        step."""
        requests = run.requests
        opening = run.opening(self.config.block_size)
        if len(requests) > min(pass_.slots_left, pass_.tokens_left) or not self.pool.can_allocate(len(opening)):
            return False
        out = pass_.output
        getattr(out, self._decode_list).extend(requests)
        out.chunk_tokens.update(run.chunk_tokens)
        self._open_blocks(opening, pass_)
        pass_.charge(len(requests), len(requests))
        run.passes += 1
        run.output, self._repeated = out, run
        return True

    def _schedule_resident(self, request: Request, pass_: SchedulingPass) -> None:
        tokens = (
            1
            if not request.is_prefilling
            else min(self.config.prefill_chunk_size, request.next_step_tokens, pass_.tokens_left)
        )
        need = max(0, self.pool.blocks_for_tokens(request.num_computed_tokens + tokens) - request.num_gpu_blocks)
        if need > self.pool.gpu_free_blocks:
            if self.config.capacity_policy == "guaranteed_no_evict":
                return
            if not self._make_room(request, need, pass_):
                return  # preempted itself, or waits for the room on its way
        if need:
            self._allocate_chunk_blocks(request, need, pass_)
        self._add_scheduled(request, tokens, pass_)

    def _watch_progress(self) -> None:
        """A4: count passes since the last progress (a prompt chunk, a decode step, a replay chunk beyond every
        earlier replay of the same replay prompt). Recomputing thrown-away replay work, copies and preemptions are
        not progress; a replay that redoes an earlier attempt's work legitimately takes up to its replay prompt's
        chunks, so the limit is `no_progress_limit` plus the chunks of the longest replay prompt."""
        if not self.requests:
            self._idle_iterations = 0
            return
        idle, limit = self._idle_iterations, self.config.no_progress_limit
        if idle >= limit and idle >= limit + self._replay_allowance():  # the allowance is read once the limit is hit
            listing = ", ".join(f"{r.request_id!r}:{r.state}" for r in list(self.requests.values())[:20])
            raise SchedulerStalled(
                f"no request made progress for {self._idle_iterations} iterations; requests {listing}; "
                f"pool {self.pool.usage()}; {self._stall_hint()}"
            )
        self._idle_iterations += 1

    def _stall_hint(self) -> str:
        """What a stall of the no-progress detector says to do: complete the copies in flight (F2) if any; with
        recompute-pause off under max_utilization, that LIVE-DONE is not promised then (spec/SPEC.md section 6);
        otherwise that it is promised, so the stall is a defect of the scheduler or of the spec in use."""
        in_flight = len(self.pool.in_flight)
        hints = [
            f"in-flight copies {in_flight}"
            + (" (complete them with complete_migrations: a copy never completed stalls the run)" if in_flight else "")
        ]
        if not self.config.enable_recompute_pause and self.config.capacity_policy == "max_utilization":
            hints.append(
                "recompute-pause is off (enable_recompute_pause=False), and without it every request finishing "
                "is not promised under max_utilization: a full host tier can stall the scheduler (LIVE-DONE, "
                "spec/SPEC.md section 6); enable recompute-pause, or raise host_blocks or gpu_blocks"
            )
        elif not in_flight:
            hints.append(
                "every request fits alone and recompute-pause is "
                + ("on" if self.config.enable_recompute_pause else "not needed under guaranteed_no_evict")
                + ", so every request finishing is promised (LIVE-DONE, spec/SPEC.md section 6): this stall is a "
                "defect of the scheduler or of the spec in use; `kvstate check --spec SPEC` looks for it"
            )
        return "; ".join(hints)

    def _replay_allowance(self) -> int:
        """Passes the longest pending replay prompt needs to be recomputed once (0 when nothing replays)."""
        if self._idle_iterations < self.config.no_progress_limit:
            return 0  # not needed yet: only computed once the detector would otherwise fire
        replays = [len(r.prefill_tokens) for r in self.requests.values() if r.num_recompute_pauses]
        return ceil_div(max(replays, default=0), self.config.prefill_chunk_size)

    def stats(self) -> IterationStats:
        """Statistics of the last completed iteration; before the first one completes, the requests and the pool as
        they are (iteration 0, nothing done yet). Every state is in `requests_per_state` from the start."""
        if self._last_figures is None:
            return stats_of(SchedulerOutput(), figures_now(self, 0, 0, iteration=0), self.config.block_bytes)
        if self._last_stats is None:
            self._last_stats = stats_of(*self._last_figures, self.config.block_bytes)
        return self._last_stats

    def check_invariants(self, output: SchedulerOutput | None = None) -> None:
        """Raise `InvariantViolation` unless the pool, every request and `output` satisfy the spec's invariants."""
        check_scheduler(self, output)

    def forget_finished(self, request_ids: Iterable[Hashable]) -> list[Request]:
        """Drop these finished requests from `finished` and return them (their ids may be used again); the
        caller has taken their outputs. Raises `UnknownRequestId` (nothing changed) for an id not in `finished`."""
        ids = list(request_ids)
        missing = [rid for rid in ids if rid not in self.finished]
        if missing:
            raise UnknownRequestId(
                f"cannot forget requests {shown(missing[:5])}: they are not finished (active, unknown "
                "or already forgotten); forget only ids from `finished`"
            )
        return [self.finished.pop(rid) for rid in ids]
