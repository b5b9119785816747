"""Bad input and API misuse: each is refused with a `ValueError` subclass naming the problem and the limit,
nothing changes, and the engine keeps serving with outputs equal to their references."""

from __future__ import annotations

import re

import pytest
import torch

from executor import GREEDY, EngineClosed, InvalidTokenId, RequestNotActive
from executor.checks import leaked_blocks, random_workload, submit_all
from kvstate.cli import main
from kvstate.config import ConfigError, RequestRejected, SchedulerConfig
from kvstate.scheduler import Scheduler, UnknownRequestId

# (prompt, max_new_tokens, keyword arguments, exception, message): GPU tier 16 blocks x 4 tokens = 64 tokens
BAD_REQUESTS = [
    ([], 4, {}, RequestRejected, "prompt is empty"),
    ("hello world", 4, {}, RequestRejected, "tokenize the text first"),
    (None, 4, {}, RequestRejected, "list or tuple of integer token ids, got NoneType"),
    ([1, 2.0, 3], 4, {}, RequestRejected, r"prompt\[1\] is float 2.0"),
    ([1, True], 4, {}, RequestRejected, r"prompt\[1\] is bool True"),
    ([1, "2"], 4, {}, RequestRejected, r"prompt\[1\] is str"),
    ([[1, 2], [3, 4]], 4, {}, RequestRejected, r"prompt\[0\] is list"),
    ([1, -3], 4, {}, RequestRejected, r"prompt\[1\] is negative \(-3\)"),
    ([1, 512], 4, {}, InvalidTokenId, r"vocabulary has 512 ids \(0..511\)"),
    ([1, 2], 0, {}, RequestRejected, "max_new_tokens must be a positive integer"),
    ([1, 2], -5, {}, RequestRejected, "max_new_tokens must be a positive integer"),
    ([1, 2], 2.5, {}, RequestRejected, "got float 2.5"),
    ([1, 2], True, {}, RequestRejected, "got bool True"),
    ([1, 2], "8", {}, RequestRejected, "got str '8'"),
    ([1, 2], 10**9, {}, RequestRejected, "max_position_embeddings=4096"),
    ([1, 2, 3], 62, {}, RequestRejected, "65 tokens can never fit the GPU tier of 16 blocks x 4 tokens = 64"),
    ([1] * 70, 1, {}, RequestRejected, "can never fit"),
    ([1], 4, {"request_id": "live"}, RequestRejected, "request id 'live' is already in use"),
    ([1], 4, {"request_id": "done"}, RequestRejected, "request id 'done' is already in use"),
    ([1], 4, {"request_id": True}, RequestRejected, "request_id must be a str or an int, got bool"),
    ([1], 4, {"request_id": [7]}, RequestRejected, "request_id must be a str or an int, got list"),
    ([1], 4, {"request_id": 1.5}, RequestRejected, "request_id must be a str or an int, got float"),
    ([1], 4, {"stop_token_ids": 5}, RequestRejected, "stop_token_ids must be an iterable"),
    ([1], 4, {"stop_token_ids": "eos"}, RequestRejected, "stop_token_ids must be an iterable"),
    ([1], 4, {"stop_token_ids": [1.5]}, RequestRejected, r"stop_token_ids\[0\] is float"),
    ([1], 4, {"stop_token_ids": [-1]}, RequestRejected, r"stop_token_ids\[0\] is int -1"),
    ([1], 4, {"stop_token_ids": [900]}, InvalidTokenId, "stop_token_ids has token id 900"),
    ([1], 4, {"sampling": "greedy"}, RequestRejected, "sampling must be a SamplingParams"),
]


def _engine_snapshot(engine):
    s = engine.scheduler
    return (
        {rid: (r.state, tuple(r.generated)) for rid, r in s.requests.items()},
        sorted(map(str, s.finished)),
        s.pool.usage(),
        s.iteration,
        list(engine._submissions),
        engine.totals.steps,
    )


@pytest.fixture
def busy_engine(make_engine):
    """An engine mid-run under pressure: some requests running, some preempted, one ('done') finished."""
    engine = make_engine(gpu_blocks=16, host_blocks=6, block_size=4)
    engine.add_request([5, 6, 7], 1, request_id="done")
    engine.step()
    assert engine.scheduler.finished["done"].done_reason == "finished"
    engine.add_request([8, 9], 6, request_id="live")
    submit_all(engine, random_workload(10, 4, (4, 30), (4, 24)))
    for _ in range(12):
        engine.step()
    assert engine.scheduler.has_unfinished
    return engine


def _finishes_like_the_reference(engine):
    outputs = engine.run()
    references = engine.batched_reference_outputs()
    assert outputs == references
    assert leaked_blocks(engine) == 0


@pytest.mark.parametrize(
    "prompt, max_new_tokens, kwargs, error, message",
    BAD_REQUESTS,
    ids=[f"{i}-{m[:28]}" for i, (*_, m) in enumerate(BAD_REQUESTS)],
)
def test_engine_refuses_bad_requests_and_keeps_serving(busy_engine, prompt, max_new_tokens, kwargs, error, message):
    before = _engine_snapshot(busy_engine)
    with pytest.raises(error, match=message) as info:
        busy_engine.add_request(prompt, max_new_tokens, **kwargs)
    assert isinstance(info.value, ValueError)
    assert _engine_snapshot(busy_engine) == before
    _finishes_like_the_reference(busy_engine)


def test_tensors_are_accepted_as_token_ids(busy_engine):
    rid = busy_engine.add_request(torch.tensor([3, 4, 5]), 3, stop_token_ids=torch.tensor([511]), sampling=GREEDY)
    _finishes_like_the_reference(busy_engine)
    assert len(busy_engine.outputs()[rid]) <= 3


@pytest.mark.parametrize(
    "request_id, message",
    [
        ("nope", "'nope': it is unknown"),
        ("done", "'done': it has already finished"),
        ([1], "request ids are str or int, got list"),
    ],
)
def test_cancelling_what_is_not_active_is_refused(busy_engine, request_id, message):
    before = _engine_snapshot(busy_engine)
    with pytest.raises(RequestNotActive, match=message) as info:
        busy_engine.cancel(request_id)
    assert isinstance(info.value, ValueError) and isinstance(info.value, UnknownRequestId)
    assert _engine_snapshot(busy_engine) == before
    _finishes_like_the_reference(busy_engine)


def test_a_closed_engine_refuses_to_be_driven_but_can_be_inspected(busy_engine):
    busy_engine.close()
    before = _engine_snapshot(busy_engine)
    for call in (
        busy_engine.step,
        busy_engine.run,
        lambda: next(busy_engine.stream()),
        lambda: busy_engine.add_request([1], 1),
        lambda: busy_engine.cancel("live"),
        busy_engine.lose_host_tier,
    ):
        with pytest.raises(EngineClosed, match=r"after close\(\).*create a new Engine") as info:
            call()
        assert isinstance(info.value, ValueError)
    assert _engine_snapshot(busy_engine) == before
    assert "done" in busy_engine.outputs() and busy_engine.stats().iteration == before[3]
    busy_engine.close()  # closing twice is harmless


@pytest.mark.parametrize(
    "prompt, max_new_tokens, kwargs, message",
    [
        (p, m, kw, msg)
        for p, m, kw, err, msg in BAD_REQUESTS
        if err is RequestRejected and "sampling" not in kw and "max_position" not in msg
    ],
)
def test_scheduler_submit_refuses_the_same_inputs_and_changes_nothing(prompt, max_new_tokens, kwargs, message):
    sched = Scheduler(SchedulerConfig(gpu_blocks=16, block_size=4))
    sched.submit([1], 4, request_id="live")
    sched.submit([1], 1, request_id="done")
    sched.cancel("done")
    before = ({rid: r.state for rid, r in sched.requests.items()}, sched.pool.usage(), list(sched.waiting))
    with pytest.raises(RequestRejected, match=message):
        sched.submit(prompt, max_new_tokens, **kwargs)
    assert ({rid: r.state for rid, r in sched.requests.items()}, sched.pool.usage(), list(sched.waiting)) == before


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"gpu_blocks": 0}, "gpu_blocks must be a positive integer"),
        ({"host_blocks": -1}, "host_blocks must be an integer >= 0"),
        ({"max_preemptions_per_request": True}, "max_preemptions_per_request must be a positive integer or None"),
        ({"enable_recompute_pause": "no"}, "enable_recompute_pause must be True or False"),
        ({"enable_recompute_pause": False}, "enable_recompute_pause=False with host_blocks=0"),
    ],
)
def test_bad_configurations_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        SchedulerConfig(**{"gpu_blocks": 8, **overrides})


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--inject", "melt_gpu"], "unknown fault kind 'melt_gpu'"),
        (["demo", "--inject", "copy_to_host:7"], r"probability in \[0, 1\]"),
        (["demo", "--requests", "0"], "--requests must be positive"),
        (["demo", "--gpu-blocks", "-2"], "--gpu-blocks must be a positive integer, got -2"),
        (["soak", "--requests", "0"], "--requests must be positive"),
        (["soak", "--cancel-rate", "1.5"], r"--cancel-rate must be in \[0, 1\]"),
        (["soak", "--inject", "host_loss@x"], "iterations must be integers"),
    ],
)
def test_the_cli_refuses_bad_options_with_exit_status_2(argv, message, capsys, tmp_path):
    assert main([*argv, "--trace", str(tmp_path / "t.ndjson")] if argv[0] == "demo" else argv) == 2
    err = capsys.readouterr().err
    assert "error" in err
    assert re.search(message, " ".join(err.split())), err
