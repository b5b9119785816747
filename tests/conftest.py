"""Shared test configuration: Hypothesis profiles and the `cuda` marker.

The Hypothesis profiles (`ci`, `dev`, `long`; choose with KVSTATE_HYPOTHESIS_PROFILE, default "ci" when CI is set,
else "dev") are registered and loaded by `kvstate.testing` itself, so third parties get them too; importing it here
loads them for every test, including those that never import it.
"""

from __future__ import annotations

import pytest

import kvstate.testing  # noqa: F401  (registers and loads the Hypothesis profiles)


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
