"""The fast path of steady decoding: a run of decode-only passes that the next pass repeats without walking the
resident requests. The reference path is `Scheduler._schedule_decoding`'s walk, which lists exactly what a repeat
lists; the differential machine `tests/kvstate/test_decode_run_machine.py` steps both side by side."""

from __future__ import annotations

from kvstate.output import SchedulerOutput
from kvstate.request import Request

__all__ = ["DecodeRun", "next_run"]


class DecodeRun:
    """A run of decode-only passes: the last pass's decode list held every resident request, and no transition has
    fired since (`Scheduler._move` ends the run), so the next pass's walk would list the same requests, one token
    each, in the same order; `Scheduler._repeat_decodes` repeats it without the walk.

    Invariants kept: `requests` is the decode list of the pass the run began with, in arrival order, and every one
    of them is active and done with its prefill; `phases[k]` lists, in that order, the requests whose step in the
    k-th repeat (modulo the block size) opens a new block, which is so while no request holds a block beyond the
    one its next token fills; `passes` counts the repeats so far, `output` is the last one's (None before)."""

    __slots__ = ("chunk_tokens", "output", "passes", "phases", "requests")

    def __init__(self, requests: list[Request], phases: list[list[Request]]) -> None:
        self.requests = requests
        self.chunk_tokens = dict.fromkeys((r.request_id for r in requests), 1)
        self.phases = phases
        self.passes = 0
        self.output: SchedulerOutput | None = None

    @classmethod
    def after(cls, requests: list[Request], block_size: int) -> DecodeRun | None:
        """The run that follows a pass whose decode list, `requests`, is about to land (each request's computed
        tokens one short of what the next pass sees); None when a request holds a spare block, so its openings
        do not follow the block size's period."""
        phases: list[list[Request]] = [[] for _ in range(block_size)]
        for request in requests:
            room = request.num_gpu_blocks * block_size - request.num_computed_tokens - 1  # free slots once landed
            if not 0 <= room < block_size:
                return None
            phases[room].append(request)
        return cls(requests, phases)

    def opening(self, block_size: int) -> list[Request]:
        """The requests whose step in the next repeat opens a new block."""
        return self.phases[self.passes % block_size]


def next_run(
    output: SchedulerOutput, decodes: list[Request], resident: int, repeated: DecodeRun | None, block_size: int
) -> DecodeRun | None:
    """The run of decode-only passes that `output`, planned undisturbed and about to land with no other step in
    flight, begins or carries on (`decodes`: its decode list; `resident`: the resident requests; `repeated`: the run
    its pass repeated, if any): its decode list holds every resident request, and nothing else is scheduled or
    moved. A copy in flight changes no decode list: a request whose resume copy is in flight is resident but not
    listed, and one that completes or fails late frees blocks (the next repeat checks the free blocks) or fires a
    transition (which ends the run). None otherwise."""
    if not decodes or len(decodes) != resident or len(output.chunk_tokens) != len(decodes):
        return None  # a resident request was skipped, or a prompt or replay chunk was scheduled (admitted)
    if output.resumed or output.suspended or output.recompute_paused or output.migrations:
        return None
    if repeated is not None and repeated.output is output:
        return repeated
    return DecodeRun.after(list(decodes), block_size)
