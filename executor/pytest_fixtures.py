"""pytest fixtures for tests that embed the reference executor as an oracle.

Import the ones you need into a `conftest.py` (`from executor.pytest_fixtures import make_engine, tiny_model`):

* `single_thread_torch` (session, autouse once imported): torch runs one intra-op thread. The tiny model's ops
  are short; with two intra-op threads on a busy two-core machine every op waits on a barrier, which costs more
  than the op;
* `tiny_model` (session): the default tiny model in float64 on the CPU, seed 0, shared by every engine;
* `make_engine`: `make_engine(**overrides)` builds a CPU engine on `tiny_model` that checks the scheduler's
  invariants around every step (`check_invariants=True`), and closes it after the test; `overrides` name
  `EngineConfig` fields, and `SchedulerConfig` fields (``gpu_blocks=16, block_size=4``) set its `scheduler`;
* `equivalent`: `equivalent(engine, outputs)` asserts every finished output equals its unpressured reference
  and that no block is held afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import fields, replace

import pytest
import torch

from executor.checks import leaked_blocks, mismatches
from executor.engine import Engine
from executor.engine_config import EngineConfig
from executor.model import LlamaModel, ModelConfig
from kvstate.config import SchedulerConfig

_SCHEDULER_FIELDS = frozenset(f.name for f in fields(SchedulerConfig))


@pytest.fixture(autouse=True, scope="session")
def single_thread_torch() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model() -> LlamaModel:
    return LlamaModel.from_seed(ModelConfig(), 0, dtype=torch.float64, device="cpu")


@pytest.fixture
def make_engine(tiny_model: LlamaModel) -> Iterator[Callable[..., Engine]]:
    engines: list[Engine] = []

    def make(**overrides) -> Engine:
        sizes = {name: overrides.pop(name) for name in list(overrides) if name in _SCHEDULER_FIELDS}
        if sizes:
            overrides["scheduler"] = replace(overrides.get("scheduler", EngineConfig().scheduler), **sizes)
        engine = Engine(EngineConfig(**{"device": "cpu", "check_invariants": True, **overrides}), model=tiny_model)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def assert_equivalent(engine: Engine, outputs: dict) -> None:
    """Every finished output equals its unpressured reference, and no block is held afterwards."""
    differ = mismatches(engine, outputs)
    assert not differ, f"{len(differ)} outputs differ from their references, e.g. {next(iter(differ.items()))}"
    assert leaked_blocks(engine) == 0, engine.scheduler.pool.usage()


@pytest.fixture
def equivalent() -> Callable[[Engine, dict], None]:
    return assert_equivalent
