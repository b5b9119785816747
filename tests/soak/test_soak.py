"""Soaks: seeded random arrivals, lengths and cancellations on the real executor under heavy memory pressure and
injected faults. Every request must end done, every output equal (or, if cancelled, be a prefix of) its
unpressured reference, no block may leak, and the scheduler's invariants are checked around every iteration.

The CI-sized soaks (150 requests) run in the normal suite; the 2,000-request ones are marked `slow`
(`pytest -m slow tests/soak`; the same as `kvstate soak` and `kvstate soak --host-blocks 0`).
"""

from __future__ import annotations

import re

import pytest

from executor.commands.soak import DEFAULT_FAULTS, SoakError, SoakSettings, run_soak
from kvstate.checker import validate_trace
from kvstate.cli import main


def _assert_clean(report):
    assert report.unfinished == 0 and report.aborted == 0
    assert report.finished + report.cancelled == report.requests == report.compared
    assert report.mismatches == (), f"outputs of {report.mismatches[:10]} differ from their references"
    assert report.leaked_blocks == 0
    assert report.ok


CI = {"requests": 150, "seed": 3}


def test_ci_soak_with_a_host_tier_and_every_copy_fault():
    report = run_soak(SoakSettings(**CI, faults=(*DEFAULT_FAULTS, "host_loss@400")))
    _assert_clean(report)
    # the pressure and the faults were real
    assert report.suspensions > 0 and report.resumes > 0 and report.recompute_pauses > 0 and report.cancelled > 0
    assert report.faults.get("copy_to_host", 0) > 0 and report.faults.get("copy_to_gpu", 0) > 0
    assert report.faults.get("corrupt_host", 0) > 0 and report.checksum_mismatches > 0
    assert report.failed_copies == report.faults["copy_to_host"] + report.faults["copy_to_gpu"]
    assert report.host_tier_losses == 1 and report.host_tier_fallback
    assert report.events.get("lose_host_copy", 0) >= report.faults["copy_to_host"]
    assert report.offload == "on_demand" and report.events["offload"] > 0 and report.blocks_offloaded > 0


@pytest.mark.parametrize("offload", ["on_demand", "eager"])
def test_ci_soak_under_each_offload_policy(offload):
    report = run_soak(SoakSettings(**CI, offload=offload))
    _assert_clean(report)
    assert report.offload == offload and report.suspensions > 0 and report.blocks_offloaded > 0
    assert report.resumed_without_copy <= report.resumes


def test_ci_soak_without_a_host_tier():
    report = run_soak(SoakSettings(**CI, host_blocks=0))
    _assert_clean(report)
    assert report.suspensions == 0 and report.recompute_pauses > 0 and report.replays > 0
    assert not report.faults  # no copies, so no copy faults


def test_ci_soak_when_the_host_tier_cannot_be_allocated():
    report = run_soak(SoakSettings(**CI, faults=("host_alloc",)))
    _assert_clean(report)
    assert report.faults == {"host_alloc": 1} and report.host_tier_fallback and report.suspensions == 0


def test_soak_command_prints_a_summary_and_passes(capsys, tmp_path):
    report = tmp_path / "report"  # --report writes the trace and a visual report of it
    argv = ["soak", "--requests", "40", "--seed", "1", "--inject", "copy_to_host:0.2", "--report", str(report)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f"report: {report / 'report.html'}" in printed and (report / "report.html").stat().st_size > 0
    assert validate_trace(report / "trace.ndjson").ok
    out = " ".join(re.sub(r"[^\w\s:/.,()-]", " ", printed).split())  # drop table borders
    for row in (
        "requests 40",
        "outputs compared 40",
        "mismatches 0",
        "leaked blocks 0",
        "faults injected",
        "suspensions",
        "offloads",
        "blocks offloaded (GPU - host)",
        "resumes without a copy",
        "recompute-pauses",
        "SOAK: PASS",
    ):
        assert row in out, row


def test_soak_command_fails_when_corruption_goes_unchecked(capsys):
    """Exit status 1 on mismatches: corrupt host copies without checksums garble outputs."""
    status = main(["soak", "--requests", "60", "--seed", "2", "--inject", "corrupt_host:0.5", "--no-checksums"])
    out = " ".join(capsys.readouterr().out.split())
    assert status == 1 and "SOAK: FAIL" in out


def test_soak_settings_are_validated():
    with pytest.raises(SoakError, match="--gpu-blocks must be positive"):
        SoakSettings(gpu_blocks=0)
    with pytest.raises(SoakError, match="prompt_len"):
        SoakSettings(prompt_len=(5, 2))
    with pytest.raises(SoakError, match="--offload must be one of"):
        SoakSettings(offload="lazily")


@pytest.mark.slow
@pytest.mark.parametrize("host_blocks", [24, 0], ids=["host-tier", "no-host-tier"])
def test_full_soak(host_blocks):
    report = run_soak(SoakSettings(requests=2000, seed=0, host_blocks=host_blocks))
    _assert_clean(report)
    assert report.requests == 2000 and report.recompute_pauses > 0


def test_low_precision_soak_compares_by_the_per_dtype_rule(monkeypatch):
    """A float16 soak is judged by `executor.checks.compare_outputs`: near-ties of the reference may diverge
    (reported in `accepted`), anything else is a mismatch; with a zero tolerance it is exact equality."""
    import torch

    from executor import checks

    report = run_soak(SoakSettings(requests=40, seed=5, dtype="float16"))
    _assert_clean(report)
    assert all(d.gap <= checks.GAP_TOLERANCE[torch.float16] for d in report.accepted)
    monkeypatch.setitem(checks.GAP_TOLERANCE, torch.float16, 0.0)
    exact = run_soak(SoakSettings(requests=40, seed=5, dtype="float16"))
    assert set(exact.mismatches) >= {d.request_id for d in report.accepted} and exact.accepted == ()
