"""Which paths of spec edges a request may have taken between two observations, and which edges a pass reported.

Between two observations a request may take several spec events (one `step()` runs a whole iteration). A path of
edges is admitted only if the guard of every edge on it may have held: each guard is the spec's own function
(`kvstate.semantics.GUARDS`), evaluated on an `ObservedRequest`, a `RequestView` that answers only what the observed
counters decide. A guard that reads anything else is not refuted. Where the adapter reports its passes, each request
a pass lists as having taken an event (the list that event feeds, `Event.feeds`) must have been in a source state of
that event just before the pass: the edge is checked exactly, not as a path.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstate.semantics import GUARDS
from kvstate.spec import Spec, Transition

__all__ = ["ObservedRequest", "Unobservable", "admitted_path", "refuted_edges", "unlisted_sources"]


class Unobservable(Exception):
    """A guard read a field that the observed counters do not decide."""


@dataclass
class ObservedRequest:
    """What the observed counters of one request decide between two observations, read as a `RequestView`.

    `tokens_sampled`: tokens its output grew by between the observations. `output_is_final`: its output after them
    ends with a stop token or spends its budget. A replay completes with the chunk that samples its next token (the
    `catch_up` event: the last chunk of the replay samples a token), so a request that sampled no token did not
    complete a replay. `generated_before`: its output's length at the earlier observation (None: not known);
    `replaying_before`: it was then replaying or waiting to replay (`mid_replay` reads both). Every other field raises
    `Unobservable`. `read` keeps the fields the guards read.
    """

    request_id: Hashable
    tokens_sampled: int
    output_is_final: bool
    read: list[str] = field(default_factory=list)
    generated_before: int | None = None
    replaying_before: bool = False

    @property
    def replay_complete(self) -> bool:
        self.read.append("replay_complete")
        return self.tokens_sampled > 0

    @property
    def mid_replay(self) -> bool:
        """Decided in two cases: a request that has never produced a token is no replay under way; one that was
        replaying (or waiting to replay) with tokens produced, and sampled none since, is one all along the path,
        since a replay completes only with a sampled token and a reset starts another."""
        if self.generated_before is None:
            raise Unobservable("mid_replay")
        if self.generated_before + self.tokens_sampled == 0:
            self.read.append("mid_replay")
            return False
        if self.replaying_before and self.tokens_sampled == 0:
            self.read.append("mid_replay")
            return True
        raise Unobservable("mid_replay")

    @property
    def final_token_produced(self) -> bool:
        self.read.append("final_token_produced")
        return self.output_is_final

    def __getattr__(self, name: str) -> Any:
        raise Unobservable(name)

    def evidence(self, name: str) -> str:
        """Why the observed counters decide the field `name`."""
        if name == "replay_complete":
            return (
                f"it sampled {self.tokens_sampled} token(s) between the observations, and a replay completes with "
                "the chunk that samples its next token"
            )
        if name == "mid_replay":
            if not self.generated_before and not self.tokens_sampled:
                return "it has produced no token, so no replay of it is under way"
            return (
                f"it was replaying with {self.generated_before} token(s) produced and sampled none since, so its "
                "replay has not caught up"
            )
        return f"its output after them is {'' if self.output_is_final else 'not '}final"


class _UnobservedPool:
    """The pool as a black box: every field is `Unobservable`."""

    def __getattr__(self, name: str) -> Any:
        raise Unobservable(name)


def _refutes(transition: Transition, request: ObservedRequest) -> str | None:
    """Why `request`'s observed counters refute `transition`'s guard; None when it may have held."""
    if transition.guard is None:
        return None
    request.read.clear()
    try:
        holds = GUARDS[transition.guard](request, _UnobservedPool())
    except Unobservable:
        return None
    if holds:
        return None
    reasons = "; ".join(request.evidence(name) for name in dict.fromkeys(request.read))
    return f"{transition.source} -{transition.event}-> {transition.dest} needs {transition.guard}, yet {reasons}"


def admitted_path(spec: Spec, old: str, new: str, request: ObservedRequest) -> list[Transition] | None:
    """A path of spec edges from `old` to `new` whose every guard `request`'s counters leave possible, or None when
    there is none. Its first edge is, where several could be, one the scheduler or executor takes if the request
    sampled a token and one the environment takes if it did not (a cancel samples nothing); then it is shortest."""
    sampled = request.tokens_sampled > 0
    paths = []
    for first in (t for t in spec.transitions if t.source == old and _refutes(t, request) is None):
        rest = [] if first.dest == new else _shortest(spec, first.dest, new, request)
        if rest is not None:
            paths.append([first, *rest])
    return min(paths, key=lambda p: ((p[0].event in spec.environment_events) == sampled, len(p)), default=None)


def _shortest(spec: Spec, old: str, new: str, request: ObservedRequest) -> list[Transition] | None:
    came: dict[str, list[Transition]] = {old: []}
    frontier = deque([old])
    while frontier:
        state = frontier.popleft()
        for t in spec.transitions:
            if t.source != state or t.dest in came or _refutes(t, request) is not None:
                continue
            came[t.dest] = [*came[state], t]
            if t.dest == new:
                return came[t.dest]
            frontier.append(t.dest)
    return None


def refuted_edges(spec: Spec, old: str, request: ObservedRequest) -> list[str]:
    """For every edge reachable from `old` whose guard `request`'s counters refute, why."""
    seen, frontier, found = {old}, deque([old]), []
    while frontier:
        state = frontier.popleft()
        for t in spec.transitions:
            if t.source != state:
                continue
            why = _refutes(t, request)
            if why is not None:
                found.append(why)
            elif t.dest not in seen:
                seen.add(t.dest)
                frontier.append(t.dest)
    return found


def unlisted_sources(spec: Spec, list_name: str, before: str) -> Sequence[Transition] | None:
    """The edges a request in state `before` may take into output list `list_name`: the edges from `before` of the
    events that feed it, or none needed (empty) for a list whose states include `before`. None: no edge leads a request
    in `before` into that list."""
    if before in spec.list_states.get(list_name, frozenset()):
        return ()
    edges = [t for t in spec.transitions if t.source == before and spec.event_by_name[t.event].feeds == list_name]
    return edges or None
