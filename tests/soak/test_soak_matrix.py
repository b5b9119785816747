"""The soak's matrix (`executor.commands.soak_matrix`): a fault that ends the host tier runs in a mix of its own, so
the host paths stay busy in the main mix; every path and fault kind is counted per mix, and a path below its floor
is named in the summary. The CI-sized matrix runs in the normal suite, the command's default one is `slow`."""

from __future__ import annotations

import re

import pytest

from executor.commands.soak import DEFAULT_INJECT, SoakSettings, run_soak
from executor.commands.soak_matrix import PATHS, TIER_ENDING, fault_mixes, path_counts, run_matrix
from executor.faults import FaultSpec
from kvstate.cli import main

# the faults of the soak that exercised almost no host path while it ran as one
ISSUE_FAULTS = ("copy_to_host:0.1", "copy_to_gpu:0.1", "corrupt_host:0.1", "host_loss:0.002", "host_alloc:0.02")


def kinds(faults: tuple[str, ...]) -> set[str]:
    return {FaultSpec.parse(text).kind for text in faults}


def test_each_tier_ending_fault_runs_in_a_mix_of_its_own():
    settings = SoakSettings(requests=6000, seed=5, faults=ISSUE_FAULTS, cancel_rate=0.1)
    mixes = fault_mixes(settings)
    assert [m.name for m in mixes] == ["main", "host_loss", "host_alloc"]
    assert sum(m.settings.requests for m in mixes) == settings.requests
    assert all(m.settings.seed == settings.seed and m.settings.cancel_rate == 0.1 for m in mixes)
    main_mix, *isolated = mixes
    assert kinds(main_mix.settings.faults) == kinds(ISSUE_FAULTS) - set(TIER_ENDING)
    for mix in isolated:
        assert kinds(mix.settings.faults) & set(TIER_ENDING) == {mix.name}
        assert mix.settings.requests < main_mix.settings.requests


def test_a_bare_host_loss_fires_once_when_its_mix_has_arrived():
    settings = SoakSettings(faults=DEFAULT_INJECT)
    loss = next(m for m in fault_mixes(settings) if m.name == "host_loss")
    arrived = round(loss.settings.requests / settings.arrival_rate)
    assert "host_loss" in DEFAULT_INJECT and f"host_loss@{arrived}" in loss.settings.faults
    rated = next(m for m in fault_mixes(SoakSettings(faults=ISSUE_FAULTS)) if m.name == "host_loss")
    assert "host_loss:0.002" in rated.settings.faults  # a rate given is kept


def test_one_mix_without_a_host_tier_or_a_tier_ending_fault():
    assert [m.name for m in fault_mixes(SoakSettings(faults=ISSUE_FAULTS, host_blocks=0))] == ["main"]
    plain = SoakSettings(requests=300)
    assert fault_mixes(plain)[0].settings == plain and len(fault_mixes(plain)) == 1


def test_the_default_matrix_exercises_every_path_above_its_floor():
    """CI-sized: every path and every default fault kind ran at least its floor, and the main mix kept its host
    tier for the whole run."""
    matrix = run_matrix(SoakSettings(requests=150, seed=3, faults=DEFAULT_INJECT), run_soak)
    assert matrix.ok
    counts = {count.path: count for count in matrix.paths()}
    assert set(PATHS) | kinds(DEFAULT_INJECT) <= {path for path, count in counts.items() if count.floor >= 1}
    assert matrix.barely_exercised() == (), [(c.path, c.total, c.floor) for c in counts.values() if c.barely]
    main_report = matrix.runs[0][1]
    assert main_report.host_tier_losses == 0 and not main_report.host_tier_fallback
    for index, report in enumerate(matrix.reports):
        assert all(counts[path].per_mix[index] == n for path, n in path_counts(report).items())


def test_the_issue_faults_keep_the_host_paths_busy_in_the_main_mix():
    """The faults that once ended the host tier early: host_loss now fires only in its own mix."""
    matrix = run_matrix(SoakSettings(requests=150, seed=5, faults=ISSUE_FAULTS, cancel_rate=0.1), run_soak)
    assert matrix.ok
    main_report = matrix.reports[0]
    assert "host_loss" not in main_report.faults and not main_report.host_tier_fallback
    floors = {count.path: count.floor for count in matrix.paths()}
    assert all(path_counts(main_report)[path] >= floors[path] for path in PATHS), path_counts(main_report)


def test_the_summary_names_a_path_below_its_floor(capsys):
    assert main(["soak", "--requests", "40", "--seed", "1", "--inject", "copy_to_gpu:0.001"]) == 0
    out = " ".join(re.sub(r"[^\w\s:/.,()-]", " ", capsys.readouterr().out).split())
    barely = out.partition("paths barely exercised (below their floor): ")[2].partition(" SOAK")[0]
    assert "copy_to_gpu" in barely.split(", "), out
    assert "BARELY EXERCISED" in out and "SOAK: PASS" in out


@pytest.mark.slow
def test_the_commands_default_matrix_exercises_every_path_above_its_floor():
    """The command's default soak (2,000 requests, `DEFAULT_INJECT`)."""
    matrix = run_matrix(SoakSettings(faults=DEFAULT_INJECT), run_soak)
    assert matrix.ok and matrix.barely_exercised() == ()
    assert [mix.name for mix, _ in matrix.runs] == ["main", "host_loss", "host_alloc"]
