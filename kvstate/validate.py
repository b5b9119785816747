"""Well-formedness checks of a specification. Each refusal names the offending entry and says what to do.

A spec is untrusted input, so what a refusal prints stays small whatever the spec holds: each name is echoed as a
short prefix (`kvstate.untrusted.shown`), a list of names at most `MAX_NAMES` long, and the error lists at most
`MAX_PROBLEMS` problems (saying how many more there are). Every check is linear in the spec's size, except that
the pairwise guard check stops once it has found more problems than can be listed.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from kvstate import semantics
from kvstate.errors import SpecError
from kvstate.policy import policy_problems
from kvstate.roles import LIST_NAMES, ROLES
from kvstate.untrusted import bare, shown

if TYPE_CHECKING:  # annotations only: kvstate.spec imports this module to validate what it loads
    from kvstate.spec import Spec

MAX_PROBLEMS = 20  # problems listed in one SpecError
MAX_NAMES = 12  # names listed in one problem


def validate_spec(
    spec: Spec,
    guards: Mapping[str, object] | None = None,
    effects: Collection[str] | None = None,
    tla: Collection[str] | None = None,
) -> None:
    """Raise `SpecError` listing every problem found; return None when the spec is well formed.

    `guards` and `effects` are the semantics the spec is held against, `tla` the names with a TLA+ meaning (by
    default `kvstate.semantics`).
    """
    problems = spec_problems(spec, guards, effects, tla)
    if problems:
        raise SpecError(f"{spec.source}: the specification is not well formed:\n{problem_listing(problems)}")


def problem_listing(problems: list[str]) -> str:
    """`problems` as an indented list of at most `MAX_PROBLEMS` lines, saying how many more there are."""
    listing = "\n".join(f"  - {p}" for p in problems[:MAX_PROBLEMS])
    if len(problems) > MAX_PROBLEMS:
        listing += f"\n  ... and {len(problems) - MAX_PROBLEMS} more; fix these first"
    return listing


def structure_problems(spec: Spec) -> list[str]:
    """What keeps a spec from being drawn at all: names defined twice, transitions naming unknown states."""
    return [*_duplicate_names(spec), *_unknown_states(spec)]


def spec_problems(
    spec: Spec,
    guards: Mapping[str, object] | None = None,
    effects: Collection[str] | None = None,
    tla: Collection[str] | None = None,
) -> list[str]:
    """Every problem `validate_spec` finds in `spec` (an empty list when it is well formed)."""
    guards = semantics.GUARDS if guards is None else guards
    effects = semantics.EFFECTS if effects is None else effects
    tla = semantics.TLA if tla is None else tla
    problems = [*structure_problems(spec), *_exclusive_groups(spec, guards)]
    if not problems:  # graph checks assume every named state exists
        problems += [*_terminal_edges(spec), *_unreachable(spec), *_no_way_out(spec), *_ambiguous(spec)]
    problems += _semantics(spec, guards, effects)
    problems += _tla_meanings(spec, guards, effects, tla)
    problems += _roles(spec) + _output_lists(spec)
    problems += policy_problems(spec)
    return problems


def _duplicate_names(spec: Spec) -> list[str]:
    found = []
    for kind, names in (
        ("state", [s.name for s in spec.states]),
        ("event", [e.name for e in spec.events]),
        ("invariant", [i.id for i in spec.invariants]),
    ):
        for name, count in Counter(names).items():
            if count > 1:
                found.append(f"{kind} {shown(name)} is defined {count} times; keep one definition")
    return found


def _unknown_states(spec: Spec) -> list[str]:
    known = spec.state_by_name
    choices = _names(known)  # listed once: a problem per unknown name must not cost a sort of every known one
    found = []
    if spec.initial not in known:
        found.append(f"initial state {shown(spec.initial)} is not a declared state; declare it under [[states]]")
    for t in spec.transitions:
        for role, name in (("source", t.source), ("dest", t.dest)):
            if name not in known:
                found.append(
                    f"event {shown(t.event)}: {role} {shown(name)} is an unknown state; declare it or use one of "
                    f"{choices}"
                )
    return found


def _exclusive_groups(spec: Spec, guards: Mapping[str, object]) -> list[str]:
    choices = _names(guards)
    return [
        f"exclusive_guards {shown(group.name)}: guard {shown(guard)} has no semantics; use one of {choices}"
        for group in spec.exclusive_guards
        for guard in sorted(group.guards)
        if guard not in guards
    ]


def _terminal_edges(spec: Spec) -> list[str]:
    return [
        f"terminal state {shown(t.source)} has an outgoing event {shown(t.event)}; terminal states take no events"
        for t in spec.transitions
        if spec.state_by_name[t.source].terminal
    ]


def _unreachable(spec: Spec) -> list[str]:
    reachable = spec.reachable_from(spec.initial)
    return [
        f"state {shown(s.name)} is unreachable from the initial state {shown(spec.initial)}; add an event into it "
        "or remove it"
        for s in spec.states
        if s.name not in reachable
    ]


def _no_way_out(spec: Spec) -> list[str]:
    reaches_end = _reaching(spec, set(spec.terminal_states))
    found = []
    for state in spec.states:
        if state.terminal:
            continue
        exits = spec.successors.get(state.name, frozenset()) - {state.name}
        if not exits:
            found.append(
                f"non-terminal state {shown(state.name)} has no way out; add an event leaving it or mark it terminal"
            )
        elif state.name not in reaches_end:
            found.append(f"non-terminal state {shown(state.name)} can never reach a terminal state; add a path to one")
    return found


def _reaching(spec: Spec, targets: set[str]) -> set[str]:
    """The states from which some path of transitions leads into `targets` (one backward search: linear)."""
    predecessors: dict[str, set[str]] = defaultdict(set)
    for t in spec.transitions:
        predecessors[t.dest].add(t.source)
    seen, frontier = set(targets), list(targets)
    while frontier:
        for source in predecessors[frontier.pop()]:
            if source not in seen:
                seen.add(source)
                frontier.append(source)
    return seen


def _ambiguous(spec: Spec) -> list[str]:
    by_pair = defaultdict(list)
    for t in spec.transitions:
        by_pair[(t.source, t.event)].append(t)
    found: list[str] = []
    for (source, event), edges in by_pair.items():
        for i, a in enumerate(edges):
            for b in edges[i + 1 :]:
                if len(found) > MAX_PROBLEMS:  # more than can be listed: the pairs left are not searched
                    return found
                if not spec.mutually_exclusive(a.guard, b.guard):
                    found.append(
                        f"event {shown(event)} from state {shown(source)} has two transitions (to {shown(a.dest)} "
                        f"guarded by {_guard(a.guard)}, to {shown(b.dest)} guarded by {_guard(b.guard)}) whose "
                        "guards are not declared mutually exclusive; declare them in one [[exclusive_guards]] group "
                        "or merge the transitions"
                    )
    return found


def _guard(name: str | None) -> str:
    return "nothing" if name is None else bare(name)


def _semantics(spec: Spec, guards: Mapping[str, object], effects: Collection[str]) -> list[str]:
    guard_choices, effect_choices = _names(guards), _names(effects)
    found = []
    for t in spec.transitions:
        if t.guard is not None and t.guard not in guards:
            found.append(
                f"event {shown(t.event)} from {shown(t.source)}: guard {shown(t.guard)} has no semantics; "
                f"define it in kvstate.semantics or use one of {guard_choices}"
            )
        if t.effect is not None and t.effect not in effects:
            found.append(
                f"event {shown(t.event)} from {shown(t.source)}: effect {shown(t.effect)} has no semantics; "
                f"define it in kvstate.semantics.EffectHooks or use one of {effect_choices}"
            )
    for name in sorted(set(guards) - spec.guard_names):
        found.append(f"guard {shown(name)} has semantics but no transition uses it; use it in the spec or delete it")
    for name in sorted(set(effects) - spec.effect_names):
        found.append(f"effect {shown(name)} has semantics but no transition uses it; use it in the spec or delete it")
    return _unique(found)


def _tla_meanings(
    spec: Spec, guards: Mapping[str, object], effects: Collection[str], tla: Collection[str]
) -> list[str]:
    """Guards and effects the spec uses that have Python semantics but no TLA+ meaning (`kvstate export tla`)."""
    found = []
    for kind, used, known in (("guard", spec.guard_names, guards), ("effect", spec.effect_names, effects)):
        for name in sorted(n for n in used if n in known and n not in tla):
            found.append(
                f"{kind} {name!r} has no TLA+ meaning; record one beside its Python meaning in kvstate.semantics "
                "with @tla(...) (kvstate export tla writes it as a TLA+ operator)"
            )
    return found


def _roles(spec: Spec) -> list[str]:
    found = []
    for state in spec.states:
        if state.role and state.role not in ROLES:
            found.append(f"state {shown(state.name)}: role {shown(state.role)} is unknown; use one of {_names(ROLES)}")
    roles = {s.name: s.role for s in spec.states}  # a duplicated state is reported once, as a duplicate
    for role, count in Counter(roles.values()).items():
        if count > 1 and role in ROLES:
            found.append(f"role {shown(role)} is given to {count} states; each role names exactly one state")
    for role in sorted(set(ROLES) - {s.role for s in spec.states}):
        found.append(f"no state has role {shown(role)} ({ROLES[role]}); give it to exactly one state")
    for state in spec.states:
        if state.computing != bool(state.chunk_lists):
            found.append(
                f"state {shown(state.name)}: a computing state needs chunk_lists (prefill and decode) and only a "
                "computing state may have them"
            )
        if state.chunk_lists and {k for k, _ in state.chunk_lists} != {"prefill", "decode"}:
            found.append(f"state {shown(state.name)}: chunk_lists must name exactly 'prefill' and 'decode'")
        if state.terminal != (state.container == "finished"):
            found.append(f"state {shown(state.name)}: terminal states, and only they, have container 'finished'")
    return found


def _output_lists(spec: Spec) -> list[str]:
    names = [o.name for o in spec.output_lists]
    found = []
    if sorted(names) != sorted(LIST_NAMES):
        found.append(
            f"output_lists name {_names(names, keep_order=True)}; the scheduler output has the lists "
            f"{list(LIST_NAMES)}: declare each exactly once"
        )
    for o in spec.output_lists:
        for state_name in o.states:
            if state_name not in spec.state_by_name:
                found.append(f"output list {shown(o.name)}: state {shown(state_name)} is unknown")
    for state in spec.states:
        for kind, name in state.chunk_lists:
            if name not in names:
                found.append(f"state {shown(state.name)}: chunk_lists {kind} = {shown(name)} is not an output list")
    for event in spec.events:
        if event.feeds is not None and event.feeds not in names:
            found.append(
                f"event {shown(event.name)}: feeds {shown(event.feeds)} is not an output list; use one of "
                f"{_names(names)}"
            )
    return found


def _names(names: Collection[str], *, keep_order: bool = False) -> str:
    """At most `MAX_NAMES` of `names` (sorted unless `keep_order`), each echoed short, and how many more."""
    listed = list(names) if keep_order else sorted(names)
    text = ", ".join(shown(name) for name in listed[:MAX_NAMES])
    more = f" and {len(listed) - MAX_NAMES} more" if len(listed) > MAX_NAMES else ""
    return f"[{text}{more}]"


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))
