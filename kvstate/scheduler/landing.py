"""Landing a step: what the forward pass of an output computed, applied to its requests.

Invariants kept: a request's computed tokens advance only by what its step computed; each produced token is
appended once (generated tokens are append-only); catch-up and finish fire where the step ends a replay or a
request; a step that lands after its request was preempted is kept or dropped as the spec's pipeline rules say
(PP-TERMINATE); a decode list planned undisturbed lands without a check per request.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping

from kvstate.output import SCHEDULED_LISTS, SchedulerOutput
from kvstate.request import Request, append_tokens
from kvstate.scheduler.core import SchedulerCore
from kvstate.scheduler.decode_run import next_run
from kvstate.scheduler.statistics import figures_now

__all__ = ["StepLanding"]


class StepLanding(SchedulerCore):
    """The scheduler's landing of computed steps and of pipeline consensus (this module's docstring)."""

    def complete_step(self, output: SchedulerOutput, sampled: Mapping[Hashable, int]) -> list[Request]:
        """Apply a forward pass: advance computed tokens, append each produced token (`sampled[id]`),
        fire catch_up and finish. Returns the requests that produced a token, in batch order (`output.scheduled`).

        A request of the active state's decode list (the spec's `chunk_lists`) still active is a decode step (the
        steady state): it was active and done with its prefill when planned, and only leaving the active state
        resets that; so it computes one token, never a replay, and fires no event but finish (`_complete_decodes`).
        Everything else goes through `_complete_chunk`."""
        produced: list[Request] = []
        recomputed, progress = 0, False
        undisturbed, self._planned = output is self._planned, None
        self._decode_run = (  # a finish below ends it (`_move`); several micro-batches in flight: no run
            next_run(
                output, getattr(output, self._decode_list), len(self.resident), self._repeated, self.config.block_size
            )
            if undisturbed and not self.in_flight
            else None
        )
        for name in SCHEDULED_LISTS:  # batch order
            requests = getattr(output, name)
            if name == self._decode_list:
                progress |= self._complete_decodes(requests, output, sampled, produced, undisturbed)
                continue
            for request in requests:
                tokens, advanced = self._complete_chunk(request, output, sampled, produced)
                recomputed += tokens
                progress |= advanced
        if self.in_flight:
            for request_id in output.chunk_tokens:
                self._leave_pipeline(request_id)
        self._last_figures = output, figures_now(self, recomputed, len(produced), iteration=self.iteration)
        self._last_stats = None  # built from those figures by the next `stats()` call
        if progress:
            self._idle_iterations = 0
        return produced

    def _complete_decodes(
        self,
        requests: list[Request],
        output: SchedulerOutput,
        sampled: Mapping[Hashable, int],
        produced: list[Request],
        undisturbed: bool,
    ) -> bool:
        """Apply the decode list (`complete_step`'s docstring): one token per request still active, finish when it is
        final; the rest through `_complete_chunk`. `undisturbed`: no transition was fired since `output` was planned,
        so every request of the list is still active. True when a request decoded (progress, A4)."""
        if undisturbed:  # every request of the list is still active (`_planned`): each lands, then finishes fire
            produced += requests
            for request in append_tokens(requests, sampled, computed=1):  # a decode step is progress (A4)
                self._fire(request, "finish", self._idle)
            return bool(requests)
        active, decoded = self._active, False
        for request in requests:
            if request.state != active:
                self._complete_chunk(request, output, sampled, produced)  # preempted or ended since it was planned
                continue
            decoded = True
            request.num_computed_tokens += 1  # what `advance(1, False)` does: a decode step is progress (A4)
            produced.append(request)
            if request.append_token(sampled[request.request_id]):
                self._fire(request, "finish", self._idle)
        return decoded

    def _complete_chunk(
        self, request: Request, output: SchedulerOutput, sampled: Mapping[Hashable, int], produced: list[Request]
    ) -> tuple[int, bool]:
        """Apply one prompt or replay chunk of `request` (appending it to `produced` when it samples), or land the
        step of a request preempted or ended since the output was planned; (replayed tokens, progress)."""
        state = request.state
        if state not in self._computing:
            if self._leave_pipeline(request.request_id) and self._land_preempted(request, state, sampled):
                produced.append(request)
            return 0, False  # preempted (its token landed above), cancelled or aborted since the output was planned
        tokens = output.chunk_tokens[request.request_id]
        replaying = state == self._recomputing
        progress = request.advance(tokens, replaying)
        if replaying:
            request.num_recomputed_tokens += tokens
        if request.num_computed_tokens >= request.num_prefill_tokens:  # the chunk ends its (re)prefill: a token
            final = request.append_token(sampled[request.request_id])
            produced.append(request)
            if replaying:
                self._fire(request, "catch_up", self._idle)
            if final:
                self._fire(request, "finish", self._idle)
        return (tokens if replaying else 0), progress

    def _land_preempted(self, request: Request, state: str, sampled: Mapping[Hashable, int]) -> bool:
        """The decode step a request had in flight when a later pass preempted it leaves the last stage; True when
        its token is kept. Awaiting consensus, it is kept (the replay prompt includes it) and a final one takes
        `finish`'s self-loop, so consensus terminates the request instead of replaying it (PP-TERMINATE).
        Suspended (its blocks are held where the step wrote them: none is offloaded while its step is in flight), a
        token is kept unless it is final (a stop token): a suspended request cannot finish, so that step is dropped
        and recomputed after resume, which samples the same token. After a recompute-pause reset, a cancel or an
        abort it is dropped."""
        if state not in (self._pending_reset, self._offloaded):
            return False
        token = sampled[request.request_id]  # a decode step: a request with a chunk in flight is no victim
        if state == self._offloaded and (token in request.stop_token_ids or request.remaining_tokens <= 1):
            return False
        before = self.tally.before(request)
        request.advance(1, False)
        if before is not None:
            self.tally.changed(request, before)
        if request.append_token(token):
            self._fire(request, "finish", self._idle)
        return True

    def reach_consensus(self, request_ids: Collection[Hashable] | None = None) -> list[Request]:
        """Every stage agreed on these pending recompute-pauses (default: all of them): reset them for replay,
        or terminate them if they finished or were cancelled while waiting."""
        pending = [
            r
            for r in self.resident
            if r.state == self._pending_reset and (request_ids is None or r.request_id in request_ids)
        ]
        for request in pending:
            self._fire(request, "consensus", self._idle)
        return pending
