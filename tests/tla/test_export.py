"""`kvstate export tla`: the module is written from the spec (one action per event with its guards, each guard and
effect the TLA+ meaning recorded beside its Python one), models carry symmetry exactly where our checker uses it,
and names from the spec or bounds that TLA+ cannot hold are refused."""

from __future__ import annotations

import re

import pytest

from kvstate.checker.bounds import Bound, load_bounds
from kvstate.checker.effects import offload_limited_events
from kvstate.cli import main
from kvstate.semantics import TLA
from kvstate.spec import load_spec
from kvstate.tla.models import model_files, symmetry_groups
from kvstate.tla.module import lifecycle_module
from kvstate.tla.names import TlaExportError, comment, identifier
from tests.tla.conftest import spec_copy

SPEC = load_spec()
MODULE = lifecycle_module(SPEC)


def definition(name: str) -> str:
    """The text of one top-level definition of the module (up to the next definition or comment)."""
    match = re.search(rf"^{re.escape(name)}(\(.*?\))? ==(.*?)(?=^\S)", MODULE, re.S | re.M)
    assert match is not None, f"{name} is not defined"
    return " ".join(match.group(2).split())


def camel(name: str) -> str:
    return "".join(p.capitalize() for p in name.split("_"))


@pytest.mark.parametrize("event", SPEC.events, ids=lambda e: e.name)
def test_each_event_is_one_action_with_its_guards(event):
    edge = definition(f"{camel(event.name)}Edge")
    arms = re.findall(r'IF q\.state = "(\w+)"(?: /\\ (\w+)\(RequestView\(q\), PoolView\(c\)\))? THEN (\d+)', edge)
    assert [(s, g) for s, g, _ in arms] == [(t.source, t.guard or "") for t in event.transitions]
    ks = [int(k) for _, _, k in arms]
    assert [SPEC.transitions[k - 1] for k in ks] == list(event.transitions)  # Transitions[k] is that edge
    action = definition(camel(event.name))
    if event.name in offload_limited_events(SPEC):  # the offload of held blocks: taken with every block count
        assert "\\E k \\in 1..GpuBlocks : LET c == [counts EXCEPT !.offload_limit = k] IN" in action
        assert f"{camel(event.name)}Edge(requests[r], c)" in action
    else:
        assert f"{camel(event.name)}Edge(requests[r], counts)" in action


def test_guards_and_effects_are_their_recorded_tla_meanings():
    for name, meaning in TLA.items():
        assert f"{name}({', '.join(meaning.params)}) ==" in MODULE
        assert definition(name) == " ".join(meaning.body.split())
    for t in SPEC.transitions:
        assert t.guard is None or t.guard in TLA
        assert t.effect is None or f"-> {t.effect}(q, c, t)" in definition("Effect")


def test_a_planted_tla_meaning_is_what_the_module_says():
    name = "gpu_room_for_offloaded_blocks"
    planted = {**TLA, name: TLA[name]._replace(body="FALSE")}
    assert f"{name}(request, pool) == FALSE" in lifecycle_module(SPEC, planted)


def test_environment_events_have_no_fairness_and_every_other_action_has():
    fairness = definition("Fairness")
    for event in SPEC.events:
        fair = f"WF_vars({camel(event.name)}(r))" in fairness
        assert fair == (event.name not in SPEC.environment_events), event.name
    assert "WF_vars(Compute(r))" in fairness and "WF_vars(Complete(r))" in fairness  # a request's copy completes
    assert "ComputeStop" not in fairness  # a stop token is data, no obligation


def test_symmetry_exactly_where_requests_are_interchangeable():
    bounds, _ = load_bounds()
    for bound in bounds.values():
        if not bound.abstract_model:
            continue
        files = model_files(bound, SPEC)
        twins = len(set(bound.requests)) < len(bound.requests)
        assert ("SYMMETRY MC_Symmetry" in files.cfg) == twins == files.symmetric, bound.name
        assert "SYMMETRY" not in model_files(bound, SPEC, symmetry=False).cfg
        assert "SYMMETRY" not in files.liveness_cfg  # TLC: symmetry can hide a liveness violation


def test_two_groups_of_equal_requests_permute_independently():
    bound = Bound("two_pairs", ((2, 1), (3, 1), (2, 1), (3, 1)), gpu_blocks=4)
    assert symmetry_groups(bound) == [[0, 2], [1, 3]]
    text = model_files(bound, SPEC).tla
    assert "{p0 @@ p1 : p0 \\in Permutations({r0, r2}), p1 \\in Permutations({r1, r3})}" in text


def test_every_invariant_our_checker_evaluates_is_in_the_safety_model():
    from kvstate.checker.invariants import STATE_PREDICATES, STEP_PREDICATES

    cfg = model_files(Bound("one", ((1, 1),), gpu_blocks=2), SPEC).cfg
    invariants, properties = cfg.split("PROPERTY")
    for inv in SPEC.invariants:
        name = inv.id.replace("-", "_")
        assert (f"    {name}\n" in invariants) == (inv.id in STATE_PREDICATES or inv.id == "DEADLOCK"), inv.id
        assert (f"    {name}\n" in properties) == (inv.id in STEP_PREDICATES), inv.id


def test_a_spec_event_that_is_no_tla_identifier_is_refused(tmp_path):
    def rename(data):
        (abort,) = (e for e in data["events"] if e["name"] == "abort")
        abort["name"] = "abort-now"

    spec = spec_copy(tmp_path, rename)
    with pytest.raises(TlaExportError, match=r"event 'abort-now' cannot be written as a TLA\+ identifier"):
        lifecycle_module(spec)


def test_a_bound_name_that_is_no_tla_identifier_is_refused():
    with pytest.raises(TlaExportError, match=r"bound 'a\.b'"):
        model_files(Bound("a.b", ((1, 1),), gpu_blocks=2), SPEC)
    with pytest.raises(TlaExportError, match="reserved"):
        identifier("CHOOSE", "x")


def test_free_text_becomes_safe_comment_lines():
    text = comment("ends a comment *) and opens one (* \n next line \u00e9" + " word" * 60)
    for line in text.splitlines():
        assert line.startswith("\\* ") and len(line) <= 116
        assert "*)" not in line and "(*" not in line and line.isascii()


def test_export_command_writes_the_module_and_a_model_per_bound(tmp_path, capsys):
    assert main(["export", "tla", "--out", str(tmp_path), "--bound", "default", "--bound", "pipeline2"]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "KVStateLifecycle.tla",
        "MC_default.cfg",
        "MC_default.tla",
        "MC_default_liveness.cfg",
        "MC_pipeline2.cfg",
        "MC_pipeline2.tla",
        "MC_pipeline2_liveness.cfg",
    ]
    assert (tmp_path / "KVStateLifecycle.tla").read_text() == MODULE
    assert "MC_default.cfg (symmetry over equal requests)" in capsys.readouterr().out


def test_export_command_refuses_an_unwritable_out(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["export", "tla", "--out", str(blocker)]) == 2
    assert "--out" in capsys.readouterr().err
