"""`kvstate demo --model NAME`: the demo's pressured run on a named real model (`executor.named_models`) with real
prompts (`executor.chat_workload`: questions formatted by the model's chat template, stopping at its end of turn),
a few of the answers printed, and the same verdict: every output equals its unpressured reference.

`check` runs with the demo's other option checks, before torch is imported; `chat_demo` builds the workload once
the engine holds the model; `print_answers` prints a few generated texts (escaped: they are untrusted)."""

from __future__ import annotations

import argparse
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from executor.named_models import locate, named_model
from kvstate.commands.args import UsageError

if TYPE_CHECKING:
    from executor.chat_workload import ChatRequest
    from executor.tokenizer import CheckpointTokenizer

SHOWN_ANSWERS = 3


def check(args: argparse.Namespace) -> None:
    """Refuse the options that do not apply with `--model`, and locate the model's file (`args.model_file`); an
    uninstalled model is one line that says what to install."""
    if args.pp > 1:
        raise UsageError("--model runs in a single process (pipeline stages build seeded weights); drop --pp")
    if args.hidden_size is not None:
        raise UsageError("--hidden-size sets the width of the seeded model; drop it with --model (its width is fixed)")
    try:
        args.model_file = locate(named_model(args.model))
    except ValueError as err:  # unknown name, ModelNotInstalled, a changed file
        raise UsageError(str(err)) from None


@dataclass(frozen=True)
class ChatDemo:
    """The demo's real requests, and the tokenizer that encoded them and decodes their answers."""

    requests: list[ChatRequest]
    tokenizer: CheckpointTokenizer

    @property
    def work(self) -> list[tuple[list[int], int]]:
        return [(r.prompt, r.max_new_tokens) for r in self.requests]

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self.tokenizer.eos_token_ids


def chat_demo(model_file: Path, count: int, capacity: int) -> ChatDemo:
    from executor.chat_workload import chat_workload
    from executor.text import load_tokenizer

    tokenizer = load_tokenizer(model_file)
    try:
        return ChatDemo(chat_workload(tokenizer, count, max_tokens=capacity), tokenizer)
    except ValueError as err:  # a prompt that does not fit the GPU tier alone
        raise UsageError(str(err)) from None


def print_answers(console, demo: ChatDemo, ids: Sequence[Hashable], outputs: Mapping[Hashable, list[int]]) -> None:
    """The first `SHOWN_ANSWERS` questions and the answers generated under pressure, one line each."""
    from rich.text import Text

    from executor.chat_workload import printable

    shown = min(SHOWN_ANSWERS, len(demo.requests))
    console.print(f"answers generated under memory pressure ({shown} of {len(demo.requests)}):")
    for request, rid in list(zip(demo.requests, ids, strict=True))[:SHOWN_ANSWERS]:
        answer = demo.tokenizer.decode(outputs.get(rid, []))
        console.print(Text(f"  {printable(request.question)} -> {printable(answer)}"), soft_wrap=True)
