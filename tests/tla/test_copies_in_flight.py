"""The TLA+ export follows the abstract model: a copy in flight per request (a release leaves its
destinations fenced, `Complete(r)` ends its fences), a decode step landing on a suspended request, stop tokens. Both
engines count the same states on bounds that exercise each; a planted difference in the new release meaning is
caught by the comparison; a bound whose abstract model cuts chunks (a token budget per pass) is refused, naming the
feature. Tests that run TLC skip without Java and tla2tools.jar (the `tlc_tools` fixture)."""

from __future__ import annotations

import pytest

from kvstate.checker import HOLDS, AbstractModel
from kvstate.checker.bounds import Bound
from kvstate.checker.explore import explore
from kvstate.semantics import TLA
from kvstate.spec import load_spec
from kvstate.tla.crosscheck import Options, cross_check
from kvstate.tla.models import model_files
from kvstate.tla.names import TlaExportError

# two requests that suspend, resume and are cancelled while a copy of theirs is in flight
COPIES = Bound("copies", ((2, 2), (2, 2)), gpu_blocks=4, host_blocks=2, block_size=1, chunk_size=2)
# two stages, a host tier that takes a decoding request: a decode step lands on a suspended request
LANDING = Bound("landing", ((1, 2), (2, 2)), gpu_blocks=4, host_blocks=3, block_size=1, chunk_size=2, pipeline_stages=2)
# stop tokens: any produced token may end its request
STOPS = Bound("stops", ((2, 3), (1, 2)), gpu_blocks=5, host_blocks=0, block_size=1, chunk_size=2, stop_at=(1, -1))

# the release before copies in flight were modelled: every block freed at once, the destinations
# a copy in flight still writes included
OLD_RELEASE = (
    "[request |-> [request EXCEPT !.gpu = 0, !.host = 0, !.in_flight = 0],"
    " pool |-> [pool EXCEPT !.gpu_free = @ + request.gpu, !.host_free = @ + request.host]]"
)


# ReleaseBlocks with the copy's direction taken from the tiers the request holds, not from its fences
RELEASE_BY_TIER = r"""LET incoming_gpu == IF q.gpu > 0 THEN q.incoming ELSE 0
        incoming_host == q.incoming - incoming_gpu
    IN  [request |-> [q EXCEPT !.gpu = 0, !.host = 0, !.incoming = 0,
                               !.fenced_gpu = @ + incoming_gpu, !.fenced_host = @ + incoming_host],
         pool |-> [c EXCEPT !.gpu_free = @ + q.gpu - incoming_gpu, !.host_free = @ + q.host - incoming_host,
                            !.gpu_fenced = @ + incoming_gpu, !.host_fenced = @ + incoming_host]]"""


def explored(bound: Bound):
    result = explore(AbstractModel(bound, load_spec(), symmetry=False), keep_states=True)
    assert result.verdict == HOLDS and result.reachable is not None
    return result


def test_the_bounds_exercise_what_they_are_named_for():
    spec = load_spec()
    offloaded, terminal = spec.role("offloaded"), set(spec.terminal_states)
    copies, landing = explored(COPIES).reachable, explored(LANDING).reachable
    assert any(r.state in terminal and r.fenced_gpu + r.fenced_host > 0 for s in copies for r in s.requests)
    # lazy suspension: a suspended request split across both tiers while an offload is in flight, and a release of
    # one that leaves the offload's host destinations fenced
    assert any(r.state == offloaded and r.gpu and r.host and r.incoming for s in copies for r in s.requests)
    assert any(r.state in terminal and r.fenced_host for s in copies for r in s.requests)
    assert any(r.state == offloaded and r.in_flight for s in landing for r in s.requests)
    # a step landing in held GPU blocks, and one landing in the host tier when every block was offloaded
    assert any(r.state == offloaded and r.in_flight and r.gpu for s in landing for r in s.requests)
    assert any(r.state == offloaded and r.in_flight and not r.gpu and r.host for s in landing for r in s.requests)
    without_stops = Bound("no_stops", STOPS.requests, gpu_blocks=5, host_blocks=0, block_size=1, chunk_size=2)
    assert explored(STOPS).edges > explored(without_stops).edges  # a stop token is a step of its own


@pytest.mark.parametrize("bound", [COPIES, LANDING, STOPS], ids=lambda b: b.name)
@pytest.mark.parametrize("symmetry", [True, False], ids=["symmetry", "no symmetry"])
def test_both_engines_count_the_same_states_with_copies_in_flight_landings_and_stop_tokens(tlc_tools, bound, symmetry):
    code, (c,) = cross_check([bound], load_spec(), Options(symmetry=symmetry), tools=tlc_tools, say=lambda _: None)
    assert code == 0 and c.mismatches == [], c.mismatches
    assert c.ours.verdict == c.tlc.verdict == HOLDS and (c.ours.states, c.ours.depth) == (c.tlc.states, c.tlc.depth)


def test_the_release_before_issue_25_as_a_tla_meaning_is_a_difference_the_comparison_catches(tlc_tools, capsys):
    differs = {**TLA, "release_kv_and_terminate": TLA["release_kv_and_terminate"]._replace(body=OLD_RELEASE)}
    code, (c,) = cross_check([COPIES], load_spec(), Options(meanings=differs), tools=tlc_tools)
    out = capsys.readouterr().out
    assert code == 1 and c.mismatches, out
    assert "the engines disagree on 1 bound(s) (exit 1)" in out


def test_a_release_that_takes_its_copys_direction_from_the_tiers_held_is_a_difference_the_comparison_catches(
    tlc_tools, capsys
):
    """A suspended request may hold blocks in both tiers with an offload in flight: a release whose TLA+ meaning
    takes the destinations for GPU blocks whenever it holds GPU blocks (its direction before lazy suspension) differs
    from our checker's, which reads the copy's own fences."""
    release = TLA["release_kv_and_terminate"]
    by_tier = release.body.replace("ReleaseBlocks(request, pool)", "ReleaseByTier(request, pool)")
    assert by_tier != release.body
    differs = {
        "ReleaseByTier": release._replace(params=("q", "c"), body=RELEASE_BY_TIER),
        **TLA,
        "release_kv_and_terminate": release._replace(body=by_tier),
    }
    code, (c,) = cross_check([COPIES], load_spec(), Options(meanings=differs), tools=tlc_tools)
    out = capsys.readouterr().out
    assert code == 1 and c.mismatches and c.ours.states != c.tlc.states, out


def test_a_bound_whose_abstract_model_cuts_chunks_is_refused_naming_the_feature(tlc_tools, capsys):
    cut = Bound("cut", ((3, 1),), gpu_blocks=4, chunk_size=2, max_num_tokens=4)
    with pytest.raises(TlaExportError, match=r"bound cut: its token budget per pass \(max_num_tokens = 4\) cuts"):
        model_files(cut, load_spec())
    code, comparisons = cross_check([cut, COPIES], load_spec(), tools=tlc_tools)
    assert code == 0 and [c.bound.name for c in comparisons] == ["copies"]
    assert "the TLA+ export does not express chunk cuts" in capsys.readouterr().out
