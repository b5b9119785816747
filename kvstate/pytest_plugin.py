"""The `kvstate` pytest plugin (entry point `pytest11`): makes the kit's Hypothesis profiles choosable by name.

It registers the profiles of `kvstate.hypothesis_profiles` when pytest loads it, before Hypothesis' own plugin loads
the one `--hypothesis-profile=NAME` names, and loads the one `KVSTATE_HYPOTHESIS_PROFILE` names when that option is
not given. With neither, it changes no Hypothesis setting. In a HypoFuzz campaign (`hypothesis fuzz`) it lets
HypoFuzz record the failures it shrinks (`kvstate.hypofuzz_support`).
"""

from __future__ import annotations

import pytest

from kvstate import hypofuzz_support
from kvstate.hypothesis_profiles import load_profile, register_profiles

register_profiles()


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--hypothesis-profile", default=None) is None:
        load_profile()
    if hypofuzz_support.in_hypofuzz_run():  # `hypothesis fuzz` collects (and each worker runs) through pytest
        hypofuzz_support.install()
