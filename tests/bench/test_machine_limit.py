"""The machine's decode limit (`executor.bench.machine_limit`): the arithmetic on made-up figures, the weight
matrices counted from a model's own tensors, and one small measurement that yields positive finite figures."""

from __future__ import annotations

import dataclasses
import math

import pytest

from executor.bench.machine_limit import (
    MachineLimit,
    flops_per_step,
    measure_products,
    parameters_per_token,
    weight_shapes,
)


def test_a_step_takes_at_least_its_matrix_products():
    # 400 MB of weights multiplied through at batch 4 in 40 ms: 100 tok/s, 10 GB/s, 20 GFLOP/s
    limit = MachineLimit(batch=4, weight_bytes=400_000_000, flops_per_step=8e8, products_seconds=0.04)
    assert limit.step_seconds == pytest.approx(0.04)
    assert limit.tokens_per_s == pytest.approx(100.0)
    assert limit.share(75.0) == pytest.approx(0.75)
    assert limit.describe(25.0).endswith("): 25% of it")
    assert "limit 100 tok/s (the step's matrix products alone: weights 400 MB from memory at 10.0 GB/s" in (
        limit.describe(25.0)
    )
    assert "20.0 GFLOP/s" in limit.describe(25.0)
    assert limit.to_dict()["tokens_per_s"] == pytest.approx(100.0)


def test_operations_count_two_per_weight_per_row():
    assert parameters_per_token({(3, 5): 2, (7, 11): 1}) == 2 * 15 + 77
    assert flops_per_step(4, 1000) == 8000.0


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


def test_a_small_measurement_gives_positive_finite_seconds():
    import torch

    seconds = measure_products(2, {(8, 16): 2, (8, 4): 1}, "cpu", torch.float32)
    assert math.isfinite(seconds) and seconds > 0


@pytest.mark.parametrize("faster", ["row-major", "column-major"])
def test_each_shape_counts_its_faster_weight_layout_over_all_its_matrices(monkeypatch, faster):
    """Made-up timings: a sample takes one second per matrix in one layout and two in the other; each shape's
    matrices are all multiplied in each sample, in both layouts, and the faster layout's seconds count."""
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
        per_matrix = 1.0 if set(layouts) == {faster} else 2.0
        return [per_matrix * len(layouts)] * repeats

    monkeypatch.setattr(torch.nn.functional, "linear", recording_linear)
    monkeypatch.setattr(machine_limit, "_timed", made_up_timed)
    assert measure_products(2, {(8, 16): 2, (8, 4): 1}, "cpu", torch.float32) == pytest.approx(3.0)


def test_each_timed_sample_starts_with_the_caches_evicted(monkeypatch):
    """A real step finds no weight in the caches: every timed sample follows an eviction, the warmup none."""
    from executor.bench import machine_limit, stepping

    events = []
    monkeypatch.setattr(stepping, "evict_caches", lambda: events.append("evict"))
    machine_limit._timed(lambda: events.append("call"), "cpu", repeats=3)
    assert events == ["call", "evict", "call", "evict", "call", "evict", "call"]
