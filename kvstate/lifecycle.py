"""The lifecycle, two implementations of one interface: the `transitions` machine built from the spec (`Lifecycle`,
what runs by default) and a table compiled from the same spec (`TransitionTable`, the opt-in fast path and the
model checker's engine). `make_lifecycle(kind)` picks one by name (`LIFECYCLES`).

Both drive request objects that keep their state in the attribute `kvstate.request.STATE_ATTRIBUTE` (requests
expose it read-only as `state`). Neither registers requests with the machine (`add_model` is quadratic): events are
triggered on a request passed in, and requests compare by identity. They share the spec, the error wording and
`fire`: `Lifecycle` lets `transitions` find the edge (its conditions are the guards, each of its edges keeps the
spec's edge, read off the one that executed, and an event with no edge from the state is its `MachineError`),
`TransitionTable` looks the edge up itself. A differential test runs whole workloads through both and requires
byte-identical traces. The machine is a `Machine` subclass whose event, edge and state classes (the classes
`transitions` lets a subclass name) run the library's stages in its order, skipping the callback lists the spec
leaves empty and the library's debug log lines: a scheduler fires an event on every preemption.

Invariants kept by both `Lifecycle` and `TransitionTable`:
* a request's state changes only along an edge of the spec whose guard holds;
* an event with no edge from the current state raises `IllegalTransition`, an event whose edges' guards all
  fail raises `GuardRejected`; in both cases nothing changes;
* the effect hook of the edge taken runs after the state change, exactly once: `fire` runs it on the hooks it is
  given; `try_fire` runs none, and its caller runs the effect of the edge it returns, as the scheduler does with
  its own effects.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from operator import attrgetter
from typing import TYPE_CHECKING, Any, TypeVar

from transitions import Event, Machine, MachineError, State
from transitions import Transition as MachineTransition
from transitions.core import Condition, EventData

from kvstate.config import LIFECYCLES
from kvstate.errors import GuardRejected, IllegalTransition
from kvstate.request import STATE_ATTRIBUTE
from kvstate.semantics import GUARDS, EffectHooks, Guard, PoolView, RequestView
from kvstate.spec import Spec, Transition, default_spec

if TYPE_CHECKING:  # declared by the library's type stubs only
    from transitions.core import Callback

R = TypeVar("R", bound=RequestView)  # the request a transition fires on, and so the one its effect hooks take


class _SpecRules(ABC):
    """What both implementations share: the spec, its guards, the events allowed from each state, the edges each
    (state, event) may take with their guards (`resolve`, `can_fire`: asking without firing), the errors, and
    `fire` on top of each one's `try_fire`."""

    def __init__(self, spec: Spec | None = None, guards: Mapping[str, Guard] = GUARDS) -> None:
        self.spec = spec if spec is not None else default_spec()
        self.guards = dict(guards)
        allowed: dict[str, list[str]] = {s.name: [] for s in self.spec.states}
        table: dict[tuple[str, str], list[tuple[Guard | None, Transition]]] = {}
        for t in self.spec.transitions:
            if t.event not in allowed[t.source]:
                allowed[t.source].append(t.event)
            table.setdefault((t.source, t.event), []).append((self.guards[t.guard] if t.guard else None, t))
        self._allowed = {state: tuple(events) for state, events in allowed.items()}
        self._table = {key: tuple(edges) for key, edges in table.items()}

    def resolve(self, request: RequestView, event: str, pool: PoolView) -> Transition | None:
        """The edge `event` would take now, or None when the spec has none or no guard holds (nothing fires)."""
        return self._resolve(self._table.get((self.state_of(request), event), ()), request, pool)

    @staticmethod
    def _resolve(
        edges: tuple[tuple[Guard | None, Transition], ...], request: RequestView, pool: PoolView
    ) -> Transition | None:
        """The first of `edges` whose guard holds, or None."""
        for guard, transition in edges:
            if guard is None or guard(request, pool):
                return transition
        return None

    def can_fire(self, request: RequestView, event: str, pool: PoolView) -> bool:
        """Some guard of `event` from the request's state holds on `pool` (nothing fires)."""
        return self.resolve(request, event, pool) is not None

    def start(self, request: object) -> None:
        """Put a new request in the spec's initial state."""
        setattr(request, STATE_ATTRIBUTE, self.spec.initial)

    @staticmethod
    def state_of(request: object) -> str:
        return getattr(request, STATE_ATTRIBUTE)

    def allowed_events(self, state: str) -> tuple[str, ...]:
        """Events that have an edge from `state` (guards not evaluated), in spec order."""
        return self._allowed[state]

    def _illegal(self, request: RequestView, event: str) -> IllegalTransition:
        state = self.state_of(request)
        reason = "" if event in self.spec.event_by_name else "The spec defines no such event."
        return IllegalTransition(request.request_id, state, event, self.allowed_events(state), reason)

    def rejected(self, request: RequestView, event: str) -> GuardRejected:
        """The error for `event` on `request` when none of its guards holds (every edge it has from the state)."""
        state = self.state_of(request)
        edges = [t for t in self.spec.event_by_name[event].transitions if t.source == state]
        failed = ", ".join(f"{t.guard} (to {t.dest})" for t in edges)
        return GuardRejected(
            request.request_id,
            state,
            event,
            self.allowed_events(state),
            f"No guard holds in the current pool state: {failed}. Fire it only when one of these guards holds.",
        )

    @abstractmethod
    def try_fire(self, request: R, event: str, pool: PoolView) -> Transition | None:
        """Take `event` on `request` if one of its guards holds: the edge taken, or None (nothing changed). Each
        guard is evaluated once; no effect runs (the caller runs the edge's effect). Raises
        `IllegalTransition` (nothing changed) for an event with no edge from the request's state."""

    def fire(self, request: R, event: str, pool: PoolView, hooks: EffectHooks[R] | None = None) -> Transition:
        """Take `event` on `request` (`try_fire`), then run the edge's effect on `hooks` when given; returns the
        edge taken. Raises `IllegalTransition` or `GuardRejected`; in both cases nothing changed."""
        transition = self.try_fire(request, event, pool)
        if transition is None:
            raise self.rejected(request, event)
        if hooks is not None and transition.effect is not None:
            getattr(hooks, transition.effect)(request, transition)
        return transition


class _EventCondition(Condition):
    """A condition given as a callable that takes the event (the machine sends events): called as it is, with no
    resolution of a name on the model (a spec's guards are functions, never model methods)."""

    def check(self, event_data: EventData) -> bool:
        func = self.func
        if isinstance(func, str):  # a name: resolved on the model as `Condition` resolves it
            return super().check(event_data)
        return bool(func(event_data) == self.target)


class _SpecState(State):
    """A state of the spec, named by a string (never an enumeration: its name and value are read as they are).
    Entering or leaving it runs its callbacks as `transitions.State` does; the spec gives none (the scheduler runs
    each edge's effect itself), so then nothing runs, not even the log lines that report callbacks run."""

    name = property(attrgetter("_name"))
    value = name

    def enter(self, event_data: EventData) -> None:
        if self.on_enter:
            super().enter(event_data)

    def exit(self, event_data: EventData) -> None:
        if self.on_exit:
            super().exit(event_data)


class _SpecEdge(MachineTransition):
    """An edge of the spec in the machine, which keeps the spec's own edge (`spec_edge`, given to
    `Machine.add_transition` as the extra argument the library passes on to its transition class): executed in the
    order `transitions.Transition.execute` documents (prepare callbacks, conditions, before callbacks, exit, the
    state change, enter, final callbacks, after callbacks), each list of callbacks run only when it has any, and
    without the debug log lines of each stage."""

    condition_cls = _EventCondition

    def __init__(self, *args: Any, spec_edge: Transition | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spec_edge = spec_edge

    def execute(self, event_data: EventData) -> bool:
        machine = event_data.machine
        if self.prepare:
            machine.callbacks(self.prepare, event_data)
        for condition in self.conditions:
            if not condition.check(event_data):
                return False
        before = machine.before_state_change
        if before or self.before:
            machine.callbacks([*before, *self.before], event_data)
        if self.dest is not None:  # the state change (`Transition._change_state`); None: an internal transition
            states = machine.states
            source = states[self.source]
            if source.on_exit:  # `_SpecState.exit` runs nothing without callbacks: no call then
                source.exit(event_data)
            dest = states[self.dest]
            setattr(event_data.model, machine.model_attribute, dest.value)  # what `Machine.set_state` writes
            event_data.state = dest
            if dest.on_enter:
                dest.enter(event_data)
            if dest.final and machine.on_final:
                machine.callbacks(machine.on_final, event_data)
        after = machine.after_state_change
        if after or self.after:
            machine.callbacks([*self.after, *after], event_data)
        return True


class _SpecEvent(Event):
    """An event of the spec: processed as `transitions.Event` processes one (the model's state looked up, an event
    with no edge from it a `MachineError`, the machine's prepare callbacks, the edges from the state tried in order
    until one executes, the machine's exception callbacks on an error, its finalize callbacks in any case), each list
    of callbacks run only when it has any, and without the debug log lines of each stage. `trigger_taking` is the
    library's `trigger` that also says which edge executed (`taken`: the edge of the last trigger that executed
    one; the machine is not queued, so a trigger is processed before it returns)."""

    taken: _SpecEdge | None = None

    def trigger_taking(self, model: object, **kwargs: Any) -> _SpecEdge | None:
        """`Event.trigger` on `model` with `kwargs`, and the edge that executed; None when none did (a guard
        failed)."""
        return self.taken if self.trigger(model, **kwargs) else None

    def _trigger(self, event_data: EventData) -> bool:
        """`Event._trigger` with `Event._process` run in it (one Python call fewer per event)."""
        machine = self.machine
        state = event_data.state = machine.get_state(getattr(event_data.model, machine.model_attribute))
        try:  # `_is_valid_source` raises `MachineError` for a state with no edge (called only then)
            if state.name in self.transitions or self._is_valid_source(state):
                if machine.prepare_event:  # `_process`: prepare callbacks, then the edges from the state in order
                    machine.callbacks(machine.prepare_event, event_data)
                for edge in self.transitions[state.name]:
                    event_data.transition = edge
                    if edge.execute(event_data):
                        event_data.result = True
                        self.taken = edge  # type: ignore[assignment]  # the machine's transition class
                        break
        except BaseException as err:
            event_data.error = err  # type: ignore[assignment]  # the library's own handler keeps any exception
            if not machine.on_exception:
                raise
            machine.callbacks(machine.on_exception, event_data)
        finally:
            if machine.finalize_event:
                machine.callbacks(machine.finalize_event, event_data)
        return bool(event_data.result)


def _callback_list(name: str) -> property:
    """`Machine`'s property `name` (a list of callbacks), read without a Python call (its getter returns the
    attribute `_name`; the library's own setter makes a list of what it is given)."""
    library = vars(Machine)[name]
    return property(attrgetter(f"_{name}"), library.fset, doc=library.__doc__)


class _SpecMachine(Machine):
    """The `transitions` machine of a spec: its states and edges are `_SpecState` and `_SpecEdge` (the machine's
    `state_cls` and `transition_cls`) and its events `_SpecEvent` (its `event_cls`), which skip the callback lists a
    spec leaves empty; no stage writes a debug log line. Its callback lists and `has_queue` are the library's
    properties with a getter that is no Python function (each event reads them)."""

    state_cls = _SpecState
    transition_cls = _SpecEdge
    event_cls = _SpecEvent
    prepare_event = _callback_list("prepare_event")
    before_state_change = _callback_list("before_state_change")
    after_state_change = _callback_list("after_state_change")
    finalize_event = _callback_list("finalize_event")
    on_exception = _callback_list("on_exception")
    on_final = _callback_list("on_final")
    has_queue = property(attrgetter("_queued"), doc=vars(Machine)["has_queue"].__doc__)

    def get_state(self, state: str) -> State:  # type: ignore[override]  # a spec names its states by strings
        """The state named `state`, as `Machine.get_state` finds it (a spec's states are named by strings, never by
        an enumeration: nothing to convert); `ValueError` for a name the machine lacks."""
        try:
            return self.states[state]
        except KeyError:
            raise ValueError(f"State '{state}' is not a registered state.") from None

    def callbacks(self, funcs: Iterable[Callback], event_data: EventData) -> None:
        """Run `funcs` in order, as `Machine.callbacks` does, without its log line per callback."""
        for func in funcs:
            self.callback(func, event_data)


class Lifecycle(_SpecRules):
    """The reference implementation: fires events through the `transitions` machine built from the spec."""

    def __init__(self, spec: Spec | None = None, guards: Mapping[str, Guard] = GUARDS) -> None:
        super().__init__(spec, guards)
        self.machine = _SpecMachine(
            model=None,
            states=[{"name": s.name, "final": s.terminal} for s in self.spec.states],
            initial=self.spec.initial,
            auto_transitions=False,
            send_event=True,
            model_attribute=STATE_ATTRIBUTE,
        )
        for t in self.spec.transitions:
            self.machine.add_transition(
                trigger=t.event,
                source=t.source,
                dest=t.dest,
                conditions=[self._guard_condition(t.guard)] if t.guard else None,
                spec_edge=t,
            )
        # read once: every attribute read on a `Machine` goes through its __getattr__
        self._events: dict[str, _SpecEvent] = self.machine.events  # type: ignore[assignment]  # its event_cls

    def _guard_condition(self, guard_name: str):
        guard = self.guards[guard_name]
        return lambda event_data: guard(event_data.model, event_data.kwargs["pool"])

    def try_fire(self, request: R, event: str, pool: PoolView) -> Transition | None:
        """`_SpecRules.try_fire` through the `transitions` machine: it evaluates the guards (its conditions) once,
        changes the state and reports an event with no edge from the state (its `MachineError`); the edge taken is
        the spec's edge of the machine's edge that executed."""
        trigger = self._events.get(event)
        if trigger is None:
            raise self._illegal(request, event)
        try:
            taken = trigger.trigger_taking(request, pool=pool)
        except MachineError:
            raise self._illegal(request, event) from None
        return None if taken is None else taken.spec_edge


class TransitionTable(_SpecRules):
    """The hot-path form of the same spec: fires by looking the edge up in the dictionary from (state, event) to the
    candidate edges that both implementations keep (`_SpecRules.resolve`).

    Gives the same answers as `Lifecycle` (a Hypothesis test checks every state, event and guard outcome)
    at the cost of one dictionary lookup and the guard calls.
    """

    def try_fire(self, request: R, event: str, pool: PoolView) -> Transition | None:
        """`_SpecRules.try_fire` by a table lookup (the request's state read once)."""
        edges = self._table.get((self.state_of(request), event))
        if edges is None:
            raise self._illegal(request, event)
        transition = self._resolve(edges, request, pool)
        if transition is not None:
            setattr(request, STATE_ATTRIBUTE, transition.dest)
        return transition


def make_lifecycle(
    kind: str = "machine", spec: Spec | None = None, guards: Mapping[str, Guard] = GUARDS
) -> Lifecycle | TransitionTable:
    """The lifecycle implementation named `kind`: "machine" (the `transitions` machine) or "compiled" (the table)."""
    if kind == "machine":
        return Lifecycle(spec, guards)
    if kind == "compiled":
        return TransitionTable(spec, guards)
    raise ValueError(f"lifecycle must be one of {', '.join(LIFECYCLES)}, got {kind!r}")
