"""The Hypothesis profiles of the conformance kit, registered without being loaded.

Registering a profile changes nothing until it is loaded, so importing this module (or `kvstate.testing`, which
imports it) leaves every global Hypothesis setting as it was. A profile is loaded only when asked for:
`pytest --hypothesis-profile=NAME` (the `kvstate` pytest plugin, installed with the package, registers the profiles
before Hypothesis' own plugin loads the one named), the environment variable `KVSTATE_HYPOTHESIS_PROFILE=NAME`
(loaded when `kvstate.testing` is imported and by the plugin), or `load_profile(NAME)`.

| profile | examples | for |
|---|---|---|
| `ci` | 40, derandomized, replayable blob on failure | bounded runs in CI |
| `thorough` | 200, derandomized, blob | CI's second pass over the stateful machines |
| `dev` | 40 | local runs |
| `long` | 5,000 | soaks |
| `fail-fast` | 40, derandomized, no shrinking | the first failing step list as found, in seconds (unshrunk) |

None has a per-example deadline. Shrinking a long step list can take minutes: `fail-fast` prints the failure as it
was found; `--hypothesis-verbosity=verbose` shows each shrink as it is tried.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

__all__ = ["PROFILES", "PROFILE_ENV", "load_profile", "register_profiles"]

PROFILE_ENV = "KVSTATE_HYPOTHESIS_PROFILE"
_BOUNDED = settings(derandomize=True, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
PROFILES = {
    "ci": settings(_BOUNDED, max_examples=40),
    "thorough": settings(_BOUNDED, max_examples=200),
    "dev": settings(max_examples=40, deadline=None),
    "long": settings(max_examples=5000, deadline=None),
    "fail-fast": settings(_BOUNDED, max_examples=40, phases=[Phase.explicit, Phase.reuse, Phase.generate]),
}


def register_profiles(*, keep_current: bool = True) -> None:
    """Register the profiles of `PROFILES` with Hypothesis (loads none). Hypothesis reloads a profile registered
    under the name currently loaded, so with `keep_current` that one is left as it is: where the environment
    variable ``CI`` is set, Hypothesis has loaded its own ``ci`` profile, and importing the kit must not change it
    (ours replaces it only when loaded by name: `load_profile`, `PROFILE_ENV`)."""
    current = settings.get_current_profile_name()
    for name, profile in PROFILES.items():
        if not (keep_current and name == current):
            settings.register_profile(name, profile)


def load_profile(name: str | None = None) -> str | None:
    """Load the profile `name`, or else the one `PROFILE_ENV` names; return the name loaded (None: neither was
    given, nothing changed). An unknown name raises a `ValueError` listing the profiles."""
    chosen = name if name is not None else os.environ.get(PROFILE_ENV)
    if chosen is None:
        return None
    if chosen not in PROFILES:
        where = f"{PROFILE_ENV}={chosen!r}" if name is None else repr(chosen)
        raise ValueError(f"{where} names no kvstate Hypothesis profile; use one of {', '.join(PROFILES)}")
    register_profiles(keep_current=False)
    settings.load_profile(chosen)
    return chosen
