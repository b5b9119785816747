"""Swept bounds (`kvstate check --sweep NAME`): every configuration of a sweep is enumerated once and
checked, the summary table counts configurations x verdicts, and every counterexample is written as a regression
test. The packaged `ci` sweep runs in CI (`.ci/run`); the `wide` ones run with the slow tests."""

from __future__ import annotations

import os
import sys

import pytest

from kvstate.checker.bounds import BoundsError
from kvstate.checker.sweep import Sweep, load_sweeps, run_sweep, select_sweep
from kvstate.cli import main
from kvstate.spec import packaged_spec_path

TINY = """
[bounds.one]
requests = [[1, 1]]
gpu_blocks = 2

[sweeps.tiny]
request_counts = [1]
prompt_lens = [1, 2]
max_new_tokens = [1]
host_blocks = [0, 1]
pipeline_stages = [1, 2]
copy_delays = [0, 1]

[sweeps.pairs]
description = "two requests that each fill the GPU tier alone, with micro-batches in flight"
request_counts = [2]
prompt_lens = [2]
max_new_tokens = [2]
block_sizes = [2]
chunk_sizes = [1]
pipeline_stages = [2]
"""


@pytest.fixture
def bounds_file(tmp_path):
    path = tmp_path / "bounds.toml"
    path.write_text(TINY, encoding="utf-8")
    return path


def test_a_sweep_enumerates_each_configuration_once_with_delays_only_where_copies_exist(bounds_file):
    sweep = select_sweep("tiny", bounds_file)
    bounds = sweep.bounds()
    # 2 shapes x (host 0 with delay 0, host 1 with delays 0 and 1) x (1 stage; 2 stages with 1 or 2 micro-batches)
    assert len(bounds) == 2 * 3 * 3
    keys = {(b.requests, b.host_blocks, b.copy_delay, b.pipeline_stages, b.micro_batches) for b in bounds}
    assert len(keys) == len(bounds)
    assert all(b.copy_delay == 0 for b in bounds if b.host_blocks == 0)
    assert {b.gpu_blocks for b in bounds if b.requests == ((2, 1),)} == {3}  # the smallest tier that fits it


def test_a_sweep_takes_each_offload_rule_only_where_a_host_tier_takes_offloads():
    entry = {"request_counts": [1], "prompt_lens": [1], "max_new_tokens": [1], "host_blocks": [0, 1]}
    sweep = Sweep.from_dict({**entry, "offloads": ["on_demand", "eager"]}, "offloads")
    bounds = sweep.bounds()
    assert [(b.host_blocks, b.offload) for b in bounds] == [(0, "on_demand"), (1, "on_demand"), (1, "eager")]
    assert [b.offload for b in Sweep.from_dict(entry, "spec").bounds()] == [None, None]  # the spec's own rule
    report = run_sweep(sweep)
    assert report.verdict == "holds" and "| offload | eager | 1 | 1 | 0 | 0 |" in "\n".join(report.lines())
    with pytest.raises(BoundsError, match="'offloads' must be a non-empty list of offload rules"):
        Sweep.from_dict({**entry, "offloads": ["lazy"]}, "bad")


def test_a_sweep_reports_a_table_of_configurations_by_verdict(bounds_file):
    report = run_sweep(select_sweep("tiny", bounds_file), workers=2)
    assert report.verdict == "holds" and len(report.outcomes) == 18
    lines = report.lines()
    assert lines[0].startswith("sweep tiny: 18 configurations") and "18 holds, 0 violated, 0 incomplete" in lines[0]
    assert "| all |  | 18 | 18 | 0 | 0 |" in "\n".join(lines)
    assert "| stages x micro-batches | 2x2 | 6 | 6 | 0 | 0 |" in "\n".join(lines)


def test_every_counterexample_of_a_sweep_is_written_as_a_regression_test(bounds_file, tmp_path):
    """The policy before P1 livelocks on some of these pairs: each violation gets its own regression file."""
    text = packaged_spec_path().read_text(encoding="utf-8")
    spec = tmp_path / "lifecycle.toml"
    spec.write_text(text.replace('"wait_for_chunk_in_flight"', '"preempt_self"', 1), encoding="utf-8")
    out = tmp_path / "counterexamples"
    out.mkdir()
    report = run_sweep(select_sweep("pairs", bounds_file), spec_path=str(spec), counterexample_dir=out)
    violated = [o for o in report.outcomes if o.verdict == "violated"]
    assert violated and all(o.invariant == "LIVE-DONE" for o in violated)
    stems = sorted(f"kvstate-counterexample-{o.bound.name.replace('-', '_')}" for o in violated)
    assert sorted(p.name for p in out.iterdir()) == sorted(  # each as a regression test and as a trace
        [f"{stem}.py" for stem in stems] + [f"{stem}.ndjson" for stem in stems]
    )
    assert any(o.bound.name in line and "regression test" in line for o in violated for line in report.lines())
    assert run_sweep(select_sweep("pairs", bounds_file)).verdict == "holds"  # with P1


def test_the_command_runs_a_sweep_and_refuses_what_it_cannot(bounds_file, tmp_path, capsys):
    args = ["check", "--bounds-file", str(bounds_file), "--counterexample-dir", str(tmp_path)]
    assert main([*args, "--sweep", "tiny", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "sweep tiny: 18 configurations" in out and "verdict: holds (18 configurations, exit 0)" in out
    assert main([*args, "--sweep", "nope"]) == 2
    assert "unknown sweep 'nope'; known sweeps: tiny, pairs" in capsys.readouterr().err
    assert main([*args, "--sweep", "tiny", "--bound", "one"]) == 2


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"request_counts": [1], "prompt_lens": [1]}, "'max_new_tokens' is required"),
        ({"request_counts": [0], "prompt_lens": [1], "max_new_tokens": [1]}, "positive integers"),
        ({"request_counts": [1], "prompt_lens": [1], "max_new_tokens": [1], "gpu_extra": [-1]}, "non-negative"),
        ({"request_counts": [1], "prompt_lens": [1], "max_new_tokens": [1], "colour": "red"}, "unknown keys"),
    ],
)
def test_a_bad_sweep_is_refused_with_the_key_named(entry, message):
    with pytest.raises(BoundsError, match=message):
        Sweep.from_dict(entry, "bad")


def test_the_packaged_sweeps_span_the_dimensions_the_issue_names():
    sweeps = load_sweeps()
    ci = sweeps["ci"]
    parts = {p.name: p for p in ci.parts}
    assert len(ci.bounds()) == sum(len(p.bounds()) for p in ci.parts) == 3696
    assert len(parts["ci_timing"].bounds()) == 2400  # 1440 configurations, 960 with a host tier twice
    assert not any(p.abstract_model for p in ci.parts)
    assert set(parts["ci_timing"].offloads) == {"on_demand", "eager"}  # the spec's offload rule and the other one
    union = {key: set() for key in ("request_counts", "host_blocks", "block_sizes", "chunk_sizes", "copy_delays")}
    for sweep in sweeps.values():
        for key, values in union.items():
            values.update(getattr(sweep, key))
    assert union == {
        "request_counts": {1, 2, 3},
        "host_blocks": {0, 1, 2, 5},
        "block_sizes": {1, 2, 3},
        "chunk_sizes": {1, 2, 3},
        "copy_delays": {0, 1},
    }
    bounds = ci.bounds()
    assert {(b.pipeline_stages, b.micro_batches) for b in bounds} == {(1, 1), (2, 1), (2, 2), (3, 1), (3, 2), (3, 3)}
    faulted = [b for b in bounds if b.cancel and b.env_cancels and b.env_copy_failures and b.env_host_losses]
    assert faulted and {b.host_blocks for b in faulted} == {0, 2}  # copies and host copies where there is a host tier
    assert any(not b.recompute_pause for b in bounds)
    assert any(b.capacity_policy == "guaranteed_no_evict" for b in bounds)


def test_a_sweep_of_parts_joins_their_configurations_and_names_its_scope(bounds_file):
    text = (
        bounds_file.read_text(encoding="utf-8")
        + """
[sweeps.faults]
request_counts = [1]
prompt_lens = [1]
max_new_tokens = [1]
host_blocks = [0, 1]
cancel = true
env_cancels = 1
env_copy_failures = 1

[sweeps.both]
parts = ["tiny", "faults"]
"""
    )
    bounds_file.write_text(text, encoding="utf-8")
    both = select_sweep("both", bounds_file)
    bounds = both.bounds()
    assert len(bounds) == 18 + 2 and len({b.name for b in bounds}) == 20
    report = run_sweep(both)
    lines = report.lines()
    assert report.verdict == "holds"
    assert lines[1].startswith(
        "scope: pipeline stages 1, 2 (1..stages micro-batches in flight); fault budgets in 2 of 20"
    )
    assert "| fault budgets | 1 cancels, 1 failed copies | 1 |" in "\n".join(lines)
    assert "| fault budgets | 1 cancels | 1 |" in "\n".join(lines)  # no host tier: no copy to fail
    bounds_file.write_text(text + '[sweeps.bad]\nparts = ["nope"]\n', encoding="utf-8")
    with pytest.raises(BoundsError, match="'parts' names \\['nope'\\]"):
        load_sweeps(bounds_file)


def test_a_sweep_takes_the_scheduler_settings_and_skips_configurations_the_scheduler_refuses():
    entry = {"request_counts": [1], "prompt_lens": [1], "max_new_tokens": [1], "host_blocks": [0, 1]}
    sweep = Sweep.from_dict(
        {**entry, "recompute_pauses": [True, False], "capacity_policies": ["max_utilization", "guaranteed_no_evict"]},
        "settings",
    )
    settings = [(b.host_blocks, b.recompute_pause, b.capacity_policy) for b in sweep.bounds()]
    # recompute-pause off without a host tier under max_utilization has no way to evict: the scheduler refuses it
    assert (0, False, "max_utilization") not in settings and len(settings) == 2 * 2 * 2 - 1
    assert run_sweep(sweep).verdict == "holds"
    with pytest.raises(BoundsError, match="'recompute_pauses' must be a non-empty list of true / false"):
        Sweep.from_dict({**entry, "recompute_pauses": ["no"]}, "bad")
    with pytest.raises(BoundsError, match="'capacity_policies' must be a non-empty list of"):
        Sweep.from_dict({**entry, "capacity_policies": ["lazy"]}, "bad")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["wide", "wide_env"])
def test_the_wide_sweeps_hold(name):
    report = run_sweep(select_sweep(name), workers=2)
    assert report.verdict == "holds", "\n".join(report.lines())


def test_without_dask_a_sweep_runs_in_this_process_unless_workers_ask_for_more(
    bounds_file, tmp_path, monkeypatch, capsys
):
    """`import distributed` fails as it does where the cluster extra is not installed."""
    monkeypatch.setitem(sys.modules, "distributed", None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1})  # two CPUs: the default asks for two workers
    args = ["check", "--bounds-file", str(bounds_file), "--counterexample-dir", str(tmp_path), "--sweep", "tiny"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Dask is not installed (pip install 'kvstate[cluster]'): the sweep runs in this process" in out
    assert "s on this process: 18 holds" in out
    for extra in (["--workers", "2"], ["--cluster", "tcp://127.0.0.1:9"]):
        assert main([*args, *extra]) == 2
        err = capsys.readouterr().err
        assert f"{extra[0]} " in err and "needs Dask, which is not installed: pip install 'kvstate[cluster]'" in err
