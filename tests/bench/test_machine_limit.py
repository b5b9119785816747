"""The machine's decode limit (`executor.bench.machine_limit`): the arithmetic on made-up figures, the weight
matrices counted from a model's own tensors, and one small measurement that yields positive finite figures."""

from __future__ import annotations

import dataclasses
import math

import pytest

from executor.bench.machine_limit import (
    MachineLimit,
    copy_bandwidth,
    flops_per_step,
    measure_bandwidth,
    measure_matmul,
    parameters_per_token,
    weight_shapes,
    weighted_flops_per_s,
)


def test_a_step_bound_by_reading_its_weights_takes_their_bytes_at_the_bandwidth():
    # 400 MB at 10 GB/s: 40 ms; 0.8 GFLOP at 100 GFLOP/s: 8 ms; the weights bound it
    limit = MachineLimit(
        batch=4, weight_bytes=400_000_000, flops_per_step=8e8, bandwidth_bytes_per_s=1e10, matmul_flops_per_s=1e11
    )
    assert limit.step_seconds == pytest.approx(0.04)
    assert limit.tokens_per_s == pytest.approx(100.0)
    assert limit.share(75.0) == pytest.approx(0.75)


def test_a_step_bound_by_its_matrix_products_takes_their_operations_at_the_throughput():
    # 100 MB at 10 GB/s: 10 ms; 2 GFLOP at 50 GFLOP/s: 40 ms; the products bound it
    limit = MachineLimit(
        batch=8, weight_bytes=100_000_000, flops_per_step=2e9, bandwidth_bytes_per_s=1e10, matmul_flops_per_s=5e10
    )
    assert limit.step_seconds == pytest.approx(0.04)
    assert limit.tokens_per_s == pytest.approx(200.0)
    assert limit.describe(50.0).endswith("): 25% of it")
    assert "limit 200 tok/s (weights 100 MB at 10.0 GB/s, matmul 50.0 GFLOP/s)" in limit.describe(50.0)
    assert limit.to_dict()["tokens_per_s"] == pytest.approx(200.0)


def test_operations_count_two_per_weight_per_row():
    assert parameters_per_token({(3, 5): 2, (7, 11): 1}) == 2 * 15 + 77
    assert flops_per_step(4, 1000) == 8000.0


def test_copy_bandwidth_counts_the_bytes_read_and_written_over_the_median_time():
    assert copy_bandwidth(1000, [2.0, 0.5, 1.0]) == pytest.approx(2000.0)


def test_matmul_throughput_weights_each_shape_by_how_often_a_step_uses_it():
    shapes = {(10, 20): 3, (10, 100): 1}  # batch 2: 800 operations per (10, 20) call, 4,000 per (10, 100)
    seconds = {(10, 20): 1e-6, (10, 100): 2e-6}
    assert weighted_flops_per_s(2, shapes, seconds) == pytest.approx((3 * 800 + 4000) / (3e-6 + 2e-6))


def test_the_weight_matrices_come_from_the_models_tensors_with_a_tied_vocabulary_projection():
    from executor.model import LlamaModel, ModelConfig

    config = ModelConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=24,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaModel.from_seed(config, seed=0)
    shapes = weight_shapes(model)
    assert shapes[(16, 50)] == 1 and sum(shapes.values()) == 3 * 4 + 1  # per layer: qkv, o, gate_up, down
    untied = weight_shapes(LlamaModel.from_seed(dataclasses.replace(config, tie_word_embeddings=False)))
    assert untied == shapes  # the separate lm_head has the embedding's shape
    embedded = model.embed_tokens.weight.numel()
    linear = sum(p.numel() for name, p in model.named_parameters() if name.endswith("proj.weight"))
    assert parameters_per_token(shapes) == linear + embedded


def test_a_small_measurement_gives_positive_finite_figures():
    import torch

    bandwidth = measure_bandwidth("cpu", elements=1 << 16, repeats=2)
    flops = measure_matmul(2, {(8, 16): 2, (8, 4): 1}, "cpu", torch.float32)
    assert math.isfinite(bandwidth) and bandwidth > 0
    assert math.isfinite(flops) and flops > 0


@pytest.mark.parametrize("faster", ["row-major", "column-major"])
def test_each_shape_counts_its_faster_weight_layout(monkeypatch, faster):
    """Made-up timings: a product takes one second with its weight in one layout and two in the other; each
    shape is timed in both and its faster second counts, whichever layout that is."""
    import torch

    from executor.bench import machine_limit

    layouts = []
    linear = torch.nn.functional.linear

    def recording_linear(rows, weight):
        layouts.append("row-major" if weight.is_contiguous() else "column-major")
        return linear(rows, weight)

    def made_up_timed(call, device, *, repeats):
        layouts.clear()
        call()
        return [1.0 if set(layouts) == {faster} else 2.0] * repeats

    monkeypatch.setattr(torch.nn.functional, "linear", recording_linear)
    monkeypatch.setattr(machine_limit, "_timed", made_up_timed)
    shapes = {(8, 16): 2, (8, 4): 1}
    calls = {
        shape: max(1, round(machine_limit.MATMUL_FLOPS_PER_SAMPLE / flops_per_step(2, math.prod(shape))))
        for shape in shapes
    }
    expected = weighted_flops_per_s(2, shapes, {shape: 1.0 / calls[shape] for shape in shapes})
    assert measure_matmul(2, shapes, "cpu", torch.float32) == pytest.approx(expected)
