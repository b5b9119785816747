"""The `smollm2` group of `kvstate bench --peers` (`executor.bench.real_model`): SmolLM2-135M's decode beside
transformers' `generate`, steady and under memory pressure, each beside the machine's decode limit measured in the
same run; without the model its row says what to install."""

from __future__ import annotations

import math

import pytest

from executor.bench import PEER_GROUPS, TORCH_GROUPS, run_all
from executor.bench.real_model import REGIMES, RealShape, smollm2_section


def test_without_the_model_the_group_says_what_to_install(monkeypatch):
    from executor.named_models import SMOLLM2, ModelNotInstalled

    def missing(model):
        raise ModelNotInstalled(f"not installed: {model.install}")

    monkeypatch.setattr("executor.named_models.locate", missing)
    assert "smollm2" in PEER_GROUPS and "smollm2" in TORCH_GROUPS  # `--peers` runs it, on one torch thread
    (section,) = run_all(groups=("smollm2",), quick=True, device="cpu")
    (row,) = section.rows
    assert row.baseline is None and math.isnan(row.ratio) and SMOLLM2.install in row.note


@pytest.mark.slow
def test_the_rows_compare_the_engine_beside_generate_steady_and_under_pressure():
    pytest.importorskip("transformers")
    from executor.named_models import SMOLLM2, ModelNotInstalled, locate

    try:
        locate(SMOLLM2)
    except ModelNotInstalled as err:
        pytest.skip(str(err))
    section = smollm2_section(shape=RealShape(batches=(8,), new_tokens=16, repeats=1), device="cpu")
    assert [row.name.split(", ")[1:3] for row in section.rows] == [["batch 8", regime] for regime in REGIMES]
    for row in section.rows:
        assert row.value > 0 and row.baseline and row.ratio > 0
        assert "greedy outputs equal for" in row.note
        limit = section.data["limit"][8]
        assert f"limit {limit['tokens_per_s']:,.0f} tok/s" in row.note and limit["weight_bytes"] > 0
    pressured = section.data["per_batch"][8]
    assert pressured["host none"]["recompute_pauses"] > 0 and pressured["host none"]["suspensions"] == 0


@pytest.mark.parametrize(
    ("ours", "theirs", "equal", "met"),
    [(130.0, 100.0, 8, True), (129.0, 100.0, 8, False), (130.0, 100.0, 7, False), (70.0, 50.0, 8, False)],
    ids=["met", "ratio-short", "outputs-differ", "limit-short"],
)
def test_a_steady_row_meets_its_target_with_the_ratio_the_limit_share_and_equal_outputs(ours, theirs, equal, met):
    """The limit here is 100 tok/s at batch 8 (a step's products take 0.08 s): 70 tok/s is 70% of it."""
    from executor.bench.machine_limit import MachineLimit
    from executor.bench.real_model import _rows

    limit = MachineLimit(batch=8, weight_bytes=80, flops_per_step=1.0, products_seconds=0.08)
    figures = {
        "steady": {"tokens_per_s": ours, "outputs_equal": equal},
        "host none": {"tokens_per_s": ours / 2, "outputs_equal": 8, "suspensions": 0, "recompute_pauses": 3},
        "generate": {"tokens_per_s": theirs, "outputs_equal": 8},
    }
    steady, pressured = _rows(8, figures, "generate", RealShape(batches=(8,), new_tokens=4, repeats=2), limit)
    assert steady.met is met and "of the limit" in steady.target
    assert pressured.met is None and pressured.target == ""
