"""A spec or bounds file under the size limit still cannot exhaust time or memory: what reaches the TOML
parser is bounded first, and a spec's error listing stays small and linear."""

from __future__ import annotations

import tomllib

import pytest

from kvstate.checker.bounds import load_bounds
from kvstate.errors import KVStateError, SpecError
from kvstate.spec import load_spec, packaged_spec_path
from kvstate.untrusted import Limits, read_toml

PACKAGED = packaged_spec_path().read_text(encoding="utf-8")


@pytest.fixture
def no_parser(monkeypatch):
    """Fail if anything reaches the TOML parser."""

    def refuse(*_, **__):
        raise AssertionError("the text reached the TOML parser")

    monkeypatch.setattr(tomllib, "loads", refuse)


@pytest.mark.parametrize(
    "text",
    [
        "a" + ".a" * 20_000 + " = 1\n",  # 40 KB: 2.4 GB of parser memory before the bound
        "[" + "a" + ".a" * 20_000 + "]\n",  # the same as a table header
        'x = 1\n"a"' + ' . "a"' * 5_000 + " = 1\n",  # quoted parts, blanks around the dots
    ],
    ids=["dotted key", "table header", "quoted parts"],
)
def test_a_long_dotted_key_is_refused_before_parsing(tmp_path, no_parser, text):
    path = tmp_path / "hostile.toml"
    path.write_text(text)
    with pytest.raises(SpecError, match=r"hostile.toml:\d+: a dotted key .* of more than 16 parts, nested deeper"):
        load_spec(path)
    with pytest.raises(KVStateError, match="of more than 8 parts"):
        load_bounds(path)  # the bounds file is read the same way


def test_many_tables_are_refused_before_parsing(tmp_path, no_parser):
    path = tmp_path / "tables.toml"
    path.write_text("".join(f"[t{i}]\nx = 1\n" for i in range(60_000)))  # 840 KB: seconds of parsing
    with pytest.raises(SpecError, match=r"holds 120000 keys and table headers .* more than the 10000"):
        load_spec(path)


def test_the_packaged_files_and_a_key_at_the_bound_pass(tmp_path):
    limits = Limits(max_bytes=1 << 20, max_depth=16)
    assert read_toml(packaged_spec_path(), limits, "spec file")["spec"]["version"] >= 1
    path = tmp_path / "x.toml"
    path.write_text("a" + ".a" * 15 + " = 1\n")  # 16 parts: exactly the bound, accepted
    assert read_toml(path, limits, "x")["a"]["a"]


def hostile_spec(tmp_path, states: int, unknown: int):
    """The packaged spec with `states` more states and one event naming `unknown` undeclared states."""
    lines = [PACKAGED]
    lines += [f'[[states]]\nname = "s{i}"\nresidency = "none"\nmeaning = "x"\n' for i in range(states)]
    lines.append('[[events]]\nname = "bogus"\nlabel = "b"\n')
    per_edge = 300
    for start in range(0, unknown, per_edge):
        names = ", ".join(f'"u{i}"' for i in range(start, min(start + per_edge, unknown)))
        lines.append(f'[[events.transitions]]\nsource = [{names}]\ndest = "done"\n')
    path = tmp_path / "hostile.toml"
    path.write_text("".join(lines))
    return path


def test_a_spec_error_lists_a_bounded_number_of_problems_and_names(tmp_path):
    path = hostile_spec(tmp_path, states=300, unknown=3_000)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    message = str(info.value)
    problems = [line for line in message.splitlines() if line.startswith("  - ")]
    assert len(problems) == 20 and "... and 2980 more; fix these first" in message
    assert all("and 295 more]" in line for line in problems)  # 12 of the 307 known states, then a count
    assert len(message) < 6_000  # not 3,000 problems each listing every known state


def test_a_huge_name_is_echoed_as_a_short_prefix(tmp_path):
    text = PACKAGED.replace('initial = "waiting"', 'initial = "' + "w" * 500_000 + '"')
    path = tmp_path / "long.toml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert len(str(info.value)) < 2_000 and "500000 characters" in str(info.value)
