"""OUTPUT-EQUIV under both offload policies of the spec (`[policy] offload`): `on_demand` (shipped: held blocks move
to the host tier only when an allocation needs the GPU room) and `eager` (every block of a victim moves in the pass
that suspends it), each with no host tier, one too small for most victims, and an ample one.

Each case asserts that the paths it is about were taken, so a workload change cannot silently turn it into an
unpressured run, and what the policy implies for the copies: `eager` with room for every victim copies all of a
suspended request's blocks at once, so no resume finds a block on the GPU; `on_demand` offloads only what an
allocation needs, so some suspended requests resume with their blocks still on the GPU.
"""

from __future__ import annotations

import pytest

from executor import OFFLOAD_POLICIES, EngineConfig, offload_spec
from executor.checks import random_workload as workload
from executor.checks import submit_all as submit
from kvstate.config import ConfigError
from kvstate.spec import default_spec

HOST_TIERS = {"none": 0, "too small": 3, "ample": 64}
PRESSURED = {"gpu_blocks": 16, "block_size": 4, "prefill_chunk_size": 64}


def _run(make_engine, offload: str, host_blocks: int, seed: int = 1, **overrides):
    engine = make_engine(spec=offload_spec(offload), host_blocks=host_blocks, **{**PRESSURED, **overrides})
    submit(engine, workload(12, seed, (4, 30), (4, 24)))
    return engine, engine.run()


@pytest.mark.parametrize("host", list(HOST_TIERS))
@pytest.mark.parametrize("offload", OFFLOAD_POLICIES)
def test_every_output_equals_its_unpressured_reference(make_engine, equivalent, offload, host):
    engine, outputs = _run(make_engine, offload, HOST_TIERS[host])
    totals = engine.totals
    assert engine.scheduler.policy.offload == offload
    assert totals.suspensions + totals.recompute_pauses > 0  # the run was pressured
    assert totals.blocks_offloaded + totals.blocks_onboarded == totals.blocks_migrated
    if host == "none":
        assert totals.suspensions == totals.events["offload"] == totals.blocks_migrated == 0
        assert totals.recompute_pauses > 0
    else:
        assert totals.suspensions > 0 and totals.events["offload"] > 0 and totals.events["resume"] > 0
    if host == "ample":
        if offload == "eager":  # every block of every victim was copied at suspension
            assert totals.resumed_without_copy == totals.blocks_relocked == 0
        else:  # only what allocations needed
            assert totals.resumed_without_copy > 0 or totals.blocks_relocked > 0
    equivalent(engine, outputs)


@pytest.mark.parametrize("offload", OFFLOAD_POLICIES)
def test_faults_under_both_policies_keep_every_output(make_engine, equivalent, offload):
    from executor import FaultPlan

    faults = FaultPlan.of(5, copy_to_host=0.3, copy_to_gpu=0.3, corrupt_host=0.5)
    engine, outputs = _run(make_engine, offload, 8, faults=faults, verify_host_checksums=True)
    totals = engine.totals
    assert totals.failed_copies + totals.checksum_mismatches >= 2  # copies failed or found corrupt, and undone
    equivalent(engine, outputs)


def test_on_demand_copies_fewer_blocks_than_eager_on_the_same_workload(make_engine, equivalent):
    """The point of lazy suspension: with room on the host for every victim, eager offload copies every block of
    every victim down and up again, on-demand only those an allocation needed (and re-locks the rest)."""
    runs = {offload: _run(make_engine, offload, HOST_TIERS["ample"]) for offload in OFFLOAD_POLICIES}
    for engine, outputs in runs.values():
        equivalent(engine, outputs)
    lazy, eager = runs["on_demand"][0].totals, runs["eager"][0].totals
    assert lazy.blocks_migrated < eager.blocks_migrated
    assert lazy.blocks_relocked > eager.blocks_relocked == 0


def test_offload_spec_copies_the_spec_and_refuses_unknown_policies():
    spec = default_spec()
    assert offload_spec(spec.policy.offload, spec) is spec
    other = next(p for p in OFFLOAD_POLICIES if p != spec.policy.offload)
    copy = offload_spec(other, spec)
    assert copy.policy.offload == other and copy.states == spec.states and spec.policy.offload != other
    with pytest.raises(ConfigError, match="is not one of"):
        offload_spec("sometimes")
    with pytest.raises(ConfigError, match=r"EngineConfig\.spec must be a kvstate\.Spec"):
        EngineConfig(spec="eager")  # type: ignore[arg-type]
