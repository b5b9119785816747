"""The engine survives its own exceptions, refuses re-entrant and concurrent misuse, forgets what it handed over,
and refuses configurations it cannot run.

* one transient exception injected at every point of a pressured step (suspends, offloads, resumes,
  recompute-pauses): the step is settled (nothing in flight, the scheduler's invariants hold) and the run then
  finishes with every output equal to its reference and no block held — or, where the step cannot be undone, the
  engine is cleanly broken: every later driving call raises the same `EngineBroken`;
* calls from inside the `on_transition` hook or a `stream()` consumer raise `EngineBusy` and change nothing;
* two threads on one engine are serialized: outputs equal the references and the trace follows the spec;
* `take_finished` leaves no record of the requests it handed over; `close()` drains the copy stream;
* `EngineConfig` refuses unsupported dtypes, wrong types and pool sizes the machine cannot hold.
"""

from __future__ import annotations

import enum
import errno
import io
import sys
import threading
from pathlib import Path

import pytest
import torch

import executor.engine as engine_module
from executor import Engine, EngineConfig
from executor.checks import leaked_blocks, random_workload
from executor.engine import FinishedRequest
from executor.engine_errors import EngineBroken, EngineBusy
from kvstate import load_spec
from kvstate.checker import validate_trace
from kvstate.cli import main
from kvstate.config import ConfigError, RequestRejected, SchedulerConfig
from kvstate.scheduler import UnknownRequestId
from kvstate.trace import TraceWriter

SPEC = load_spec()
PRESSURED = {"gpu_blocks": 16, "host_blocks": 6, "block_size": 4, "prefill_chunk_size": 64}
WORK = random_workload(12, 1, (4, 30), (4, 24))


class Injected(Exception):
    """The transient failure the tests inject."""


@pytest.fixture(scope="module")
def references(tiny_model) -> dict:
    """{id: reference output} of WORK (ids = positions), on the shared tiny model."""
    with Engine(EngineConfig(device="cpu", scheduler=SchedulerConfig(**PRESSURED)), model=tiny_model) as engine:
        for prompt, new in WORK:
            engine.add_request(prompt, new)
        return engine.batched_reference_outputs()


def pressured(make_engine, tmp_path: Path, **overrides) -> Engine:
    engine = make_engine(**{**PRESSURED, "trace_path": tmp_path / "trace.ndjson", **overrides})
    for prompt, new in WORK:
        engine.add_request(prompt, new)
    return engine


def assert_trace_follows_the_spec(engine: Engine) -> None:
    engine.close()
    lines = Path(engine.trace.path).read_text().splitlines()
    report = validate_trace(lines, SPEC)
    assert report.ok, report.divergence.describe()


def assert_settled(engine: Engine) -> None:
    """Nothing in flight and every invariant holds (between two calls)."""
    engine.scheduler.check_invariants()
    assert not engine.scheduler.pool.in_flight


def assert_finishes_like_the_references(engine: Engine, references: dict) -> None:
    outputs = engine.run()
    assert outputs == references
    assert leaked_blocks(engine) == 0, engine.scheduler.pool.usage()


# ------------------------------------------------------------------------------------------ injection
def once(original, when=lambda: True, exc: BaseException | None = None, after: bool = False):
    """`original`, except that the first call for which `when()` holds raises `exc` (before the call, or after
    it with `after`); `calls.fired` tells whether it did."""

    def wrapper(*args, **kwargs):
        if not wrapper.fired and when():
            wrapper.fired = True
            if after:
                original(*args, **kwargs)
            raise exc if exc is not None else Injected("injected transient failure")
        return original(*args, **kwargs)

    wrapper.fired = False
    return wrapper


def in_flight(engine):
    return lambda: bool(engine.scheduler.pool.in_flight)


def listener_of(engine):
    """The `on_transition` listener installed on the engine's scheduler, or one that does nothing."""
    return engine.scheduler.on_transition or (lambda request, transition: None)


def hook_raising_on(engine, event: str):
    """Install an `on_transition` listener that raises after the first `event` transition (recorded by then)."""
    original = listener_of(engine)

    def hook(request, transition):
        original(request, transition)
        if transition.event == event and not hook.fired:
            hook.fired = True
            raise Injected(f"injected failure in the on_transition hook after {event}")

    hook.fired = False
    engine.scheduler.on_transition = hook
    return hook


class FlakyFence:
    """A completed copy whose first `wait()` raises."""

    def __init__(self, fence) -> None:
        self.fence, self.failed = fence, False

    def wait(self):
        if not self.failed:
            self.failed = True
            raise Injected("injected failure waiting on a fence")
        self.fence.wait()

    def done(self):
        return self.fence.done()

    def order_before(self, stream):
        self.fence.order_before(stream)


def _flaky_fences(engine, monkeypatch):
    original = engine.cache.migrate
    state = {"fired": False}

    def migrate(plan, **kwargs):
        fence = original(plan, **kwargs)
        if state["fired"]:
            return fence
        state["fired"] = True
        return FlakyFence(fence)

    monkeypatch.setattr(engine.cache, "migrate", migrate)
    return lambda: state["fired"]


def _patch(engine, monkeypatch, obj, name, **kwargs):
    wrapper = once(getattr(obj, name), **kwargs)
    monkeypatch.setattr(obj, name, wrapper)
    return lambda: wrapper.fired


def _raising_hook(event: str):
    """An install(engine, monkeypatch) that makes the first `event` transition's hook raise (`hook_raising_on`)."""

    def install(engine, monkeypatch):
        hook = hook_raising_on(engine, event)
        return lambda: hook.fired

    return install


def _trace_disk_full(engine, monkeypatch):
    """The trace file is /dev/full from the 20th transition on: writes fail with ENOSPC, as on a full disk."""
    original = TraceWriter.write

    def write(self, fired):
        if self.lines >= 20 and self._file is not None and self._file.name != "/dev/full":
            self._file.close()
            self._file = open("/dev/full", "w", buffering=1)  # noqa: SIM115 - the writer closes it
        return original(self, fired)

    monkeypatch.setattr(TraceWriter, "write", write)
    return lambda: engine.trace.lines >= 20


# point -> (install(engine, monkeypatch) -> fired(), expected outcome)
POINTS = {
    "schedule (before planning)": (
        lambda e, m: _patch(e, m, e.scheduler, "schedule", when=lambda: e.scheduler.iteration >= 6),
        "settled",
    ),
    "schedule (mid-pass, after a suspend)": (
        _raising_hook("suspend"),
        "settled",
    ),
    "schedule (mid-pass, after an offload)": (
        _raising_hook("offload"),
        "settled",
    ),
    "schedule (mid-pass, after a resume)": (
        _raising_hook("resume"),
        "settled",
    ),
    "schedule (mid-pass, after a recompute-pause)": (
        _raising_hook("recompute_pause"),
        "settled",
    ),
    "invariant check": (lambda e, m: _patch(e, m, e.scheduler, "check_invariants", when=in_flight(e)), "settled"),
    "issue copies": (lambda e, m: _patch(e, m, e.cache, "migrate"), "settled"),
    "forward": (lambda e, m: _patch(e, m, e.model, "forward_paged", when=in_flight(e)), "settled"),
    "forward (KeyboardInterrupt)": (
        lambda e, m: _patch(e, m, e.model, "forward_paged", when=in_flight(e), exc=KeyboardInterrupt()),
        "settled",
    ),
    "sampling": (lambda e, m: _patch(e, m, engine_module, "sample_batch", when=in_flight(e)), "settled"),
    "wait on a fence": (_flaky_fences, "settled"),
    "record an offload": (lambda e, m: _patch(e, m, e._host_tier, "after_offload"), "settled"),
    "complete_migrations": (
        lambda e, m: _patch(e, m, e.scheduler, "complete_migrations", when=in_flight(e)),
        "settled",
    ),
    "complete_step (before applying)": (
        lambda e, m: _patch(e, m, e.scheduler, "complete_step", when=lambda: e.scheduler.iteration >= 6),
        "settled",
    ),
    "complete_step (part applied)": (_raising_hook("finish"), "broken"),
    "statistics after the step": (
        lambda e, m: _patch(e, m, e, "stats", when=lambda: e.scheduler.iteration >= 6),
        "settled",
    ),
    "trace write": (
        lambda e, m: _patch(
            e,
            m,
            TraceWriter,
            "write",
            when=lambda: e.scheduler.iteration >= 6 and bool(e.scheduler.finished),
            exc=OSError(errno.ENOSPC, "No space left on device"),
        ),
        "broken",
    ),
    "trace write (/dev/full)": (_trace_disk_full, "broken"),
}


@pytest.mark.parametrize("point", list(POINTS))
def test_one_exception_at_any_point_of_a_step_is_settled_or_breaks_cleanly(
    point, make_engine, references, tmp_path, monkeypatch
):
    engine = pressured(make_engine, tmp_path)
    install, expected = POINTS[point]
    fired = install(engine, monkeypatch)
    with pytest.raises((Injected, KeyboardInterrupt, OSError, EngineBroken)) as info:
        engine.run()
    assert fired(), f"the failure at {point!r} was never injected: the workload no longer reaches it"
    assert_settled(engine)  # nothing in flight, no leaked or double-owned block, residency matches state
    if expected == "settled":
        assert not isinstance(info.value, EngineBroken), info.value
        assert any("was settled" in note for note in getattr(info.value, "__notes__", []))
        assert_finishes_like_the_references(engine, references)
        totals = engine.totals
        assert totals.suspensions > 0 and totals.events["offload"] > 0 and totals.events["resume"] > 0  # pressured
        assert_trace_follows_the_spec(engine)
        return
    assert isinstance(info.value, EngineBroken)
    message = str(info.value)
    assert message.startswith("the engine is broken: ") and "create a new Engine" in message
    assert isinstance(info.value.__cause__, (Injected, OSError))
    calls = {
        "step": engine.step,
        "run": engine.run,
        "add_request": lambda: engine.add_request([1, 2], 2),
        "cancel": lambda: engine.cancel(next(iter(engine.scheduler.requests), 0)),
        "lose_host_tier": engine.lose_host_tier,
        "stream": lambda: list(engine.stream()),
    }
    for name, call in calls.items():
        with pytest.raises(EngineBroken) as again:
            call()
        assert str(again.value) == message, name
    finished = {rid: r.generated for rid, r in engine.scheduler.finished.items() if r.done_reason == "finished"}
    assert finished and all(tokens == references[rid] for rid, tokens in finished.items())
    assert set(engine.take_finished()) >= set(finished)  # finished results can still be handed over
    engine.close()
    engine.close()


def test_a_failed_step_waits_on_every_fence_and_close_drains_the_copy_stream(make_engine, tmp_path, monkeypatch):
    engine = pressured(make_engine, tmp_path)
    fences, waited = [], []
    original = engine.cache.migrate

    class Recording:
        def __init__(self, fence):
            self.fence = fence

        def wait(self):
            waited.append(self)
            self.fence.wait()

        def done(self):
            return self.fence.done()

        def order_before(self, stream):
            self.fence.order_before(stream)

    def migrate(plan, **kwargs):
        fences.append(Recording(original(plan, **kwargs)))
        return fences[-1]

    monkeypatch.setattr(engine.cache, "migrate", migrate)
    monkeypatch.setattr(engine.model, "forward_paged", once(engine.model.forward_paged, when=in_flight(engine)))
    with pytest.raises(Injected):
        engine.run()
    assert fences and set(map(id, fences)) <= set(map(id, waited))
    drains = []
    monkeypatch.setattr(engine.cache, "drain", lambda: drains.append(1))
    engine.close()
    assert drains == [1]


# ------------------------------------------------------------------------------------------ re-entrancy
@pytest.mark.parametrize("call", ["step", "run", "cancel", "add_request", "take_finished", "lose_host_tier", "close"])
def test_calls_from_inside_the_on_transition_hook_are_refused(call, make_engine, references, tmp_path):
    engine = pressured(make_engine, tmp_path)
    original, refused, read = listener_of(engine), [], []
    calls = {
        "step": engine.step,
        "run": engine.run,
        "cancel": lambda: engine.cancel(0),
        "add_request": lambda: engine.add_request([1, 2], 2),
        "take_finished": engine.take_finished,
        "lose_host_tier": engine.lose_host_tier,
        "close": engine.close,
    }

    def hook(request, transition):
        original(request, transition)
        try:
            calls[call]()
        except EngineBusy as err:
            refused.append(str(err))
        read.append(len(engine.outputs()))  # reading from the hook is allowed

    engine.scheduler.on_transition = hook
    assert_finishes_like_the_references(engine, references)
    assert refused and len(refused) == len(read)
    assert f"{call}() was called from inside" in refused[0] and "nothing changed" in refused[0]
    engine.scheduler.on_transition = original
    assert_trace_follows_the_spec(engine)


def test_a_stream_consumer_may_not_step_run_or_stream(make_engine, references, tmp_path):
    engine = pressured(make_engine, tmp_path)
    produced: dict = {}
    stream = engine.stream()
    for rid, token in stream:
        produced.setdefault(rid, []).append(token)
        for call in (engine.step, engine.run, lambda: list(engine.stream())):
            with pytest.raises(EngineBusy, match="while a stream\\(\\) is being consumed"):
                call()
    assert produced == references and engine.outputs() == references
    assert engine.run() == references  # the finished stream released the engine
    assert_trace_follows_the_spec(engine)


def test_a_stream_closed_early_releases_the_engine(make_engine, references, tmp_path):
    engine = pressured(make_engine, tmp_path)
    stream = engine.stream()
    next(stream)
    stream.close()
    assert_finishes_like_the_references(engine, references)


# --------------------------------------------------------------------------------------------- threads
@pytest.fixture
def fast_switching():
    """Switch threads every 10 µs so that unserialized access would interleave inside a step."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(before)


def _in_threads(*targets):
    errors = []

    def guarded(target):
        try:
            target()
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(t.is_alive() for t in threads), "a thread is stuck"
    assert not errors, errors


@pytest.mark.parametrize("trial", range(3))
def test_two_threads_stepping_one_engine_are_serialized(trial, make_engine, references, tmp_path, fast_switching):
    engine = pressured(make_engine, tmp_path)
    start = threading.Barrier(2)
    steps = []

    def stepper():
        start.wait()
        while engine.scheduler.has_unfinished:
            engine.step()
            steps.append(1)

    _in_threads(stepper, stepper)
    assert engine.outputs() == references and leaked_blocks(engine) == 0
    assert engine.totals.steps == len(steps)
    assert_trace_follows_the_spec(engine)


@pytest.mark.parametrize("trial", range(3))
def test_cancel_from_a_second_thread_during_run(trial, make_engine, references, tmp_path, fast_switching):
    for attempt in range(10):  # the OS may not run the canceller before the run ends; then try a fresh engine
        (tmp_path / str(attempt)).mkdir()
        engine = pressured(make_engine, tmp_path / str(attempt))
        cancelled = []

        def canceller(engine=engine, cancelled=cancelled):
            while engine.totals.steps < 3 + trial and engine.scheduler.has_unfinished:
                pass
            for rid in list(engine.scheduler.requests)[::2]:
                try:
                    engine.cancel(rid)
                    cancelled.append(rid)
                except ValueError:  # finished in the meantime
                    pass

        _in_threads(engine.run, canceller)
        if cancelled:
            break
    assert cancelled
    reasons = {rid: r.done_reason for rid, r in engine.scheduler.finished.items()}
    assert all(reasons[rid] == "cancelled" for rid in cancelled)
    outputs = engine.outputs()
    assert all(outputs[rid] == references[rid] for rid, reason in reasons.items() if reason == "finished")
    assert leaked_blocks(engine) == 0
    assert_trace_follows_the_spec(engine)


# ------------------------------------------------------------------------------------- take_finished
def test_take_finished_hands_over_and_forgets(make_engine, references, tmp_path):
    engine = pressured(make_engine, tmp_path)
    for _ in range(12):
        engine.step()
    first = engine.take_finished()
    assert first and all(isinstance(f, FinishedRequest) and f.reason == "finished" for f in first.values())
    assert {rid: f.tokens for rid, f in first.items()} == {rid: references[rid] for rid in first}
    engine.run()
    rest = engine.take_finished()
    assert set(first) | set(rest) == set(range(len(WORK))) and not set(first) & set(rest)
    assert {rid: f.tokens for rid, f in rest.items()} == {rid: references[rid] for rid in rest}
    # no record of a taken request is left anywhere in the engine
    assert not engine.scheduler.finished and not engine.scheduler.requests and not engine._submissions
    assert not engine._host_tier.checksums and engine.outputs() == {} and engine.take_finished() == {}
    for rid in first:
        with pytest.raises(UnknownRequestId):
            engine.scheduler.get(rid)
    report = validate_trace(Path(engine.trace.path).read_text().splitlines(), SPEC)  # line-buffered: all there
    assert report.ok, report.divergence.describe()
    # a taken id may be used again: the trace then names it twice, the second time from the initial state, which
    # the trace format documents and `kvstate validate` accepts
    prompt, new = WORK[3]
    assert engine.add_request(prompt, new, request_id=3) == 3
    assert engine.run() == {3: references[3]}
    assert engine.take_finished() == {3: FinishedRequest(references[3], "finished")}
    engine.close()
    assert engine.take_finished() == {}  # also on a closed engine
    report = validate_trace(Path(engine.trace.path))
    assert report.ok and report.requests == len(WORK) + 1, report.divergence and report.divergence.describe()


def test_take_finished_reports_cancelled_requests(make_engine, tmp_path):
    engine = pressured(make_engine, tmp_path)
    engine.step()
    engine.cancel(5)
    taken = engine.take_finished()
    assert taken[5].reason == "cancelled" and 5 not in engine._submissions
    with pytest.raises(ValueError, match="take_finished"):
        engine.reference_outputs([5])


def test_an_id_reused_after_each_cancel_while_waiting_gives_a_valid_trace(make_engine, tmp_path):
    """The same id cancelled while waiting, taken and submitted again writes the same line each time (the
    validator reads each as a new request's first line), then once run to its end."""
    engine = make_engine(trace_path=tmp_path / "trace.ndjson")
    for _ in range(3):
        engine.add_request([1, 2, 3], 2, request_id="again")
        engine.cancel("again")
        assert engine.take_finished()["again"].reason == "cancelled"
    engine.add_request([1, 2, 3], 2, request_id="again")
    engine.run()
    engine.close()
    lines = Path(engine.trace.path).read_text().splitlines()
    assert lines[0] == lines[1] == lines[2]
    report = validate_trace(Path(engine.trace.path))
    assert report.ok and report.requests == 4, report.divergence and report.divergence.describe()


# ------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.complex64, torch.int64, "int8", "float8_e5m2", 3])
def test_unsupported_dtypes_are_refused_at_construction(dtype):
    with pytest.raises(ConfigError, match=r"dtype must be one of \['bfloat16', 'float16', 'float32', 'float64'\]"):
        EngineConfig(device="cpu", dtype=dtype)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("seed", "x", "EngineConfig.seed must be an int, got str 'x'"),
        ("weights_seed", 1.5, "weights_seed must be an int"),
        ("decode_kv_bytes", 2.0, "decode_kv_bytes must be an int"),
        ("decode_kv_bytes", -1, "decode_kv_bytes must be >= 0, got -1; 0 keeps nothing"),
        ("check_invariants", "yes", "check_invariants must be True or False, got 'yes'"),
        ("verify_host_checksums", 1, "verify_host_checksums must be True or False"),
        ("trace_path", 7, "trace_path must be a path"),
        ("model", {}, "model must be an executor.ModelConfig"),
        ("device", 0, "device must be 'auto'"),
        ("scheduler", {"gpu_blocks": 8}, "EngineConfig.scheduler must be a kvstate.SchedulerConfig .*, got dict"),
    ],
)
def test_config_types_are_checked_at_construction(field, value, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**{field: value})


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("gpu_blocks", True, "gpu_blocks must be a positive integer, got True"),
        ("max_preemptions_per_request", "3", "max_preemptions_per_request must be a positive integer or None"),
    ],
)
def test_scheduler_config_types_are_checked_at_construction(field, value, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(scheduler=SchedulerConfig(**{"gpu_blocks": 8, field: value}))


def test_an_engine_config_refuses_several_pipeline_stages():
    with pytest.raises(ConfigError, match="pipeline_stages is 2; keep it 1"):
        EngineConfig(device="cpu", scheduler=SchedulerConfig(gpu_blocks=8, pipeline_stages=2))


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ({"gpu_blocks": 10**9}, r"gpu_blocks=1000000000 \+ host_blocks=0 needs .* GiB of host memory"),
        ({"gpu_blocks": 256, "host_blocks": 10**12}, r"host_blocks=1000000000000 needs .* GiB of host memory"),
    ],
)
def test_pool_sizes_beyond_the_machine_are_refused_before_allocating(sizes, message, tiny_model):
    with pytest.raises(ConfigError, match=message):
        Engine(EngineConfig(device="cpu", scheduler=SchedulerConfig(**sizes)), model=tiny_model)


# ------------------------------------------------------------------------------------ every step, every event
CHUNKED = {"gpu_blocks": 20, "host_blocks": 6, "block_size": 4, "prefill_chunk_size": 5, "max_num_tokens": 12}
CHUNKED_WORK = random_workload(10, 4, (12, 40), (4, 16))


def _sweep(make_engine, monkeypatch, inject, occasions) -> dict[int, str]:
    """Run CHUNKED_WORK once per k of `occasions` with `inject(engine, monkeypatch, k)` arming one failure at the
    k-th occasion; a settled run must then finish like the references, a broken one must say that
    complete_step had applied part of the iteration. Returns {k: "settled" or "broken"}."""
    refs = _chunked_engine(make_engine).batched_reference_outputs()
    outcomes = {}
    for k in occasions:
        engine = _chunked_engine(make_engine)
        with monkeypatch.context() as patch:
            inject(engine, patch, k)
            with pytest.raises((Injected, EngineBroken)) as info:
                engine.run()
        assert_settled(engine)
        if isinstance(info.value, EngineBroken):
            assert isinstance(info.value.__cause__, Injected) and "complete_step" in str(info.value), info.value
            outcomes[k] = "broken"
        else:
            assert engine.run() == refs, f"occasion {k}"
            assert leaked_blocks(engine) == 0
            outcomes[k] = "settled"
        engine.close()
    return outcomes


def _chunked_engine(make_engine) -> Engine:
    engine = make_engine(**CHUNKED)
    for prompt, new in CHUNKED_WORK:
        engine.add_request(prompt, new)
    return engine


def _fail_forward_at(engine, patch, k):
    original, calls = engine.model.forward_paged, iter(range(10_000))

    def forward(*args, **kwargs):
        if next(calls) == k:
            raise Injected(f"forward {k}")
        return original(*args, **kwargs)

    patch.setattr(engine.model, "forward_paged", forward)


def _fail_hook_at(engine, patch, k):
    original, calls = listener_of(engine), iter(range(10_000))

    def hook(request, transition):
        original(request, transition)
        if next(calls) == k:
            raise Injected(f"transition {k} ({transition.event})")

    patch.setattr(engine.scheduler, "on_transition", hook)


def _transitions(make_engine, monkeypatch) -> list[tuple[str, bool]]:
    """(event, fired inside complete_step) of every transition of an undisturbed CHUNKED_WORK run."""
    engine, seen, inside = _chunked_engine(make_engine), [], [False]
    original_hook, original_complete = listener_of(engine), engine.scheduler.complete_step

    def complete_step(*args, **kwargs):
        inside[0] = True
        try:
            return original_complete(*args, **kwargs)
        finally:
            inside[0] = False

    def hook(request, transition):
        original_hook(request, transition)
        seen.append((transition.event, inside[0]))

    with monkeypatch.context() as patch:
        patch.setattr(engine.scheduler, "complete_step", complete_step)
        patch.setattr(engine.scheduler, "on_transition", hook)
        engine.run()
    return seen


@pytest.mark.parametrize(
    "occasions",
    [pytest.param(range(80), marks=pytest.mark.slow, id="every"), pytest.param((0, 14, 36, 50), id="regressions")],
)
def test_a_forward_failure_at_any_step_is_settled(make_engine, monkeypatch, occasions):
    """Regression (forward calls 14, 36 and 50): a discarded step left a prefilling request holding blocks for a
    larger chunk than the one planned next, which the scheduler then subtracted from its block count
    (RES-STATE two steps later)."""
    outcomes = _sweep(make_engine, monkeypatch, _fail_forward_at, occasions)
    assert set(outcomes.values()) == {"settled"}


@pytest.mark.parametrize(
    "every", [pytest.param(1, marks=pytest.mark.slow, id="every"), pytest.param(None, id="first-of-each-event")]
)
def test_a_hook_failure_at_any_transition_is_settled_or_breaks_cleanly(make_engine, monkeypatch, every):
    """A transition fired inside schedule() or fail_migration (admit, suspend, resume, pause, replay, ...) is
    settled; one fired inside complete_step (catch-up, finish) means part of the iteration was applied, so the
    engine breaks cleanly."""
    seen = _transitions(make_engine, monkeypatch)
    firsts = {event: k for k, (event, _) in reversed(list(enumerate(seen)))}
    occasions = sorted(firsts.values()) if every is None else range(0, len(seen), every)
    assert len(firsts) >= 5  # admit, suspend, resume, a pause, finish at least
    outcomes = _sweep(make_engine, monkeypatch, _fail_hook_at, occasions)
    assert outcomes == {k: "broken" if seen[k][1] else "settled" for k in occasions}


# ------------------------------------------------------------------------------- the trace under failure
def test_an_interrupt_inside_the_trace_write_breaks_the_engine_and_says_so(make_engine, tmp_path, monkeypatch):
    """Ctrl-C landing in the trace write: the lines left unwritten would make the trace lie, so the engine
    is broken at once, says why, and the interrupt goes on; what was written is a valid prefix."""
    engine = pressured(make_engine, tmp_path)
    fired = _patch(
        engine, monkeypatch, TraceWriter, "write", when=lambda: engine.scheduler.iteration >= 6, exc=KeyboardInterrupt()
    )
    with pytest.raises(KeyboardInterrupt) as info:
        engine.run()
    assert fired()
    assert any("the engine is broken: KeyboardInterrupt interrupted" in note for note in info.value.__notes__)
    for call in (engine.step, lambda: engine.add_request([1, 2], 2)):
        with pytest.raises(EngineBroken, match="misses lines") as broken:
            call()
        assert isinstance(broken.value.__cause__, KeyboardInterrupt)
    assert_settled(engine)
    engine.close()
    assert validate_trace(Path(engine.trace.path), require_done=False).ok


class _FillingFile(io.RawIOBase):
    """A file on a disk that fills after `room` bytes: the write that crosses it stores what fits (a short write),
    every later one fails with ENOSPC."""

    def __init__(self, path: Path, room: int) -> None:
        self._file, self._room = path.open("wb"), room

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if self._room == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        kept = bytes(data[: self._room])
        self._file.write(kept)
        self._room -= len(kept)
        return len(kept)

    def close(self) -> None:
        self._file.close()
        super().close()


def test_a_disk_that_fills_mid_line_leaves_a_torn_trace_the_validator_reads(make_engine, tmp_path, capsys):
    """The disk fills inside a line; the engine breaks naming the trace, and `kvstate validate` reports
    the cut last line as torn and validates every line before it."""
    engine = pressured(make_engine, tmp_path)
    path = engine.trace.path
    engine.trace._file.close()
    engine.trace._file = io.TextIOWrapper(io.BufferedWriter(_FillingFile(path, 6_000)), "utf-8", line_buffering=True)
    with pytest.raises(EngineBroken, match=f"writing the trace {path} failed .*No space left on device"):
        engine.run()
    engine.close()
    whole = path.read_bytes().count(b"\n")
    assert path.stat().st_size == 6_000 and not path.read_bytes().endswith(b"\n") and whole > 10
    report = validate_trace(path, require_done=False)
    assert report.ok and report.torn_line == whole + 1 and report.lines == whole, report
    assert main(["validate", "--no-require-done", str(path)]) == 0
    assert f"line {whole + 1}, the last, is torn" in capsys.readouterr().out


class _BigId(enum.IntEnum):
    HUGE = 10**25


@pytest.mark.parametrize(
    "request_id, words",
    [
        (10**19, "more than 19 digits"),
        (-(10**19), "more than 19 digits"),
        (_BigId.HUGE, "more than 19 digits"),  # an int subclass is an int id (its trace line carries the int)
        ("x" * 70_000, "70000 characters, more than the 4096 bytes"),
    ],
)
def test_an_id_the_trace_cannot_carry_is_refused_at_submission(make_engine, tmp_path, request_id, words):
    """What the engine accepts, its own trace reader accepts."""
    engine = make_engine(trace_path=tmp_path / "trace.ndjson")
    with pytest.raises(RequestRejected, match=words) as info:
        engine.add_request([1, 2, 3], 2, request_id=request_id)
    assert len(str(info.value)) < 400 and not engine.scheduler.requests
    for fits in (10**19 - 1, "é" * 680):  # at the bounds: 19 digits; 4082 bytes as JSON (\u00e9 each)
        engine.add_request([1, 2, 3], 2, request_id=fits)
    engine.run()
    engine.close()
    report = validate_trace(Path(engine.trace.path))
    assert report.ok and report.requests == 2


def test_a_trace_path_in_a_missing_directory_is_a_clear_error(make_engine, tmp_path):
    """The engine names the trace path and what to do, not a bare `[Errno 2]`."""
    path = tmp_path / "missing" / "trace.ndjson"
    with pytest.raises(OSError) as info:
        make_engine(trace_path=path)
    assert str(info.value) == (
        f"cannot write the trace {path}: No such file or directory; the directory {path.parent} does not exist: "
        "create it first"
    )
