"""The scheduler against the spec's preemption design and its pass-scope invariants.

Scenarios use block_size 1 (blocks = tokens) and pools a few blocks wide so that each behaviour is forced in a
known pass. Steps are driven by `SimExecutor` (which also checks every invariant after every step) or, where a
pass must be inspected between planning and completion, by `schedule()`/`complete_step()` directly. Before the
pass under test each scenario asserts its preconditions, so a change in earlier passes fails loudly instead of
making the test vacuous.
"""

from __future__ import annotations

import random
import tomllib

import pytest

from kvstate.config import RequestRejected, SchedulerConfig
from kvstate.errors import IllegalTransition, KVStateError, PoolError
from kvstate.output import SchedulerOutput
from kvstate.policy import Wait
from kvstate.request import Request
from kvstate.scheduler import Scheduler, SchedulerStalled, UnknownRequestId
from kvstate.sim import SimExecutor, reference_output
from kvstate.spec import packaged_spec_path, parse_spec

# ---------------------------------------------------------------------------------------------- helpers


def make(gpu_blocks: int, host_blocks: int = 0, block_size: int = 1, **kw) -> Scheduler:
    return Scheduler(SchedulerConfig(gpu_blocks=gpu_blocks, host_blocks=host_blocks, block_size=block_size, **kw))


def ids(requests: list[Request]) -> list:
    return [r.request_id for r in requests]


def listed(out: SchedulerOutput) -> set:
    return {r.request_id for _, rs in out.lists() for r in rs}


def reference(request: Request) -> list[int]:
    return reference_output(request.prompt, request.max_new_tokens, sorted(request.stop_token_ids))


def run_and_check(ex: SimExecutor, max_iterations: int = 5_000) -> None:
    """Run to the end; every request finished with exactly its solo, unlimited-memory output (OUT-EQUIV)."""
    ex.run(max_iterations)
    sched = ex.scheduler
    assert not sched.has_unfinished, f"unfinished: {[(r.request_id, r.state) for r in sched.requests.values()]}"
    for rid, request in sched.finished.items():
        if request.done_reason == "finished":
            assert request.generated == reference(request), f"request {rid!r} output differs from its reference"


def three_prefills(host_blocks: int, pipeline_stages: int = 1) -> tuple[Scheduler, SimExecutor]:
    """GPU 15 blocks, chunks of 6, 14 tokens per pass. Pass 1 admits p (6 of 13 prompt tokens), x (6 of 8) and
    y (2 of 5): 1 block left, all three still prefilling. In pass 2, p needs 6 more blocks: the tail victims are
    y (2 blocks, 2 computed tokens), then x (6 blocks, 6 computed tokens)."""
    sched = make(15, host_blocks, prefill_chunk_size=6, max_num_tokens=14, pipeline_stages=pipeline_stages)
    sched.submit(list(range(1, 14)), 1, request_id="p")
    sched.submit(list(range(21, 29)), 2, request_id="x")
    sched.submit([31, 32, 33, 34, 35], 2, request_id="y")
    ex = SimExecutor(sched)
    out = ex.step()
    assert ids(out.context) == ["p", "x", "y"] and sched.pool.gpu_free_blocks == 1
    assert all(r.is_prefilling for r in sched.requests.values())
    return sched, ex


def two_decoders(pipeline_stages: int = 1, b_stop: tuple[int, ...] = ()) -> tuple[Scheduler, SimExecutor]:
    """GPU 6 blocks. Pass 1 prefills a and b (3 tokens each): no block left, each has generated one token. In pass
    2, a needs a block for its next decode: the tail victim is b (budget left 2)."""
    sched = make(6, pipeline_stages=pipeline_stages)
    sched.submit([1, 2, 3], 3, request_id="a")
    sched.submit([21, 22, 23], 3, stop_token_ids=b_stop, request_id="b")
    ex = SimExecutor(sched)
    ex.step()
    assert sched.pool.gpu_free_blocks == 0 and [len(r.generated) for r in sched.requests.values()] == [1, 1]
    return sched, ex


def pressured_workload(sched: Scheduler, seed: int, n: int = 8) -> None:
    """n requests, each fitting the GPU tier alone, together far larger than it."""
    rng = random.Random(seed)
    capacity = sched.config.gpu_token_capacity
    for i in range(n):
        p = rng.randint(1, max(1, capacity // 3))
        m = rng.randint(2, max(2, capacity - p))
        sched.submit([rng.randrange(1000) for _ in range(p)], m, request_id=f"r{i}")


# -------------------------------------------------------------------------------- promotion gate (§1.3)


def test_promotion_with_host_tier_recompute_pauses_a_request_suspended_earlier_in_the_pass() -> None:
    sched, ex = three_prefills(host_blocks=6)
    x, y = sched.get("x"), sched.get("y")
    # y fits the host tier, x alone fits it, both together do not; y's KV is worth less than x's
    assert sched.pool.host_free_blocks == 6 and y.num_gpu_blocks + x.num_gpu_blocks > 6 >= x.num_gpu_blocks
    assert y.num_computed_tokens < x.num_computed_tokens
    out = ex.step()
    # y was suspended first (tail); x did not fit the host beside it, so y was promoted to make room
    assert ids(out.suspended) == ["x"] and ids(out.recompute_paused) == ["y"]
    assert y.state == "recompute_paused" and y.num_suspensions == 1 and y.num_recompute_pauses == 1
    # x's blocks are held: only the 3 that p's chunk needs beyond the free blocks are offloaded (on demand)
    assert x.state == "suspended" and (x.num_gpu_blocks, x.num_host_blocks) == (3, 3)
    assert [p.request_id for p in out.migrations] == ["x"]  # y's abandoned copy is not issued
    assert sched.pool.host_blocks("y") == () and sched.pool.gpu_blocks("y") == ()
    assert y.num_computed_tokens == 0 and y.prefill_tokens == y.prompt  # fully reset
    run_and_check(ex)


def test_without_host_tier_every_eviction_is_a_recompute_pause() -> None:
    sched, ex = three_prefills(host_blocks=0)
    out = ex.step()
    assert out.suspended == [] and out.migrations == []
    assert ids(out.recompute_paused) == ["y", "x"]
    assert sched.get("p") in out.context  # the freed room is usable at once: nothing is fenced
    run_and_check(ex)
    assert all(r.num_suspensions == 0 for r in sched.finished.values())


# --------------------------------------------------------------------------------------- victims (§1.4)


def test_victims_are_taken_most_recently_admitted_first() -> None:
    sched, ex = three_prefills(host_blocks=0)
    x, y = sched.get("x"), sched.get("y")
    assert y.admission > x.admission
    out = ex.step()
    assert out.recompute_paused == [y, x]


def test_decoding_victim_is_the_tail_not_the_requester() -> None:
    sched, ex = two_decoders()
    a, b = sched.get("a"), sched.get("b")
    assert b.admission > a.admission
    out = ex.step()
    assert out.recompute_paused == [b] and a in out.generation
    run_and_check(ex)


def test_tail_first_follows_admission_order_not_arrival_order() -> None:
    sched = make(9, 7, prefill_chunk_size=1)
    for rid, prompt, m in [
        ("b", [49, 27, 3, 17], 5),
        ("c", [26, 20, 31, 23], 5),
        ("a", [33, 9], 3),
        ("d", [49, 7], 5),
        ("e", [35, 46, 39], 2),
    ]:
        sched.submit(prompt, m, request_id=rid)
    ex = SimExecutor(sched)
    for _ in range(4):
        ex.step()
    # b was suspended and resumed after d was admitted: admission order a, d, b; arrival order b, a, d
    assert ids(sched.admitted) == ["a", "d", "b"]
    assert sched.get("d").arrival > sched.get("b").arrival
    assert sched.pool.gpu_free_blocks == 0 and not sched.get("d").about_to_finish  # d is an eligible victim too
    out = ex.step()
    assert ids(out.suspended + out.recompute_paused) == ["b"]  # the last admitted, although d arrived later
    assert sched.get("d").state == "running"


def test_no_request_is_chosen_as_a_victim_twice_in_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    multi_victim_passes = 0
    for seed in range(6):
        sched = make(12, host_blocks=6 if seed % 2 else 0)
        pressured_workload(sched, seed)
        chosen: list[int] = []
        original = sched._preempt

        def record(victim, step, _original=original, _chosen=chosen):
            _chosen.append(id(victim))
            return _original(victim, step)

        monkeypatch.setattr(sched, "_preempt", record)
        ex = SimExecutor(sched)
        while sched.has_unfinished:
            chosen.clear()
            out = ex.step()
            assert len(chosen) == len(set(chosen)), f"seed {seed}, iteration {sched.iteration}: a victim chosen twice"
            victims = ids(out.suspended + out.recompute_paused)
            assert len(victims) == len(set(victims))
            multi_victim_passes += len(chosen) > 1
    assert multi_victim_passes > 0  # the property was exercised


def test_a_request_that_cannot_be_moved_is_no_victim() -> None:
    """With recompute-pause off and the host tier full, a request that cannot be suspended is no victim
    (`cannot_be_moved`): every victim leaves its state in its pass and none is scheduled in it; a requester that
    finds no victim it can move waits."""
    unmoved = stuck_waits = 0
    for seed in range(8):
        config = SchedulerConfig(
            gpu_blocks=8, host_blocks=4, block_size=2, enable_recompute_pause=False, no_progress_limit=8
        )
        sched = Scheduler(config)
        rng = random.Random(seed)
        for _ in range(8):  # each fits the GPU tier alone (16 tokens)
            sched.submit([rng.randrange(1000) for _ in range(rng.randint(2, 6))], rng.randint(4, 10))
        ex = SimExecutor(sched)
        try:
            while sched.has_unfinished:
                out = ex.step()
                pass_ = sched.last_pass
                taken = pass_.victims
                moved = {id(r) for r in out.suspended + out.recompute_paused}
                unmoved += len(taken - moved)
                assert not taken & {id(r) for r in out.scheduled}, f"seed {seed}: a victim was scheduled in its pass"
                if any(not sched.victim_movable(r, pass_) for r in sched.admitted):
                    stuck_waits += sum(isinstance(d, Wait) and d.reserved == 0 for d in pass_.record.decisions)
        except SchedulerStalled:
            pass  # the known limit once the host tier stays full (tests/faults/test_liveness.py)
    assert unmoved == 0, "a victim the pass could not move was taken"
    assert stuck_waits > 0  # the case was exercised: requesters waited beside requests the pass could not move


def test_request_about_to_produce_its_final_token_is_skipped_as_a_victim() -> None:
    # block_size 2: a (4 prompt tokens) needs a 3rd block for its next decode; c's next decode fits its block
    sched = make(4, block_size=2)
    sched.submit([1, 2, 3, 4], 3, request_id="a")
    sched.submit([5, 6], 3, request_id="b")
    sched.submit([7], 2, request_id="c")
    ex = SimExecutor(sched)
    ex.step()
    c = sched.get("c")
    assert ids(sched.admitted) == ["a", "b", "c"] and sched.pool.gpu_free_blocks == 0
    assert c.remaining_tokens == 1 and not c.is_prefilling and c.about_to_finish
    out = ex.step()
    assert ids(out.recompute_paused) == ["b"]  # not c, the tail
    assert c in out.generation and c.state == "done" and c.done_reason == "finished"
    run_and_check(ex)


def test_request_about_to_produce_its_final_token_is_never_preempted() -> None:
    sched = make(5)
    sched.submit([1, 2, 4], 2, request_id="a")
    sched.submit([3], 2, request_id="b")
    ex = SimExecutor(sched)
    ex.step()
    b = sched.get("b")
    assert b.about_to_finish and sched.pool.gpu_free_blocks == 1
    out = ex.step()  # a takes the last free block; b needs one too
    assert sched.get("a") in out.generation and sched.get("a").state == "done"  # a finished in this very pass
    assert b not in out.recompute_paused and b not in out.suspended and b.num_recompute_pauses == 0, (
        f"b (budget left 1, decoding) was preempted: {b.state}"
    )


def test_preemption_cap_protects_a_request_that_reached_it() -> None:
    def scenario(cap):
        sched = make(10, 4, max_preemptions_per_request=cap)
        for rid, prompt, m in [("x", [42, 16], 2), ("a", [44, 0, 29], 6), ("b", [21], 6), ("c", [34], 3)]:
            sched.submit(prompt, m, request_id=rid)
        ex = SimExecutor(sched)
        for _ in range(3):
            ex.step()
        c = sched.get("c")
        # x finished in pass 2, when c was suspended; c was resumed in pass 3: it is the tail of the admission order;
        # a takes the one free block, then b needs one
        assert ids(sched.admitted) == ["a", "b", "c"] and c.num_suspensions == 1
        assert sched.pool.gpu_free_blocks == 1 and not c.about_to_finish
        return sched, ex, ex.step()

    _, _, uncapped = scenario(None)
    assert ids(uncapped.suspended + uncapped.recompute_paused) == ["c"]  # control: c would be the victim
    sched, ex, capped = scenario(1)
    assert "c" not in ids(capped.suspended + capped.recompute_paused)
    assert sched.get("c").state == "running" and sched.get("c").num_suspensions == 1
    run_and_check(ex)


# -------------------------------------------------------------------------------------- reset for replay


def test_reset_for_replay_builds_the_replay_prompt_and_clears_kv_state() -> None:
    sched = make(10, max_input_len=4)
    sched.submit([1, 2, 3, 4], 6, request_id="a")
    sched.submit([5, 6, 7, 8], 6, request_id="b")
    ex = SimExecutor(sched)
    ex.step()
    ex.step()
    b = sched.get("b")
    generated = list(b.generated)
    assert len(generated) == 2 and sched.pool.gpu_free_blocks == 0
    out = ex.step()
    assert out.recompute_paused == [b] and b.state == "recompute_paused"
    # RESET-PROMPT: prompt + every generated token, the last sampled one included; RESET-NO-TRUNCATE
    assert b.prefill_tokens == (5, 6, 7, 8, *generated)
    assert len(b.prefill_tokens) > sched.config.max_input_len
    assert b.generated == generated  # GEN-APPEND: nothing was dropped
    # RESET-BUDGET
    assert b.remaining_tokens == 6 - len(generated)
    # RESET-CLEARED
    assert (b.num_computed_tokens, b.num_gpu_blocks, b.num_host_blocks) == (0, 0, 0)
    assert b.prefill_tokens_left == len(b.prefill_tokens)  # its next first chunk starts the replay prompt afresh
    assert sched.pool.gpu_blocks("b") == () and sched.pool.host_blocks("b") == ()
    # the replay recomputes the whole replay prompt, untruncated, before b produces another token
    replayed = 0
    while b.state not in {"done", "running"}:
        out = ex.step()
        if b in out.replay:
            assert len(b.generated) == len(generated) or b.state == "running"
            replayed += out.chunk_tokens["b"]
    assert replayed == 4 + len(generated)
    run_and_check(ex)


# ------------------------------------------------------------------------------ pipeline parallel (§1.6)


def test_awaiting_consensus_keeps_blocks_and_is_neither_scheduled_nor_a_victim() -> None:
    sched, ex = three_prefills(host_blocks=0, pipeline_stages=2)
    out = ex.step()
    x, y = sched.get("x"), sched.get("y")
    assert out.recompute_paused == [y, x]
    assert x.state == y.state == "awaiting_consensus"
    held = {r.request_id: sched.pool.gpu_blocks(r.request_id) for r in (x, y)}
    assert [len(held["x"]), len(held["y"])] == [6, 2]  # PP-HOLD: blocks kept until consensus
    assert x.num_computed_tokens == 6 and x.num_recompute_pauses == 0  # not reset yet
    assert sched.get("p") not in out.context  # the room is not free before consensus
    for _ in range(2):  # passes without consensus: x and y are neither scheduled nor chosen again
        again = sched.schedule()
        sched.check_invariants(again)
        assert not {"x", "y"} & listed(again)
        assert {r.request_id: sched.pool.gpu_blocks(r.request_id) for r in (x, y)} == held
        sched.complete_step(again, {r.request_id: 0 for r in again.scheduled})


def test_cancel_while_awaiting_consensus_terminates_at_consensus_instead_of_replaying() -> None:
    sched, ex = two_decoders(pipeline_stages=2)
    ex.step()
    b = sched.get("b")
    generated = list(b.generated)
    assert b.state == "awaiting_consensus" and generated
    assert sched.cancel("b") is b
    assert b.state == "awaiting_consensus" and sched.pool.gpu_blocks("b")  # deferred: still holds its blocks
    settled = sched.reach_consensus()
    assert b in settled
    assert b.state == "done" and b.done_reason == "cancelled"
    assert b.num_recompute_pauses == 0 and b.prefill_tokens == b.prompt and b.generated == generated
    assert sched.pool.gpu_blocks("b") == () and "b" in sched.finished and "b" not in sched.requests
    with pytest.raises(UnknownRequestId):
        sched.cancel("b")
    run_and_check(ex)


def test_finish_while_awaiting_consensus_terminates_at_consensus() -> None:
    prompt = [21, 22, 23]  # b's prompt in two_decoders
    solo = reference_output(prompt, 3)
    assert solo[0] != solo[1]
    stop = solo[1]
    sched, ex = two_decoders(pipeline_stages=2, b_stop=(stop,))
    ex.step()
    b = sched.get("b")
    assert b.state == "awaiting_consensus" and b.generated == solo[:1]
    # the last pipeline stage delivers b's in-flight token, which is final (a stop token)
    b.append_token(stop)
    sched.lifecycle.fire(b, "finish", sched.pool, sched._effects_in(sched._idle))
    assert b.state == "awaiting_consensus" and b.termination_reason == "finished"
    sched.reach_consensus()
    assert b.state == "done" and b.done_reason == "finished" and b.num_recompute_pauses == 0
    assert b.generated == reference_output(prompt, 3, [stop])
    assert sched.pool.gpu_blocks("b") == ()
    run_and_check(ex)


# --------------------------------------------------------------------------------------- GPU-only (§1.7)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gpu_only_never_suspends_and_recompute_pauses_under_pressure(seed: int) -> None:
    sched = make(12, host_blocks=0, block_size=2)
    pressured_workload(sched, seed)
    ex = SimExecutor(sched)
    while sched.has_unfinished:
        out = ex.step()
        assert out.suspended == [] and out.migrations == [] and out.resumed == []
        assert sched.stats().requests_per_state["suspended"] == 0 and sched.stats().suspended_kv_tokens == 0
    assert sum(r.num_suspensions for r in sched.finished.values()) == 0
    assert sum(r.num_recompute_pauses for r in sched.finished.values()) > 0
    run_and_check(ex)


@pytest.mark.parametrize("lifecycle", ["machine", "compiled"])
def test_without_host_tier_no_victim_is_offered_to_suspend(lifecycle: str) -> None:
    """A victim goes straight to recompute-pause: the lifecycle is never asked to suspend it (the suspension would
    free nothing: SUSPEND-ROOM), while with a host tier a victim is offered to suspend first."""
    for host_blocks in (0, 4):
        sched = make(12, host_blocks=host_blocks, block_size=2, lifecycle=lifecycle)
        asked: list[str] = []
        try_fire = sched.lifecycle.try_fire

        def recording(request, event, pool, try_fire=try_fire, asked=asked):
            asked.append(event)
            return try_fire(request, event, pool)

        sched.lifecycle.try_fire = recording  # type: ignore[method-assign]
        pressured_workload(sched, 0)
        run_and_check(SimExecutor(sched))
        pauses = sum(r.num_recompute_pauses for r in sched.finished.values())
        assert pauses > 0 and asked.count("recompute_pause") == pauses
        assert (asked.count("suspend") > 0) == (host_blocks > 0)


# ------------------------------------------------------------------------------------------- admission


def test_no_new_admission_in_a_pass_that_preempted() -> None:
    sched, ex = three_prefills(host_blocks=0)
    d = sched.submit([41], 1, request_id="d")
    out = ex.step()
    assert out.recompute_paused  # this pass preempted
    assert d.state == "waiting" and d not in out.context
    assert sched.pool.gpu_free_blocks >= 1  # room for d existed: it was the rule, not the room
    for victim in out.recompute_paused:  # their replays come before d (ADMIT-ORDER); take them out of its way
        sched.cancel(victim.request_id)
    out = ex.step()
    assert not (out.suspended or out.recompute_paused)
    assert d in out.context  # the next, quiet pass admits it
    run_and_check(ex)


def test_chunked_prefill_computes_a_long_prompt_in_several_context_chunks() -> None:
    sched = make(32, prefill_chunk_size=4)
    prompt = list(range(100, 110))
    r = sched.submit(prompt, 3, request_id="long")
    ex = SimExecutor(sched)
    chunks = []
    while r.is_prefilling:
        out = ex.step()
        assert out.context == [r] and out.generation == []
        chunks.append(out.chunk_tokens["long"])
        if r.is_prefilling:
            assert r.generated == []  # no token before the whole prompt is computed
    assert chunks == [4, 4, 2] and sum(chunks) == len(prompt)
    assert len(r.generated) == 1
    run_and_check(ex)


def test_a_first_chunk_is_cut_to_what_the_pass_has_left_of_its_token_budget() -> None:
    """The first chunk is pass data: the second admission of a pass gets the budget the first left, and only the
    blocks of that cut chunk (block size 4: a 6-token chunk takes 2 blocks, the 2 left; a full 10-token chunk would
    need 3)."""
    sched = make(5, block_size=4, prefill_chunk_size=10, max_num_tokens=16)
    a = sched.submit(list(range(1, 11)), 1, request_id="a")
    b = sched.submit(list(range(20, 39)), 1, request_id="b")
    out = sched.schedule()
    assert out.context == [a, b] and out.chunk_tokens == {"a": 10, "b": 6}
    assert (a.num_gpu_blocks, b.num_gpu_blocks) == (3, 2) and sched.pool.gpu_free_blocks == 0
    assert b.prefill_tokens_left == 19  # nothing of the cut is stored on the request
    sched.check_invariants(out)


def test_suspended_requests_resume_in_arrival_order() -> None:
    sched = make(8, 8)
    for rid, prompt, m in [("a", [2, 16], 5), ("b", [25, 19], 4), ("c", [37, 13], 5), ("d", [18], 2)]:
        sched.submit(prompt, m, request_id=rid)
    ex = SimExecutor(sched)
    suspension_order: list[str] = []
    for _ in range(12):  # until the first pass that resumes
        out = ex.step()
        suspension_order += ids(out.suspended)
        if out.resumed:
            break
    assert suspension_order == ["c", "b"]  # suspended c first, then b
    assert ids(out.resumed) == ["b", "c"]  # arrival order, not suspension order
    assert sched.get("b").arrival < sched.get("c").arrival
    run_and_check(ex)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_guaranteed_no_evict_never_preempts(seed: int) -> None:
    def run(policy):
        sched = make(12, host_blocks=6, block_size=2, capacity_policy=policy)
        pressured_workload(sched, seed)
        ex = SimExecutor(sched)
        outs = []
        while sched.has_unfinished:
            outs.append(ex.step())
        return sched, outs

    sched, outs = run("guaranteed_no_evict")
    for out in outs:
        assert out.recompute_paused == [] and out.suspended == [] and out.resumed == [] and out.migrations == []
        assert out.to_dict()["recompute_paused"] == []
    assert all(r.num_suspensions == r.num_recompute_pauses == 0 for r in sched.finished.values())
    for request in sched.finished.values():
        assert request.generated == reference(request)
    _, greedy = run("max_utilization")
    assert any(o.suspended or o.recompute_paused for o in greedy)  # control: the workload is pressured


# ------------------------------------------------------------------------------------ submission checks


@pytest.mark.parametrize(
    ("prompt", "max_new_tokens", "kwargs", "message"),
    [
        ([], 4, {}, "prompt is empty"),
        ([1, 2], 0, {}, "max_new_tokens"),
        ([1, 2], -3, {}, "max_new_tokens"),
        ([1, 2, 3, 4, 5, 6], 1, {}, "max_input_len=5"),
        ([1, 2, 3], 14, {}, "GPU tier of 4 blocks x 4 tokens = 16"),
        ([1], 2, {"request_id": "taken"}, "already in use"),
    ],
)
def test_submission_refusals_name_the_problem_and_change_nothing(prompt, max_new_tokens, kwargs, message) -> None:
    sched = make(4, block_size=4, max_input_len=5)
    sched.submit([9], 1, request_id="taken")

    def state():
        return (dict(sched.requests), ids(sched.waiting), sched.pool.usage(), sched.iteration)

    before = state()
    with pytest.raises(RequestRejected, match=message):
        sched.submit(prompt, max_new_tokens, **kwargs)
    assert state() == before
    # the arrival counter did not move either: the next accepted request arrives right after "taken"
    assert sched.submit([7], 1, request_id="next").arrival == sched.get("taken").arrival + 1


def test_submission_refuses_the_id_of_a_finished_request() -> None:
    sched = make(8)
    sched.submit([1], 1, request_id="x")
    run_and_check(SimExecutor(sched))
    with pytest.raises(RequestRejected, match="already in use"):
        sched.submit([2], 1, request_id="x")


@pytest.mark.parametrize("verb", ["cancel", "abort"])
def test_ending_an_unknown_or_finished_request_raises_unknown_request_id(verb: str) -> None:
    sched = make(8)
    sched.submit([1], 1, request_id="x")
    run_and_check(SimExecutor(sched))
    with pytest.raises(UnknownRequestId, match=r"'nope'.*unknown"):
        getattr(sched, verb)("nope")
    with pytest.raises(UnknownRequestId, match=r"'x'.*already finished") as info:
        getattr(sched, verb)("x")
    assert isinstance(info.value, KeyError)
    assert sched.get("x").done_reason == "finished"  # unchanged


# --------------------------------------------------------------------------------------------- liveness


def test_never_completed_fences_raise_scheduler_stalled_naming_requests() -> None:
    """a's decode steps outgrow the GPU tier: a suspended request's held blocks are offloaded for the next block,
    and the requester waits for that copy, which never completes."""
    sched = make(5, 8, no_progress_limit=5)
    sched.submit([1, 2], 3, request_id="a")
    sched.submit([3], 3, request_id="b")
    ex = SimExecutor(sched, complete_fences=False)
    with pytest.raises(SchedulerStalled) as info:
        for _ in range(50):
            ex.step()
    message = str(info.value)
    assert "'a':suspended" in message and "complete_migrations" in message
    assert sched.iteration < 50
    assert sched.pool.in_flight  # the cause: copies never reported complete


def test_manual_loop_without_completing_migrations_stalls_instead_of_hanging() -> None:
    sched = make(5, 8, no_progress_limit=4)
    sched.submit([1, 2], 3, request_id="a")
    sched.submit([3], 3, request_id="b")
    with pytest.raises(SchedulerStalled, match="'a':suspended"):
        for _ in range(40):
            out = sched.schedule()
            sampled = {r.request_id: 1 for r in out.scheduled}
            sched.complete_step(out, sampled)  # complete_migrations never called


# ----------------------------------------------------------------------------------- host copy and tier


def test_lose_host_copy_moves_a_suspended_request_to_replay_and_output_still_matches() -> None:
    sched, ex = two_decoders()
    sched.set_host_capacity(4)  # attach a host tier while it is empty
    ex.sync_host_tier()
    ex.step()
    b = sched.get("b")
    # b's 3 blocks are held, the one a's next step needs offloaded: split across the tiers
    assert b.state == "suspended" and (b.num_gpu_blocks, b.num_host_blocks) == (2, 1) and b.generated
    assert sched.lose_host_copy("b") is b
    assert b.state == "recompute_paused" and sched.pool.host_blocks("b") == () == sched.pool.gpu_blocks("b")
    assert sched.pool.host_free_blocks == 4
    assert b.prefill_tokens == b.prompt + tuple(b.generated) and b.num_computed_tokens == 0
    sched.check_invariants()
    with pytest.raises(IllegalTransition):
        sched.lose_host_copy("a")  # running: no host copy to lose
    run_and_check(ex)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_removing_the_host_tier_mid_run_replays_every_suspended_request(seed: int) -> None:
    sched = make(12, host_blocks=12, block_size=2)
    pressured_workload(sched, seed)
    ex = SimExecutor(sched)
    for _ in range(500):
        ex.step()
        if sched.suspended:
            break
    suspended = list(sched.suspended)
    assert suspended, "the workload never suspended anything"
    lost = sched.set_host_capacity(0)
    ex.sync_host_tier()
    assert set(map(id, lost)) == set(map(id, suspended))
    assert all(r.state == "recompute_paused" for r in suspended)
    assert not sched.pool.has_host_tier and sched.suspended == []
    sched.check_invariants()
    while sched.has_unfinished:
        out = ex.step()
        assert out.suspended == [] and out.migrations == []
    assert sched.stats().host_tier_fallback
    run_and_check(ex)


def test_refused_host_tier_removal_changes_nothing() -> None:
    sched = make(6, 8)
    for rid, prompt, m in [("a", [10, 26], 3), ("b", [5], 3), ("c", [24], 3), ("d", [33], 1)]:
        sched.submit(prompt, m, request_id=rid)
    ex = SimExecutor(sched)
    for _ in range(3):
        ex.step()
    out = sched.schedule()  # plans a resume (host -> GPU copy in flight) while c stays suspended, offloaded
    assert any(p.direction == "to_gpu" for p in out.migrations) and ids(sched.suspended) == ["c"]
    assert sched.get("c").num_host_blocks == 1
    before = {r.request_id: r.state for r in sched.requests.values()}
    with pytest.raises(PoolError):
        sched.set_host_capacity(0)
    after = {r.request_id: r.state for r in sched.requests.values()}
    assert after == before, f"refused, yet states changed from {before} to {after}"


def test_a_victim_of_the_pass_is_skipped_not_a_stop_for_later_resumes() -> None:
    """Request 1 is suspended in pass 4; requests 3 and 4, suspended earlier and arriving later, fit and are resumed
    in the same pass: the victim is left out of the candidates (no readmission of victims), it does not end the
    admissions as a misfit would."""
    sched = make(8, 6, prefill_chunk_size=4)
    for rid, (prompt, m) in enumerate([([51, 88], 6), ([60, 98], 6), ([57, 95], 3), ([52], 3), ([65], 3)]):
        sched.submit(prompt, m, request_id=rid)
    ex = SimExecutor(sched)
    for _ in range(3):
        ex.step()
    out = ex.step()
    assert ids(out.suspended) == [1] and ids(out.resumed) == [3, 4]
    assert sched.get(3).arrival > sched.get(1).arrival
    run_and_check(ex)


def test_recorded_transitions_are_taken_once_and_only_from_a_scheduler_that_records_them() -> None:
    with pytest.raises(KVStateError, match="record_transitions=True"):
        Scheduler(SchedulerConfig(gpu_blocks=4)).take_fired()
    sched = Scheduler(SchedulerConfig(gpu_blocks=4, block_size=2), record_transitions=True)
    sched.submit([1, 2, 3], 2, request_id="a")
    SimExecutor(sched).step()
    taken = sched.take_fired()
    assert [(f.request.request_id, f.transition.event) for f in taken] == [("a", "admit")]
    assert (taken[0].gpu_blocks, taken[0].gpu_free, taken[0].iteration) == (2, 2, 1)
    assert sched.take_fired() == []


def test_forget_finished_is_all_or_nothing() -> None:
    """One active id among finished ones refuses the call and forgets none of them."""
    sched = Scheduler(SchedulerConfig(gpu_blocks=8, host_blocks=0, block_size=2))
    done = sched.submit([1, 2], 1, request_id="done")
    active = sched.submit([3, 4, 5, 6], 4, request_id="active")
    ex = SimExecutor(sched)
    while "done" not in sched.finished:
        ex.step()
    assert "active" in sched.requests
    with pytest.raises(UnknownRequestId, match="active"):
        sched.forget_finished(["done", "active"])
    assert sched.finished["done"] is done and sched.requests["active"] is active
    assert sched.forget_finished(["done"]) == [done] and "done" not in sched.finished


def test_an_id_is_echoed_short_in_the_scheduler_errors() -> None:
    """A 50,000-character id is echoed as a short prefix, not whole."""
    sched = Scheduler(SchedulerConfig(gpu_blocks=8, host_blocks=0, block_size=2))
    long_id = "x" * 50_000
    sched.submit([1, 2], 1, request_id=long_id)
    for call in (
        lambda: sched.submit([1, 2], 1, request_id=long_id),
        lambda: sched.get("y" * 50_000),
        lambda: sched.forget_finished([long_id]),
    ):
        with pytest.raises(KVStateError) as info:
            call()
        assert len(str(info.value)) < 400  # a short prefix of the id, not 50,000 characters


def test_a_spec_whose_admission_stays_in_its_queue_is_refused_by_name() -> None:
    """Admission reads its queue in place and counts on an admitted request leaving it: a spec whose admission class
    reaches a state kept in the class's own queue is refused when the scheduler is built, naming the file, the class
    and the state to give another container."""
    data = tomllib.loads(packaged_spec_path().read_text(encoding="utf-8"))
    for state in data["states"]:
        if state["name"] == "replaying":
            state["container"] = "paused"  # the queue of recompute_paused, which `replay` leaves
    spec = parse_spec(data, source="same_queue.toml")
    with pytest.raises(KVStateError, match=r"same_queue.toml: admission class 'replay' .*give 'replaying' another"):
        Scheduler(SchedulerConfig(gpu_blocks=8), spec)


def test_containers_stay_in_arrival_and_admission_order_and_a_reordered_one_is_refused_by_name() -> None:
    """Requests leave their containers by bisection on their arrival (admission) numbers, which needs the containers
    in that order: they are after every step of a pressured run, and one reordered from outside is an error naming
    the request, not a wrong removal."""
    scheduler = Scheduler(SchedulerConfig(gpu_blocks=12, host_blocks=4, block_size=4, max_num_tokens=16))
    sim = SimExecutor(scheduler)
    rng = random.Random(7)
    for _ in range(10):
        scheduler.submit([rng.randrange(1, 30) for _ in range(rng.randint(1, 9))], rng.randint(4, 20))
    preempted = 0
    while scheduler.has_unfinished:
        out = sim.step()
        preempted += len(out.suspended) + len(out.recompute_paused)
        for queue in (scheduler.waiting, scheduler.resident, scheduler.suspended, scheduler.paused):
            assert [r.arrival for r in queue] == sorted({r.arrival for r in queue})
        assert [r.admission for r in scheduler.admitted] == sorted({r.admission for r in scheduler.admitted})
    assert preempted > 0  # requests moved between every kind of container

    first, second = scheduler.submit([1, 2], 4), scheduler.submit([3], 4)
    scheduler.waiting.reverse()
    with pytest.raises(KVStateError, match=f"request {first.request_id!r} is not where its order puts it"):
        scheduler.cancel(first.request_id)
    assert second.request_id in scheduler.requests
