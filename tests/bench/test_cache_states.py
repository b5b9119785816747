"""`stepping.measure`'s cache states (warm, interleaved, cold), the eviction they use, and the peer rows that give
the warm and cold ratios beside the interleaved one (never wall times: orders, calls, keys and notes)."""

from __future__ import annotations

import functools
import itertools
import re

import pytest

from executor.bench import stepping
from executor.bench.peers import BRACKETS, Peer, peer_section
from executor.bench.stepping import Driver, OursDriver, Workload, largest_cache_bytes, measure


class _Recording(Driver):
    """A driver whose steps append its name to a shared log (and record a fixed sample)."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.workload = Workload(4, "steady", 1)
        self.name, self.log = name, log
        self.schedule_s, self.step_s, self.scheduled, self.preempted = [], [], [], []

    def step(self) -> None:
        self.log.append(self.name)
        self.record(1e-6, 2e-6, 4, 0)


def _drivers(log: list[str]) -> dict[str, Driver]:
    return {name: _Recording(name, log) for name in ("a", "b", "c")}


def test_warm_steps_each_driver_back_to_back_and_interleaved_takes_turns() -> None:
    log: list[str] = []
    figures = measure(_drivers(log), repeats=3, warmup=1, seed=5, cache="warm")
    assert len(log) == 12 and all(log[i : i + 4] == [log[i]] * 4 for i in range(0, 12, 4))  # runs of one driver
    assert sorted(log[::4]) == ["a", "b", "c"] and figures["a"].step_us == pytest.approx(2.0)
    again: list[str] = []
    measure(_drivers(again), repeats=3, warmup=1, seed=5, cache="warm")
    assert again == log  # the order of the drivers is seeded
    log.clear()
    measure(_drivers(log), repeats=3, warmup=1, seed=5)
    assert all(sorted(log[i : i + 3]) == ["a", "b", "c"] for i in range(0, 12, 3))  # every driver once a round


def test_cold_evicts_the_caches_before_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    monkeypatch.setattr(stepping, "evict_caches", lambda: log.append("evict"))
    measure(_drivers(log), repeats=2, warmup=1, seed=0, cache="cold")
    assert len(log) == 18 and log[::2] == ["evict"] * 9 and "evict" not in log[1::2]
    with pytest.raises(ValueError, match="cache must be one of"):
        measure(_drivers(log), repeats=1, cache="lukewarm")


def test_the_eviction_buffer_exceeds_the_largest_cache() -> None:
    stepping.evict_caches()  # writes over the whole buffer without error
    buffer, ones = stepping._eviction_buffer()
    largest = largest_cache_bytes()
    assert len(buffer) >= stepping.EVICT_MIN_BYTES and len(ones) == len(buffer) // 64
    assert largest is None or len(buffer) >= min(stepping.EVICT_MAX_BYTES, 4 * largest)


def test_the_largest_cache_is_read_from_sysfs_sizes(tmp_path) -> None:
    for index, size in (("index0", "48K"), ("index2", "1024K"), ("index3", "16M"), ("index4", "n/a")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert largest_cache_bytes(tmp_path) == 16 << 20
    assert largest_cache_bytes(tmp_path / "missing") is None


def test_each_pressure_step_row_gives_the_warm_and_cold_ratios_of_its_data() -> None:
    # our own scheduler on the compiled table stands in for a peer: the section's structure, not a comparison
    peer = Peer(
        "self",
        "ours again",
        functools.partial(OursDriver, lifecycle="compiled"),
        None,
        "step()",
        "schedule()",
        {"steady": 10.0, "pressure": 10.0},
    )
    section = peer_section(peer, sizes=(16,), repeats=2)
    brackets = section.data["brackets"]
    pressure = {"16 pressure ours machine", "16 pressure ours compiled", "16 pressure self"}
    assert tuple(brackets) == BRACKETS and all(set(found) == pressure for found in brackets.values())
    steps = [row for row in section.rows if row.name.startswith("step, 16 running, under pressure")]
    assert len(steps) == 2
    for row in steps:
        kind = row.name.rsplit(" ", 1)[1]
        shown = re.search(r"step ratio with caches warm ([\d.]+), cold ([\d.]+)$", row.note)
        assert shown is not None, row.note
        for cache, text in zip(BRACKETS, shown.groups(), strict=True):
            found = brackets[cache]
            ratio = found[f"16 pressure ours {kind}"]["step_us"] / found["16 pressure self"]["step_us"]
            assert text == f"{ratio:.2f}"
    assert not any("caches" in row.note for row in section.rows if "steady" in row.name)


def test_without_the_peer_nothing_is_measured_again() -> None:
    peer = Peer("self", "missing", None, "not here", "step()", "schedule()", {"steady": 1.0, "pressure": 1.0})
    section = peer_section(peer, sizes=(16,), repeats=1)
    assert section.data["brackets"] == {} and not any("caches" in row.note for row in section.rows)


def _replay_chunks(driver: OursDriver, steps: int) -> int:
    """Replay chunks scheduled over the next `steps` steps of `driver`."""
    replays = 0
    for _ in range(steps):
        driver.step()
        replays += len(driver.scheduler.last_pass.output.replay)
    return replays


def test_the_pressure_regime_preempts_nearly_every_step_and_thins_out() -> None:
    """What `stepping`'s docstring says of the pressure workload, and why `peers` measures the warm and cold states
    on new drivers: nearly every measured step preempts, each decodes no more requests than the one before (the
    resident set thins out well below where it began), and readmissions rarely find room."""
    driver = OursDriver(Workload(256, "pressure", 42), lifecycle="compiled")
    assert _replay_chunks(driver, 42) <= 3
    assert driver.preempted.count(0) <= 3
    assert all(later <= earlier for earlier, later in itertools.pairwise(driver.scheduled))
    assert driver.scheduled[-1] <= 0.6 * driver.scheduled[0]
    for size in (1024, 4096):
        assert _replay_chunks(OursDriver(Workload(size, "pressure", 42), lifecycle="compiled"), 42) <= 3
