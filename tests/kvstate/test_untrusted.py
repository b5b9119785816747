"""The bounds of `kvstate.untrusted` at their edges: each test kills a mutant the suite let
through — the depth bound off by one, `shown` unbounded, duplicate keys accepted."""

from __future__ import annotations

import json

import pytest

from kvstate.trace import TRACE_LIMITS, TraceError, parse_line
from kvstate.untrusted import Fields, Limits, UntrustedFileError, parse_json, read_json, shown


def nested(levels: int) -> str:
    """A JSON document of `levels` objects, each inside the one before: {"a": {"a": ... 1}}."""
    return '{"a": ' * levels + "1" + "}" * levels


@pytest.mark.parametrize("depth", [1, 2, 5, 32])
def test_a_document_nested_exactly_to_the_bound_is_read_and_one_level_more_is_refused(depth):
    limits = Limits(max_bytes=1 << 20, max_depth=depth)
    value = parse_json(nested(depth), limits, "test file", path="f.json")
    for _ in range(depth - 1):
        value = value["a"]
    assert value == {"a": 1}
    with pytest.raises(UntrustedFileError, match=f"nested deeper than {depth} levels"):
        parse_json(nested(depth + 1), limits, "test file", path="f.json")
    with pytest.raises(UntrustedFileError, match=f"nested deeper than {depth} levels"):
        parse_json("[" * (depth + 1) + "]" * (depth + 1), limits, "test file", path="f.json")


@pytest.mark.parametrize(
    "value",
    [list(range(100_000)), {str(i): i for i in range(100_000)}, "x" * 100_000, 10**5000, [[1] * 50], (1,) * 9],
    ids=["list", "dict", "str", "int", "nested list", "tuple"],
)
def test_shown_echoes_any_value_short(value):
    assert len(shown(value)) <= 120


def test_a_refused_huge_list_is_echoed_short():
    fields = Fields.of({"gpu_blocks": list(range(100_000))}, "config", path="c.json")
    with pytest.raises(UntrustedFileError) as info:
        fields.integer("gpu_blocks")
    assert len(str(info.value)) < 200 and "100000 items" in str(info.value)


def test_a_trace_line_with_a_repeated_key_is_refused():
    line = json.dumps({"iteration": 1})[:-1] + ', "iteration": 2}'
    with pytest.raises(TraceError, match="key 'iteration' appears twice"):
        parse_line(line, 3, path="t.ndjson", limits=TRACE_LIMITS)


def test_a_config_json_with_a_repeated_key_is_refused(tmp_path):
    pytest.importorskip("torch")
    from executor import CheckpointError, LlamaModel, save_hf_llama
    from executor.hf import load_hf_llama

    save_hf_llama(LlamaModel.from_seed(seed=0), tmp_path)
    config = tmp_path / "config.json"
    text = config.read_text()
    config.write_text(text[: text.rindex("}")] + ', "hidden_size": 4096}')  # the last one would win silently
    with pytest.raises(CheckpointError, match="key 'hidden_size' appears twice"):
        load_hf_llama(tmp_path)
    with pytest.raises(UntrustedFileError, match="appears twice"):
        read_json(config, Limits(max_bytes=1 << 16), "checkpoint config")
