"""A local pipeline listens on loopback only, and a rank that dies or stops ends the run fast with one line.

Each spawning test starts two gloo ranks on the CPU and, from a watcher thread, acts on rank 1 once its trace
shows it is serving (so the signal lands mid-run, not during start-up).
"""

from __future__ import annotations

import inspect
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from executor.pipeline import PipelineConfig, RankFailed, RankLost, run_pipeline
from executor.pipeline import __main__ as pipeline_main
from executor.pipeline.config import PipelineConfigError
from executor.pipeline.demo import DEMO_TIMEOUT_S, run_pp_demo
from executor.pipeline.launch import LOOPBACK, loopback_store, process_state

from .conftest import pressured, workload

pytestmark = pytest.mark.distributed
TIMEOUT_S = 5.0  # every wait on a peer; a stopped rank is also detected after this long


def _listening(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket (IPv4 and IPv6) the processes `pids` hold."""
    inodes: dict[str, int] = {}
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes[target[8:-1]] = pid
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A = LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # /proc writes 32-bit words host-order
            found.append((inodes[fields[9]], socket.inet_ntop(family, raw), int(port, 16)))
    return found


def _is_loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("::1", "::ffff:127.0.0.1")


def test_the_store_listens_on_loopback_only():
    with loopback_store(2, TIMEOUT_S) as port:
        mine = [(address, p) for _, address, p in _listening({os.getpid()}) if p == port]
        assert mine == [(LOOPBACK, port)]
        with socket.create_connection((LOOPBACK, port), timeout=TIMEOUT_S):
            pass


def _run_and_act(tmp_path, monkeypatch, act, requests: int = 24):
    """run_pipeline on two ranks; once rank 1 wrote 5 trace lines, `act(context)` runs in a watcher thread.
    Returns (the exception raised, seconds from the act to it, what `act` returned)."""
    contexts, acted = [], {}
    original = mp.start_processes

    def start_processes(*args, **kwargs):
        contexts.append(original(*args, **kwargs))
        return contexts[-1]

    monkeypatch.setattr(mp, "start_processes", start_processes)
    trace = tmp_path / "trace.ndjson"
    config = PipelineConfig(engine=pressured(trace_path=trace, check_invariants=False), timeout_s=TIMEOUT_S)
    rank1 = config.trace_path_for(1)

    def watcher():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if contexts and rank1.exists() and len(rank1.read_text().splitlines()) >= 5:
                acted["result"] = act(contexts[0])
                acted["at"] = time.monotonic()
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watcher)
    thread.start()
    with pytest.raises(Exception) as info:
        run_pipeline(config, workload(requests, seed=3), world_size=2)
    raised = time.monotonic()
    thread.join()
    assert "at" in acted, "rank 1 never started serving"
    assert not any(p.is_alive() for p in contexts[0].processes), "a rank outlived the run"
    return info.value, raised - acted["at"], acted["result"]


def test_a_killed_rank_is_one_clear_line_and_the_run_listens_on_loopback_only(tmp_path, monkeypatch):
    def kill_rank1(context):
        pids = {os.getpid(), *(p.pid for p in context.processes)}
        sockets = _listening(pids)
        os.kill(context.processes[1].pid, signal.SIGKILL)
        return sockets

    err, seconds, sockets = _run_and_act(tmp_path, monkeypatch, kill_rank1)
    assert sockets, "no listening socket found: the inspection is broken"
    assert all(_is_loopback(address) for _, address, _ in sockets), sockets
    assert isinstance(err, RankLost) and isinstance(err, ConnectionError)
    message = str(err)
    assert "\n" not in message and "rank 1" in message and "SIGKILL" in message, message
    assert seconds < TIMEOUT_S + 10


def test_a_stopped_rank_fails_the_run_within_its_timeout(tmp_path, monkeypatch):
    err, seconds, _ = _run_and_act(
        tmp_path, monkeypatch, lambda context: os.kill(context.processes[1].pid, signal.SIGSTOP)
    )
    assert isinstance(err, RankLost), err
    message = str(err)
    assert "\n" not in message and "rank 1" in message and "stopped" in message, message
    assert seconds < TIMEOUT_S + 15  # detection after TIMEOUT_S, then the ranks are killed


def test_a_failing_rank_is_one_line_with_its_traceback_kept():
    config = PipelineConfig(engine=pressured(), timeout_s=30.0, max_iterations=3)
    with pytest.raises(RankFailed, match="max_iterations") as info:
        run_pipeline(config, workload(4), world_size=2)
    assert isinstance(info.value, mp.ProcessRaisedException)
    assert "\n" not in str(info.value) and str(info.value).startswith("pipeline rank ")
    assert "Traceback (most recent call last)" in info.value.rank_traceback


def test_the_demo_waits_on_a_peer_for_60_seconds_by_default():
    assert DEMO_TIMEOUT_S == 60.0
    assert inspect.signature(run_pp_demo).parameters["timeout_s"].default == DEMO_TIMEOUT_S
    assert pipeline_main._parser().parse_args([]).timeout == DEMO_TIMEOUT_S
    assert pipeline_main._parser().parse_args(["--timeout", "7"]).timeout == 7.0


@pytest.mark.parametrize("value", ["inf", "1e300", "nan", "1e-9", "0", "-1"])
def test_a_timeout_out_of_range_is_one_usage_error(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        pipeline_main._parser().parse_args(["--timeout", value])
    assert exit_.value.code == 2
    assert "must be between 1 and 86400 seconds" in capsys.readouterr().err
    with pytest.raises(PipelineConfigError, match="between 1 and 86400 seconds"):
        PipelineConfig(timeout_s=float(value))


def test_sigterm_to_the_launcher_stops_the_ranks_and_removes_its_temporary_directory(tmp_path):
    """The launcher (`python -m executor.pipeline`) is sent SIGTERM mid-run: its ranks are killed and its
    `kvstate-pp-*` directory is removed on the way out."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    trace = tmp_path / "trace.ndjson"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "executor.pipeline", "--pp", "2", "--requests", "48", "--trace", str(trace)],
        env={**os.environ, "TMPDIR": str(temp)},
        cwd=tmp_path,  # not the checkout: its ranks import the kvstate installed (CI), whose package holds the spec
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    rank1 = trace.with_name("trace.rank1.ndjson")
    deadline = time.monotonic() + 120
    while not (rank1.exists() and len(rank1.read_text().splitlines()) >= 5) and launcher.poll() is None:
        assert time.monotonic() < deadline, "rank 1 never started serving"
        time.sleep(0.05)
    assert list(temp.glob("kvstate-pp-*")), "the launcher's directory is not where the test looks"
    children = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True, check=False)
    ranks = [int(pid) for pid in children.stdout.split() if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(ranks) == 2  # the spawned ranks (not torch's resource tracker)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(60) == 128 + signal.SIGTERM
    assert not list(temp.glob("kvstate-pp-*"))
    assert [process_state(pid) for pid in ranks if process_state(pid) not in (None, "Z")] == [], "a rank outlived it"


def test_a_failed_run_leaves_no_file_in_the_temporary_directory(tmp_path, monkeypatch):
    """torch's spawn leaves each failed rank's exception in a ``pytorch-errorfile-*.pickle`` of the temporary
    directory; the launcher removes them, and its own directory, once the run has read them."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where tempfile (and so torch) creates them
    config = PipelineConfig(engine=pressured(), timeout_s=30.0, max_iterations=3)
    with pytest.raises(RankFailed, match="max_iterations"):
        run_pipeline(config, workload(4), world_size=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
