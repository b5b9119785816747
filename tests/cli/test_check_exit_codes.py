"""`kvstate check` exit codes are distinct and documented: 0 holds, 1 violated, 2 unusable input, 3 incomplete.

The verdict codes themselves are exercised end to end in tests/checker/test_check.py (holds on `no_host`, a
planted violation, `--max-states 10`); here: the help text states every code, and every unusable input is 2.
"""

from __future__ import annotations

import re

import pytest

from kvstate.checker import EXIT_CODES, HOLDS, INCOMPLETE, VIOLATED
from kvstate.cli import USAGE_ERROR, main


def test_the_codes_are_distinct_and_2_is_left_to_usage_errors():
    codes = [EXIT_CODES[HOLDS], EXIT_CODES[VIOLATED], EXIT_CODES[INCOMPLETE], USAGE_ERROR]
    assert codes == [0, 1, 3, 2]


def test_check_help_documents_every_exit_code(capsys):
    assert main(["check", "--help"]) == 0
    text = capsys.readouterr().out
    documented = {int(code): word for code, word in re.findall(r"^\s+(\d)\s+(\w+)", text, flags=re.M)}
    assert documented == {
        EXIT_CODES[HOLDS]: HOLDS,
        EXIT_CODES[VIOLATED]: VIOLATED,
        USAGE_ERROR: "unusable",
        EXIT_CODES[INCOMPLETE]: INCOMPLETE,
    }


@pytest.mark.parametrize(
    "content, words",
    [
        ("[bounds.x]\nrequests = 'many'\n", "bound 'x'"),
        ("not = [toml", "not valid TOML"),
        ("", "expected tables [bounds.NAME]"),
    ],
)
def test_an_unusable_bounds_file_is_exit_2(tmp_path, capsys, content, words):
    path = tmp_path / "bounds.toml"
    path.write_text(content)
    assert main(["check", "--bounds-file", str(path), "--counterexample-dir", str(tmp_path)]) == USAGE_ERROR
    err = capsys.readouterr().err
    assert err.startswith("kvstate check: error: ") and words in err and "Traceback" not in err


def test_an_unusable_spec_file_is_exit_2(tmp_path, capsys):
    path = tmp_path / "lifecycle.toml"
    path.write_bytes(b"\xff\xfe not utf-8")
    assert main(["check", "--spec", str(path), "--bound", "no_host"]) == USAGE_ERROR
    err = capsys.readouterr().err
    assert err.startswith("kvstate check: error: ") and "UTF-8" in err


def test_a_bounds_file_that_is_not_utf8_is_exit_2(tmp_path, capsys):
    path = tmp_path / "bounds.toml"
    path.write_bytes(b"\xff\xfe[bounds.x]")
    assert main(["check", "--bounds-file", str(path)]) == USAGE_ERROR
    err = capsys.readouterr().err
    assert err.startswith("kvstate check: error: ") and "not UTF-8" in err and "Traceback" not in err


def test_check_has_default_state_and_time_limits(tmp_path, capsys, monkeypatch):
    """A huge bounds file ends as incomplete (exit 3), not as a full memory or a run of days."""
    from kvstate.cli import parse
    from kvstate.commands import check

    args = parse(["check"])
    assert (args.max_states, args.time_limit) == (check.DEFAULT_MAX_STATES, check.DEFAULT_TIME_LIMIT_S)
    assert check.DEFAULT_MAX_STATES <= 10**6 and check.DEFAULT_TIME_LIMIT_S <= 3600
    path = tmp_path / "huge.toml"
    path.write_text(
        "[bounds.huge]\nrequests = " + str([[4, 4]] * 12) + "\ngpu_blocks = 40\nhost_blocks = 20\nblock_size = 1\n"
        "chunk_size = 2\nenv_cancels = 4\n"
    )
    monkeypatch.setattr(check, "DEFAULT_MAX_STATES", 200)  # the default, made small enough to reach in a test
    code = main(["check", "--bounds-file", str(path), "--no-refinement", "--counterexample-dir", str(tmp_path)])
    assert code == 3 and "incomplete" in capsys.readouterr().out
