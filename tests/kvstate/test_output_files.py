"""Output files are written whole or not at all: a write that fails part-way (a full disk, a file-size limit)
leaves no truncated file, and names the file.

The failure is real, not simulated: each command runs in a child process whose file-size limit (RLIMIT_FSIZE) is
smaller than what it writes, so the kernel refuses the write part-way, as a full disk does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstate.output_files import OutputError, whole_file, write_whole
from kvstate.spec import load_spec

LIMIT_BYTES = 6000  # far less than a DOT source, a TLA+ module or a PNG of the report
CHILD_TIMEOUT_S = 120  # a guard against a hang, far above what these commands take

CHILD = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, as ENOSPC fails
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
from kvstate.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def run_limited(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-P", "-c", CHILD.format(limit=LIMIT_BYTES), *args],  # -P: the installed kvstate
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )


def trace_file(tmp_path: Path) -> Path:
    spec = load_spec()
    line = {
        "iteration": 1,
        "request_id": "a",
        "event": next(t.event for t in spec.transitions if t.source == spec.initial),
        "from": spec.initial,
        "to": next(t.dest for t in spec.transitions if t.source == spec.initial),
        **dict.fromkeys(("gpu_blocks", "host_blocks", "gpu_free", "host_free", "gpu_fenced", "host_fenced"), 0),
        "gpu_capacity": 8,
        "host_capacity": 4,
        "generated": 0,
        "computed_tokens": 0,
        "done_reason": None,
    }
    line["gpu_free"], line["host_free"] = 8, 4
    path = tmp_path / "t.ndjson"
    path.write_text(json.dumps(line) + "\n")
    return path


@pytest.mark.parametrize("command", ["diagram", "export", "report"])
def test_a_write_that_fails_part_way_leaves_no_partial_file_and_names_it(command: str, tmp_path: Path) -> None:
    if command == "report":
        pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    args = {
        "diagram": ["diagram", "--out", str(out), "--mkdir"],
        "export": ["export", "tla", "--out", str(out), "--mkdir"],
        "report": ["report", str(trace_file(tmp_path)), "--out", str(out), "--mkdir"],
    }[command]
    done = run_limited(*args)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"cannot write {out}{os.sep}" in done.stderr and "nothing partial was left there" in done.stderr
    left = {path.name: path.stat().st_size for path in out.iterdir()}
    assert all(size <= LIMIT_BYTES for size in left.values()), left
    named = done.stderr.split("cannot write ", 1)[1].split(":", 1)[0]
    assert Path(named).name not in left, f"the file that failed was left behind: {left}"
    assert not [name for name in left if ".partial" in name], left


def test_a_whole_write_replaces_the_file_and_keeps_no_temporary(tmp_path: Path) -> None:
    path = write_whole(tmp_path / "a.txt", "old")
    write_whole(path, b"new")
    assert path.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_a_failing_block_keeps_the_previous_file_and_removes_the_temporary(tmp_path: Path) -> None:
    path = write_whole(tmp_path / "a.svg", "old")
    with pytest.raises(OutputError, match=f"cannot write {path}: "), whole_file(path) as temporary:
        assert temporary.parent == tmp_path and temporary.suffix == ".svg"
        temporary.write_text("half")
        raise OSError(28, "No space left on device")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["a.svg"]
