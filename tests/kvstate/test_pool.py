"""The tiered block pool: allocation, conservation, ownership, held blocks and their offload, all-or-nothing
migration, fences, invariant checks.

Every scenario uses a pool small enough that the behaviour under test is forced; expectations are computed from
the pool's own tables (`usage()`, `gpu_blocks()`, `host_blocks()`), not from private counters.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate.errors import InvariantViolation, PoolError
from kvstate.pool import TO_GPU, TO_HOST, MigrationPlan, TieredBlockPool, ceil_div


def snapshot(pool: TieredBlockPool, *owners: object) -> tuple:
    """Everything observable about a pool: usage, in-flight plans and each owner's block tables."""
    return (
        pool.usage(),
        dict(pool.in_flight),
        {o: (pool.gpu_blocks(o), pool.host_blocks(o)) for o in owners},
        pool.gpu_free_blocks,
        pool.host_free_blocks,
    )


def assert_conserved(pool: TieredBlockPool) -> None:
    """CONS-GPU / CONS-HOST seen through `usage()`, and the pool's own check agrees."""
    u = pool.usage()
    assert u["gpu_free"] + u["gpu_owned"] + u["gpu_fenced"] == u["gpu_capacity"]
    assert u["host_free"] + u["host_owned"] + u["host_fenced"] == u["host_capacity"]
    assert u["gpu_held"] <= u["gpu_owned"]
    pool.check_invariants()


def suspend(pool: TieredBlockPool, owner: object) -> MigrationPlan:
    """Hold `owner`'s GPU blocks and offload every one of them (the eager schedule of a suspension)."""
    pool.hold(owner)
    return pool.offload(owner, len(pool.gpu_blocks(owner)))


def resume(pool: TieredBlockPool, owner: object) -> MigrationPlan:
    plan = pool.onboard(owner)
    assert plan is not None
    return plan


# ------------------------------------------------------------------------------------------- allocation


def test_allocation_prefers_consecutive_low_ids() -> None:
    pool = TieredBlockPool(gpu_blocks=8)
    assert pool.allocate("a", 3) == [0, 1, 2]
    assert pool.allocate("b", 2) == [3, 4]
    pool.release("a")
    # the lowest free ids come back first, and they are consecutive
    assert pool.allocate("c", 2) == [0, 1]
    assert pool.allocate("d", 2) == [2, 5]
    assert pool.gpu_blocks("c") == (0, 1)


_POOL_OPS = st.lists(
    st.tuples(
        st.sampled_from(["allocate", "one_each", "release", "hold", "offload", "onboard", "complete"]),
        st.integers(0, 3),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ops=_POOL_OPS)
def test_every_allocation_takes_the_lowest_free_blocks(ops: list[tuple[str, int]]) -> None:
    """Whatever allocations, releases, holds, offloads, onboards and completed copies came before, every block a
    tier hands out is its lowest free one at that moment (read from `free_blocks()` just before), and the free
    blocks, their count and the conservation check stay in agreement."""
    pool = TieredBlockPool(gpu_blocks=12, host_blocks=6)
    owners = ["a", "b", "c", "d"]
    for op, which in ops:
        owner = owners[which]
        gpu_free, host_free = pool.gpu.free_blocks(), pool.host.free_blocks()
        if op == "allocate" and pool.can_allocate(which + 1):
            assert pool.allocate(owner, which + 1) == list(gpu_free[: which + 1])
        elif op == "one_each" and pool.can_allocate(which + 1):
            pool.allocate_one_each(owners[: which + 1])
            assert [pool.gpu_blocks(o)[-1] for o in owners[: which + 1]] == list(gpu_free[: which + 1])
        elif op == "release":
            pool.release(owner)
        elif op == "hold":
            pool.hold(owner)
        elif op == "offload" and pool.can_offload(owner, 1 + which % 2):
            plan = pool.offload(owner, 1 + which % 2)
            assert [dst for _, dst in plan.pairs] == list(host_free[: plan.num_blocks])
        elif op == "onboard" and pool.is_held(owner) and pool.host_blocks(owner) and pool.can_onboard(owner):
            plan = resume(pool, owner)
            assert [dst for _, dst in plan.pairs] == list(gpu_free[: plan.num_blocks])
        elif op == "complete" and pool.in_flight:
            pool.complete(next(iter(pool.in_flight.values())))
        assert len(pool.gpu.free_blocks()) == pool.gpu_free_blocks
        assert len(pool.host.free_blocks()) == pool.host_free_blocks
        assert_conserved(pool)


def test_alloc_and_release_conserve_blocks_and_keep_ownership_exclusive() -> None:
    pool = TieredBlockPool(gpu_blocks=6, host_blocks=4)
    a = pool.allocate("a", 2)
    b = pool.allocate("b", 3)
    assert_conserved(pool)
    assert pool.usage()["gpu_owned"] == 5 and pool.gpu_free_blocks == 1
    assert set(a).isdisjoint(b)
    assert pool.gpu_blocks("a") == tuple(a) and pool.gpu_blocks("b") == tuple(b)
    more = pool.allocate("a", 1)  # appends to a's table
    assert pool.gpu_blocks("a") == tuple(a + more)
    assert pool.release("a") == 3
    assert pool.gpu_blocks("a") == () and pool.gpu_free_blocks == 3
    assert_conserved(pool)
    assert pool.release("a") == 0  # releasing an owner with nothing is a no-op
    assert_conserved(pool)


def test_allocate_more_than_free_is_refused_and_changes_nothing() -> None:
    pool = TieredBlockPool(gpu_blocks=3)
    pool.allocate("a", 2)
    before = snapshot(pool, "a", "b")
    assert not pool.can_allocate(2)
    with pytest.raises(PoolError, match="1 free blocks"):
        pool.allocate("b", 2)
    assert snapshot(pool, "a", "b") == before


# --------------------------------------------------------------------------------- several at once


def test_one_block_each_is_what_allocating_one_block_to_each_in_turn_gives() -> None:
    def fragmented() -> TieredBlockPool:  # free ids out of order, and owners that already hold blocks
        pool = TieredBlockPool(gpu_blocks=10)
        for owner, count in (("a", 2), ("x", 3), ("b", 1), ("y", 2)):
            pool.allocate(owner, count)
        pool.release("x")
        return pool

    one_by_one, at_once = fragmented(), fragmented()
    owners = ["b", "c", "a", "y"]
    for owner in owners:
        one_by_one.allocate(owner, 1)
    at_once.allocate_one_each(owners)
    assert snapshot(at_once, "a", "b", "c", "y") == snapshot(one_by_one, "a", "b", "c", "y")
    assert_conserved(at_once)


def test_one_block_each_beyond_the_free_blocks_is_refused_and_changes_nothing() -> None:
    pool = TieredBlockPool(gpu_blocks=3)
    pool.allocate("a", 1)
    before = snapshot(pool, "a", "b", "c")
    with pytest.raises(PoolError, match="2 free blocks, 3 owners asked for one each"):
        pool.allocate_one_each(["a", "b", "c"])
    assert snapshot(pool, "a", "b", "c") == before
    assert_conserved(pool)


def test_an_offload_beyond_the_host_room_is_atomic() -> None:
    pool = TieredBlockPool(gpu_blocks=8, host_blocks=2)
    pool.allocate("a", 3)
    pool.hold("a")
    before = snapshot(pool, "a")
    assert not pool.can_offload("a", 3)
    with pytest.raises(PoolError, match="the host tier has 2 free of 2"):
        pool.offload("a", 3)
    assert snapshot(pool, "a") == before  # no block moved, nothing fenced, no plan in flight
    assert pool.is_held("a")
    # the next plan id was not consumed by the refusal: a successful offload still gets the first id
    assert pool.offload("a", 2).plan_id == 0


def test_holding_copies_nothing_and_without_a_host_tier_held_blocks_cannot_move() -> None:
    pool = TieredBlockPool(gpu_blocks=4, host_blocks=0)
    pool.allocate("a", 1)
    assert not pool.has_host_tier
    pool.hold("a")
    assert pool.is_held("a") and pool.gpu_held_blocks == 1 and not pool.in_flight
    before = snapshot(pool, "a")
    assert not pool.can_offload("a", 1)
    with pytest.raises(PoolError):
        pool.offload("a", 1)
    assert snapshot(pool, "a") == before


def test_an_offload_fences_its_gpu_sources_until_complete() -> None:
    pool = TieredBlockPool(gpu_blocks=4, host_blocks=4)
    sources = pool.allocate("a", 2)
    pool.allocate("b", 1)
    plan = suspend(pool, "a")
    assert plan.direction == TO_HOST and plan.request_id == "a"
    assert [s for s, _ in plan.pairs] == sources
    assert pool.gpu_blocks("a") == () and pool.host_blocks("a") == tuple(d for _, d in plan.pairs)
    assert pool.usage()["gpu_fenced"] == 2 and not pool.is_held("a")  # nothing of it is left on the GPU
    assert_conserved(pool)
    # the fenced sources are not allocatable: only the one never-used block is free
    assert pool.gpu_free_blocks == 1 and not pool.can_allocate(2)
    got = pool.allocate("c", 1)
    assert set(got).isdisjoint(sources)
    pool.complete(plan)
    assert pool.usage()["gpu_fenced"] == 0 and pool.gpu_free_blocks == 2
    assert sorted(pool.allocate("d", 2)) == sorted(sources)
    assert_conserved(pool)


def test_a_partial_offload_moves_the_first_blocks_of_the_table_and_keeps_the_rest_held() -> None:
    pool = TieredBlockPool(gpu_blocks=6, host_blocks=4)
    table = pool.allocate("a", 4)
    pool.hold("a")
    plan = pool.offload("a", 1)
    assert [s for s, _ in plan.pairs] == table[:1]
    assert pool.gpu_blocks("a") == tuple(table[1:]) and len(pool.host_blocks("a")) == 1
    assert pool.is_held("a") and pool.gpu_held_blocks == 3
    assert not pool.can_offload("a", 1)  # one copy of it at a time
    pool.complete(plan)
    second = pool.offload("a", 2)
    assert [s for s, _ in second.pairs] == table[1:3]
    assert [d for _, d in plan.pairs + second.pairs] == list(pool.host_blocks("a"))  # host blocks keep table order
    assert_conserved(pool)


def test_held_owners_are_offloaded_least_recently_held_first() -> None:
    pool = TieredBlockPool(gpu_blocks=6, host_blocks=6)
    for owner in ("a", "b", "c"):
        pool.allocate(owner, 2)
    pool.hold("b")
    pool.hold("a")
    assert pool.held_owners() == ["b", "a"]  # the order they were held in, not the order they were allocated in
    pool.complete(pool.offload("b", 2))
    assert pool.held_owners() == ["a"]  # b has no GPU block left
    pool.release("a")
    assert pool.held_owners() == [] and pool.gpu_held_blocks == 0
    assert_conserved(pool)


def test_an_onboard_locks_gpu_blocks_again_without_a_copy() -> None:
    pool = TieredBlockPool(gpu_blocks=4, host_blocks=4)
    table = pool.allocate("a", 3)
    pool.hold("a")
    assert pool.onboard("a") is None  # nothing was offloaded: no copy
    assert pool.gpu_blocks("a") == tuple(table) and not pool.is_held("a") and not pool.in_flight
    assert_conserved(pool)


def test_an_onboard_copies_only_host_blocks_and_places_them_first() -> None:
    """The offloaded prefix comes back before the blocks that stayed on the GPU: the table keeps its order."""
    pool = TieredBlockPool(gpu_blocks=6, host_blocks=4)
    table = pool.allocate("a", 3)
    pool.hold("a")
    pool.complete(pool.offload("a", 2))
    host_sources = list(pool.host_blocks("a"))
    plan = resume(pool, "a")
    assert plan.direction == TO_GPU and [s for s, _ in plan.pairs] == host_sources and plan.num_blocks == 2
    assert pool.gpu_blocks("a") == (*[d for _, d in plan.pairs], table[2])
    assert pool.host_blocks("a") == () and pool.usage()["host_fenced"] == 2 and not pool.is_held("a")
    assert_conserved(pool)


def test_resume_fences_host_sources_until_complete() -> None:
    pool = TieredBlockPool(gpu_blocks=4, host_blocks=3)
    pool.allocate("a", 2)
    pool.complete(suspend(pool, "a"))
    host_sources = list(pool.host_blocks("a"))
    assert pool.can_onboard("a")
    plan = resume(pool, "a")
    assert plan.direction == TO_GPU and [s for s, _ in plan.pairs] == host_sources
    assert pool.host_blocks("a") == () and len(pool.gpu_blocks("a")) == 2
    assert pool.usage()["host_fenced"] == 2 and pool.host_free_blocks == 1
    assert_conserved(pool)
    # while the copy back is in flight, another request cannot take the fenced host blocks
    pool.allocate("b", 1)
    plan_b = suspend(pool, "b")
    assert {d for _, d in plan_b.pairs}.isdisjoint(host_sources)
    pool.complete(plan)
    assert pool.usage()["host_fenced"] == 0 and pool.host_free_blocks == 2
    assert_conserved(pool)


def test_resume_is_atomic_when_the_gpu_tier_is_too_small() -> None:
    pool = TieredBlockPool(gpu_blocks=3, host_blocks=3)
    pool.allocate("a", 2)
    pool.complete(suspend(pool, "a"))
    pool.allocate("b", 2)
    before = snapshot(pool, "a", "b")
    assert not pool.can_onboard("a")
    with pytest.raises(PoolError, match="wait for GPU room"):
        pool.onboard("a")
    assert snapshot(pool, "a", "b") == before


# ------------------------------------------------------------------------------------------ plan shape


def test_runs_merge_pairs_consecutive_on_both_sides() -> None:
    plan = MigrationPlan(0, "r", TO_HOST, ((0, 5), (1, 6), (2, 7), (4, 8), (5, 9), (6, 3), (8, 4)))
    assert plan.runs() == ((0, 5, 3), (4, 8, 2), (6, 3, 1), (8, 4, 1))
    assert sum(n for _, _, n in plan.runs()) == plan.num_blocks
    assert MigrationPlan(1, "r", TO_GPU, ()).runs() == ()


def test_an_offload_of_consecutive_blocks_is_one_run() -> None:
    pool = TieredBlockPool(gpu_blocks=8, host_blocks=8)
    pool.allocate("a", 5)
    plan = suspend(pool, "a")
    assert plan.runs() == ((0, 0, 5),)


def test_completing_a_plan_twice_is_an_error() -> None:
    pool = TieredBlockPool(gpu_blocks=4, host_blocks=4)
    pool.allocate("a", 2)
    plan = suspend(pool, "a")
    pool.complete(plan)
    before = snapshot(pool, "a")
    with pytest.raises(PoolError, match="exactly once"):
        pool.complete(plan)
    assert snapshot(pool, "a") == before
    assert_conserved(pool)


# ------------------------------------------------------------------------------------------- host tier


def test_set_host_capacity_refused_while_host_blocks_are_held() -> None:
    pool = TieredBlockPool(gpu_blocks=4, host_blocks=4)
    pool.allocate("a", 2)
    pool.complete(suspend(pool, "a"))
    before = snapshot(pool, "a")
    with pytest.raises(PoolError, match="holds 2 blocks"):
        pool.set_host_capacity(0)
    assert snapshot(pool, "a") == before and pool.has_host_tier


def test_set_host_capacity_refused_while_host_blocks_are_fenced() -> None:
    pool = TieredBlockPool(gpu_blocks=4, host_blocks=4)
    pool.allocate("a", 2)
    pool.complete(suspend(pool, "a"))
    resume(pool, "a")  # host sources fenced, nothing owned
    assert pool.usage()["host_owned"] == 0 and pool.usage()["host_fenced"] == 2
    with pytest.raises(PoolError, match="fences 2"):
        pool.set_host_capacity(8)
    assert pool.host.capacity == 4


def test_set_host_capacity_attaches_and_detaches_an_empty_host_tier() -> None:
    pool = TieredBlockPool(gpu_blocks=4, host_blocks=0)
    pool.set_host_capacity(3)
    assert pool.has_host_tier and pool.host_free_blocks == 3
    pool.set_host_capacity(0)
    assert not pool.has_host_tier
    assert_conserved(pool)


# ------------------------------------------------------------------------------------------ invariants


def test_check_invariants_detects_a_block_listed_by_two_owners() -> None:
    pool = TieredBlockPool(gpu_blocks=4)
    a = pool.allocate("a", 2)
    pool.allocate("b", 1)
    pool.check_invariants()
    pool.gpu.blocks_of["b"] += (a[0],)  # corrupt: block a[0] now listed by a and by b
    with pytest.raises(InvariantViolation) as info:
        pool.check_invariants()
    assert info.value.invariant_id == "OWN-EXCL"


def test_check_invariants_detects_a_held_block_on_the_free_list() -> None:
    pool = TieredBlockPool(gpu_blocks=4)
    a = pool.allocate("a", 2)
    pool.gpu.give_back([a[0]])  # corrupt: a held block is also free
    with pytest.raises(InvariantViolation) as info:
        pool.check_invariants()
    assert info.value.invariant_id == "CONS-GPU"  # free + held + fenced exceeds capacity


def test_check_invariants_detects_a_block_freed_twice() -> None:
    pool = TieredBlockPool(gpu_blocks=4)
    pool.allocate("a", 1)
    pool.gpu.give_back([3])  # corrupt: a free block is given back again (counted free twice)
    with pytest.raises(InvariantViolation, match="on the free list twice") as info:
        pool.check_invariants()
    assert info.value.invariant_id == "CONS-GPU"


def test_check_invariants_detects_a_lost_host_block() -> None:
    pool = TieredBlockPool(gpu_blocks=4, host_blocks=4)
    pool.allocate("a", 2)
    pool.complete(suspend(pool, "a"))
    pool.host._free.pop()  # corrupt: a free host block vanished
    with pytest.raises(InvariantViolation) as info:
        pool.check_invariants()
    assert info.value.invariant_id == "CONS-HOST"


def test_check_invariants_detects_a_fence_of_a_finished_plan() -> None:
    pool = TieredBlockPool(gpu_blocks=4, host_blocks=4)
    pool.allocate("a", 2)
    plan = suspend(pool, "a")
    pool.in_flight.pop(plan.plan_id)  # corrupt: the plan is gone but its sources stay fenced
    with pytest.raises(InvariantViolation) as info:
        pool.check_invariants()
    assert info.value.invariant_id == "FENCE"


def test_check_invariants_detects_owner_tables_naming_different_owners() -> None:
    pool = TieredBlockPool(gpu_blocks=4)
    a = pool.allocate("a", 1)
    pool.allocate("b", 1)
    pool.gpu.owner_of[a[0]] = "b"  # corrupt: blocks_of says a owns it, owner_of says b
    with pytest.raises(InvariantViolation) as info:
        pool.check_invariants()
    assert info.value.invariant_id == "OWN-EXCL"


# ------------------------------------------------------------------------------- release during a copy (FENCE)


@pytest.mark.parametrize("direction", [TO_HOST, TO_GPU])
def test_release_during_an_in_flight_copy_keeps_its_destinations_fenced_until_complete(direction) -> None:
    """A request released (cancelled, paused) while its offload or resume copy is in flight: the copy still writes
    its destination blocks, so they stay fenced by that plan and nobody can take them until `complete` (FENCE)."""
    pool = TieredBlockPool(gpu_blocks=4, host_blocks=4)
    pool.allocate("a", 2)
    if direction == TO_HOST:
        plan = suspend(pool, "a")
    else:
        pool.complete(suspend(pool, "a"))
        plan = resume(pool, "a")
    dest = pool.host if direction == TO_HOST else pool.gpu
    destinations = [d for _, d in plan.pairs]
    free_before = dest.num_free
    assert pool.release("a") == 0  # nothing is free yet: sources and destinations are fenced by the copy
    assert pool.gpu_blocks("a") == () and pool.host_blocks("a") == ()
    assert sorted(dest.fenced_by(plan.plan_id)) == sorted(destinations)
    assert dest.num_free == free_before
    assert_conserved(pool)
    # another request cannot be given a block the copy still writes
    taken = dest.take("b", dest.num_free)
    assert set(taken).isdisjoint(destinations)
    dest.release("b")
    pool.complete(plan)
    assert pool.usage()["gpu_fenced"] == pool.usage()["host_fenced"] == 0
    assert pool.gpu_free_blocks == 4 and pool.host_free_blocks == 4
    assert_conserved(pool)


# ------------------------------------------------------------------------------- block tables are values


def test_a_block_table_read_earlier_is_not_changed_by_later_allocations_or_release() -> None:
    """Tables are immutable tuples replaced on change (no copy per read): what a caller holds stays as it was."""
    pool = TieredBlockPool(gpu_blocks=6)
    pool.allocate("a", 2)
    before = pool.gpu_blocks("a")
    view = pool.gpu_block_tables()
    pool.allocate("a", 1)
    assert len(before) == 2 and len(pool.gpu_blocks("a")) == 3 and pool.gpu_blocks("a")[:2] == before
    assert view["a"] == pool.gpu_blocks("a")  # the view follows the pool
    pool.release("a")
    assert len(before) == 2 and "a" not in view and pool.gpu_blocks("a") == ()
    with pytest.raises(TypeError):
        view["a"] = (0,)  # read-only
    pool.check_invariants()


def test_the_block_table_lookup_follows_the_pool_and_answers_none_for_an_owner_without_blocks() -> None:
    pool = TieredBlockPool(gpu_blocks=6)
    table_of = pool.gpu_block_table_of()
    assert table_of("a") is None
    pool.allocate("a", 2)
    assert table_of("a") == pool.gpu_blocks("a") == pool.gpu_block_tables()["a"]
    pool.release("a")
    assert table_of("a") is None


@pytest.mark.parametrize("numerator", range(40))
@pytest.mark.parametrize("denominator", [1, 2, 3, 16])
def test_ceil_div_is_the_smallest_count_that_covers(numerator: int, denominator: int) -> None:
    blocks = ceil_div(numerator, denominator)
    assert (blocks * denominator >= numerator and (blocks - 1) * denominator < numerator) or numerator == blocks == 0
