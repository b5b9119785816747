"""Every guard and effect the spec uses has a TLA+ meaning beside its Python one; validate_spec refuses one without."""

from __future__ import annotations

import pytest

from kvstate.errors import SpecError
from kvstate.semantics import EFFECTS, GUARDS, TLA
from kvstate.spec import load_spec
from kvstate.validate import validate_spec

SPEC = load_spec()


def test_every_guard_and_effect_has_a_tla_meaning():
    assert SPEC.guard_names <= set(TLA) and SPEC.effect_names <= set(TLA)
    assert validate_spec(SPEC, GUARDS, EFFECTS, TLA) is None


@pytest.mark.parametrize("name", sorted(SPEC.guard_names | SPEC.effect_names))
def test_a_guard_or_effect_without_a_tla_meaning_is_refused(name):
    kind = "guard" if name in GUARDS else "effect"
    with pytest.raises(SpecError) as info:
        validate_spec(SPEC, GUARDS, EFFECTS, {n: m for n, m in TLA.items() if n != name})
    problems = [line for line in str(info.value).splitlines() if line.startswith("  - ")]
    expected = (
        f"  - {kind} {name!r} has no TLA+ meaning; record one beside its Python meaning in kvstate.semantics with "
        "@tla(...) (kvstate export tla writes it as a TLA+ operator)"
    )
    assert problems == [expected]


def test_a_name_without_python_semantics_is_reported_once():
    """A guard with neither meaning is refused for its missing Python semantics alone, not also for its TLA+ one."""
    guards = {n: g for n, g in GUARDS.items() if n != "single_stage"}
    with pytest.raises(SpecError) as info:
        validate_spec(SPEC, guards, EFFECTS, {n: m for n, m in TLA.items() if n != "single_stage"})
    problems = [line for line in str(info.value).splitlines() if "'single_stage'" in line]
    assert problems and all("has no semantics" in line and "TLA+" not in line for line in problems)
