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
