"""The first hour on the command line: every count is bounded and says its bound, one rule for
every output path, a warning is one line of its own, the options read the same in every command
and nothing is written unasked."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from kvstate.cli import build_parser, main, parse

COMMANDS = build_parser()._subparsers._group_actions[0].choices  # name -> subparser


def options(command: str) -> dict[str, argparse.Action]:
    return {flag: action for action in COMMANDS[command]._actions for flag in action.option_strings}


# ------------------------------------------------------------------------------------------- item 1
def integer_options() -> list[tuple[str, str, argparse.Action]]:
    found = []
    for command in COMMANDS:
        for flag, action in options(command).items():
            if action.type is int or hasattr(action.type, "maximum"):
                found.append((command, flag, action))
    return found


def test_every_count_option_has_an_upper_bound():
    found = integer_options()
    assert len(found) >= 15  # demo, soak, bench, check, generate
    unbounded = [f"{command} {flag}" for command, flag, action in found if action.type is int]
    assert not unbounded, f"count options without an upper bound: {unbounded}"
    assert all(action.type.maximum < 10**19 for _, _, action in found)


@pytest.mark.parametrize("command, flag", [("demo", "--requests"), ("soak", "--requests"), ("demo", "--gpu-blocks")])
def test_a_count_past_its_bound_is_refused_by_the_parser_naming_the_bound(capsys, command, flag):
    with pytest.raises(SystemExit) as exit_:  # refused while parsing: nothing runs
        parse([command, flag, "99999999999999999999"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    bound = options(command)[flag].type.maximum
    assert f"at most {bound}" in err and "99999999999999999999" in err
    assert err.strip().splitlines()[-1].startswith(f"kvstate {command}: error: {flag} must be at most {bound}")


@pytest.mark.parametrize("command, flag, action", integer_options(), ids=lambda v: getattr(v, "dest", v))
def test_a_count_below_its_minimum_is_refused_naming_the_flag(capsys, command, flag, action):
    below = str(action.type.minimum - 1)
    assert main([command, flag, below]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(f"kvstate {command}: error: {flag} must be "), lines
    assert lines[-1].endswith(f"got {below}"), lines
    assert not lines[0].startswith("kvstate") or len(lines) == 1  # argparse's usage, then the one error line


def test_a_duration_too_large_for_a_timer_is_refused(capsys):
    assert main(["diagram", "--dot-timeout", "1e300"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "kvstate diagram: error: --dot-timeout must be between 0.01 and 86400 seconds, got '1e300'"
    )


def test_a_count_with_thousands_of_digits_is_echoed_short(capsys):
    assert main(["demo", "--requests", "9" * 5000]) == 2
    err = capsys.readouterr().err
    assert len(err) < 1000 and "5000 characters" in err


# ------------------------------------------------------------------------------------------- item 2
@pytest.mark.parametrize(
    "argv",
    [
        ["report", "TRACE", "--out", "OUT/a/b"],
        ["demo", "--trace", "OUT/a/t.ndjson"],
        ["demo", "--report", "OUT/a/b"],
        ["soak", "--trace", "OUT/a/t.ndjson"],
        ["diagram", "--out", "OUT/a/b"],
        ["check", "--counterexample-dir", "OUT/a/b"],
        ["bench", "--json", "OUT/a/b.json"],
        ["bench", "--plots", "OUT/a/b"],
    ],
    ids=lambda argv: " ".join(argv[:2]),
)
def test_an_output_path_whose_parent_is_missing_is_refused_naming_it(tmp_path, capsys, argv):
    trace = tmp_path / "t.ndjson"
    trace.write_text("")
    missing = tmp_path / "missing"
    argv = [str(trace) if a == "TRACE" else a.replace("OUT", str(missing)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    path = next(a for a in argv if str(missing) in a)
    option = argv[argv.index(path) - 1]
    assert err.strip().splitlines() == [
        f"kvstate {argv[0]}: error: {option} {path}: the directory {Path(path).parent} does not exist; create it "
        + "first, or pass --mkdir to create it"
    ]
    assert not missing.exists()  # nothing created at the filesystem root or anywhere else


def test_mkdir_creates_the_missing_parents(tmp_path, capsys):
    from kvstate.spec import load_spec
    from tests.conftest import two_line_trace

    trace = tmp_path / "t.ndjson"
    trace.write_text("".join(json.dumps(line) + "\n" for line in two_line_trace(load_spec())))
    out = tmp_path / "new" / "deeper" / "report"
    assert main(["report", str(trace), "--out", str(out), "--mkdir"]) == 0
    assert (out / "report.html").is_file()


# ------------------------------------------------------------------------------------------- item 3
@pytest.mark.filterwarnings("default:.*GPU-only:RuntimeWarning")  # expected here: the demo loses its host tier
def test_a_host_tier_fallback_is_one_warning_line_of_its_own(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main(["demo", "--requests", "2", "--device", "cpu", "--inject", "host_loss@1"])
    out, err = capsys.readouterr()
    assert code == 0 and "OUTPUT EQUIVALENCE: PASS" in out
    assert err.splitlines() == [
        "kvstate demo: warning: injected fault host_loss at iteration 1; 0 suspended requests with host blocks will "
        + "be replayed and "
        + "the engine runs GPU-only from now on (every eviction is a recompute-pause)"
    ]
    assert not list(tmp_path.iterdir())  # and the demo wrote nothing it was not asked to


# ------------------------------------------------------------------------------------------- item 9
def test_version(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvstate {metadata.version('kvstate')}"


def test_device_dtype_and_spec_read_the_same_in_every_command():
    devices = {c: options(c)["--device"] for c in COMMANDS if "--device" in options(c)}
    assert {"demo", "soak", "generate", "bench"} <= set(devices)
    assert {c for c, action in devices.items() if action.default != "auto"} == {"bench"}  # bench: auto, torch only
    dtypes = {c: options(c)["--dtype"] for c in COMMANDS if "--dtype" in options(c)}
    assert set(dtypes) == {"demo", "soak", "generate"}
    assert len({tuple(a.choices) for a in dtypes.values()}) == 1
    # the commands that prove outputs equal run the device's default (float64 on the CPU); generate prints text
    assert {c: a.default for c, a in dtypes.items()} == {"demo": "auto", "soak": "auto", "generate": "float32"}
    specs = {c: options(c)["--spec"] for c in COMMANDS if "--spec" in options(c)}
    assert set(specs) == {"spec", "diagram", "check", "validate", "report", "export"}
    assert {a.metavar for a in specs.values()} == {"PATH"}
    for command in ("demo", "soak"):
        assert {"--trace", "--report", "--mkdir"} <= set(options(command))
        assert options(command)["--trace"].default is None  # nothing written unasked


def test_the_spec_cites_no_file_the_repository_lacks():
    root = Path(__file__).resolve().parents[2]
    text = (root / "spec" / "SPEC.md").read_text(encoding="utf-8")
    assert "DESIGN" not in text  # the design brief is not part of the repository
    for link in re.findall(r"\]\(([^)#]+)", text):
        if not link.startswith("http"):
            assert (root / "spec" / link).exists(), link


def test_a_truncated_json_string_is_reported_without_a_stutter():
    from kvstate.trace import TraceError, parse_line

    with pytest.raises(TraceError) as info:
        parse_line('{"iteration": "ab', 1)
    assert " at at " not in str(info.value) and "Unterminated string starting at column" in str(info.value)
