"""Sweeps on Dask (`kvstate check --sweep NAME --cluster ADDRESS`, `--workers N`): a `LocalCluster` of two worker
processes gives the same table, verdicts, counterexample files and exit codes as the sweep run in this process; an
address nobody answers at is one line and exit 2; a configuration whose worker dies is run again or reported."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from kvstate.checker.sweep_runners import Lost, cluster_runner
from kvstate.cli import main
from kvstate.spec import packaged_spec_path

dask = pytest.importorskip("dask")  # the cluster extra; CI installs it with the test extra
distributed = pytest.importorskip("distributed")

BOUNDS = """
[sweeps.tiny]
request_counts = [1]
prompt_lens = [1, 2]
max_new_tokens = [1]
host_blocks = [0, 1]
pipeline_stages = [1, 2]
copy_delays = [0, 1]

[sweeps.pairs]
request_counts = [2]
prompt_lens = [2]
max_new_tokens = [2]
block_sizes = [2]
chunk_sizes = [1]
pipeline_stages = [2]
"""


@pytest.fixture(scope="module")
def cluster():
    """Two worker processes of one thread each, stopped after the module's tests."""
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as local:
        yield local


@pytest.fixture
def bounds_file(tmp_path):
    path = tmp_path / "bounds.toml"
    path.write_text(BOUNDS, encoding="utf-8")
    return path


def sweep(capsys, bounds_file, out: Path, *where: str, spec: Path | None = None) -> tuple[int, list[str]]:
    """Run `kvstate check --sweep` and return its exit code and its stdout lines, with the time the sweep took and
    where it ran cut from its summary line, and `out` from the lines that name counterexample files."""
    out.mkdir()
    args = ["check", "--bounds-file", str(bounds_file), "--counterexample-dir", str(out), *where]
    code = main([*args, *(["--spec", str(spec)] if spec else [])])
    lines = capsys.readouterr().out.splitlines()
    return code, [
        re.sub(r"[\d.]+ s on .*(?=: \d+ holds)", "TIME on PLACE", line).replace(str(out), "OUT") for line in lines
    ]


def test_a_sweep_on_a_cluster_gives_the_table_and_verdicts_of_the_sweep_in_this_process(
    cluster, bounds_file, tmp_path, capsys
):
    here = sweep(capsys, bounds_file, tmp_path / "here", "--sweep", "tiny", "--workers", "1")
    there = sweep(capsys, bounds_file, tmp_path / "there", "--sweep", "tiny", "--cluster", cluster.scheduler_address)
    assert there == here
    code, lines = there
    assert code == 0 and "| all |  | 18 | 18 | 0 | 0 |" in "\n".join(lines) and "TIME on PLACE: 18 holds" in lines[1]
    assert lines[-1] == "verdict: holds (18 configurations, exit 0)"


def test_a_violation_found_on_a_cluster_exits_1_with_the_same_counterexample_files(
    cluster, bounds_file, tmp_path, capsys
):
    """The policy before P1 livelocks on some of these pairs: the workers check the spec given here, not their own."""
    spec = tmp_path / "lifecycle.toml"
    text = packaged_spec_path().read_text(encoding="utf-8")
    spec.write_text(text.replace('"wait_for_chunk_in_flight"', '"preempt_self"', 1), encoding="utf-8")
    here = sweep(capsys, bounds_file, tmp_path / "here", "--sweep", "pairs", "--workers", "1", spec=spec)
    there = sweep(
        capsys, bounds_file, tmp_path / "there", "--sweep", "pairs", "--cluster", cluster.scheduler_address, spec=spec
    )
    assert there == here and here[0] == 1
    assert any("(violated, LIVE-DONE)" in line and "regression test OUT/" in line for line in there[1])
    written = {p.name: p.read_text(encoding="utf-8") for p in (tmp_path / "there").iterdir()}
    assert written == {p.name: p.read_text(encoding="utf-8") for p in (tmp_path / "here").iterdir()}
    assert any(name.endswith(".py") for name in written) and any(name.endswith(".ndjson") for name in written)


def test_an_address_nobody_answers_at_is_one_line_and_exit_2(bounds_file, tmp_path, capsys):
    address = "tcp://127.0.0.1:9"  # the discard port: nothing listens there
    args = ["check", "--bounds-file", str(bounds_file), "--sweep", "tiny", "--counterexample-dir", str(tmp_path)]
    assert main([*args, "--cluster", address, "--connect-timeout", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"kvstate check: error: --cluster {address}: no Dask scheduler")
    assert main([*args, "--cluster", "127.0.0.1"]) == 2
    assert "expected a Dask scheduler address tcp://HOST:PORT" in capsys.readouterr().err
    assert main([*args, "--cluster", address, "--workers", "2"]) == 2
    assert "--cluster excludes --workers" in capsys.readouterr().err


def test_a_configuration_whose_worker_dies_is_run_again_or_reported_lost(tmp_path):
    """Item 1 kills its worker the first time it runs and is run again; item 3 kills every worker it runs on and
    comes back as `Lost` once the scheduler stops trying (after one retry here)."""
    died_once = tmp_path / "died-once"

    def task(shared: str, item: int) -> str:  # local: pickled by value, as the workers cannot import this module
        if item == 3 or (item == 1 and not died_once.exists()):
            died_once.touch()
            os._exit(1)
        return f"{shared}{item}"

    settings = {"distributed.scheduler.allowed-failures": 1, "distributed.scheduler.worker-saturation": 1.0}
    with (
        dask.config.set(settings),
        distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as local,
        cluster_runner(local.scheduler_address) as runner,
    ):
        results = list(runner.run(task, "item ", [0, 1, 2, 3]))
    assert sorted(index for index, _ in results) == [0, 1, 2, 3]  # one result per item
    by_index = dict(results)
    assert died_once.exists() and [by_index[n] for n in range(3)] == ["item 0", "item 1", "item 2"]
    assert isinstance(by_index[3], Lost) and "worker died" in by_index[3].reason
