"""A bounded HypoFuzz campaign finds the planted bug of the head-first toy scheduler (`head_first_toy.py`).

`hypothesis fuzz` runs until every test it fuzzes has failed (or forever): here it must stop by itself within
`BOUND_S`, saying that it found a failing input, with no worker dying on a field Hypothesis renamed
(`kvstate.hypofuzz_support`); HypoFuzz must have recorded the failure for its dashboard; and the failure in the
Hypothesis database must replay without HypoFuzz, with generation off, as VICTIM-TAIL. HypoFuzz's hub looks at its
workers once a minute, so the campaign takes at least that, and stops at that look even while the worker is still
shrinking the failure: it is then recorded as found.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.stateful import run_state_machine_as_test

from kvstate.errors import InvariantViolation

pytest.importorskip("hypofuzz", reason="HypoFuzz is in the fuzz extra: pip install '.[fuzz]'")

TARGET = Path(__file__).with_name("head_first_toy.py")
BOUND_S = 300  # the campaign's wall-clock bound
FOUND = "Found a failing input for every test!"

pytestmark = pytest.mark.slow


def run_campaign(workdir: Path) -> subprocess.CompletedProcess[str]:
    """`hypothesis fuzz` on the target, one worker, no dashboard; its database under `workdir/.hypothesis`."""
    fuzz = shutil.which("hypothesis", path=str(Path(sys.executable).parent)) or "hypothesis"
    env = {key: value for key, value in os.environ.items() if key != "CI"}  # CI would load a derandomized profile
    env["KVSTATE_HYPOTHESIS_PROFILE"] = "dev"  # HypoFuzz fuzzes tests that are not derandomized only
    command = [fuzz, "fuzz", "-n", "1", "--no-dashboard", "--", str(TARGET), "-p", "no:cacheprovider"]
    return subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=BOUND_S, check=False)


def test_a_bounded_campaign_finds_the_head_first_victims(tmp_path: Path) -> None:
    done = run_campaign(tmp_path)
    assert FOUND in done.stderr, done.stdout[-3000:] + done.stderr[-3000:]
    assert "AttributeError" not in done.stderr, done.stderr[-3000:]  # HypoFuzz's worker read what it looked for
    assert "using 1 process to fuzz 1 test" in done.stdout, done.stdout

    from hypofuzz.database import FailureState, HypofuzzDatabase, test_keys_key

    from tests.fuzz.head_first_toy import HeadFirstToyMachine

    recorded = DirectoryBasedExampleDatabase(tmp_path / ".hypothesis" / "examples")
    campaign = HypofuzzDatabase(recorded)
    (key,) = campaign.fetch(test_keys_key)  # the one test fuzzed
    # shrunk, or as found when the campaign stopped while its worker was still shrinking it
    states = (FailureState.SHRUNK, FailureState.UNSHRUNK)
    found = [choices for state in states for choices in campaign.failures(state=state).fetch(key)]
    assert found, "the campaign recorded no failure for its dashboard"
    replay = settings(database=recorded, phases=[Phase.explicit, Phase.reuse], deadline=None, derandomize=False)
    with pytest.raises(InvariantViolation) as caught:
        run_state_machine_as_test(HeadFirstToyMachine, settings=replay)  # only what the campaign recorded
    assert caught.value.invariant_id == "VICTIM-TAIL", caught.value
