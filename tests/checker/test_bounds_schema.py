"""The typed schema of bounds files (`kvstate.checker.bounds_schema`): every field has an exact type and a range,
checked before anything is built; a refusal names the file, the line and the field, and `kvstate check` exits 2."""

from __future__ import annotations

import pytest

from kvstate.checker.bounds import Bound, BoundsError, load_bounds
from kvstate.checker.bounds_schema import (
    MAX_BLOCK_SIZE,
    MAX_BLOCKS,
    MAX_NEW_TOKENS,
    MAX_PROMPT_LEN,
    MAX_REQUESTS,
    MAX_WORLD_BYTES,
    world_bytes,
)
from kvstate.cli import main

BASE = "[bounds.x]\nrequests = [[1, 1]]\ngpu_blocks = 2\n"

# (the text of the file, the field its refusal names, the line that sets it)
MALFORMED = [
    ('[bounds.x]\nrequests = [[1, 1]]\ngpu_blocks = "5"\n', "gpu_blocks", 3),
    ("[bounds.x]\nrequests = [[1, 1]]\ngpu_blocks = []\n", "gpu_blocks", 3),
    ("[bounds.x]\nrequests = [[1, 1]]\ngpu_blocks = true\n", "gpu_blocks", 3),
    (BASE + 'block_size = "1"\n', "block_size", 4),
    (BASE + 'chunk_size = "2"\n', "chunk_size", 4),
    (BASE + 'pipeline_stages = "1"\n', "pipeline_stages", 4),
    (BASE + 'micro_batches = "1"\n', "micro_batches", 4),
    ("[bounds.x]\nrequests = [[1.5, 1]]\ngpu_blocks = 3\n", "requests", 2),
    ("[bounds.x]\nrequests = [[true, 1]]\ngpu_blocks = 3\n", "requests", 2),
    (BASE + 'cancel = "no"\n', "cancel", 4),
    (BASE + 'abstract_model = "false"\n', "abstract_model", 4),
    (BASE + "env_cancels = 1.0\n", "env_cancels", 4),
    (BASE + "stop_at = [true]\n", "stop_at", 4),
]

# values whose derived work (a pool, a reference output, a world per state) would exhaust time or memory
TOO_LARGE = [
    ("[bounds.x]\nrequests = [[1, 1]]\ngpu_blocks = 1000000000\n", "gpu_blocks", 3),
    (BASE + "block_size = 1000000000000\n", "block_size", 4),
    (f"[bounds.x]\nrequests = [[1, {MAX_NEW_TOKENS + 1}]]\ngpu_blocks = 200001\n", "requests", 2),
    (f"[bounds.x]\nrequests = [[{MAX_PROMPT_LEN + 1}, 1]]\ngpu_blocks = 1000001\n", "requests", 2),
    ("[bounds.x]\nrequests = [" + ", ".join(["[1, 1]"] * 1000) + "]\ngpu_blocks = 2\n", "requests", 2),
    (BASE + "pipeline_stages = 100000000\n", "pipeline_stages", 4),
]


@pytest.mark.parametrize(("text", "field", "line"), MALFORMED + TOO_LARGE)
def test_a_field_of_the_wrong_type_or_out_of_range_is_refused_naming_file_line_and_field(tmp_path, text, field, line):
    path = tmp_path / "bounds.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(BoundsError) as refused:
        load_bounds(path)
    message = str(refused.value)
    assert message.startswith(f"{path}:{line}: bound 'x': {field} ")
    assert "\n" not in message


@pytest.mark.parametrize(("text", "field", "line"), MALFORMED[:1] + TOO_LARGE[:2])
def test_kvstate_check_exits_2_on_a_malformed_bounds_file_not_1_violated(tmp_path, capsys, text, field, line):
    path = tmp_path / "bounds.toml"
    path.write_text(text, encoding="utf-8")
    assert main(["check", "--bounds-file", str(path), "--time-limit", "60"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"{path}:{line}: bound 'x': {field} " in err


def test_default_set_must_be_a_list_of_names_not_a_string_read_per_character(tmp_path):
    path = tmp_path / "bounds.toml"
    path.write_text('default_set = "b"\n' + BASE.replace("bounds.x", "bounds.b"), encoding="utf-8")
    with pytest.raises(BoundsError, match=rf"^{path}:1: default_set must be a list"):
        load_bounds(path)


def test_every_range_limit_is_named_in_its_refusal():
    cases = [
        ({"gpu_blocks": MAX_BLOCKS + 1}, str(MAX_BLOCKS)),
        ({"gpu_blocks": 4, "block_size": MAX_BLOCK_SIZE + 1}, str(MAX_BLOCK_SIZE)),
        ({"requests": (((1, 1),) * (MAX_REQUESTS + 1)), "gpu_blocks": 2}, str(MAX_REQUESTS)),
    ]
    for fields, limit in cases:
        with pytest.raises(BoundsError, match=limit):
            Bound(name="x", **{"requests": ((1, 1),), **fields})


def test_a_bound_whose_worlds_would_not_fit_the_memory_estimate_is_refused_before_it_is_built():
    blocks, size = MAX_BLOCKS, MAX_BLOCK_SIZE
    assert world_bytes(blocks, 0, size, 1) > MAX_WORLD_BYTES  # each value alone is in range; their product is not
    with pytest.raises(BoundsError, match=r"gpu_blocks \+ host_blocks\) x block_size x pipeline_stages"):
        Bound(name="x", requests=((1, 1),), gpu_blocks=blocks, block_size=size)


def test_the_packaged_bounds_all_pass_the_schema():
    bounds, default = load_bounds()
    assert bounds and set(default) <= set(bounds)
