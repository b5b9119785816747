"""What the checker derives from a bound stays linear in it and on the bound's clock: the reference output of a
request hashes each token of its context once (a running checksum), not the whole context per token, and the time
it takes counts against the time limit."""

from __future__ import annotations

import dataclasses
import time
import zlib

from kvstate import sim
from kvstate.checker import runner
from kvstate.checker.bounds import select_bounds
from kvstate.checker.explore import INCOMPLETE
from kvstate.sim import next_token, reference_output


def test_reference_output_is_next_token_of_each_context_so_far():
    prompt = [(k * 7) % 97 + 1 for k in range(9)]
    out = reference_output(prompt, 40)
    context = list(prompt)
    for token in out:
        assert token == next_token(context)
        context.append(token)
    stop = out[5]
    assert reference_output(prompt, 40, (stop,)) == out[: out.index(stop) + 1]


def test_reference_output_hashes_each_context_token_once(monkeypatch):
    hashed: list[int] = []
    crc32 = zlib.crc32

    def counting_crc32(data: bytes, value: int = 0) -> int:
        hashed.append(len(data))
        return crc32(data, value)

    monkeypatch.setattr(sim.zlib, "crc32", counting_crc32)
    prompt, new = [1] * 50, 2000
    reference_output(prompt, new)
    assert sum(hashed) <= 8 * (len(prompt) + new)  # 8 bytes per token: linear, where hashing each context is not


def test_the_time_limit_counts_the_work_derived_before_the_search(monkeypatch):
    """Building the refinement (its reference outputs) is on the bound's clock: when it alone takes longer than the
    time limit, the search is cut short at once (incomplete), not given the whole limit again."""
    real = time.perf_counter
    skipped = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real() + skipped[0])

    class SlowToBuild(runner.Refinement):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            skipped[0] += 100.0  # as if deriving its reference outputs took 100 s

    monkeypatch.setattr(runner, "Refinement", SlowToBuild)
    (bound,) = select_bounds(["default"])
    report = runner.check_bound(dataclasses.replace(bound, abstract_model=False), time_limit=60.0)
    assert report.refinement is not None and report.refinement.verdict == INCOMPLETE
