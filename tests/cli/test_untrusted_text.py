"""Text from files and command lines is printed as inert text: never read as Rich markup,
and no control character reaches the terminal, from a spec's names and meanings, a spec error, a path, a trace,
`kvstate check`'s lines or the text `kvstate generate` streams (unless `--raw`)."""

from __future__ import annotations

import io
import json
import tomllib

import pytest
import tomli_w
from rich.console import Console

from kvstate.checker.bounds import select_bounds
from kvstate.checker.runner import run_check
from kvstate.cli import main
from kvstate.roles import RECOMPUTING
from kvstate.spec import load_spec, packaged_spec_path

ESCAPES = "\x1b[2J\x1b]0;pwned\x07\x1b]52;c;cHduZWQ=\x07\u202e\x9b"  # clear, title, clipboard, bidi, C1 CSI
FORGED = "\nkvstate spec: FAKE all good"
MARKUP = ("[/]", "[link=javascript:alert(1)]click[/link]", "[x]", ":warning:")


def packaged_data() -> dict:
    return tomllib.loads(packaged_spec_path().read_text(encoding="utf-8"))


def spec_file(tmp_path, data: dict, name: str = "spec.toml"):
    path = tmp_path / name
    path.write_text(tomli_w.dumps(data), encoding="utf-8")
    return path


def assert_inert(text: str) -> None:
    assert not any(ch in text for ch in "\x1b\x07\x9b\u202e"), repr(text[:300])
    assert not any(line.startswith("kvstate spec: FAKE") for line in text.splitlines())


def test_inert_escapes_controls_visibly_and_keeps_what_it_is_told_to():
    from kvstate.terminal import inert

    assert inert("a\x1b[2Jb\x07\u202e\ud800\n") == "a\\x1b[2Jb\\x07\\u202e\\ud800\\n"
    assert inert("line\n\ttab\r\x00", keep="\n\t") == "line\n\ttab\\r\\x00"
    assert inert("[/] ünïcode ⚠") == "[/] ünïcode ⚠"  # printable text is untouched


@pytest.mark.parametrize("name", MARKUP)
def test_spec_names_print_as_typed_never_as_markup(tmp_path, capsys, name):
    data = packaged_data()
    data["spec"]["name"] = name
    data["states"][0]["meaning"] = f"waits {name}"
    code = main(["spec", "--spec", str(spec_file(tmp_path, data))])
    out = capsys.readouterr().out
    assert code == 0
    assert out.splitlines()[0].startswith(f"{name} v")  # literally, not a style, a link or an emoji
    assert f"waits {name}" in out
    assert "\x1b]8;" not in out  # no terminal hyperlink


def test_escapes_and_forged_lines_in_a_spec_never_reach_the_terminal(tmp_path, capsys):
    data = packaged_data()
    data["spec"]["name"] = "lifecycle" + ESCAPES
    data["states"][0]["meaning"] = "waits" + ESCAPES + FORGED
    code = main(["spec", "--spec", str(spec_file(tmp_path, data))])
    out = capsys.readouterr().out
    assert code == 0
    assert_inert(out)
    assert "\\x1b[2J" in out and "\\n" in out  # shown, visibly escaped


def test_a_spec_error_naming_a_hostile_state_is_inert(tmp_path, capsys):
    data = packaged_data()
    data["states"].append({"name": ESCAPES + FORGED + "[/]"})  # no residency: refused while parsing
    code = main(["spec", "--spec", str(spec_file(tmp_path, data))])
    out, err = capsys.readouterr()
    assert code == 2 and not out
    assert_inert(err)
    assert len(err.strip().splitlines()) == 1 and "residency" in err


def test_a_spec_validation_error_naming_hostile_states_is_inert(tmp_path, capsys):
    data = packaged_data()
    data["events"][0]["transitions"][0]["dest"] = ESCAPES + FORGED  # an unknown state
    code = main(["spec", "--spec", str(spec_file(tmp_path, data))])
    err = capsys.readouterr().err
    assert code == 2 and "is an unknown state" in err
    assert_inert(err)


BRACKETED = "[x] [link=https:example.com]run"  # a directory name that is Rich markup (a style, a link)


def test_validate_prints_a_bracketed_path_as_typed(tmp_path, capsys):
    from tests.conftest import two_line_trace

    directory = tmp_path / BRACKETED
    directory.mkdir()
    trace = directory / "t[bold].ndjson"
    trace.write_text("".join(json.dumps(line) + "\n" for line in two_line_trace(load_spec())))
    assert main(["validate", str(trace)]) == 0
    assert capsys.readouterr().out.startswith(f"VALID {trace}:")


def renamed(data: dict, old: str, new: str) -> dict:
    """The spec's TOML data with state `old` renamed `new` everywhere."""
    if data["spec"]["initial"] == old:
        data["spec"]["initial"] = new
    for state in data["states"]:
        state["name"] = new if state["name"] == old else state["name"]
    for event in data["events"]:
        for edge in event["transitions"]:
            edge["source"] = [new if s == old else s for s in edge["source"]]
            edge["dest"] = new if edge["dest"] == old else edge["dest"]
    for output_list in data["output_lists"]:
        output_list["states"] = [new if s == old else s for s in output_list["states"]]
    return data


def test_check_lines_are_inert(tmp_path):
    """`kvstate check` prints every line (the spec's source, coverage, transitions never taken) through one
    printer: a state named with escapes shows up escaped."""
    spec = load_spec()
    replaying = spec.role(RECOMPUTING)
    hostile = spec_file(tmp_path, renamed(packaged_data(), replaying, replaying + ESCAPES + FORGED))
    out = io.StringIO()
    code, _ = run_check(
        select_bounds(["no_host"]), spec=load_spec(hostile), console=Console(file=out), refine=False, max_states=40
    )
    text = out.getvalue()
    assert code == 3  # cut short: so coverage lists the transitions never taken, named by their states
    words = " ".join(text.split())
    assert "never taken in any bound" in words and f"{replaying}\\x1b[2J" in words
    assert_inert(text)


def test_say_wraps_only_at_spaces_and_never_inside_a_path(monkeypatch):
    from kvstate.terminal import console, say

    monkeypatch.setenv("COLUMNS", "30")
    out = console()
    out.file = io.StringIO()
    path = "/a/very/long/path/that/is/longer/than/the/width/spec.toml"
    say(out, ("kvstate spec", "bold"), f": lifecycle v1 — {path}: valid [/]")
    lines = out.file.getvalue().splitlines()
    assert f"{path}:" in lines and all(len(line) <= 30 for line in lines if line != f"{path}:")
    assert " ".join(lines) == f"kvstate spec: lifecycle v1 — {path}: valid [/]"


# ------------------------------------------------------------------------------------------- generate
tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def hostile_checkpoint(tmp_path_factory):
    """A tiny random-weight Llama whose tokenizer's every token is a terminal escape sequence."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from executor import LlamaModel, save_hf_llama

    directory = tmp_path_factory.mktemp("hostile-checkpoint")
    save_hf_llama(LlamaModel.from_seed(seed=3), directory)
    vocab = {"hello": 0} | {f"\x1b]52;c;{i:03d}\x07\x1b[2J\x1b]0;t{i}\x07": i for i in range(1, 512)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="hello"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "config.json").read_text())
    config.pop("eos_token_id", None)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def generate(capsys, checkpoint, *extra: str) -> str:
    argv = ["generate", "--checkpoint", str(checkpoint), "--max-new-tokens", "4", "--device", "cpu", *extra]
    assert main([*argv, "hello"]) == 0
    return capsys.readouterr().out


def test_generate_escapes_a_hostile_vocabulary_unless_raw(hostile_checkpoint, capsys):
    out = generate(capsys, hostile_checkpoint)
    assert_inert(out)
    assert "\\x1b]52;c;" in out  # visible, escaped
    raw = generate(capsys, hostile_checkpoint, "--raw")
    assert "\x1b]52;c;" in raw  # exactly what the model generated, as asked
    assert raw.replace("\x1b", "\\x1b").replace("\x07", "\\x07") == out
