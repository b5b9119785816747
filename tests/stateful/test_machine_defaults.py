"""The conformance machine's own defaults: profiles registered by `kvstate.testing`, no per-example
deadline, token ids drawn from the adapter's vocabulary, so a third party's first run fails only for a real reason."""

from __future__ import annotations

import os
import subprocess
import sys

from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvstate.config import SchedulerConfig
from kvstate.testing import PROFILE_ENV, PROFILES, KVStateAdapter, conformance_machine

SMALL = SchedulerConfig(gpu_blocks=8, host_blocks=8, block_size=4, prefill_chunk_size=6, max_num_tokens=16)


def test_the_profiles_keep_their_values_and_none_has_a_deadline() -> None:
    assert {name: (p.max_examples, p.deadline) for name, p in PROFILES.items()} == {
        "ci": (40, None),
        "thorough": (200, None),
        "dev": (40, None),
        "long": (5000, None),
        "fail-fast": (40, None),
    }
    assert all(PROFILES[name].derandomize and PROFILES[name].print_blob for name in ("ci", "thorough", "fail-fast"))
    assert Phase.shrink not in PROFILES["fail-fast"].phases  # the failure as found: no minutes of shrinking
    for name in PROFILES:
        assert settings.get_profile(name).max_examples == PROFILES[name].max_examples


def test_the_environment_variable_chooses_the_profile_in_a_fresh_process() -> None:
    code = "import kvstate.testing, hypothesis; print(hypothesis.settings.get_current_profile_name())"
    for chosen in ("long", "ci"):
        env = {**os.environ, PROFILE_ENV: chosen}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == chosen
    env = {**os.environ, PROFILE_ENV: "bogus"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert out.returncode != 0 and "names no kvstate Hypothesis profile" in out.stderr


def test_importing_the_kit_changes_no_hypothesis_setting() -> None:
    code = (
        "import hypothesis; before = repr(hypothesis.settings()); "
        "name = hypothesis.settings.get_current_profile_name(); import kvstate.testing; "
        "print(hypothesis.settings.get_current_profile_name() == name, repr(hypothesis.settings()) == before)"
    )
    # Hypothesis itself loads its own "ci" profile where CI is set, so the profile before the import is compared
    env = {k: v for k, v in os.environ.items() if k != PROFILE_ENV}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]


def test_pytest_loads_a_kit_profile_by_name(tmp_path) -> None:
    """The package's pytest plugin registers the profiles before Hypothesis' plugin loads `--hypothesis-profile`."""
    probe = tmp_path / "test_profile_probe.py"
    probe.write_text(
        "import hypothesis\n\n\ndef test_probe():\n"
        "    assert hypothesis.settings.get_current_profile_name() == 'thorough'\n"
        "    assert hypothesis.settings().max_examples == 200\n"
    )
    env = {k: v for k, v in os.environ.items() if k != PROFILE_ENV}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--hypothesis-profile=thorough"]
    out = subprocess.run([*command, str(probe)], env=env, capture_output=True, text=True, cwd=tmp_path, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_machine_runs_without_a_deadline_whatever_profile_is_loaded() -> None:
    machine = conformance_machine(lambda: KVStateAdapter(SMALL), name="Defaults")
    assert machine.TestCase.settings.deadline is None


class SmallVocab(KVStateAdapter):
    """Refuses any token id outside its vocabulary, as a real engine does."""

    def submit(self, prompt, max_new_tokens, stop_token_ids=()):
        if any(t >= self.vocab_size for t in (*prompt, *stop_token_ids)):
            raise AssertionError(f"token id outside the vocabulary of {self.vocab_size}: {prompt} {stop_token_ids}")
        return super().submit(prompt, max_new_tokens, stop_token_ids)


def test_token_ids_are_drawn_from_the_adapters_vocabulary() -> None:
    machine = conformance_machine(lambda: SmallVocab(SMALL, vocab=7), name="SmallVocab")
    run_state_machine_as_test(
        machine, settings=settings(max_examples=10, stateful_step_count=20, database=None, derandomize=True)
    )
