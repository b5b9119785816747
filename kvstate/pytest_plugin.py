"""The `kvstate` pytest plugin (entry point `pytest11`): makes the kit's Hypothesis profiles choosable by name.

It registers the profiles of `kvstate.hypothesis_profiles` when pytest loads it, before Hypothesis' own plugin loads
the one `--hypothesis-profile=NAME` names, and loads the one `KVSTATE_HYPOTHESIS_PROFILE` names when that option is
not given. With neither, it changes no Hypothesis setting.
"""

from __future__ import annotations

import pytest

from kvstate.hypothesis_profiles import load_profile, register_profiles

register_profiles()


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--hypothesis-profile", default=None) is None:
        load_profile()
