"""Step refinement: each action of the real scheduler's world maps to a sequence of abstract actions (or none).

The scheduler refinement (`kvstate.checker.refinement`) takes the abstraction of the world before and after each
action it explores (a submission, a scheduler step, a copy completing or failing, a micro-batch landing, a cancel,
...) and asks `StepMatcher.match` for a sequence of abstract actions (`AbstractModel.apply`: the spec's events
with the real guards and the abstract effects, compute steps, copy completions) that leads from the one to the
other. An empty sequence is a stutter. By induction from the initial state, every state the real scheduler reaches
then abstracts to a state the abstract model reaches (REFINES), without enumerating the abstract model.

The search is a breadth-first search over abstract states in bound order (a request keeps its slot: its index in
the bound), limited to the requests the action touched and, for spec events, to the events the scheduler fired on
them (it records every transition it takes), so it stays small; results are cached by (before, after, allowed).

Invariant: `match` returns True only when some sequence of at most `depth` enabled abstract actions leads from a
variant of `before` to a variant of `after` (variants: the abstraction's choices for decode steps that may still be
in the pipeline, `Abstraction.variants`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping

from kvstate.checker.model import AbstractModel
from kvstate.checker.records import STOP, AbstractState, Action

COMPUTED_BY_STEP = frozenset({"catch_up", "finish"})  # fired inside an abstract compute action, not on their own


class StepMatcher:
    """Finds abstract action sequences between the abstractions of two worlds of one bound."""

    def __init__(self, model: AbstractModel) -> None:
        self.model = model
        self._cache: dict[tuple, bool] = {}

    def allowed(self, touched: Iterable[int], fired: Mapping[int, Iterable[str]]) -> frozenset[Action]:
        """The abstract actions a step may use: on each touched request, computing (its token a stop token, in a
        bound with stop tokens), arriving, completing its copy, and the spec events the scheduler fired on it (an
        offload of held blocks with any block count: `Action.blocks`)."""
        model, out = self.model, set[Action]()
        for slot in touched:
            out |= {Action("compute", slot, None), Action("complete", slot, None), Action("arrive", slot, None)}
            if model.stop_tokens:
                out.add(Action("compute", slot, STOP))
            events = {e for e in fired.get(slot, ()) if e not in COMPUTED_BY_STEP}
            out |= {Action("event", slot, e) for e in events - model.limited_events}
            counts = range(1, model.bound.gpu_blocks + 1)
            out |= {Action("event", slot, e, None, n) for e in events & model.limited_events for n in counts}
            for n in model.chunk_cuts:  # a token budget may cut chunks short
                out.add(Action("compute", slot, None, n))
                out |= {Action("event", slot, e, n) for e in events & model.first_chunk_events}
        return frozenset(out)

    def match(
        self, before: list[AbstractState], after: list[AbstractState], allowed: frozenset[Action], depth: int
    ) -> bool:
        """Some sequence of at most `depth` actions of `allowed` leads from a state of `before` to one of `after`."""
        key = (tuple(before), frozenset(after), allowed, depth)
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = self._search(before, set(after), allowed, depth)
        return found

    def _search(self, before: list[AbstractState], after: set[AbstractState], allowed: frozenset, depth: int) -> bool:
        model = self.model
        seen = set(before)
        frontier = deque((state, 0) for state in before)
        while frontier:
            state, n = frontier.popleft()
            if state in after:
                return True
            if n == depth:
                continue
            for action in allowed:
                edge = model.apply(state, action)
                if edge is None:
                    continue
                nxt = AbstractState(edge.after_requests, *edge.after_pool)
                if nxt not in seen:
                    seen.add(nxt)
                    frontier.append((nxt, n + 1))
        return False
