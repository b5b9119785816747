"""`kvstate generate --checkpoint DIR "a prompt"`: text in, streamed text out, with the checkpoint's own tokenizer.

The checkpoint directory holds a Hugging Face Llama (`config.json`, `model.safetensors`; `executor.hf`) and its
tokenizer (`tokenizer.json`); both load from the local directory, nothing is downloaded. Arguments and files are
checked before torch is imported; the engine side is `executor.text.generate_text`.
"""

from __future__ import annotations

import argparse
import sys

from kvstate.commands.args import UsageError, device_name, input_dir, non_negative_int, positive_int

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
        type=positive_int("max_new_tokens"),
        default=64,
        help="most tokens to generate (default %(default)s); generation also stops at the EOS token",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default %(default)s)")
    p.add_argument("--seed", type=non_negative_int("seed"), default=0, help="sampling seed (default %(default)s)")
    p.add_argument("--device", type=device_name, default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="(default %(default)s)")
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
        config = EngineConfig(checkpoint=str(checkpoint), device=args.device, dtype=args.dtype, seed=args.seed)
        with Engine(config) as engine:
            pieces = generate_text(
                engine,
                args.prompt,
                max_new_tokens=args.max_new_tokens,
                tokenizer=tokenizer,
                sampling=SamplingParams(temperature=args.temperature),
            )
            for piece in pieces:
                sys.stdout.write(piece)
                sys.stdout.flush()
    except ValueError as err:  # CheckpointError, a refused request, an unusable device
        raise UsageError(str(err)) from None
    sys.stdout.write("\n")
    return 0
