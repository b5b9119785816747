"""Every invariant id the tools raise or check is declared in the spec, and every policy rule and role the code
gives meaning to is one the spec can name (one vocabulary, read from one place)."""

from __future__ import annotations

import re
from pathlib import Path

import kvstate
from kvstate import policy
from kvstate.policy import VICTIM_EXCLUSIONS
from kvstate.roles import ROLES
from kvstate.spec import load_spec

SPEC = load_spec()
SOURCES = [p for root in ("kvstate", "executor") for p in (Path(kvstate.__file__).parents[1] / root).rglob("*.py")]
RAISED = re.compile(r'(?:InvariantViolation|\.fail)\(\s*"([A-Z]+(?:-[A-Z]+)+)"')  # raised, or via a checker's fail()


def test_every_raised_invariant_id_is_declared_in_the_spec() -> None:
    raised = {m.group(1) for path in SOURCES for m in RAISED.finditer(path.read_text(encoding="utf-8"))}
    assert len(raised) >= 15, "the scan found the raise sites"
    assert raised <= {i.id for i in SPEC.invariants}, sorted(raised - {i.id for i in SPEC.invariants})


def test_the_scheduler_gives_meaning_to_exactly_the_victim_exclusions_the_policy_vocabulary_has() -> None:
    assert set(VICTIM_EXCLUSIONS) == set(policy.VOCABULARY["victim_exclusions"])
    assert set(SPEC.policy.victim_exclusions) <= set(VICTIM_EXCLUSIONS)


def test_every_role_names_one_state_of_the_packaged_spec() -> None:
    assert sorted(SPEC.state_by_role) == sorted(ROLES)
    assert len(set(SPEC.state_by_role.values())) == len(ROLES)
