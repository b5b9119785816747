"""The serving workloads of the `transformers` group: their shapes, and a tiny run of every variant with outputs
compared (structure only, never wall times)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.bench.serving import (
    HOST_TIERS,
    PRESSURE_RUNS,
    Request,
    ServingShape,
    _engine_run,
    fewest_steps,
    needed_blocks,
    pressure_run,
    step_cost_ceiling,
    workload_section,
    workloads,
)

TINY = ServingShape(batch=2, prompt_len=4, new_tokens=4, repeats=1)


def test_the_workloads_differ_where_their_names_say() -> None:
    work = workloads(ServingShape(batch=16, prompt_len=32, new_tokens=64, repeats=1), vocab=512, seed=0)
    assert set(work) == {"best case", "ragged prompts", "staggered budgets", "arrivals during decode"}
    assert all(len(requests) == 16 for requests in work.values())
    assert {len(r.prompt) for r in work["best case"]} == {32} and {r.budget for r in work["best case"]} == {64}
    assert len({len(r.prompt) for r in work["ragged prompts"]}) > 1
    assert all(8 <= len(r.prompt) <= 64 for r in work["ragged prompts"])
    assert len({r.budget for r in work["staggered budgets"]}) > 1
    arrivals = [r.arrival for r in work["arrivals during decode"]]
    assert arrivals[:8] == [0] * 8 and arrivals[8:] == sorted(arrivals[8:]) and min(arrivals[8:]) > 0
    assert workloads(TINY, 512, 3) == workloads(TINY, 512, 3)  # seeded


def test_every_variant_runs_and_every_output_is_compared() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        section = workload_section(shape=TINY, device="cpu")
    finally:
        torch.set_num_threads(threads)
    names = [row.name for row in section.rows]
    assert len(names) == 4 + len(PRESSURE_RUNS)
    # every host tier runs under both offload policies, but none: without a host tier nothing is offloaded
    assert PRESSURE_RUNS == (
        ("none", None),
        ("a quarter", "on_demand"),
        ("a quarter", "eager"),
        ("full", "on_demand"),
        ("full", "eager"),
    )
    assert {tier for tier, _ in PRESSURE_RUNS} == set(HOST_TIERS)
    need = needed_blocks(workloads(TINY, 512, 0)["best case"])
    assert section.data["gpu_blocks_needed"] == need
    for row in section.rows[:4]:
        assert row.baseline_name.endswith("one static batch at a time") and row.ratio > 0
        assert row.met is not None
        # one round after the warmup: its per-round ratio is the row's ratio itself
        assert (
            row.note
            == f"greedy outputs equal for 2/2; per-round ratios {row.ratio:.2f} to {row.ratio:.2f} over 1 rounds"
        )
    steps, fewest = section.data["engine_steps"], section.data["fewest_steps_under_pressure"]
    best = workloads(TINY, 512, 0)["best case"]
    assert steps["best case engine"] == fewest_steps(best, need) == TINY.new_tokens  # unpressured: one step a token
    assert fewest == fewest_steps(best, need // 2)
    copies = section.data["engine_copies"]
    for row, (tier, offload) in zip(section.rows[4:], PRESSURE_RUNS, strict=True):
        policy = "" if offload is None else f", offload {offload}"
        assert row.name.endswith(f"GPU tier {need // 2} of {need} blocks, host tier {tier}{policy}")
        assert row.note.startswith("outputs equal to unpressured for 2/2, to generate for 2;")
        assert (row.met is not None) == (tier == "full")
        run = pressure_run(tier, offload)
        taken, copied = steps[run], copies[run]
        assert taken >= fewest
        assert 0 <= copied["resumed_without_copy"] <= copied["resumes"]
        if offload is None:
            assert copied["blocks_offloaded"] == copied["blocks_migrated"] == 0
            assert "; no host tier: nothing is offloaded under either policy" in row.note
        assert (
            f"; {taken} engine steps (unpressured {TINY.new_tokens}; no schedule in {need // 2} GPU blocks takes "
            f"fewer than {fewest}); {copied['blocks_offloaded']} blocks offloaded, "
            f"{copied['resumed_without_copy']} of {copied['resumes']} resumes without a copy"
        ) in row.note
        assert row.note.endswith(f"; per-round ratios {row.ratio:.2f} to {row.ratio:.2f} over 1 rounds")
        # the ceiling is this run's ratio scaled by its steps over the fewest any schedule takes
        ceiling, per_step = section.data["step_cost_ceiling"][run], section.data["step_seconds"]
        assert ceiling == pytest.approx(row.ratio * taken / fewest) and ceiling >= row.ratio * (1 - 1e-9)
        assert per_step[run] > 0 and per_step["best case engine"] > 0
        assert (
            f"; a step took {per_step[run] * 1e3:.2f} ms vs {per_step['best case engine'] * 1e3:.2f} ms "
            f"unpressured: at that cost {fewest} steps give a ratio of at most {ceiling:.2f}"
        ) in row.note


@given(
    unpressured=st.floats(1e-3, 10.0),
    pressured=st.floats(1e-3, 10.0),
    fewest=st.integers(1, 200),
    extra=st.integers(0, 200),
)
def test_the_step_cost_ceiling_is_the_ratio_at_the_fewest_steps(unpressured, pressured, fewest, extra) -> None:
    """A run that took the fewest steps is at its own ceiling; each step more raises the ceiling above the
    measured ratio in proportion."""
    steps = fewest + extra
    ceiling = step_cost_ceiling(unpressured, pressured, steps, fewest)
    assert ceiling == pytest.approx((unpressured / pressured) * steps / fewest)
    assert step_cost_ceiling(unpressured, pressured, fewest, fewest) == pytest.approx(unpressured / pressured)


@pytest.mark.parametrize(("steps", "fewest", "seconds"), [(3, 4, 1.0), (4, 0, 1.0), (4, 4, 0.0)])
def test_the_step_cost_ceiling_refuses_impossible_runs(steps, fewest, seconds) -> None:
    with pytest.raises(ValueError, match="fewest"):
        step_cost_ceiling(1.0, seconds, steps, fewest)


_REQUESTS = st.lists(
    st.builds(Request, st.lists(st.integers(0, 511), min_size=1, max_size=40).map(tuple), st.integers(1, 24)),
    min_size=1,
    max_size=4,
)


@given(requests=_REQUESTS, block_size=st.integers(1, 16))
def test_fewest_steps_is_the_longest_budget_when_every_block_fits(requests, block_size) -> None:
    """With a GPU tier of every block the requests need, nothing bounds the steps but the longest budget; with
    fewer blocks the bound never falls."""
    need = needed_blocks(requests, block_size)
    longest = max(r.budget for r in requests)
    assert fewest_steps(requests, need, block_size) == longest
    bounds = [fewest_steps(requests, blocks, block_size) for blocks in range(need, 0, -1)]
    assert bounds == sorted(bounds) and bounds[-1] >= longest


@pytest.fixture(scope="module")
def float32_model():
    torch = pytest.importorskip("torch")
    from executor import LlamaModel, ModelConfig

    return LlamaModel.from_seed(ModelConfig(), 0, dtype=torch.float32, device="cpu")


@settings(max_examples=12, deadline=None)
@given(requests=_REQUESTS, room=st.floats(0.0, 1.0), host=st.sampled_from([0.0, 1.0]))
def test_no_engine_run_takes_fewer_steps_than_the_bound(float32_model, requests, room, host) -> None:
    """The engine, preempting by recompute or by suspension to fit a GPU tier between the largest request alone
    and all of them, never finishes in fewer steps than `fewest_steps` says any schedule needs."""
    largest = max(needed_blocks([r]) for r in requests)
    need = needed_blocks(requests)
    gpu = largest + round(room * (need - largest))
    taken: list[int] = []
    run = _engine_run(
        float32_model, requests, need=gpu, host=round(host * need), lifecycle="compiled", record_steps=taken.append
    )
    run()
    assert taken[0] >= fewest_steps(requests, gpu)
