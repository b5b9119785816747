"""Liveness as SPEC.md states it: weak fairness of every non-environment action, checked by a fair-cycle
search that finds lassos a weakly fair run really follows; the no-trap check named for what it computes; and what
`kvstate check` prints about it (information reads as information)."""

from __future__ import annotations

from types import SimpleNamespace

from kvstate.checker import Bound
from kvstate.checker.explore import explore, is_environment, weakly_fair_lasso
from kvstate.checker.model import AbstractModel
from kvstate.checker.records import Action
from kvstate.cli import main

X, Y, Z = (Action("event", 0, name) for name in ("x", "y", "z"))


def lasso(fair: list[list[tuple[int, Action]]], final: set[int] = frozenset()):
    """`weakly_fair_lasso` on a hand-made graph: state i is `i`, `fair[i]` its (successor, action) edges."""
    model = SimpleNamespace(is_final=lambda state: state in final)
    states = list(range(len(fair)))
    return weakly_fair_lasso(model, states, fair, lambda j: [(Action("arrive", 0, None), j)])  # type: ignore[arg-type]


def test_a_cycle_that_never_takes_an_action_enabled_all_along_is_not_fair():
    # 0 -y-> 1 -y-> 0, and x is enabled in both states (to the final state 2), never taken on the cycle
    assert lasso([[(1, Y), (2, X)], [(0, Y), (2, X)], []], final={2}) is None


def test_a_cycle_is_fair_once_the_action_enabled_all_along_is_taken_inside_it():
    # as above, but x also has an edge inside the cycle (1 -x-> 0)
    found = lasso([[(1, Y), (2, X)], [(0, Y), (0, X), (2, X)], []], final={2})
    assert found is not None and found.invariant == "LIVE-DONE"
    loop = found.path[found.loop_start :]
    assert {a for a, _ in loop} >= {X, Y}


def test_an_action_disabled_somewhere_on_the_cycle_does_not_have_to_be_taken():
    # x is enabled in state 0 only: a run through 0 and 1 forever is weakly fair without taking it
    found = lasso([[(1, Y), (2, X)], [(0, Z)], []], final={2})
    assert found is not None
    assert X not in {a for a, _ in found.path[found.loop_start :]}


def test_a_final_cycle_is_no_lasso():
    assert lasso([[(1, Y)], [(0, Y)]], final={0, 1}) is None


def continuously_enabled_are_taken(model: AbstractModel, found) -> None:
    """Independently of the search: on the loop of `found`, every non-environment action enabled in all of its
    states is one the loop takes (weak fairness of each action)."""
    environment = model.spec.environment_events
    loop = found.path[found.loop_start :]
    states = [found.path[found.loop_start - 1][1], *(s for _, s in loop)]
    enabled = [
        {Action(*e.action) for e in model.successors(state) if not is_environment(e.action, environment)}
        for state in states
    ]
    always = set.intersection(*enabled)
    taken = {Action(*a) for a, _ in loop}
    assert always <= taken, always - taken


def test_the_policy_free_model_has_a_weakly_fair_lasso_that_is_really_fair():
    """One request, GPU 5, host 2 (the bound on which TLC with per-action fairness found a lasso where `kvstate check`
    claimed LIVE-DONE "under strong fairness"): the model has a weakly fair run that never finishes, replaying and
    recompute-pausing forever. It is reported as information, and the bound holds."""
    bound = Bound(name="one", requests=((3, 2),), gpu_blocks=5, host_blocks=2, block_size=1, chunk_size=2)
    model = AbstractModel(bound, symmetry=False)
    result = explore(model)
    assert result.verdict == "holds" and result.violation is None
    found = result.fair_lasso
    assert found is not None and found.loop_start is not None
    assert {a.name for a, _ in found.path[found.loop_start :]} >= {"replay", "recompute_pause"}
    continuously_enabled_are_taken(model, found)


def test_no_output_calls_the_no_trap_check_strong_fairness(capsys, tmp_path):
    assert main(["check", "--bound", "no_host", "--counterexample-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "strong fairness" not in out.lower()
    assert "no trap" in out and "weak fairness alone admits a fair lasso" in out
    assert "liveness, scheduler refinement: LIVE-DONE" in out


def test_information_is_printed_as_information_and_the_lists_only_with_verbose(capsys, tmp_path):
    """Without --verbose no per-bound list of never-enabled transitions and no SCC count; with it,
    both, each saying it is information, and the weakly fair lasso's steps."""
    assert main(["check", "--bound", "no_host", "--counterexample-dir", str(tmp_path)]) == 0
    plain = capsys.readouterr().out
    assert "never enabled in this bound" not in plain and "non-trivial SCCs" not in plain
    assert main(["check", "--bound", "no_host", "--verbose", "--counterexample-dir", str(tmp_path)]) == 0
    verbose = capsys.readouterr().out
    assert "never enabled in this bound (information: other bounds may take them): suspended -offload-> suspended" in (
        verbose
    )
    assert "progress-free cycles (information:" in verbose and "non-trivial SCCs with an unfinished request" in verbose
    assert "the fair lasso: under weak fairness alone" in verbose and "-- the following steps repeat forever --" in (
        verbose
    )
