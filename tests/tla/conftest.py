"""Shared fixtures of the TLA+ tests: the TLC tools (tests that run TLC skip without Java and tla2tools.jar, unless
KVSTATE_REQUIRE_TLC is set, as in CI's TLC step, where a missing tool is a failure) and planted spec copies."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest
import tomli_w

from kvstate.spec import Spec, load_spec, packaged_spec_path
from kvstate.tla.tlc import TlcMissing, TlcTools, find_tools

REQUIRE = "KVSTATE_REQUIRE_TLC"


@pytest.fixture(scope="session")
def tlc_tools() -> TlcTools:
    try:
        return find_tools()
    except TlcMissing as err:
        if os.environ.get(REQUIRE):
            pytest.fail(f"{REQUIRE} is set, but {err}")
        pytest.skip(str(err))


def spec_copy(directory: Path, change) -> Spec:
    """The packaged spec with `change(data)` applied to its TOML data, written into `directory` and loaded."""
    data = tomllib.loads(packaged_spec_path().read_text(encoding="utf-8"))
    change(data)
    path = directory / "lifecycle.toml"
    path.write_text(tomli_w.dumps(data), encoding="utf-8")
    return load_spec(path)


def swap_suspend_and_resume_guards(data: dict) -> None:
    """The planted spec bug: suspend guarded by the guard of resume to running, and that resume by suspend's (in
    the exclusivity group of resume's two guards too, so that the copy is well formed)."""
    events = {e["name"]: e for e in data["events"]}
    (suspend,), (resume, *_) = events["suspend"]["transitions"], events["resume"]["transitions"]
    suspend["guard"], resume["guard"] = resume["guard"], suspend["guard"]
    for group in data["exclusive_guards"]:
        group["guards"] = [resume["guard"] if g == suspend["guard"] else g for g in group["guards"]]
