"""nano-vllm's real scheduler as a peer (`executor.bench.nanovllm_peer`). nano-vllm is not on PyPI: the tests that
drive it need a checkout named by KVSTATE_NANO_VLLM (git clone https://github.com/GeeeekExplorer/nano-vllm) and
its block manager's `xxhash`; without them only the loader's refusals are tested."""

from __future__ import annotations

import os
import sys

import pytest

from executor.bench.nanovllm_peer import NanoVLLMDriver, NanoVLLMUnavailable, load
from executor.bench.peers import nano_vllm_section
from executor.bench.stepping import Workload

CHECKOUT = os.environ.get("KVSTATE_NANO_VLLM")
needs_checkout = pytest.mark.skipif(
    not CHECKOUT, reason="set KVSTATE_NANO_VLLM to a nano-vllm checkout (git clone ... nano-vllm) to drive it"
)


def test_a_directory_without_nano_vllm_is_refused_naming_the_file(tmp_path) -> None:
    with pytest.raises(NanoVLLMUnavailable, match=r"not a nano-vllm checkout \(no .*scheduler\.py\); git clone"):
        load(tmp_path)
    section = nano_vllm_section(str(tmp_path), sizes=(8,), repeats=1)
    assert "not a nano-vllm checkout" in section.data["missing"]
    assert all(row.baseline is None and row.value > 0 for row in section.rows)


@needs_checkout
def test_its_scheduler_loads_privately_and_stays_steady_or_preempts_as_sized() -> None:
    before = {name for name in sys.modules if name.split(".")[0] == "nanovllm"}
    nano = load(CHECKOUT)
    assert {name for name in sys.modules if name.split(".")[0] == "nanovllm"} == before
    steps = 12
    steady = NanoVLLMDriver(Workload(32, "steady", steps), nano)
    for _ in range(steps):
        steady.step()
    assert steady.scheduled == [32] * steps and steady.preempted == [0] * steps
    pressure = NanoVLLMDriver(Workload(32, "pressure", steps), nano)
    for _ in range(steps):
        pressure.step()
    assert max(pressure.scheduled) < 32 and sum(pressure.preempted) > 0
    assert not any(seq.is_finished for seq in (*pressure.scheduler.running, *pressure.scheduler.waiting))


@needs_checkout
def test_the_nano_vllm_section_measures_both_side_by_side() -> None:
    section = nano_vllm_section(CHECKOUT, sizes=(16,), repeats=2)
    assert section.data["missing"] is None and section.data["peer"].startswith("nano-vllm")
    assert set(section.data["figures"]) == {
        "16 steady ours machine",
        "16 steady nano-vllm",
        "16 pressure ours machine",
        "16 pressure ours compiled",
        "16 pressure nano-vllm",
    }
    assert all(row.baseline > 0 and row.ratio > 0 for row in section.rows)
    assert [row.met is not None for row in section.rows] == [False, True] * 3  # targets on the step rows
