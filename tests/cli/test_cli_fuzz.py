"""No bad command line prints a traceback: every malformed argument list of every command exits with status 2
and one error line, before any work starts and before torch (or the torch side, `executor`) is imported."""

from __future__ import annotations

import builtins
import os
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstate.cli import build_parser, main
from kvstate.commands.args import GPU_DRIVER_FILES

TORCH_SIDE = ("torch", "executor")


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "trace.ndjson"
    path.write_text('{"event": "admit"}\n')
    return str(path)


@pytest.fixture
def run_cli(monkeypatch, capsys):
    """Run `main(argv)` in-process; fail if it imports torch or `executor` (even when already loaded)."""
    real_import = builtins.__import__

    def spy(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name.split(".")[0] in TORCH_SIDE:
            raise AssertionError(f"the command imported {name} before refusing its arguments")
        return real_import(name, globals, locals, fromlist, level)

    def run(argv: list[str]) -> tuple[int, str, str]:
        monkeypatch.setattr(builtins, "__import__", spy)
        try:
            code = main(argv)
        finally:
            monkeypatch.setattr(builtins, "__import__", real_import)
        out, err = capsys.readouterr()
        return code, out, err

    return run


def assert_refused(code: int, out: str, err: str, argv: list[str]) -> None:
    assert code == 2, (argv, code, out, err)
    assert "Traceback" not in out + err, argv
    lines = err.strip().splitlines()
    assert lines, argv
    command = argv[0]
    if lines[0].startswith("usage:"):  # argparse: the subcommand's usage, then one error line
        assert lines[0].startswith(f"usage: kvstate {command}"), (argv, err)
    else:
        assert len(lines) == 1, (argv, err)
    assert lines[-1].startswith(f"kvstate {command}: error: "), (argv, err)


# (argv, words the error must contain); "TRACE" is replaced by an existing trace file, "EMPTY" by an empty file
CASES = [
    (["demo", "--bogus"], "unrecognized arguments: --bogus"),
    (["demo", "--report", "/proc/x"], "--report /proc/x"),
    (["demo", "--trace", "/proc/x/t.ndjson"], "--trace /proc/x/t.ndjson"),
    (["demo", "--trace", "/tmp"], "is a directory"),
    (["demo", "--inject", "bogus"], "unknown fault kind 'bogus'"),
    (["demo", "--inject", "copy_to_host:2"], "copy_to_host"),
    (["demo", "--inject", "bogus", "--pp", "2"], "--inject is not supported with --pp 2"),
    (["demo", "--inject", "copy_to_host:0.1", "--pp", "2"], "--inject is not supported with --pp 2"),
    (["demo", "--no-checksums", "--pp", "2"], "--no-checksums is not supported with --pp 2"),
    (["demo", "--gpu-blocks", "1", "--block-size", "1"], "the smallest request needs 2"),
    (["demo", "--gpu-blocks", "0"], "--gpu-blocks must be a positive integer, got 0"),
    (["demo", "--requests", "-3"], "--requests must be positive, got -3"),
    (["demo", "--pp", "0"], "--pp must be a positive integer, got 0"),
    (["demo", "--device", "tpu"], "expected auto, cpu, cuda or cuda:N"),
    (["demo", "--dtype", "int8"], "invalid choice"),
    (["soak", "--inject", "bogus"], "unknown fault kind 'bogus'"),
    (["soak", "--requests", "0"], "--requests must be positive"),
    (["soak", "--cancel-rate", "2"], "--cancel-rate must be in [0, 1]"),
    (["soak", "--arrival-rate", "nan"], "--arrival-rate"),
    (["soak", "--device", "gpu"], "expected auto, cpu, cuda or cuda:N"),
    (["check", "--max-states", "-1"], "must be a positive integer"),
    (["check", "--max-states", "0"], "must be a positive integer"),
    (["check", "--time-limit", "nan"], "must be a number > 0"),
    (["check", "--bound", "nope"], "unknown bound"),
    (["check", "--spec", "/nonexistent.toml"], "--spec /nonexistent.toml does not exist"),
    (["check", "--bounds-file", "/tmp"], "--bounds-file /tmp is a directory"),
    (["check", "--counterexample-dir", "/proc/x"], "--counterexample-dir /proc/x"),
    (["check", "--counterexample-dir", "/etc/passwd"], "not a directory"),
    (["report", "/tmp"], "TRACE /tmp is a directory"),
    (["report", "/nonexistent.ndjson"], "does not exist"),
    (["report", "TRACE", "--out", "/etc/passwd"], "--out /etc/passwd exists and is not a directory"),
    (["report", "TRACE", "--out", "/proc/x"], "--out /proc/x"),
    (["report"], "the following arguments are required: trace"),
    (["validate", "EMPTY"], "the trace is empty"),
    (["validate", "/tmp"], "/tmp"),
    (["validate", "/nonexistent.ndjson"], "/nonexistent.ndjson"),
    (["diagram", "--out", "/proc/x"], "--out /proc/x"),
    (["diagram", "--spec", "/tmp"], "--spec /tmp is a directory"),
    (["spec", "--spec", "/nonexistent.toml"], "does not exist"),
    (["bench", "--json", "/proc/x/y.json"], "--json /proc/x/y.json"),
    (["bench", "--json", "/tmp"], "--json /tmp is a directory"),
    (["bench", "--plots", "/proc/x"], "--plots /proc/x"),
    (["bench", "--only", "everything"], "invalid choice"),
    (["bench", "--only", "overhead", "--device", "cpu"], "--device does not apply"),
    (["bench", "--seed", "x"], "expected an integer >= 0"),
    (["generate", "hello"], "one of the arguments --checkpoint --model is required"),
    (["generate", "--model", "nope", "hello"], "unknown model 'nope'"),
    (["demo", "--model", "nope"], "unknown model 'nope'"),
    (["demo", "--model", "smollm2", "--pp", "2"], "--model runs in a single process"),
    (["demo", "--model", "smollm2", "--hidden-size", "128"], "drop it with --model"),
    (["generate", "--checkpoint", "/nonexistent", "hello"], "--checkpoint /nonexistent does not exist"),
    (["generate", "--checkpoint", "/tmp", "hello"], "has no config.json"),
    (["generate", "--checkpoint", "/etc/passwd", "hello"], "is not a directory"),
    (["generate", "--checkpoint", "/tmp", "--max-new-tokens", "0", "hi"], "--max-new-tokens must be a positive"),
    (["nope"], "invalid choice"),
]


@pytest.mark.parametrize("argv, words", CASES, ids=[" ".join(argv) for argv, _ in CASES])
def test_bad_command_line_is_one_error_line_and_exit_2(run_cli, trace, tmp_path, argv, words):
    (tmp_path / "empty.ndjson").write_bytes(b"")
    files = {"TRACE": trace, "EMPTY": str(tmp_path / "empty.ndjson")}
    argv = [files.get(a, a) for a in argv]
    code, out, err = run_cli(argv)
    if argv[0] == "nope":  # the top-level parser's usage
        assert code == 2 and "Traceback" not in err and words in err
        return
    assert_refused(code, out, err, argv)
    assert words in err, (argv, err)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or any(os.path.exists(path) for path in GPU_DRIVER_FILES),
    reason="a GPU driver is present: torch decides whether CUDA is usable",
)
@pytest.mark.parametrize("command", ["demo", "soak", "bench"])
def test_cuda_without_a_gpu_driver_is_refused_before_torch_is_imported(run_cli, command):
    build_parser()  # the command modules are loaded (torch-free) before the spy watches
    code, out, err = run_cli([command, "--device", "cuda"])
    assert_refused(code, out, err, [command])
    assert "--device cuda: this machine has no GPU driver" in err and "use 'cpu' or 'auto'" in err


def test_unknown_option_prints_the_subcommands_usage(run_cli):
    code, _, err = run_cli(["demo", "--bogus"])
    assert code == 2 and err.startswith("usage: kvstate demo ") and "--gpu-blocks" in err


def test_help_exits_0(run_cli):
    for command in build_parser()._subparsers._group_actions[0].choices:
        code, out, _ = run_cli([command, "--help"])
        assert code == 0 and f"usage: kvstate {command}" in out


# ------------------------------------------------------------------------------ generated malformed lines
BAD_COUNT = ["-1", "x", "", "1.5", "nan", "1e999", "--"]  # never a valid count, positive or not
BAD_PATH = ["/proc/x/out", "/etc/passwd/x", "/proc/x"]
COUNT_OPTIONS = {
    "demo": [
        "--requests",
        "--gpu-blocks",
        "--host-blocks",
        "--block-size",
        "--chunk-size",
        "--hidden-size",
        "--seed",
        "--pp",
    ],
    "soak": ["--requests", "--gpu-blocks", "--host-blocks", "--block-size", "--chunk-size"],
    "check": ["--max-states"],
    "bench": ["--seed"],
    "generate": ["--max-new-tokens", "--seed"],
}
OUTPUT_OPTIONS = {
    "demo": ["--trace", "--report"],
    "bench": ["--json", "--plots"],
    "diagram": ["--out"],
    "check": ["--counterexample-dir"],
}
REQUIRED = {"generate": ["--checkpoint", "/tmp", "hi"]}


@st.composite
def malformed(draw) -> list[str]:
    """A command, some valid-looking options, and at least one value no check may accept."""
    command = draw(st.sampled_from(sorted(set(COUNT_OPTIONS) | set(OUTPUT_OPTIONS))))
    bad = []
    if command in COUNT_OPTIONS:
        bad += [
            [flag, draw(st.sampled_from(BAD_COUNT))]
            for flag in draw(st.lists(st.sampled_from(COUNT_OPTIONS[command]), max_size=3, unique=True))
        ]
    if command in OUTPUT_OPTIONS:
        bad += [
            [flag, draw(st.sampled_from(BAD_PATH))]
            for flag in draw(st.lists(st.sampled_from(OUTPUT_OPTIONS[command]), max_size=2, unique=True))
        ]
    if not bad:
        flag = draw(st.sampled_from(COUNT_OPTIONS.get(command) or OUTPUT_OPTIONS[command]))
        bad = [[flag, draw(st.sampled_from(BAD_COUNT if command in COUNT_OPTIONS else BAD_PATH))]]
    order = draw(st.permutations(bad))
    return [command, *REQUIRED.get(command, []), *(part for pair in order for part in pair)]


@settings(
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(argv=malformed())
def test_generated_malformed_command_lines_are_refused(run_cli, argv):
    code, out, err = run_cli(argv)
    assert_refused(code, out, err, argv)
