"""A sweep's configurations are counted before any is built, and a sweep of more than `MAX_CONFIGURATIONS` is
refused; every dimension's values have exact types and ranges (`kvstate.checker.bounds_schema`)."""

from __future__ import annotations

import itertools

import pytest

from kvstate.checker.bounds import BoundsError
from kvstate.checker.sweep import MAX_CONFIGURATIONS, Sweep, load_sweeps
from kvstate.cli import main

HEAD = "[bounds.one]\nrequests = [[1, 1]]\ngpu_blocks = 2\n\n"
TEN = "[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]"


def _sweep_file(tmp_path, body: str):
    path = tmp_path / "bounds.toml"
    path.write_text(HEAD + "[sweeps.s]\n" + body, encoding="utf-8")
    return path


@pytest.mark.parametrize("count", [3, 30])
def test_a_sweep_of_too_many_configurations_is_refused_before_any_is_built(tmp_path, capsys, count):
    path = _sweep_file(tmp_path, f"request_counts = [{count}]\nprompt_lens = {TEN}\nmax_new_tokens = {TEN}\n")
    with pytest.raises(
        BoundsError, match=rf"^{path}: sweep 's' spans .* more than the limit of {MAX_CONFIGURATIONS:,}"
    ):
        load_sweeps(path)
    assert main(["check", "--bounds-file", str(path), "--sweep", "s", "--workers", "1"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("line", "field", "number"),
    [
        ("request_counts = [40]\nprompt_lens = [1]\nmax_new_tokens = [1]\n", "request_counts", 6),
        ("request_counts = [1]\nprompt_lens = [1000000000]\nmax_new_tokens = [1]\n", "prompt_lens", 7),
        (
            "request_counts = [1]\nprompt_lens = [1]\nmax_new_tokens = [1]\npipeline_stages = [100000000]\n",
            "pipeline_stages",
            9,
        ),
        ('request_counts = [1]\nprompt_lens = [1]\nmax_new_tokens = [1]\ncancel = "no"\n', "cancel", 9),
        ("request_counts = [1]\nprompt_lens = [1]\nmax_new_tokens = [1]\nenv_cancels = true\n", "env_cancels", 9),
    ],
)
def test_a_sweep_value_of_the_wrong_type_or_out_of_range_names_file_line_and_field(tmp_path, line, field, number):
    path = _sweep_file(tmp_path, line)
    with pytest.raises(BoundsError, match=rf"^{path}:{number}: sweep 's': {field} "):
        load_sweeps(path)


def test_the_count_is_exactly_the_configurations_enumerated():
    for sweep in load_sweeps().values():
        parts = sweep.parts or (sweep,)
        enumerated = sum(1 for part in parts for _ in part._configurations())
        assert sweep.count() == enumerated
        assert len(sweep.bounds()) <= enumerated


def test_bounds_are_enumerated_lazily():
    sweep = Sweep.from_dict({"request_counts": [2], "prompt_lens": [1, 2], "max_new_tokens": [1, 2]}, "lazy")
    first = list(itertools.islice(sweep.iter_bounds(), 3))
    assert [b.name for b in first] == ["lazy-0", "lazy-1", "lazy-2"]
    assert first == sweep.bounds()[:3]
