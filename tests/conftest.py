"""Shared test configuration: Hypothesis profiles and the `cuda` marker.

Profiles (choose with KVSTATE_HYPOTHESIS_PROFILE; default "ci" when CI is set, else "dev"):
  ci    bounded and derandomized, prints a replayable blob on failure
  dev   quick local runs
  long  soaks (5,000 examples)
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=200,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.register_profile("long", max_examples=5000, deadline=None)
settings.load_profile(os.environ.get("KVSTATE_HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))


@pytest.hookimpl(trylast=True)  # after -k/-m deselection, so deselected cuda tests never import torch
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `cuda`-marked tests when no CUDA device is usable; torch is imported only if such a test exists."""
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items:
        return
    try:
        import torch
    except ImportError:
        reason = "needs a CUDA device; torch is not installed"
    else:
        if torch.cuda.is_available():
            return
        reason = "needs a CUDA device; torch.cuda.is_available() is False"
    skip = pytest.mark.skip(reason=reason)
    for item in cuda_items:
        item.add_marker(skip)
