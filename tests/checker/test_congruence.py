"""The world fingerprint holds every field the scheduler or the policy reads: every field of a request is either read
into it or named as not read with a reason, and merged worlds behave alike (`congruence_mismatch`, a bisimulation
check one step at a time, over worlds told apart by every field of their requests). Planted omissions (a read taken
out of the fingerprint, a new field of a request) fail these checks. Plants are monkeypatches and subclasses, never
edits of library files."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import kvstate.checker.world as world_module
from kvstate.checker import Bound, select_bounds
from kvstate.checker.congruence import congruence_mismatch
from kvstate.checker.refinement import Refinement
from kvstate.request import Request

# two requests that preempt each other with two micro-batches in flight and a cap of one preemption: worlds that
# differ only in whether a request's cap is reached are reachable here
CAP = Bound.from_dict(
    {
        "requests": [[2, 2], [2, 2]],
        "gpu_blocks": 5,
        "host_blocks": 2,
        "block_size": 1,
        "chunk_size": 2,
        "pipeline_stages": 2,
        "micro_batches": 2,
        "max_preemptions": 1,
        "cancel": False,
        "env_cancels": 0,
        "abstract_model": False,
    },
    "cap_two_micro_batches",
)
CAP_READ = "preemptions up to the cap (A3)"


# ------------------------------------------------------------------------------------- every field classified
def test_every_request_field_is_read_into_the_fingerprint_or_said_not_read():
    assert world_module.unclassified_fields() == set()
    read = {name for fields, _ in world_module.REQUEST_READS.values() for name in fields}
    assert not read & world_module.REQUEST_FIELDS_NOT_READ.keys()
    assert all(reason.strip() for reason in world_module.REQUEST_FIELDS_NOT_READ.values())


def test_a_new_request_field_is_unclassified_until_said():
    @dataclass(eq=False, slots=True)
    class WithPriority(Request):
        priority: int = 0

    assert world_module.unclassified_fields(WithPriority) == {"priority"}


# ----------------------------------------------------------------------------------- merged worlds behave alike
@pytest.mark.parametrize(
    "name", ["preemption_cap", "gpu_only_ladder", "no_cancel", "pipeline2_no_cancel", "mb2_livelock", "late_copies"]
)
def test_worlds_the_fingerprint_merges_behave_alike(name):
    (bound,) = select_bounds([name])
    mismatch = congruence_mismatch(bound)
    assert mismatch is None, mismatch.describe()


def test_worlds_the_fingerprint_merges_behave_alike_under_a_cap_with_two_micro_batches():
    mismatch = congruence_mismatch(CAP)
    assert mismatch is None, mismatch.describe()


# ------------------------------------------------------------------------------------------ planted omissions
def test_a_fingerprint_without_the_preemption_count_merges_worlds_that_differ(monkeypatch):
    """Taken out of the fingerprint, the count the cap (A3) reads merges worlds: the search finds fewer of them,
    and two merged worlds behave differently."""
    full = Refinement(CAP).explore()
    monkeypatch.delitem(world_module.REQUEST_READS, CAP_READ)
    planted = Refinement(CAP).explore()
    assert planted.states < full.states
    mismatch = congruence_mismatch(CAP)
    assert mismatch is not None and mismatch.path
