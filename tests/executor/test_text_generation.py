"""Text in, text out (`executor.text`, `kvstate generate`) on a checkpoint and tokenizer built here; no downloads."""

from __future__ import annotations

import json
import re

import pytest

from executor import CheckpointError, Engine, EngineConfig, LlamaModel, save_hf_llama
from executor.text import check_fits, generate_text, load_tokenizer
from kvstate.cli import build_parser, main
from kvstate.config import SchedulerConfig
from kvstate.terminal import inert

tokenizers = pytest.importorskip("tokenizers")

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a paged cache keeps keys and values in blocks",
    "suspend copies blocks to the host tier; replay recomputes them",
    "héllo wörld, naïve café",
] * 20


def train_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on `CORPUS` (256 byte symbols + merges + <eos>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<eos>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random-weight Llama (vocab 512) saved with `executor.hf`, plus its tokenizer.json."""
    directory = tmp_path_factory.mktemp("checkpoint")
    save_hf_llama(LlamaModel.from_seed(seed=5), directory)
    tokenizer = train_tokenizer()
    tokenizer.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "config.json").read_text())
    config["eos_token_id"] = tokenizer.token_to_id("<eos>")
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_generate_text_streams_the_decoding_of_the_reference_tokens(checkpoint):
    tokenizer = load_tokenizer(checkpoint)
    assert tokenizer.eos_token_ids == (tokenizer.tokenizer.token_to_id("<eos>"),)
    prompt = "the lazy fox"
    with Engine(
        EngineConfig(checkpoint=str(checkpoint), device="cpu", scheduler=SchedulerConfig(gpu_blocks=16, block_size=4))
    ) as engine:
        pieces = list(generate_text(engine, prompt, max_new_tokens=12))
        reference = engine.reference(tokenizer.encode(prompt), 12, stop_token_ids=tokenizer.eos_token_ids)
    assert len(pieces) > 1 and all(pieces)  # streamed, not one piece at the end
    assert "".join(pieces) == tokenizer.decode(reference)


def test_generate_command_prints_the_same_text(checkpoint, capsys):
    prompt = "héllo wörld"
    code = main(
        [
            "generate",
            "--checkpoint",
            str(checkpoint),
            "--max-new-tokens",
            "10",
            "--device",
            "cpu",
            "--dtype",
            "float64",
            prompt,
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    tokenizer = load_tokenizer(checkpoint)
    with Engine(EngineConfig(checkpoint=str(checkpoint), device="cpu", dtype="float64")) as engine:
        reference = engine.reference(tokenizer.encode(prompt), 10, stop_token_ids=tokenizer.eos_token_ids)
    assert out == tokenizer.decode(reference) + "\n"


@pytest.mark.parametrize("options, dtype", [([], "float32"), (["--dtype", "float64"], "float64")])
def test_generate_command_says_what_it_does_on_stderr_in_float32_by_default(checkpoint, capsys, options, dtype):
    """Only the text goes to stdout; stderr has one line per phase, in the dtype the model runs in (float32
    unless --dtype says otherwise); --quiet leaves stderr empty."""
    prompt = "the lazy fox"
    argv = ["generate", "--checkpoint", str(checkpoint), "--max-new-tokens", "6", "--device", "cpu", *options]
    assert main([*argv, prompt]) == 0
    out, err = capsys.readouterr()
    tokenizer = load_tokenizer(checkpoint)
    ids = tokenizer.encode(prompt)
    with Engine(EngineConfig(checkpoint=str(checkpoint), device="cpu", dtype=dtype)) as engine:
        reference = engine.reference(ids, 6, stop_token_ids=tokenizer.eos_token_ids)
    assert out == inert(tokenizer.decode(reference), keep="\n\t") + "\n"  # control characters escaped
    lines = err.splitlines()
    assert len(lines) == 4, err
    assert lines[0] == f"kvstate generate: loading {checkpoint}: its tokenizer, and its weights as {dtype} (device cpu)"
    assert re.fullmatch(r"kvstate generate: model ready on cpu in [0-9.]+ s", lines[1]), lines[1]
    assert lines[2] == f"kvstate generate: prefill of {len(ids)} prompt tokens, then up to 6 new tokens"
    done = rf"kvstate generate: {len(reference)} tokens generated in [0-9.]+ s \(prefill included\)"
    assert re.fullmatch(done, lines[3]), lines[3]
    assert main([*argv, "--quiet", prompt]) == 0
    assert capsys.readouterr() == (out, "")


def test_generate_defaults_to_float32_where_the_equality_commands_keep_auto():
    parser = build_parser()
    assert parser.parse_args(["generate", "--model", "smollm2", "hi"]).dtype == "float32"
    assert parser.parse_args(["generate", "--model", "smollm2", "--dtype", "float64", "hi"]).dtype == "float64"
    assert parser.parse_args(["demo"]).dtype == "auto"  # float64 on the CPU: demo proves outputs equal
    assert parser.parse_args(["soak"]).dtype == "auto"


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(checkpoint, tmp_path):
    tokenizer = train_tokenizer()
    tokenizer.add_tokens([f"word{i}" for i in range(600 - tokenizer.get_vocab_size())])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = EngineConfig(checkpoint=str(checkpoint), device="cpu", scheduler=SchedulerConfig(gpu_blocks=8))
    with (
        Engine(config) as engine,
        pytest.raises(CheckpointError, match="600 token ids but the model's vocabulary has 512"),
    ):
        check_fits(load_tokenizer(tmp_path), engine)


def test_missing_or_malformed_tokenizer_is_a_clear_error(tmp_path, checkpoint, capsys):
    with pytest.raises(CheckpointError, match=r"tokenizer\.json not found"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not a tokenizers JSON file"):
        load_tokenizer(tmp_path)
    assert main(["generate", "--checkpoint", str(tmp_path), "hi"]) == 2
    assert "has no config.json" in capsys.readouterr().err
