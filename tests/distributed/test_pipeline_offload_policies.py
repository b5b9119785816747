"""Two gloo ranks on the CPU, two micro-batches in flight, under both offload policies of the spec (`on_demand`,
`eager`) with no host tier, one too small for most victims and an ample one: every output equals the
single-process oracle, nothing leaks, and every rank's trace follows the spec and equals rank 0's.

Under on-demand offload a suspended request whose decode step is still in flight is not offloaded until the step
lands (its token is written into the held blocks), so micro-batches in flight are the case that matters here.
"""

from __future__ import annotations

import pytest

from executor import offload_spec
from executor.pipeline import PipelineConfig, run_pipeline

from .conftest import check_trace, pressured, references, workload

pytestmark = pytest.mark.distributed
HOST_TIERS = {"none": 0, "too small": 3, "ample": 64}


@pytest.mark.parametrize("host", list(HOST_TIERS))
@pytest.mark.parametrize("offload", ["on_demand", "eager"])
def test_outputs_equal_the_oracle_under_each_offload_policy(offload, host):
    engine = pressured(host_blocks=HOST_TIERS[host], spec=offload_spec(offload))
    work = workload()
    config = PipelineConfig(engine=engine, timeout_s=30.0, max_iterations=1000, micro_batches=2)
    result = run_pipeline(config, work, world_size=2)
    driver = result.driver
    refs = references(engine, work)
    assert set(driver.done_reasons) == set(range(len(work)))
    assert all(reason == "finished" for reason in driver.done_reasons.values())
    assert result.outputs == refs
    assert driver.leaked_blocks == 0
    totals, events = driver.totals, driver.totals["events"]
    assert events.get("suspend", 0) + events.get("recompute_pause", 0) > 0  # the run was pressured
    assert totals["blocks_offloaded"] + totals["blocks_onboarded"] == totals["blocks_migrated"]
    assert totals["resumed_without_copy"] <= events.get("resume", 0)
    if host == "none":
        assert events.get("offload", 0) == events.get("suspend", 0) == totals["blocks_migrated"] == 0
    else:
        assert events.get("offload", 0) > 0 and totals["blocks_offloaded"] > 0
    for rank in result.ranks:
        check_trace(list(rank.trace))
    assert result.ranks[1].trace == result.ranks[0].trace
