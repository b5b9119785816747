"""The statistics the scheduler keeps on each transition: per-state counts and the figures of the requests that
hold still, so that a step's statistics cost O(states), never O(requests)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

__all__ = ["Figures", "Holding", "StateTally", "figures"]


class Holding(Protocol):
    """What the tally reads of a request (`kvstate.Request` is one)."""

    state: str
    num_computed_tokens: int
    num_prefill_tokens: int
    num_gpu_blocks: int


Figures = tuple[int, int, int]  # (num_computed_tokens, num_prefill_tokens, num_gpu_blocks) of one request


def figures(request: Holding) -> Figures:
    """What `StateTally` sums of `request`."""
    return request.num_computed_tokens, request.num_prefill_tokens, request.num_gpu_blocks


class StateTally:
    """Per-state request counts, and token and block sums of the requests that hold still, kept on every transition
    so that a step's statistics cost O(states), never O(requests held) (STATS-COUNT).

    Invariants kept, checked against `recount` by `Scheduler.check_invariants`:
    * `counts[s]` is the number of active (unfinished) requests in state s, for every non-terminal state s;
    * `peaks[s]` is the largest `counts[s]` has been, taken on every transition: a request that entered s and left
      it again between two samples of `counts` still counts (not part of the recount: a recount has no history);
    * for every `held` state s (a non-terminal state whose requests do not compute: the spec's `computing` flag
      says which, never a name), `kv_tokens[s]`, `replay_tokens[s]` and `gpu_blocks[s]` are the sums of
      `num_computed_tokens`, `num_prefill_tokens` (`len(prefill_tokens)`) and `num_gpu_blocks` over the requests in
      s. A computing request's figures change on every step, so computing states keep a count only.

    The owner calls `added` for a new request, `moved` after every transition (with the request's figures from
    before it: the edge's effect changes them) and `changed` when a held request's figures change without one (a
    pipelined step that lands after its request was preempted); nothing else changes a held request's figures.
    """

    __slots__ = ("counts", "gpu_blocks", "held", "kv_tokens", "peaks", "replay_tokens")

    def __init__(self, states: Iterable[str], held: Iterable[str]) -> None:
        self.counts: dict[str, int] = dict.fromkeys(states, 0)
        self.peaks: dict[str, int] = dict.fromkeys(self.counts, 0)
        self.held = frozenset(held)
        if not self.held <= set(self.counts):
            raise ValueError(f"held states {sorted(self.held - set(self.counts))} are not among the tallied states")
        self.kv_tokens: dict[str, int] = dict.fromkeys(self.held, 0)
        self.replay_tokens: dict[str, int] = dict.fromkeys(self.held, 0)
        self.gpu_blocks: dict[str, int] = dict.fromkeys(self.held, 0)

    def before(self, request: Holding) -> Figures | None:
        """What `moved` needs of `request` before a transition: its figures when its state is held, else None."""
        return figures(request) if request.state in self.held else None

    def added(self, request: Holding) -> None:
        self._count(request.state)
        self._add(request.state, figures(request), 1)

    def moved(self, request: Holding, old: str, before: Figures | None) -> None:
        """`request` left `old` (its figures were `before`) for its present state (terminal: no longer counted)."""
        counts, state = self.counts, request.state
        counts[old] -= 1
        if before is not None:
            self._add(old, before, -1)
        if state in counts:
            self._count(state)
            if state in self.held:
                self._add(state, figures(request), 1)

    def _count(self, state: str) -> None:
        count = self.counts[state] = self.counts[state] + 1
        self.peaks[state] = max(self.peaks[state], count)

    def changed(self, request: Holding, before: Figures) -> None:
        """A held `request`'s figures changed from `before` without a transition."""
        self._add(request.state, before, -1)
        self._add(request.state, figures(request), 1)

    def _add(self, state: str, of: Figures, sign: int) -> None:
        if state in self.held:
            computed, replay, blocks = of
            self.kv_tokens[state] += sign * computed
            self.replay_tokens[state] += sign * replay
            self.gpu_blocks[state] += sign * blocks

    def recount(self, requests: Iterable[Holding]) -> StateTally:
        """A tally of the same states built from scratch over `requests` (the active ones)."""
        fresh = StateTally(self.counts, self.held)
        for request in requests:
            fresh.added(request)
        return fresh

    def to_dict(self) -> dict[str, dict[str, int]]:
        return {
            "counts": dict(self.counts),
            "kv_tokens": dict(self.kv_tokens),
            "replay_tokens": dict(self.replay_tokens),
            "gpu_blocks": dict(self.gpu_blocks),
        }
