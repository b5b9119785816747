"""Engine runs through the `transitions` machine (the default) and through the compiled table write byte-identical
lifecycle traces and produce identical outputs: `kvstate demo`'s workload, and a fault-injected run (failed and
corrupt copies, host-tier loss). The sim-level differential test is tests/kvstate/test_lifecycle_differential.py.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import pytest
import transitions

from executor import Engine, EngineConfig, FaultPlan, HostTierFallbackWarning
from executor.checks import DEMO_MAX_NEW_TOKENS, DEMO_PROMPT_LEN, random_workload
from kvstate.config import SchedulerConfig

DEMO = {"gpu_blocks": 32, "host_blocks": 16, "block_size": 8, "prefill_chunk_size": 64, "max_num_tokens": 256}


def run(tmp_path: Path, lifecycle: str, requests: int, faults: FaultPlan | None = None) -> tuple[bytes, dict]:
    trace = tmp_path / f"{lifecycle}.ndjson"
    config = EngineConfig(
        device="cpu",
        scheduler=SchedulerConfig(**DEMO, lifecycle=lifecycle),
        seed=0,
        weights_seed=0,
        trace_path=trace,
        faults=faults,
        verify_host_checksums=faults is not None,
    )
    with Engine(config) as engine:
        work = random_workload(
            requests,
            0,
            DEMO_PROMPT_LEN,
            DEMO_MAX_NEW_TOKENS,
            vocab=engine.model.config.vocab_size,
            max_tokens=DEMO["gpu_blocks"] * DEMO["block_size"],
        )
        for prompt, new in work:
            engine.add_request(prompt, new)
        outputs = engine.run()
    return trace.read_bytes(), outputs


@pytest.mark.parametrize(
    "faults",
    [None, FaultPlan.of(3, copy_to_host=0.15, copy_to_gpu=0.15, corrupt_host=0.15, host_loss=[60])],
    ids=["demo", "faults"],
)
def test_engine_traces_are_byte_identical(tmp_path: Path, faults: FaultPlan | None) -> None:
    def announced():  # the injected host-tier loss is announced, in each run
        return pytest.warns(HostTierFallbackWarning, match="host_loss at iteration 60") if faults else nullcontext()

    with announced():
        machine = run(tmp_path, "machine", 48 if faults is None else 32, faults)
    with announced():
        compiled = run(tmp_path, "compiled", 48 if faults is None else 32, faults)
    assert machine[0] == compiled[0], "the engine's lifecycle traces differ between the two implementations"
    assert machine[1] == compiled[1]
    events = machine[0].count(b'"event":"suspend"'), machine[0].count(b'"event":"recompute_pause"')
    assert all(events), f"the workload must preempt both ways, got (suspend, recompute_pause) = {events}"


def test_the_default_engine_fires_transitions_through_the_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The transitions machine is what runs: count its constructions and triggers during an engine run."""
    counts = {"machines": 0, "triggers": 0}
    machine_init, trigger = transitions.Machine.__init__, transitions.core.Event.trigger

    def counting_init(self, *args, **kwargs):
        counts["machines"] += 1
        machine_init(self, *args, **kwargs)

    def counting_trigger(self, *args, **kwargs):
        counts["triggers"] += 1
        return trigger(self, *args, **kwargs)

    monkeypatch.setattr(transitions.Machine, "__init__", counting_init)
    monkeypatch.setattr(transitions.core.Event, "trigger", counting_trigger)
    trace, _ = run(tmp_path, "machine", 12)
    lines = trace.count(b"\n")
    # every transition is a trigger; so is every tried event whose guards all failed (an admission that did not fit)
    assert counts["machines"] == 1 and counts["triggers"] >= lines > 0
    counts.update(machines=0, triggers=0)
    run(tmp_path, "compiled", 12)
    assert counts == {"machines": 0, "triggers": 0}
