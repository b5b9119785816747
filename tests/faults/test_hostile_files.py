"""Hostile and broken untrusted files: specs, traces for `kvstate validate` and `kvstate report`, and the
regression tests `kvstate check` writes. Each attack ends in the project's clear error (naming the file, the line
and the field) or a refusal at exactly the offending line, within bounded memory, never a traceback.
"""

from __future__ import annotations

import dataclasses
import json
import runpy
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvstate import load_spec
from kvstate.checker import trace as vt
from kvstate.checker.bounds import load_bounds
from kvstate.checker.runner import write_abstract_test, write_refinement_test
from kvstate.checker.trace import TRACE_FIELDS, TRACE_LIMITS, TraceError, validate_trace
from kvstate.cli import main
from kvstate.errors import KVStateError, SpecError
from kvstate.report.model import load_lines, summarize
from kvstate.spec import packaged_spec_path
from kvstate.untrusted import Limits, UntrustedFileError, iter_lines, read_json

SPEC = load_spec()
ADMIT = next(t for t in SPEC.transitions if t.source == SPEC.initial)  # read from the spec, never re-typed
FINISH = next(
    t for t in SPEC.transitions if t.source == ADMIT.dest and t.dest in SPEC.terminal_states and t.done_reason
)


def record(iteration: int, rid: object, transition, *, gpu_blocks: int = 0, gpu_free: int = 8) -> dict:
    """One trace line in the TRACE.md format (GPU capacity 8, no host tier)."""
    values = {
        "iteration": iteration,
        "request_id": rid,
        "event": transition.event,
        "from": transition.source,
        "to": transition.dest,
        "gpu_blocks": gpu_blocks,
        "host_blocks": 0,
        "gpu_free": gpu_free,
        "host_free": 0,
        "gpu_fenced": 0,
        "host_fenced": 0,
        "gpu_capacity": 8,
        "host_capacity": 0,
        "generated": 0,
        "computed_tokens": 0,
        "done_reason": transition.done_reason if transition.dest in SPEC.terminal_states else None,
    }
    assert tuple(values) == TRACE_FIELDS
    return values


def good_trace(last_iteration: int = 3) -> list[dict]:
    return [record(1, "a", ADMIT, gpu_blocks=2, gpu_free=6), record(last_iteration, "a", FINISH)]


def write_lines(path: Path, lines: list[dict | str | bytes]) -> Path:
    data = b"".join(
        x if isinstance(x, bytes) else (x if isinstance(x, str) else json.dumps(x)).encode() + b"\n" for x in lines
    )
    path.write_bytes(data)
    return path


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["validate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ------------------------------------------------------------------------------------------ kvstate validate
def test_a_good_trace_still_validates(tmp_path, capsys):
    code, out, _ = cli(capsys, str(write_lines(tmp_path / "t.ndjson", good_trace())))
    assert code == 0 and "VALID" in out


def test_a_huge_line_is_refused_at_its_line_after_reading_only_the_limit(tmp_path, capsys):
    path = write_lines(tmp_path / "t.ndjson", [good_trace()[0], "x" * (4 * TRACE_LIMITS.max_line_bytes)])
    report = validate_trace(path)
    d = report.divergence
    assert (d.line, d.rule) == (2, vt.FORMAT) and f"longer than {TRACE_LIMITS.max_line_bytes} bytes" in d.message
    code, out, _ = cli(capsys, str(path))
    assert code == 2 and "UNUSABLE" in out and "line 2:" in out and len(out) < 1000


def test_an_endless_stream_without_newlines_is_refused_at_line_one(tmp_path):
    """A /dev/zero-like stream: a bounded generated file (4x the line limit of NUL bytes) stands in for it; the
    reader must stop after max_line_bytes + 1 bytes, whatever the file's length."""
    path = tmp_path / "zero"
    path.write_bytes(b"\0" * (4 * TRACE_LIMITS.max_line_bytes))
    with path.open("rb") as handle:
        with pytest.raises(TraceError, match="line is longer than") as info:
            list(vt.trace_lines(handle, path=path))
        assert handle.tell() == TRACE_LIMITS.max_line_bytes + 1  # read no further than one byte past the limit
    assert info.value.line == 1 and str(path) in str(info.value)
    d = validate_trace(path).divergence
    assert (d.line, d.rule) == (1, vt.FORMAT)


def test_a_file_over_the_size_limit_is_refused_at_the_line_that_crosses_it(tmp_path):
    limits = Limits(max_bytes=1000, max_line_bytes=400)
    path = write_lines(tmp_path / "t.ndjson", ["\n" * 10] * 200)  # blank lines only: a stream that never ends
    d = validate_trace(path, limits=limits).divergence
    assert d.rule == vt.FORMAT and "larger than 1000 bytes" in d.message and d.line == 1001


@pytest.mark.parametrize(
    "payload, message",
    [
        ("[" * 100_000, "longer than"),  # over the line limit: refused before parsing
        ("[" * 30_000, "nested too deeply"),  # under it: Python's parser would raise RecursionError
        ('{"iteration": ' + "[" * 20 + "1" + "]" * 20 + "}", "nested deeper than 2"),
        ("1" * 5000, "too many to read"),  # over Python's integer-string limit
    ],
)
def test_deep_nesting_and_huge_numbers_are_refused_as_format(tmp_path, capsys, payload, message):
    path = write_lines(tmp_path / "t.ndjson", [good_trace()[0], payload])
    d = validate_trace(path).divergence
    assert (d.line, d.rule) == (2, vt.FORMAT) and message in d.message, d.message
    code, out, err = cli(capsys, str(path))
    assert code == 2 and "UNUSABLE" in out and "Traceback" not in out + err


@pytest.mark.parametrize("field", ["iteration", "gpu_free", "request_id"])
def test_an_integer_of_more_than_19_digits_is_refused_naming_the_field(field):
    line = json.dumps({**good_trace()[0], field: 0}).replace(f'"{field}": 0', f'"{field}": {"9" * 25}')
    d = validate_trace([line]).divergence
    assert d.rule == vt.FORMAT and repr(field) in d.message and "more than 19 digits" in d.message


@pytest.mark.parametrize("payload", ['{"iteration": NaN}', '{"a": 1, "a": 2}'])
def test_nan_and_repeated_keys_are_refused(payload):
    d = validate_trace([payload]).divergence
    assert (d.line, d.rule) == (1, vt.FORMAT)


def test_a_huge_request_id_is_not_echoed(tmp_path, capsys):
    rid = "i" * 60_000  # under the line limit, so the line parses, but over the id's (spec/TRACE.md): unusable
    lines = [record(1, rid, ADMIT)]
    lines[0]["event"] = "x" * 1000
    code, out, _err = cli(capsys, str(write_lines(tmp_path / "t.ndjson", lines)))
    assert code == 2 and "UNUSABLE" in out
    assert len(out) < 2000 and "60000 characters" in out


def test_an_empty_trace_is_not_reported_valid(tmp_path, capsys):
    for text in ("", "\n\n  \n"):
        path = tmp_path / "empty.ndjson"
        path.write_text(text)
        code, out, err = cli(capsys, str(path))
        assert code == 2 and "VALID" not in out and "empty" in err and str(path) in err


def test_unusable_input_exits_2_and_a_divergence_exits_1(tmp_path, capsys):
    bad_json = write_lines(tmp_path / "bad.ndjson", [good_trace()[0], '{"iteration": 1'])
    assert cli(capsys, str(bad_json))[0] == 2
    wrong_type = write_lines(tmp_path / "type.ndjson", [{**good_trace()[0], "gpu_free": "6"}])
    assert cli(capsys, str(wrong_type))[0] == 2
    diverges = write_lines(tmp_path / "div.ndjson", [good_trace()[1]])  # starts from a non-initial state
    code, out, _ = cli(capsys, str(diverges))
    assert code == 1 and "INVALID" in out and "UNUSABLE" not in out
    directory_code, _, err = cli(capsys, str(tmp_path))
    assert directory_code == 2 and "cannot read trace file" in err


# ------------------------------------------------------------------------------------------------ the spec
def spec_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hostile.toml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "text, message",
    [
        ("x = " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
        ("x = " + "{a = " * 3000 + "1" + "}" * 3000 + "\n", "nested too deeply"),
        ("x" + ".x" * 100 + " = 1\n", "nested deeper than 16"),  # dotted keys nest without recursion
        ("[spec]\nversion = " + "1" * 5000 + "\n", "too many to read"),
        ("[spec]\nversion = " + "1" * 30 + "\n", "more than 19 digits"),
    ],
)
def test_hostile_spec_nesting_and_numbers_are_a_spec_error(tmp_path, capsys, text, message):
    path = spec_file(tmp_path, text)
    with pytest.raises(SpecError, match=message) as info:
        load_spec(path)
    assert str(path) in str(info.value)
    trace = write_lines(tmp_path / "t.ndjson", good_trace())
    code, out, err = cli(capsys, str(trace), "--spec", str(path))
    assert code == 2 and message in err and "Traceback" not in out + err


def test_an_oversized_spec_is_refused_before_parsing(tmp_path):
    text = packaged_spec_path().read_text(encoding="utf-8")
    path = spec_file(tmp_path, text + "#" * (1 << 20) + "\n")
    with pytest.raises(SpecError, match="larger than 1048576 bytes"):
        load_spec(path)


# ---------------------------------------------------------------------------------------------- kvstate report
def test_a_trace_with_iteration_1e9_is_summarized_in_bounded_memory(tmp_path):
    path = write_lines(tmp_path / "t.ndjson", good_trace(last_iteration=10**9))
    tracemalloc.start()
    try:
        summary = summarize(load_lines(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20, f"peak {peak} bytes"  # one occupancy row per iteration would be ~10**9 rows
    assert [row["iteration"] for row in summary.occupancy] == [1, 10**9]
    assert summary.last_iteration == 10**9 and summary.spans["a"][-1].end == 10**9


@pytest.mark.parametrize(
    "line, field",
    [
        ('{"iteration": "1"}', None),  # a missing field comes first: named
        (json.dumps({**good_trace()[0], "iteration": "1"}), "iteration"),
        (json.dumps({**good_trace()[0], "request_id": [[1]]}), "request_id"),
        (json.dumps({**good_trace()[0], "gpu_free": 10**30}), "gpu_free"),
        ("[" * 30_000, None),
    ],
)
def test_the_report_refuses_wrong_types_deep_nesting_and_big_ints_naming_line_and_field(tmp_path, line, field):
    path = write_lines(tmp_path / "t.ndjson", [good_trace()[0], line])
    with pytest.raises(TraceError) as info:
        summarize(load_lines(path))
    assert info.value.line == 2 and f"{path}:2" in str(info.value)
    if field is not None:
        assert info.value.field.startswith(field) and f"field '{field}" in str(info.value)  # request_id[0]: nested
    assert isinstance(info.value, KVStateError) and isinstance(info.value, ValueError)


def test_the_report_refuses_a_trace_whose_iterations_go_backwards(tmp_path):
    lines = good_trace()
    lines[1]["iteration"] = 0
    with pytest.raises(TraceError, match="iteration 0 is below 1"):
        summarize(load_lines(write_lines(tmp_path / "t.ndjson", lines)))


# ------------------------------------------------------------------------------------------- the reader itself
def test_read_json_names_the_file_and_line_of_a_syntax_error(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{\n  "a": 1,\n  "b": \n}\n')
    with pytest.raises(UntrustedFileError) as info:
        read_json(path, Limits(max_bytes=100), "config")
    assert info.value.line == 4 and str(info.value).startswith(f"{path}:4: not a JSON object")


def test_iter_lines_accepts_a_line_of_exactly_the_limit(tmp_path):
    path = tmp_path / "t"
    path.write_bytes(b"a" * 9 + b"\n" + b"b" * 10)
    with path.open("rb") as handle:
        assert [n for n, _ in iter_lines(handle, Limits(max_bytes=100, max_line_bytes=10), "x", path=path)] == [1, 2]


# ------------------------------------------------------------------------------ generated regression tests
PAYLOADS = [
    'x"""\nimport pathlib; pathlib.Path(MARKER).write_text("pwned")\n"""',
    "x'''\nimport pathlib; pathlib.Path(MARKER).write_text('pwned')\n'''",
    '\\"""\r\n__import__("pathlib").Path(MARKER).write_text("pwned")  # \u2028 """',
]


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("kind", ["abstract", "refinement"])
@pytest.mark.parametrize("everywhere", [False, True], ids=["message", "name-message-source"])
def test_spec_text_in_a_generated_regression_test_is_data_not_code(tmp_path, payload, kind, everywhere):
    """The violation message carries spec text (a state name); before the fix a `\"\"\"` in it closed the docstring
    and the next line ran when pytest imported the file."""
    marker = tmp_path / "pwned"
    payload = payload.replace("MARKER", repr(str(marker)))
    bound, spec = load_bounds()[0]["default"], SPEC
    if everywhere:
        bound, spec = dataclasses.replace(bound, name=payload), dataclasses.replace(SPEC, source=payload)
    if kind == "abstract":
        result = SimpleNamespace(violation=SimpleNamespace(invariant="RES-STATE", message=payload, path=[]))
        written = write_abstract_test(tmp_path, bound, spec, result)
    else:
        result = SimpleNamespace(violation_id="RES-STATE", message=payload, path=[])
        written = write_refinement_test(tmp_path, bound, spec, result)
    source = written.read_text(encoding="utf-8")
    compile(source, str(written), "exec")
    module = runpy.run_path(str(written))  # what pytest does when it collects the file
    assert not marker.exists(), "text from the spec ran as code"
    assert module["BOUND_NAME"] == bound.name and module["SPEC_SOURCE"] == spec.source
    assert module["VIOLATED"] == f"invariant RES-STATE: {payload}"
    docstring = source.split('"""')[1]
    assert "pwned" not in docstring and "pathlib" not in source.split("BOUND_NAME")[0]
