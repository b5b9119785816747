"""Fixtures of the executor tests: one intra-op thread, a shared tiny model, and an engine factory.

The tiny model's ops are microseconds long; with two intra-op threads on a busy two-core machine every op waits
on a barrier (measured 25x slower), so these tests run torch single-threaded.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from executor import Engine, EngineConfig, LlamaModel, ModelConfig
from executor.checks import leaked_blocks, mismatches


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


def assert_equivalent(engine: Engine, outputs: dict) -> None:
    """Every finished output equals its unpressured reference, and no block is held afterwards."""
    differ = mismatches(engine, outputs)
    assert not differ, f"{len(differ)} outputs differ from their references, e.g. {next(iter(differ.items()))}"
    assert leaked_blocks(engine) == 0, engine.scheduler.pool.usage()


@pytest.fixture
def equivalent():
    """`equivalent(engine, outputs)` asserts output equivalence and no leak."""
    return assert_equivalent


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
