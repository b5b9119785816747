"""`kvstate generate --checkpoint DIR "a prompt"`: text in, streamed text out, with the checkpoint's own tokenizer.

The checkpoint directory holds a Hugging Face Llama (`config.json`, `model.safetensors`; `executor.hf`) and its
tokenizer (`tokenizer.json`); both load from the local directory, nothing is downloaded. Arguments and files are
checked before torch is imported; the engine side is `executor.text.generate_text`. The generated text is printed
inert (`kvstate.terminal.inert`: a control character, such as the escape sequence of a hostile vocabulary, is
written as a visible escape; newlines and tabs stay) unless `--raw` asks for the bytes as generated.
"""

from __future__ import annotations

import argparse
import sys

from kvstate.commands.args import (
    MAX_SEED,
    MAX_TOKENS,
    UsageError,
    add_device_option,
    add_dtype_option,
    dtype_setting,
    input_dir,
    non_negative_int,
    positive_int,
)
from kvstate.terminal import inert

REQUIRED_FILES = ("config.json", "tokenizer.json")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text from a prompt with a local Hugging Face Llama checkpoint and its tokenizer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("prompt", help="the prompt text")
    p.add_argument(
        "--checkpoint",
        metavar="DIR",
        required=True,
        help="Hugging Face Llama directory with config.json, model.safetensors and tokenizer.json",
    )
    p.add_argument(
        "--max-new-tokens",
        type=positive_int("max_new_tokens", maximum=MAX_TOKENS),
        default=64,
        help="most tokens to generate (default %(default)s); generation also stops at the EOS token",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default %(default)s)")
    p.add_argument(
        "--seed", type=non_negative_int("seed", maximum=MAX_SEED), default=0, help="sampling seed (default %(default)s)"
    )
    add_device_option(p)
    add_dtype_option(p)
    p.add_argument(
        "--raw",
        action="store_true",
        help="print the generated text as it is, control characters included (default: escaped, visible)",
    )
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    checkpoint = input_dir(args.checkpoint, "--checkpoint")
    missing = [name for name in REQUIRED_FILES if not (checkpoint / name).is_file()]
    if missing:
        raise UsageError(
            f"--checkpoint {checkpoint} has no {' or '.join(missing)}; pass a Hugging Face Llama "
            "directory that also holds its tokenizer (tokenizer.json)"
        )
    if not args.temperature >= 0:
        raise UsageError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not args.prompt:
        raise UsageError("the prompt is empty; pass some text")

    from executor import Engine, EngineConfig, resolve_device
    from executor.sampler import SamplingParams
    from executor.text import generate_text, load_tokenizer

    try:
        resolve_device(args.device)
        tokenizer = load_tokenizer(checkpoint)
        config = EngineConfig(
            checkpoint=str(checkpoint), device=args.device, dtype=dtype_setting(args.dtype), seed=args.seed
        )
        with Engine(config) as engine:
            pieces = generate_text(
                engine,
                args.prompt,
                max_new_tokens=args.max_new_tokens,
                tokenizer=tokenizer,
                sampling=SamplingParams(temperature=args.temperature),
            )
            for piece in pieces:
                sys.stdout.write(piece if args.raw else inert(piece, keep="\n\t"))
                sys.stdout.flush()
    except ValueError as err:  # CheckpointError, a refused request, an unusable device
        raise UsageError(str(err)) from None
    sys.stdout.write("\n")
    return 0
