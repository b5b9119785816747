"""Validation: the packaged spec passes; one broken spec per refusal class is refused naming the entry.

Each broken spec is the packaged TOML data with one edit. Every case also states how many problems the
edit must produce, so a refusal that fires for the wrong reason (or fires twice) fails the test.
"""

from __future__ import annotations

import copy
import tomllib
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from kvstate import EFFECTS, GUARDS, SpecError, load_spec, packaged_spec_path, validate_spec
from kvstate.spec import parse_spec

PACKAGED_DATA = tomllib.loads(packaged_spec_path().read_text(encoding="utf-8"))
SOURCE = "mutated.toml"


def event_entry(data: dict, name: str) -> dict:
    return next(e for e in data["events"] if e["name"] == name)


def state_entry(data: dict, name: str) -> dict:
    return next(s for s in data["states"] if s["name"] == name)


def terminal_name(data: dict) -> str:
    return next(s["name"] for s in data["states"] if s.get("terminal"))


def new_state(name: str) -> dict:
    return {"name": name, "residency": "none", "meaning": f"test state {name}"}


@dataclass(frozen=True)
class Broken:
    """`mutate` edits the TOML data and returns the phrases the refusal must contain (one list per problem)."""

    mutate: Callable[[dict], list[list[str]]]
    guards: Callable[[], dict] | None = None
    effects: Callable[[], frozenset] | None = None


# ---------------------------------------------------------------------------------------------- cases


def unknown_source(data: dict) -> list[list[str]]:
    event_entry(data, "resume")["transitions"][0]["source"] = ["limbo"]
    return [["event 'resume': source 'limbo' is an unknown state"]]


def unknown_dest(data: dict) -> list[list[str]]:
    event_entry(data, "resume")["transitions"][0]["dest"] = "limbo"
    return [["event 'resume': dest 'limbo' is an unknown state"]]


def unknown_initial(data: dict) -> list[list[str]]:
    data["spec"]["initial"] = "limbo"
    return [["initial state 'limbo' is not a declared state"]]


def unreachable_state(data: dict) -> list[list[str]]:
    # "orphan" can leave (cancel takes it to done) but nothing leads into it
    data["states"].append(new_state("orphan"))
    event_entry(data, "cancel")["transitions"][0]["source"].append("orphan")
    initial = data["spec"]["initial"]
    return [[f"state 'orphan' is unreachable from the initial state {initial!r}"]]


def terminal_with_outgoing_event(data: dict) -> list[list[str]]:
    terminal = terminal_name(data)
    admit = event_entry(data, "admit")["transitions"][0]
    event_entry(data, "admit")["transitions"].append({**admit, "source": [terminal]})
    return [[f"terminal state {terminal!r} has an outgoing event 'admit'"]]


def no_way_out(data: dict) -> list[list[str]]:
    initial = data["spec"]["initial"]
    data["states"].append(new_state("stuck"))
    data["events"].append({"name": "park", "label": "park", "transitions": [{"source": [initial], "dest": "stuck"}]})
    return [["non-terminal state 'stuck' has no way out"]]


def cannot_reach_terminal(data: dict) -> list[list[str]]:
    initial = data["spec"]["initial"]
    data["states"] += [new_state("ping"), new_state("pong")]
    data["events"].append(
        {
            "name": "bounce",
            "label": "bounce",
            "transitions": [
                {"source": [initial], "dest": "ping"},
                {"source": ["ping"], "dest": "pong"},
                {"source": ["pong"], "dest": "ping"},
            ],
        }
    )
    return [
        ["non-terminal state 'ping' can never reach a terminal state"],
        ["non-terminal state 'pong' can never reach a terminal state"],
    ]


def ambiguous_guards(data: dict) -> list[list[str]]:
    # one more edge from suspended on resume, with a guard not declared exclusive with those it has: one problem
    # for each of them
    resume = event_entry(data, "resume")["transitions"]
    existing = list(resume)
    (source,) = existing[0]["source"]
    resume.append(
        {
            "source": [source],
            "dest": "recompute_paused",
            "guard": "promotion_gate",
            "effect": "release_kv_and_reset",
        }
    )
    return [
        [
            f"event 'resume' from state {source!r} has two transitions",
            f"to {edge['dest']!r} guarded by {edge['guard']}",
            "to 'recompute_paused' guarded by promotion_gate",
            "are not declared mutually exclusive",
        ]
        for edge in existing
    ]


def exclusivity_not_declared(data: dict) -> list[list[str]]:
    # drop a declared group: every (state, event) pair that relied on it becomes ambiguous
    group = data["exclusive_guards"].pop()
    problems = []
    for event in data["events"]:
        pairs: dict[str, list[dict]] = {}
        for edge in event["transitions"]:
            for source in edge["source"]:
                pairs.setdefault(source, []).append(edge)
        for source, edges in pairs.items():
            if len(edges) > 1 and all(e.get("guard") in group["guards"] for e in edges):
                problems.append(
                    [
                        f"event {event['name']!r} from state {source!r} has two transitions",
                        "are not declared mutually exclusive",
                    ]
                )
    assert problems, "the dropped group must have been relied on"
    return problems


def ambiguous_unguarded(data: dict) -> list[list[str]]:
    edges = event_entry(data, "lose_host_copy")["transitions"]
    (source,) = edges[0]["source"]
    assert "guard" not in edges[0]
    terminal = terminal_name(data)
    edges.append({"source": [source], "dest": terminal, "effect": "release_kv_and_terminate"})
    return [
        [
            f"event 'lose_host_copy' from state {source!r} has two transitions",
            f"to {edges[0]['dest']!r} guarded by nothing, to {terminal!r} guarded by nothing",
        ]
    ]


def guard_without_semantics(data: dict) -> list[list[str]]:
    edge = event_entry(data, "lose_host_copy")["transitions"][0]
    edge["guard"] = "copy_lost"
    (source,) = edge["source"]
    return [[f"event 'lose_host_copy' from {source!r}: guard 'copy_lost' has no semantics"]]


def effect_without_semantics(data: dict) -> list[list[str]]:
    edge = event_entry(data, "catch_up")["transitions"][0]
    assert "effect" not in edge
    edge["effect"] = "celebrate"
    (source,) = edge["source"]
    return [[f"event 'catch_up' from {source!r}: effect 'celebrate' has no semantics"]]


def exclusive_group_guard_without_semantics(data: dict) -> list[list[str]]:
    group = data["exclusive_guards"][0]
    group["guards"] = [*group["guards"], "moon_phase"]
    return [[f"exclusive_guards {group['name']!r}: guard 'moon_phase' has no semantics"]]


def unused_guard_semantics(data: dict) -> list[list[str]]:
    return [["guard 'always' has semantics but no transition uses it"]]


def unused_effect_semantics(data: dict) -> list[list[str]]:
    return [["effect 'flush_caches' has semantics but no transition uses it"]]


def duplicate_state(data: dict) -> list[list[str]]:
    data["states"].append(copy.deepcopy(state_entry(data, "running")))
    return [["state 'running' is defined 2 times"]]


def duplicate_event(data: dict) -> list[list[str]]:
    data["events"].append(copy.deepcopy(event_entry(data, "admit")))
    return [["event 'admit' is defined 2 times"]]


def duplicate_invariant(data: dict) -> list[list[str]]:
    first = data["invariants"][0]
    data["invariants"].append(copy.deepcopy(first))
    return [[f"invariant {first['id']!r} is defined 2 times"]]


CASES = {
    "unknown-source-state": Broken(unknown_source),
    "unknown-dest-state": Broken(unknown_dest),
    "unknown-initial-state": Broken(unknown_initial),
    "unreachable-state": Broken(unreachable_state),
    "terminal-state-with-outgoing-event": Broken(terminal_with_outgoing_event),
    "non-terminal-state-without-way-out": Broken(no_way_out),
    "states-that-never-reach-terminal": Broken(cannot_reach_terminal),
    "ambiguous-non-exclusive-guards": Broken(ambiguous_guards),
    "ambiguous-exclusivity-not-declared": Broken(exclusivity_not_declared),
    "ambiguous-no-guards": Broken(ambiguous_unguarded),
    "guard-without-semantics": Broken(guard_without_semantics),
    "effect-without-semantics": Broken(effect_without_semantics),
    "exclusive-guard-without-semantics": Broken(exclusive_group_guard_without_semantics),
    "guard-semantics-unused": Broken(unused_guard_semantics, guards=lambda: {**GUARDS, "always": lambda r, p: True}),
    "effect-semantics-unused": Broken(unused_effect_semantics, effects=lambda: EFFECTS | {"flush_caches"}),
    "duplicate-state": Broken(duplicate_state),
    "duplicate-event": Broken(duplicate_event),
    "duplicate-invariant": Broken(duplicate_invariant),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_broken_spec_is_refused_naming_the_entry(case: Broken) -> None:
    data = copy.deepcopy(PACKAGED_DATA)
    expected = case.mutate(data)
    spec = parse_spec(data, source=SOURCE)  # shapes are fine: only validation may refuse
    guards = case.guards() if case.guards else GUARDS
    effects = case.effects() if case.effects else EFFECTS
    with pytest.raises(SpecError) as info:
        validate_spec(spec, guards, effects)
    message = str(info.value)
    assert message.startswith(f"{SOURCE}: the specification is not well formed:"), message
    problems = [line for line in message.splitlines() if line.startswith("  - ")]
    assert len(problems) == len(expected), message
    for phrases in expected:
        assert any(all(p in line for p in phrases) for line in problems), (phrases, message)


def test_packaged_spec_passes_validation() -> None:
    spec = load_spec(validate=False)
    assert validate_spec(spec) is None
    assert validate_spec(spec, GUARDS, EFFECTS) is None


def test_unmutated_data_passes_validation() -> None:
    """Guards the case table: the parse path used by the cases accepts the unmutated data."""
    assert validate_spec(parse_spec(copy.deepcopy(PACKAGED_DATA), source=SOURCE), GUARDS, EFFECTS) is None


def test_every_problem_is_listed_at_once() -> None:
    """Independent problems are reported together, not one per run."""
    data = copy.deepcopy(PACKAGED_DATA)
    expected = duplicate_state(data) + guard_without_semantics(data) + effect_without_semantics(data)
    with pytest.raises(SpecError) as info:
        validate_spec(parse_spec(data, source=SOURCE), GUARDS, EFFECTS)
    message = str(info.value)
    for phrases in expected:
        assert all(p in message for p in phrases), (phrases, message)
