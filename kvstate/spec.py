"""The specification as immutable values, and loading it from TOML.

`load_spec()` parses and validates; a `Spec` that exists has passed every check in `kvstate.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, cached_property
from importlib import resources
from pathlib import Path
from types import MappingProxyType

from kvstate.errors import SpecError
from kvstate.untrusted import Limits, UntrustedFileError, bare, read_toml, shown
from kvstate.validate import validate_spec

RESIDENCIES = ("gpu", "held", "none")
# residency -> the tiers a request in a state of that residency may hold blocks in (RES-STATE)
RESIDENCY_TIERS = MappingProxyType({"gpu": ("gpu",), "held": ("gpu", "host"), "none": ()})
INVARIANT_SCOPES = ("state", "step", "pass", "run", "liveness")
CONTAINERS = ("waiting", "resident", "suspended", "paused", "finished")
MAX_NAME_CHARS = 80  # a name (state, event, guard, effect, list, role, rule, invariant id) is at most this long
MAX_LABEL_CHARS = 120  # an event's diagram label is at most this long
ORIGINS = ("scheduler", "executor", "environment")


@dataclass(frozen=True, slots=True)
class State:
    """A lifecycle state. `residency` says where the request's KV may be in this state: `gpu` (locked on the GPU),
    `held` (held: on the GPU until an allocation offloads it to the host tier, so in either tier or split) or `none`.

    `role` says what the state is for (`kvstate.roles.ROLES`; each role names exactly one state; "" for a state
    that plays none), so code finds states by role, never by name. `computing`: a request in it computes in a
    forward pass; `victim`: it may be chosen as a victim; `container`: the scheduler queue holding it;
    `chunk_lists`: for a computing state, the output list of its prefill chunks and of its decode steps.
    """

    name: str
    residency: str
    meaning: str
    terminal: bool = False
    role: str = ""
    computing: bool = False
    victim: bool = False
    container: str = ""
    chunk_lists: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Transition:
    """One edge: `event` moves a request from `source` to `dest` when `guard` holds, running `effect`.

    `guard` None means always enabled; `effect` None means a pure state change.
    """

    event: str
    source: str
    dest: str
    guard: str | None
    effect: str | None
    destructive: bool
    done_reason: str | None = None


@dataclass(frozen=True, slots=True)
class Event:
    """A named input of the lifecycle with its diagram label and its edges (one per source state).

    `done_reason` is the reason recorded when this event ends a request (finished, cancelled, aborted).
    """

    name: str
    label: str
    destructive: bool
    transitions: tuple[Transition, ...]
    done_reason: str | None = None
    origin: str = "scheduler"
    feeds: str | None = None
    production_name: str = ""


@dataclass(frozen=True, slots=True)
class OutputList:
    """One request list of the scheduler output; a request in it is in one of `states` right after the pass."""

    name: str
    states: tuple[str, ...]
    meaning: str
    production_name: str = ""


@dataclass(frozen=True, slots=True)
class Policy:
    """The scheduling policy (SPEC.md section 7) as rule names; `kvstate.policy` gives each name its meaning."""

    victim_order: str
    victim_exclusions: tuple[str, ...]
    no_eligible_victim: str
    promotion_candidates: str
    promotion_order: str
    promotion_worth: str
    admission_classes: tuple[str, ...]
    admission_rules: tuple[str, ...]
    room_on_its_way: str
    work_conservation: bool
    readmissions_keeping_admission: tuple[str, ...]
    progress: str
    suspend_rule: str = "host_takes_every_held_block"
    offload: str = "on_demand"


@dataclass(frozen=True, slots=True)
class ExclusiveGuards:
    """A set of guards of which at most one holds in any request and pool state."""

    name: str
    guards: frozenset[str]


@dataclass(frozen=True, slots=True)
class Invariant:
    """A property with a stable id; `scope` says over what it is checked (see INVARIANT_SCOPES)."""

    id: str
    scope: str
    statement: str


@dataclass(frozen=True)
class Spec:
    """The whole lifecycle specification. Entries keep the order in which the TOML lists them."""

    name: str
    version: int
    initial: str
    states: tuple[State, ...]
    events: tuple[Event, ...]
    exclusive_guards: tuple[ExclusiveGuards, ...]
    invariants: tuple[Invariant, ...]
    output_lists: tuple[OutputList, ...]
    policy: Policy
    source: str = "<memory>"

    @cached_property
    def transitions(self) -> tuple[Transition, ...]:
        return tuple(t for event in self.events for t in event.transitions)

    @cached_property
    def state_by_name(self) -> dict[str, State]:
        return {s.name: s for s in self.states}

    @cached_property
    def event_by_name(self) -> dict[str, Event]:
        return {e.name: e for e in self.events}

    @cached_property
    def guard_names(self) -> frozenset[str]:
        return frozenset(t.guard for t in self.transitions if t.guard is not None)

    @cached_property
    def effect_names(self) -> frozenset[str]:
        return frozenset(t.effect for t in self.transitions if t.effect is not None)

    @cached_property
    def terminal_states(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.states if s.terminal)

    def residency(self, state: str) -> str:
        return self.state_by_name[state].residency

    @cached_property
    def state_by_role(self) -> dict[str, str]:
        """Role -> the name of the state that plays it."""
        return {s.role: s.name for s in self.states}

    def role(self, role: str) -> str:
        """The name of the state playing `role` (see `kvstate.roles.ROLES`)."""
        return self.state_by_role[role]

    @cached_property
    def computing_states(self) -> frozenset[str]:
        """States whose requests compute in a forward pass."""
        return frozenset(s.name for s in self.states if s.computing)

    @cached_property
    def victim_states(self) -> frozenset[str]:
        """States whose requests may be chosen as victims."""
        return frozenset(s.name for s in self.states if s.victim)

    @cached_property
    def list_states(self) -> dict[str, frozenset[str]]:
        """Output list name -> the states a request in it may be in right after the pass (OUT-STATE)."""
        return {o.name: frozenset(o.states) for o in self.output_lists}

    @cached_property
    def environment_events(self) -> frozenset[str]:
        """Events the environment decides (users, faults): no fairness, never progress."""
        return frozenset(e.name for e in self.events if e.origin == "environment")

    @cached_property
    def successors(self) -> dict[str, frozenset[str]]:
        """State -> the states one transition from it leads to (states without a transition map to nothing)."""
        found: dict[str, set[str]] = {s.name: set() for s in self.states}
        for t in self.transitions:
            found.setdefault(t.source, set()).add(t.dest)
        return {state: frozenset(dests) for state, dests in found.items()}

    def reachable_from(self, start: str) -> frozenset[str]:
        """`start` and every state that a path of transitions leads to from it (the one reachability search)."""
        graph = self.successors
        seen, frontier = {start}, [start]
        while frontier:
            for nxt in graph.get(frontier.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    frontier.append(nxt)
        return frozenset(seen)

    def states_with_residency(self, residency: str) -> tuple[str, ...]:
        return tuple(s.name for s in self.states if s.residency == residency)

    def states_holding(self, tier: str) -> frozenset[str]:
        """The states whose residency lets a request hold blocks in `tier` ("gpu" or "host"; RESIDENCY_TIERS)."""
        return frozenset(s.name for s in self.states if tier in RESIDENCY_TIERS[s.residency])

    def mutually_exclusive(self, guard_a: str | None, guard_b: str | None) -> bool:
        """True when both guards are named, differ, and share a declared exclusivity group."""
        if guard_a is None or guard_b is None or guard_a == guard_b:
            return False
        return any({guard_a, guard_b} <= group.guards for group in self.exclusive_guards)


@cache
def default_spec() -> Spec:
    """The packaged specification, loaded and validated once per process and shared by every caller that passes
    no spec of its own (a `Spec` is frozen: sharing it is safe). Every scheduler, engine and adapter built
    without one reads it, so none parses and validates the file again."""
    return load_spec()


def packaged_spec_path() -> Path:
    """The path of the specification that ships inside the `kvstate` distribution."""
    return Path(str(resources.files("kvstate.spec_files").joinpath("lifecycle.toml")))


def load_spec(path: str | Path | None = None, *, validate: bool = True) -> Spec:
    """Read a specification from `path` (the packaged one by default) and validate it.

    Raises `SpecError` naming the file and the offending entry when the file cannot be parsed or fails
    a check of `kvstate.validate.validate_spec`.
    """
    source = Path(path) if path is not None else packaged_spec_path()
    try:  # a spec may come from anyone: bounded size, nesting and integers; every failure names the file
        data = read_toml(source, Limits(max_bytes=1 << 20, max_depth=16), "spec file")
    except UntrustedFileError as err:
        raise SpecError(str(err)) from (err.__cause__ or err)
    spec = parse_spec(data, source=str(source))
    if validate:
        validate_spec(spec)
    return spec


def parse_spec(data: dict, *, source: str = "<memory>") -> Spec:
    """Build a `Spec` from parsed TOML data, checking only the shape of each entry."""
    reader = _Reader(source)
    header = reader.table(data, "spec", "[spec]")
    states = tuple(reader.state(entry, i) for i, entry in enumerate(reader.array(data, "states")))
    events = tuple(reader.event(entry, i) for i, entry in enumerate(reader.array(data, "events")))
    groups = tuple(
        ExclusiveGuards(
            name=reader.name(entry, "name", f"exclusive_guards[{i}]"),
            guards=frozenset(reader.strings(entry, "guards", f"exclusive_guards[{i}]")),
        )
        for i, entry in enumerate(reader.array(data, "exclusive_guards", required=False))
    )
    invariants = tuple(reader.invariant(entry, i) for i, entry in enumerate(reader.array(data, "invariants")))
    output_lists = tuple(reader.output_list(entry, i) for i, entry in enumerate(reader.array(data, "output_lists")))
    return Spec(
        name=reader.name(header, "name", "[spec]"),
        version=reader.integer(header, "version", "[spec]"),
        initial=reader.name(header, "initial", "[spec]"),
        states=states,
        events=events,
        exclusive_guards=groups,
        invariants=invariants,
        output_lists=output_lists,
        policy=reader.policy(reader.table(data, "policy", "[policy]")),
        source=source,
    )


def _entry(kind: str, index: int, name: object) -> str:
    """``states[3] (running)``: an entry of an array of tables, with its name when that is a short string."""
    return (
        f"{kind}[{index}] ({bare(name)})"
        if isinstance(name, str) and 0 < len(name) <= MAX_NAME_CHARS
        else (f"{kind}[{index}]")
    )


class _Reader:
    """Shape checks for TOML entries; every failure names the file and the entry."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, message: str) -> SpecError:
        return SpecError(f"{self.source}: {where}: {message}")

    def table(self, data: dict, key: str, where: str) -> dict:
        value = data.get(key)
        if not isinstance(value, dict):
            what = "name, version and initial" if key == "spec" else "the entries SPEC.md documents for it"
            raise self.fail(where, f"missing table [{key}]; add it with {what}")
        return value

    def array(self, data: dict, key: str, *, required: bool = True) -> list[dict]:
        value = data.get(key, None if required else [])
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise self.fail(f"[[{key}]]", f"expected an array of tables [[{key}]]")
        return value

    def string(self, entry: dict, key: str, where: str) -> str:
        value = entry.get(key)
        if not isinstance(value, str) or not value:
            raise self.fail(where, f"'{key}' must be a non-empty string, got {shown(value)}")
        return value

    def name(self, entry: dict, key: str, where: str, *, most: int = MAX_NAME_CHARS) -> str:
        """`string`, refused when longer than `most` characters (what is derived from a name, such as a diagram's
        layout, grows with its length)."""
        return self.short(self.string(entry, key, where), key, where, most)

    def short(self, value: str, key: str, where: str, most: int = MAX_NAME_CHARS) -> str:
        if len(value) > most:
            line = self.line_of(value)
            place = f"{self.source}:{line}" if line is not None else self.source
            raise SpecError(
                f"{place}: {where}: field {key!r} is {len(value)} characters long ({shown(value, 24)}); it may have "
                f"at most {most}: shorten it"
            )
        return value

    def line_of(self, value: str) -> int | None:
        """The line of the spec file where `value` first appears (None when the file cannot be searched)."""
        try:
            with open(self.source, "rb") as handle:
                text = handle.read(1 << 20).decode("utf-8", errors="replace")
        except OSError:
            return None
        at = text.find(value[: MAX_NAME_CHARS + 1])
        return None if at < 0 else text.count("\n", 0, at) + 1

    def optional_string(self, entry: dict, key: str, where: str) -> str | None:
        """`string`, or None when the entry leaves `key` out."""
        return None if entry.get(key) is None else self.string(entry, key, where)

    def optional_name(self, entry: dict, key: str, where: str) -> str | None:
        """`name`, or None when the entry leaves `key` out."""
        return None if entry.get(key) is None else self.name(entry, key, where)

    def strings(self, entry: dict, key: str, where: str) -> list[str]:
        """A non-empty list of names (one name alone stands for a list of it), each at most `MAX_NAME_CHARS` long."""
        value = entry.get(key)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise self.fail(where, f"'{key}' must be a non-empty list of names, got {shown(value)}")
        for item in value:
            self.short(item, key, where)
        return value

    def choice(self, entry: dict, key: str, where: str, allowed: tuple[str, ...]) -> str:
        value = self.name(entry, key, where)
        if value not in allowed:
            raise self.fail(where, f"{key} {shown(value)} is not one of {', '.join(allowed)}")
        return value

    def integer(self, entry: dict, key: str, where: str) -> int:
        value = entry.get(key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(where, f"'{key}' must be an integer, got {shown(value)}")
        return value

    def boolean(self, entry: dict, key: str, where: str, default: bool) -> bool:
        value = entry.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(where, f"'{key}' must be true or false, got {shown(value)}")
        return value

    def state(self, entry: dict, index: int) -> State:
        where = _entry("states", index, entry.get("name"))
        residency = self.string(entry, "residency", where)
        if residency not in RESIDENCIES:
            raise self.fail(where, f"residency {shown(residency)} is not one of {', '.join(RESIDENCIES)}")
        lists = entry.get("chunk_lists", {})
        if not isinstance(lists, dict) or not all(isinstance(v, str) and v for v in lists.values()):
            raise self.fail(
                where, f"'chunk_lists' must be a table {{ prefill = LIST, decode = LIST }}, got {shown(lists)}"
            )
        for kind, list_name in lists.items():
            self.short(kind, "chunk_lists", where)
            self.short(list_name, f"chunk_lists.{kind}", where)
        return State(
            name=self.name(entry, "name", where),
            residency=residency,
            meaning=self.string(entry, "meaning", where),
            terminal=self.boolean(entry, "terminal", where, False),
            role=self.optional_name(entry, "role", where) or "",
            computing=self.boolean(entry, "computing", where, False),
            victim=self.boolean(entry, "victim", where, False),
            container=(
                self.choice(entry, "container", where, CONTAINERS)
                if "container" in entry
                else "finished"
                if entry.get("terminal") is True
                else ""
            ),
            chunk_lists=tuple(sorted(lists.items())),
        )

    def event(self, entry: dict, index: int) -> Event:
        name = self.name(entry, "name", f"events[{index}]")
        where = f"event {shown(name)}"
        destructive = self.boolean(entry, "destructive", where, False)
        done_reason = self.optional_name(entry, "done_reason", where)
        edges = entry.get("transitions")
        if not isinstance(edges, list) or not edges or not all(isinstance(e, dict) for e in edges):
            raise self.fail(where, "'transitions' must be a non-empty list of {source, dest, guard, effect} tables")
        transitions = tuple(
            Transition(
                event=name,
                source=source,
                dest=self.name(edge, "dest", f"{where} transition {i}"),
                guard=self.optional_name(edge, "guard", f"{where} transition {i}"),
                effect=self.optional_name(edge, "effect", f"{where} transition {i}"),
                destructive=destructive,
                done_reason=done_reason,
            )
            for i, edge in enumerate(edges)
            for source in self.strings(edge, "source", f"{where} transition {i}")
        )
        return Event(
            name=name,
            label=self.name(entry, "label", where, most=MAX_LABEL_CHARS),
            destructive=destructive,
            transitions=transitions,
            done_reason=done_reason,
            origin=self.choice(entry, "origin", where, ORIGINS) if "origin" in entry else "scheduler",
            feeds=self.optional_name(entry, "feeds", where),
            production_name=self.optional_string(entry, "production_name", where) or "",
        )

    def output_list(self, entry: dict, index: int) -> OutputList:
        where = _entry("output_lists", index, entry.get("name"))
        return OutputList(
            name=self.name(entry, "name", where),
            states=tuple(self.strings(entry, "states", where)),
            meaning=self.string(entry, "meaning", where),
            production_name=self.optional_string(entry, "production_name", where) or "",
        )

    def policy(self, entry: dict) -> Policy:
        where = "[policy]"
        return Policy(
            victim_order=self.name(entry, "victim_order", where),
            victim_exclusions=tuple(self.strings(entry, "victim_exclusions", where)),
            no_eligible_victim=self.name(entry, "no_eligible_victim", where),
            promotion_candidates=self.name(entry, "promotion_candidates", where),
            promotion_order=self.name(entry, "promotion_order", where),
            promotion_worth=self.name(entry, "promotion_worth", where),
            admission_classes=tuple(self.strings(entry, "admission_classes", where)),
            admission_rules=tuple(self.strings(entry, "admission_rules", where)),
            room_on_its_way=self.name(entry, "room_on_its_way", where),
            work_conservation=self.boolean(entry, "work_conservation", where, True),
            readmissions_keeping_admission=(
                tuple(self.strings(entry, "readmissions_keeping_admission", where))
                if entry.get("readmissions_keeping_admission")
                else ()
            ),
            progress=self.name(entry, "progress", where),
            suspend_rule=self.optional_name(entry, "suspend_rule", where) or "host_takes_every_held_block",
            offload=self.optional_name(entry, "offload", where) or "on_demand",
        )

    def invariant(self, entry: dict, index: int) -> Invariant:
        where = _entry("invariants", index, entry.get("id"))
        scope = self.string(entry, "scope", where)
        if scope not in INVARIANT_SCOPES:
            raise self.fail(where, f"scope {shown(scope)} is not one of {', '.join(INVARIANT_SCOPES)}")
        return Invariant(
            id=self.name(entry, "id", where), scope=scope, statement=self.string(entry, "statement", where)
        )
