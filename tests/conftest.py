"""Shared test configuration: Hypothesis profiles, the `cuda` marker, no inherited terminal width, a two-line
trace of any spec and lines of progress while the suite runs (tests/progress.py).

The Hypothesis profiles are registered by `kvstate.hypothesis_profiles` (the package's pytest plugin registers them,
so `pytest --hypothesis-profile=NAME` works), which loads none by itself; this suite loads the one
KVSTATE_HYPOTHESIS_PROFILE names, else "ci" when CI is set, else "dev" (`--hypothesis-profile=NAME` still wins: it is
loaded after this file).
"""

from __future__ import annotations

import os

import pytest

from kvstate.hypothesis_profiles import PROFILE_ENV, load_profile
from kvstate.trace import TRACE_FIELDS

load_profile(os.environ.get(PROFILE_ENV) or ("ci" if os.environ.get("CI") else "dev"))


def _draw_without_local_constants() -> None:
    """Hypothesis mixes literals of the local modules loaded so far into what it draws (its "local constants"), so a
    derandomized search (a test that must find a planted bug) would depend on which modules earlier tests imported
    and on whether kvstate is installed (CI) or editable: this suite draws without them, and each search is the same
    in any order and any install.

    Hypothesis has no setting for it, so its provider's private lookup is replaced. A Hypothesis that renames or
    moves that lookup stops the suite here, saying so, rather than letting the searches silently depend on order."""
    from hypothesis import __version__
    from hypothesis.internal.conjecture import providers

    lookup = "hypothesis.internal.conjecture.providers._get_local_constants"
    if not all(hasattr(providers, name) for name in ("_get_local_constants", "Constants", "HypothesisProvider")):
        raise RuntimeError(
            f"tests/conftest.py: Hypothesis {__version__} has no {lookup} (or no Constants or HypothesisProvider "
            "beside it), which this suite replaces so that its derandomized searches draw no local constants; find "
            "where HypothesisProvider now collects its local constants and replace that here, or install "
            "Hypothesis 6.170.x, which has it"
        )
    providers._get_local_constants = providers.Constants
    drawn_from = getattr(providers.HypothesisProvider(None), "_local_constants", None)
    if drawn_from is None or len(drawn_from):
        raise RuntimeError(
            f"tests/conftest.py: Hypothesis {__version__}'s HypothesisProvider no longer reads its local constants "
            f"through {lookup}, so replacing it does not keep them out of this suite's derandomized searches; find "
            "where the provider now collects them and replace that here, or install Hypothesis 6.170.x, which "
            "reads them there"
        )


_draw_without_local_constants()


@pytest.fixture(autouse=True)
def _no_inherited_terminal_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """Output is printed as it would be to a pipe (unwrapped) unless a test declares a width: a ``COLUMNS`` that
    the runner exported (pytest-xdist exports its terminal's width to its workers) would wrap printed paths and
    break the tests that look for them. A test that wants a width sets ``COLUMNS`` itself."""
    monkeypatch.delenv("COLUMNS", raising=False)


def pytest_configure(config: pytest.Config) -> None:
    """A line of progress every half minute while the suite runs: the directories running, tests done and left."""
    from tests.progress import register

    register(config)


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


def two_line_trace(spec, request_id: object = "a") -> list[dict]:
    """A two-line trace of `request_id`: the spec's first transition, then a terminal edge out of its destination."""
    first = spec.transitions[0]
    end = next(t for t in spec.transitions if t.source == first.dest and spec.state_by_name[t.dest].terminal)
    common = {
        "gpu_blocks": 0,
        "host_blocks": 0,
        "host_free": 4,
        "gpu_fenced": 0,
        "host_fenced": 0,
        "gpu_capacity": 8,
        "host_capacity": 4,
        "generated": 0,
        "computed_tokens": 0,
    }
    lines = [
        {
            "iteration": 1,
            "request_id": request_id,
            "event": first.event,
            "from": first.source,
            "to": first.dest,
            "gpu_free": 6,
            "done_reason": None,
            **common,
        },
        {
            "iteration": 4,
            "request_id": request_id,
            "event": end.event,
            "from": end.source,
            "to": end.dest,
            "gpu_free": 8,
            "done_reason": "finished",
            **common,
        },
    ]
    return [{key: line[key] for key in TRACE_FIELDS} for line in lines]  # the trace's field order


@pytest.fixture(scope="session")
def spec_trace_lines():
    """`spec_trace_lines(spec, request_id="a")`: a two-line trace of `spec` (`two_line_trace`)."""
    return two_line_trace
