"""Fixtures of the fault tests: one intra-op thread (two shared cores), a shared tiny model, an engine factory.

Every engine built here checks the scheduler's invariants around every step (`check_invariants=True`), so a
fault that broke block conservation, residency or the output lists fails the step that caused it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from executor import Engine, EngineConfig, LlamaModel, ModelConfig


@pytest.fixture(autouse=True, scope="session")
def _single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model() -> LlamaModel:
    """The default tiny model in float64 on the CPU (seed 0); engines share it through `Engine(model=...)`."""
    return LlamaModel.from_seed(ModelConfig(), 0, dtype=torch.float64, device="cpu")


@pytest.fixture
def make_engine(tiny_model) -> Callable[..., Engine]:
    """`make_engine(**EngineConfig overrides)` on the CPU with invariant checks around every step."""
    engines: list[Engine] = []

    def make(**overrides) -> Engine:
        settings = {"device": "cpu", "check_invariants": True, **overrides}
        engine = Engine(EngineConfig(**settings), model=tiny_model)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()
