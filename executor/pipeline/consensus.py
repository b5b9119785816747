"""Per-rank bookkeeping of pipeline consensus (SPEC.md §9.1): acknowledgements, agreement, PP-HOLD.

Protocol (one exchange per iteration, on every rank, also when no batch runs):
1. a rank *announces* a pause when it applies the scheduler output of iteration i naming a request in
   `recompute_paused` while the request is `awaiting_consensus`; it also records the GPU blocks it holds;
2. a rank *acknowledges* the pause once it has retired every micro-batch up to and including iteration i
   (plus its configured `delay`, a slow-stage test hook): `acks()` lists the ids it reports;
3. every rank all-gathers the ack lists; a pause is *agreed* when every rank reported it (`agree`);
4. rank 0 fires `consensus` only for agreed pauses; every rank checks, when the consensus transition reaches
   it, that it had agreed before (`release`), else raises `InvariantViolation("PP-HOLD")`.

Invariants kept:
* no pause is released (blocks freed, state reset or terminated) before every rank acknowledged it;
* until released, no other request's chunk and no migration destination may touch a pending request's blocks
  (`check_untouched`, PP-HOLD); a request awaiting consensus is never in a batch.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from kvstate.errors import InvariantViolation


@dataclass
class PauseRecord:
    """The life of one pause of one request on one rank (iterations are scheduler iterations)."""

    request_id: Hashable
    paused: int  # iteration whose output announced the pause
    blocks: tuple[int, ...]  # GPU blocks it keeps while awaiting consensus
    acked: int | None = None  # iteration at whose start this rank first reported it
    agreed: int | None = None  # iteration at whose start every rank had reported it
    released: int | None = None  # iteration during which the consensus transition was applied here
    outcome: str | None = None  # the state consensus took it to: recompute_paused or done

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "paused": self.paused,
            "blocks": list(self.blocks),
            "acked": self.acked,
            "agreed": self.agreed,
            "released": self.released,
            "outcome": self.outcome,
        }


class ConsensusBook:
    """What one rank knows of pending pauses. Pure Python: the collectives are the caller's."""

    def __init__(self, rank: int, delay: int = 0) -> None:
        self.rank = rank
        self.delay = delay
        self.pending: dict[Hashable, PauseRecord] = {}
        self.history: list[PauseRecord] = []
        self.retired = 0  # last iteration whose micro-batch this rank has completed

    def announce(self, request_id: Hashable, iteration: int, blocks: Sequence[int]) -> None:
        if request_id in self.pending:
            raise InvariantViolation(
                "PP-HOLD",
                f"request {request_id!r} was paused again at iteration {iteration} "
                "while its previous pause still awaits consensus",
            )
        record = PauseRecord(request_id, iteration, tuple(blocks))
        self.pending[request_id] = record
        self.history.append(record)

    def retire(self, iteration: int) -> None:
        """This rank finished every micro-batch up to and including `iteration`."""
        self.retired = max(self.retired, iteration)

    def acks(self, now: int) -> list[Hashable]:
        """Ids this rank reports at the start of iteration `now` (retired the pausing iteration, plus delay)."""
        ready = []
        for rid, record in self.pending.items():
            if record.paused + self.delay <= self.retired:
                if record.acked is None:
                    record.acked = now
                ready.append(rid)
        return ready

    def agree(self, reports: Iterable[Iterable[Hashable]], now: int) -> set[Hashable]:
        """The pauses every rank reported (one report per rank); records when each became agreed."""
        sets = [set(r) for r in reports]
        agreed = set.intersection(*sets) if sets else set()
        for rid in agreed:
            record = self.pending.get(rid)
            if record is not None and record.agreed is None:
                record.agreed = now
        return {rid for rid in agreed if rid in self.pending}

    def release(self, request_id: Hashable, iteration: int, outcome: str) -> PauseRecord:
        """The consensus transition of `request_id` reached this rank; refuse it unless every rank had agreed."""
        record = self.pending.get(request_id)
        if record is None or record.agreed is None:
            acked = None if record is None else record.acked
            raise InvariantViolation(
                "PP-HOLD",
                f"rank {self.rank}: request {request_id!r} was reset or terminated "
                f"at iteration {iteration} before every stage acknowledged its pause "
                f"(this rank acked at {acked})",
            )
        record.released, record.outcome = iteration, outcome
        del self.pending[request_id]
        return record

    def held_blocks(self) -> dict[int, Hashable]:
        return {block: rid for rid, record in self.pending.items() for block in record.blocks}

    def check_untouched(self, writers: Iterable[tuple[Hashable, Iterable[int]]], iteration: int) -> None:
        """PP-HOLD: no request other than a block's pending owner writes it, and no pending request computes."""
        held = self.held_blocks()
        if not held:
            return
        for rid, blocks in writers:
            if rid in self.pending:
                raise InvariantViolation(
                    "PP-HOLD",
                    f"rank {self.rank}: request {rid!r} awaits consensus but is in the batch of iteration {iteration}",
                )
            for block in blocks:
                owner = held.get(block)
                if owner is not None:
                    raise InvariantViolation(
                        "PP-HOLD",
                        f"rank {self.rank}: iteration {iteration} writes block "
                        f"{block} of {rid!r}, but request {owner!r} still holds it while it "
                        "awaits consensus",
                    )
