"""Well-formedness checks of a specification. Each refusal names the offending entry and says what to do."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from kvstate import semantics
from kvstate.errors import SpecError
from kvstate.policy import policy_problems
from kvstate.roles import LIST_NAMES, ROLES

if TYPE_CHECKING:  # annotations only: kvstate.spec imports this module to validate what it loads
    from kvstate.spec import Spec


def validate_spec(
    spec: Spec, guards: Mapping[str, object] | None = None, effects: Collection[str] | None = None
) -> None:
    """Raise `SpecError` listing every problem found; return None when the spec is well formed.

    `guards` and `effects` are the semantics the spec is held against (by default `kvstate.semantics`).
    """
    guards = semantics.GUARDS if guards is None else guards
    effects = semantics.EFFECTS if effects is None else effects
    problems = [
        *_duplicate_names(spec),
        *_unknown_states(spec),
        *_exclusive_groups(spec, guards),
    ]
    if not problems:  # graph checks assume every named state exists
        problems += [*_terminal_edges(spec), *_unreachable(spec), *_no_way_out(spec), *_ambiguous(spec)]
    problems += _semantics(spec, guards, effects)
    problems += _roles(spec) + _output_lists(spec)
    problems += policy_problems(spec)
    if problems:
        listing = "\n".join(f"  - {p}" for p in problems)
        raise SpecError(f"{spec.source}: the specification is not well formed:\n{listing}")


def _duplicate_names(spec: Spec) -> list[str]:
    found = []
    for kind, names in (
        ("state", [s.name for s in spec.states]),
        ("event", [e.name for e in spec.events]),
        ("invariant", [i.id for i in spec.invariants]),
    ):
        for name, count in Counter(names).items():
            if count > 1:
                found.append(f"{kind} {name!r} is defined {count} times; keep one definition")
    return found


def _unknown_states(spec: Spec) -> list[str]:
    known = spec.state_by_name
    found = []
    if spec.initial not in known:
        found.append(f"initial state {spec.initial!r} is not a declared state; declare it under [[states]]")
    for t in spec.transitions:
        for role, name in (("source", t.source), ("dest", t.dest)):
            if name not in known:
                found.append(
                    f"event {t.event!r}: {role} {name!r} is an unknown state; declare it or use one of {sorted(known)}"
                )
    return found


def _exclusive_groups(spec: Spec, guards: Mapping[str, object]) -> list[str]:
    return [
        f"exclusive_guards {group.name!r}: guard {guard!r} has no semantics; use one of {sorted(guards)}"
        for group in spec.exclusive_guards
        for guard in sorted(group.guards)
        if guard not in guards
    ]


def _terminal_edges(spec: Spec) -> list[str]:
    return [
        f"terminal state {t.source!r} has an outgoing event {t.event!r}; terminal states take no events"
        for t in spec.transitions
        if spec.state_by_name[t.source].terminal
    ]


def _unreachable(spec: Spec) -> list[str]:
    reachable = spec.reachable_from(spec.initial)
    return [
        f"state {s.name!r} is unreachable from the initial state {spec.initial!r}; add an event into it or remove it"
        for s in spec.states
        if s.name not in reachable
    ]


def _no_way_out(spec: Spec) -> list[str]:
    terminals = set(spec.terminal_states)
    found = []
    for state in spec.states:
        if state.terminal:
            continue
        exits = spec.successors.get(state.name, frozenset()) - {state.name}
        if not exits:
            found.append(
                f"non-terminal state {state.name!r} has no way out; add an event leaving it or mark it terminal"
            )
        elif not spec.reachable_from(state.name) & terminals:
            found.append(f"non-terminal state {state.name!r} can never reach a terminal state; add a path to one")
    return found


def _ambiguous(spec: Spec) -> list[str]:
    by_pair = defaultdict(list)
    for t in spec.transitions:
        by_pair[(t.source, t.event)].append(t)
    found = []
    for (source, event), edges in by_pair.items():
        for i, a in enumerate(edges):
            for b in edges[i + 1 :]:
                if not spec.mutually_exclusive(a.guard, b.guard):
                    found.append(
                        f"event {event!r} from state {source!r} has two transitions (to {a.dest!r} guarded by "
                        f"{a.guard or 'nothing'}, to {b.dest!r} guarded by {b.guard or 'nothing'}) whose guards "
                        "are not declared mutually exclusive; declare them in one [[exclusive_guards]] group or "
                        "merge the transitions"
                    )
    return found


def _semantics(spec: Spec, guards: Mapping[str, object], effects: Collection[str]) -> list[str]:
    found = []
    for t in spec.transitions:
        if t.guard is not None and t.guard not in guards:
            found.append(
                f"event {t.event!r} from {t.source!r}: guard {t.guard!r} has no semantics; "
                f"define it in kvstate.semantics or use one of {sorted(guards)}"
            )
        if t.effect is not None and t.effect not in effects:
            found.append(
                f"event {t.event!r} from {t.source!r}: effect {t.effect!r} has no semantics; "
                f"define it in kvstate.semantics.EffectHooks or use one of {sorted(effects)}"
            )
    for name in sorted(set(guards) - spec.guard_names):
        found.append(f"guard {name!r} has semantics but no transition uses it; use it in the spec or delete it")
    for name in sorted(set(effects) - spec.effect_names):
        found.append(f"effect {name!r} has semantics but no transition uses it; use it in the spec or delete it")
    return _unique(found)


def _roles(spec: Spec) -> list[str]:
    found = []
    for state in spec.states:
        if state.role and state.role not in ROLES:
            found.append(f"state {state.name!r}: role {state.role!r} is unknown; use one of {sorted(ROLES)}")
    roles = {s.name: s.role for s in spec.states}  # a duplicated state is reported once, as a duplicate
    for role, count in Counter(roles.values()).items():
        if count > 1 and role in ROLES:
            found.append(f"role {role!r} is given to {count} states; each role names exactly one state")
    for role in sorted(set(ROLES) - {s.role for s in spec.states}):
        found.append(f"no state has role {role!r} ({ROLES[role]}); give it to exactly one state")
    for state in spec.states:
        if state.computing != bool(state.chunk_lists):
            found.append(
                f"state {state.name!r}: a computing state needs chunk_lists (prefill and decode) and only a "
                "computing state may have them"
            )
        if state.chunk_lists and {k for k, _ in state.chunk_lists} != {"prefill", "decode"}:
            found.append(f"state {state.name!r}: chunk_lists must name exactly 'prefill' and 'decode'")
        if state.terminal != (state.container == "finished"):
            found.append(f"state {state.name!r}: terminal states, and only they, have container 'finished'")
    return found


def _output_lists(spec: Spec) -> list[str]:
    names = [o.name for o in spec.output_lists]
    found = []
    if sorted(names) != sorted(LIST_NAMES):
        found.append(
            f"output_lists name {names}; the scheduler output has the lists {list(LIST_NAMES)}: declare "
            "each exactly once"
        )
    for o in spec.output_lists:
        for state_name in o.states:
            if state_name not in spec.state_by_name:
                found.append(f"output list {o.name!r}: state {state_name!r} is unknown")
    for state in spec.states:
        for kind, name in state.chunk_lists:
            if name not in names:
                found.append(f"state {state.name!r}: chunk_lists {kind} = {name!r} is not an output list")
    for event in spec.events:
        if event.feeds is not None and event.feeds not in names:
            found.append(f"event {event.name!r}: feeds {event.feeds!r} is not an output list; use one of {names}")
    return found


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))
