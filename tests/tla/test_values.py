"""Reading TLC's printed values: every kind of value, and refusals (deep nesting, stray text) that name the place."""

from __future__ import annotations

import pytest

from kvstate.tla.values import MAX_DEPTH, ModelValue, TlcOutputError, parse_state


def test_every_kind_of_value():
    state = parse_state(
        '/\\ counts = [gpu_free |-> -1, name |-> "a\\"b\\\\c"]\n'
        "/\\ requests = (r0 :> [ok |-> TRUE, no |-> FALSE] @@ r1 :> <<1, <<>>, {2, 3}, {}>>)"
    )
    assert state == {
        "counts": {"gpu_free": -1, "name": 'a"b\\c'},
        "requests": {
            ModelValue("r0"): {"ok": True, "no": False},
            ModelValue("r1"): (1, (), frozenset({2, 3}), frozenset()),
        },
    }


def test_a_single_variable_without_a_conjunction():
    assert parse_state("x = r2") == {"x": ModelValue("r2")}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("/\\ x = " + "<<" * (MAX_DEPTH + 2) + ">>" * (MAX_DEPTH + 2), "nested deeper"),
        ("/\\ x = 1 ?", "unexpected text in a TLC state at character 8"),
        ("/\\ x = [a |-> 1", "expected ','"),
        ("/\\ x = (r0 :> 1 r1)", "expected '@@'"),
        ("/\\ = 1", "expected a name"),
        ("/\\ x = ,", "unexpected ','"),
    ],
)
def test_what_is_not_a_tlc_state_is_refused(text, message):
    with pytest.raises(TlcOutputError, match=message.replace("(", r"\(").replace("?", r"\?")):
        parse_state(text)
