"""Loading the specification: the packaged file, explicit paths, and shape errors that name the entry."""

from __future__ import annotations

import copy
import re
import tomllib
from collections import Counter
from pathlib import Path

import pytest

from kvstate import EFFECTS, GUARDS, Spec, SpecError, load_spec, packaged_spec_path
from kvstate.spec import INVARIANT_SCOPES, RESIDENCIES, RESIDENCY_TIERS, parse_spec

PACKAGED_TEXT = packaged_spec_path().read_text(encoding="utf-8")
PACKAGED_DATA = tomllib.loads(PACKAGED_TEXT)


def packaged_data() -> dict:
    return copy.deepcopy(PACKAGED_DATA)


def index_of(entries: list[dict], key: str, value: str) -> int:
    return next(i for i, entry in enumerate(entries) if entry.get(key) == value)


# ------------------------------------------------------------------------------------------ packaged spec


def test_packaged_spec_loads_and_is_what_the_file_says() -> None:
    spec = load_spec()
    assert isinstance(spec, Spec)
    assert spec.source == str(packaged_spec_path())
    assert spec.name == PACKAGED_DATA["spec"]["name"]
    assert spec.version == PACKAGED_DATA["spec"]["version"]
    assert spec.initial == PACKAGED_DATA["spec"]["initial"]
    assert [s.name for s in spec.states] == [s["name"] for s in PACKAGED_DATA["states"]]
    assert [e.name for e in spec.events] == [e["name"] for e in PACKAGED_DATA["events"]]
    assert [i.id for i in spec.invariants] == [i["id"] for i in PACKAGED_DATA["invariants"]]
    # one Transition per (edge, source) listed in the file
    assert len(spec.transitions) == sum(
        len(edge["source"]) for event in PACKAGED_DATA["events"] for edge in event["transitions"]
    )
    assert spec.initial in spec.state_by_name
    assert spec.terminal_states, "the lifecycle needs at least one terminal state"
    assert {s.residency for s in spec.states} <= set(RESIDENCIES)
    assert {i.scope for i in spec.invariants} <= set(INVARIANT_SCOPES)


def test_every_residency_names_the_tiers_it_allows() -> None:
    """Each residency lets a request hold blocks in a subset of the two tiers; a held state in both."""
    assert tuple(RESIDENCY_TIERS) == RESIDENCIES
    assert all(set(tiers) <= {"gpu", "host"} for tiers in RESIDENCY_TIERS.values())
    spec = load_spec()
    for tier in ("gpu", "host"):
        assert spec.states_holding(tier) == {s.name for s in spec.states if tier in RESIDENCY_TIERS[s.residency]}
    assert spec.states_holding("host") == set(spec.states_with_residency("held")) < spec.states_holding("gpu")


def test_packaged_spec_names_are_unique() -> None:
    spec = load_spec()
    kinds = {
        "state": [s.name for s in spec.states],
        "event": [e.name for e in spec.events],
        "invariant": [i.id for i in spec.invariants],
        "exclusive group": [g.name for g in spec.exclusive_guards],
        "guard": list(GUARDS),
        "effect": sorted(EFFECTS),
    }
    for kind, names in kinds.items():
        duplicates = [name for name, count in Counter(names).items() if count > 1]
        assert not duplicates, f"duplicate {kind} names: {duplicates}"
    # states, events, guards and effects share no names either (they end up side by side in the
    # transitions machine, the diagrams and the semantics module)
    namespaces = {kind: set(kinds[kind]) for kind in ("state", "event", "guard", "effect")}
    for a, names_a in namespaces.items():
        for b, names_b in namespaces.items():
            if a < b:
                assert not names_a & names_b, f"{a} and {b} names overlap"
    # the semantics the spec uses are exactly the ones defined
    assert spec.guard_names == set(GUARDS)
    assert spec.effect_names == EFFECTS


def test_every_exclusive_guard_is_a_used_guard() -> None:
    spec = load_spec()
    for group in spec.exclusive_guards:
        assert len(group.guards) >= 2, group
        assert group.guards <= spec.guard_names, group


# ------------------------------------------------------------------------------------------ explicit paths


@pytest.mark.parametrize("as_str", [False, True], ids=["Path", "str"])
def test_load_from_explicit_path(tmp_path: Path, as_str: bool) -> None:
    path = tmp_path / "copy.toml"
    path.write_text(PACKAGED_TEXT, encoding="utf-8")
    spec = load_spec(str(path) if as_str else path)
    assert spec.source == str(path)
    packaged = load_spec()
    assert (spec.states, spec.events, spec.exclusive_guards, spec.invariants) == (
        packaged.states,
        packaged.events,
        packaged.exclusive_guards,
        packaged.invariants,
    )


def test_load_from_explicit_path_reads_that_file(tmp_path: Path) -> None:
    data_text = PACKAGED_TEXT.replace(f'name = "{PACKAGED_DATA["spec"]["name"]}"', 'name = "a different lifecycle"', 1)
    assert data_text != PACKAGED_TEXT
    path = tmp_path / "renamed.toml"
    path.write_text(data_text, encoding="utf-8")
    assert load_spec(path).name == "a different lifecycle"


def test_load_without_validation_returns_an_invalid_spec(tmp_path: Path) -> None:
    data_text = PACKAGED_TEXT.replace(f'initial = "{PACKAGED_DATA["spec"]["initial"]}"', 'initial = "nowhere"', 1)
    path = tmp_path / "bad_initial.toml"
    path.write_text(data_text, encoding="utf-8")
    assert load_spec(path, validate=False).initial == "nowhere"
    with pytest.raises(SpecError, match=re.escape(str(path))) as info:
        load_spec(path)
    assert "initial state 'nowhere'" in str(info.value)


# ------------------------------------------------------------------------------------------ file errors


def test_missing_file_is_refused_naming_the_path(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(SpecError) as info:
        load_spec(path)
    message = str(info.value)
    assert "cannot read spec file" in message
    assert str(path) in message


def test_directory_is_refused_naming_the_path(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(tmp_path)
    message = str(info.value)
    assert "cannot read spec file" in message
    assert str(tmp_path) in message


def test_non_utf8_file_is_refused_naming_the_path(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b"\xff\xfe[spec]\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(path) in str(info.value)
    assert "UTF-8" in str(info.value)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("[spec\nname = 'x'\n", id="unclosed-table"),
        pytest.param(PACKAGED_TEXT + "\n[spec]\nname = 'again'\n", id="duplicate-table"),
        pytest.param("states = [\n", id="unclosed-array"),
    ],
)
def test_invalid_toml_is_refused_naming_the_file(tmp_path: Path, text: str) -> None:
    path = tmp_path / "broken.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    message = str(info.value)
    assert "is not valid TOML" in message
    assert str(path) in message
    assert isinstance(info.value.__cause__, tomllib.TOMLDecodeError)


# ------------------------------------------------------------------------------------------ shape errors


def _bad_residency(data: dict) -> tuple[str, ...]:
    i = index_of(data["states"], "name", "running")
    data["states"][i]["residency"] = "vram"
    return f"states[{i}] (running)", f"residency 'vram' is not one of {', '.join(RESIDENCIES)}"


def _missing_residency(data: dict) -> tuple[str, ...]:
    i = index_of(data["states"], "name", "suspended")
    del data["states"][i]["residency"]
    return f"states[{i}] (suspended)", "'residency' must be a non-empty string"


def _missing_meaning(data: dict) -> tuple[str, ...]:
    i = index_of(data["states"], "name", "waiting")
    data["states"][i]["meaning"] = ""
    return f"states[{i}] (waiting)", "'meaning' must be a non-empty string"


def _terminal_not_bool(data: dict) -> tuple[str, ...]:
    i = index_of(data["states"], "name", "done")
    data["states"][i]["terminal"] = "yes"
    return f"states[{i}] (done)", "'terminal' must be true or false"


def _missing_label(data: dict) -> tuple[str, ...]:
    i = index_of(data["events"], "name", "admit")
    del data["events"][i]["label"]
    return "event 'admit'", "'label' must be a non-empty string"


def _missing_event_name(data: dict) -> tuple[str, ...]:
    i = index_of(data["events"], "name", "resume")
    del data["events"][i]["name"]
    return f"events[{i}]", "'name' must be a non-empty string"


def _transitions_a_table(data: dict) -> tuple[str, ...]:
    i = index_of(data["events"], "name", "suspend")
    data["events"][i]["transitions"] = data["events"][i]["transitions"][0]
    return "event 'suspend'", "'transitions' must be a non-empty list"


def _transitions_a_string(data: dict) -> tuple[str, ...]:
    i = index_of(data["events"], "name", "catch_up")
    data["events"][i]["transitions"] = "replaying -> running"
    return "event 'catch_up'", "'transitions' must be a non-empty list"


def _transitions_empty(data: dict) -> tuple[str, ...]:
    i = index_of(data["events"], "name", "finish")
    data["events"][i]["transitions"] = []
    return "event 'finish'", "'transitions' must be a non-empty list"


def _source_not_names(data: dict) -> tuple[str, ...]:
    i = index_of(data["events"], "name", "resume")
    data["events"][i]["transitions"][0]["source"] = [3]
    return "event 'resume' transition 0", "'source' must be a non-empty list of names"


def _missing_dest(data: dict) -> tuple[str, ...]:
    i = index_of(data["events"], "name", "replay")
    del data["events"][i]["transitions"][0]["dest"]
    return "event 'replay' transition 0", "'dest' must be a non-empty string"


def _bad_scope(data: dict) -> tuple[str, ...]:
    i = index_of(data["invariants"], "id", "FENCE")
    data["invariants"][i]["scope"] = "global"
    return f"invariants[{i}] (FENCE)", f"scope 'global' is not one of {', '.join(INVARIANT_SCOPES)}"


def _states_not_an_array(data: dict) -> tuple[str, ...]:
    data["states"] = {"name": "waiting"}
    return "[[states]]", "expected an array of tables [[states]]"


def _missing_spec_table(data: dict) -> tuple[str, ...]:
    del data["spec"]
    return "[spec]", "missing table [spec]"


def _version_not_int(data: dict) -> tuple[str, ...]:
    data["spec"]["version"] = "1"
    return "[spec]", "'version' must be an integer"


def _exclusive_guards_not_names(data: dict) -> tuple[str, ...]:
    data["exclusive_guards"][0]["guards"] = []
    return "exclusive_guards[0]", "'guards' must be a non-empty list of names"


SHAPE_ERRORS = [
    _bad_residency,
    _missing_residency,
    _missing_meaning,
    _terminal_not_bool,
    _missing_label,
    _missing_event_name,
    _transitions_a_table,
    _transitions_a_string,
    _transitions_empty,
    _source_not_names,
    _missing_dest,
    _bad_scope,
    _states_not_an_array,
    _missing_spec_table,
    _version_not_int,
    _exclusive_guards_not_names,
]


@pytest.mark.parametrize("mutate", SHAPE_ERRORS, ids=lambda f: f.__name__.lstrip("_").replace("_", "-"))
def test_wrong_shape_is_refused_naming_file_and_entry(mutate) -> None:
    data = packaged_data()
    where, phrase = mutate(data)
    with pytest.raises(SpecError) as info:
        parse_spec(data, source="shapes.toml")
    message = str(info.value)
    assert message.startswith(f"shapes.toml: {where}: "), message
    assert phrase in message


@pytest.mark.parametrize(
    "mutate",
    [_bad_residency, _missing_label, _transitions_a_table, _bad_scope],
    ids=lambda f: f.__name__.lstrip("_").replace("_", "-"),
)
def test_wrong_shape_in_a_file_names_the_file(tmp_path: Path, mutate) -> None:
    """The same shape errors reached through `load_spec` name the file on disk."""
    data = packaged_data()
    where, phrase = mutate(data)
    path = tmp_path / "shaped.toml"
    path.write_text(_to_toml(data), encoding="utf-8")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {where}: "), message
    assert phrase in message


def test_toml_writer_round_trips_the_packaged_spec(tmp_path: Path) -> None:
    """Guards the helper above: unmutated data written by `_to_toml` loads to the packaged spec."""
    path = tmp_path / "roundtrip.toml"
    path.write_text(_to_toml(packaged_data()), encoding="utf-8")
    spec, packaged = load_spec(path), load_spec()
    assert (spec.states, spec.events, spec.exclusive_guards, spec.invariants) == (
        packaged.states,
        packaged.events,
        packaged.exclusive_guards,
        packaged.invariants,
    )


def _to_toml(data: dict) -> str:
    """A minimal TOML writer for the spec's shape (tables of scalars, arrays of tables, inline tables)."""

    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, str)):
            return str(v) if isinstance(v, int) else _quote(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        raise TypeError(v)

    def is_table(item) -> bool:
        return isinstance(item, dict) or (
            isinstance(item, list) and bool(item) and all(isinstance(x, dict) for x in item)
        )

    lines: list[str] = []
    for key, item in sorted(data.items(), key=lambda kv: is_table(kv[1])):  # plain keys before tables
        if isinstance(item, list) and item and all(isinstance(x, dict) for x in item):
            for entry in item:
                lines.append(f"[[{key}]]")
                lines.extend(f"{k} = {value(x)}" for k, x in entry.items())
                lines.append("")
        elif isinstance(item, dict):
            lines.append(f"[{key}]")
            lines.extend(f"{k} = {value(x)}" for k, x in item.items())
            lines.append("")
        else:
            lines.append(f"{key} = {value(item)}")
    return "\n".join(lines)


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


# ------------------------------------------------------------------------------------------ name lengths
LONG = "d" * 20_000


@pytest.mark.parametrize(
    ("anchor", "field"),
    [('name = "done"', "name"), ('guard = "', "guard"), ('effect = "', "effect"), ('label = "', "label")],
    ids=["state", "guard", "effect", "label"],
)
def test_a_long_name_is_refused_naming_file_line_and_field(anchor: str, field: str, tmp_path: Path) -> None:
    """A name (or label) far longer than any spec needs is refused by the loader, before anything is derived."""
    value_start = PACKAGED_TEXT.index(anchor) + anchor.index('"') + 1  # the first such value is replaced
    end = PACKAGED_TEXT.index('"', value_start)
    text = PACKAGED_TEXT[:value_start] + LONG + PACKAGED_TEXT[end:]
    path = tmp_path / "long.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    message = str(info.value)
    line = text[:value_start].count("\n") + 1
    assert message.startswith(f"{path}:{line}: "), message
    assert f"field {field!r} is {len(LONG)} characters long" in message
    assert len(message) < 300 and "\n" not in message


def test_every_packaged_name_is_within_the_limit() -> None:
    from kvstate.spec import MAX_LABEL_CHARS, MAX_NAME_CHARS

    spec = load_spec()
    names = [s.name for s in spec.states] + [e.name for e in spec.events] + [i.id for i in spec.invariants]
    names += list(spec.guard_names | spec.effect_names)
    assert max(map(len, names)) <= MAX_NAME_CHARS
    assert max(len(e.label) for e in spec.events) <= MAX_LABEL_CHARS
