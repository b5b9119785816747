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
