"""Real prompts for a real model (`kvstate demo --model NAME`, the SmolLM2 benchmark rows): user questions
formatted by the model's chat template, as token ids, each with its token budget, and the texts generated.

Invariants kept: the workload is fixed (no randomness: `count` requests take the prompts in order, cycling);
every request fits the GPU tier alone (prompt + new tokens <= `max_tokens`, by shrinking its budget), so memory
pressure can delay it but never refuse it; decoded texts are printable (`printable`).
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

from executor.tokenizer import CheckpointTokenizer

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colors.",
    "What does a bee make?",
    "Explain what a cache is in one sentence.",
    "Give me one tip for learning to cook.",
    "Say hello in Spanish.",
    "Why is the sky blue?",
)
NEW_TOKENS = 32  # the demo's budget per request; answers that end earlier stop at the template's end of turn


@dataclass(frozen=True)
class ChatRequest:
    """One request of a chat workload: the user's `question`, the formatted prompt's token ids, the budget."""

    question: str
    prompt: list[int]
    max_new_tokens: int


def chat_workload(
    tokenizer: CheckpointTokenizer, count: int, *, max_tokens: int, new_tokens: int = NEW_TOKENS
) -> list[ChatRequest]:
    """`count` requests over `PROMPTS` in order (cycling), each formatted by `tokenizer`'s chat template; a request
    whose prompt and budget exceed `max_tokens` gets a smaller budget (at least 1 token), and one whose prompt
    alone does not fit is refused with a `ValueError` that says how many tokens it needs."""
    requests = []
    for n in range(count):
        question = PROMPTS[n % len(PROMPTS)]
        prompt = tokenizer.encode(tokenizer.chat(question))
        if len(prompt) + 1 > max_tokens:
            raise ValueError(
                f"the prompt {question!r} takes {len(prompt)} tokens with the chat template, and the GPU tier holds "
                f"{max_tokens}: give it at least {len(prompt) + 1} tokens (--gpu-blocks x --block-size)"
            )
        requests.append(ChatRequest(question, prompt, min(new_tokens, max_tokens - len(prompt))))
    return requests


def printable(text: str) -> str:
    """`text` with every control or unassigned character (other than a space) written as an escape."""
    return "".join(
        ch if ch == " " or unicodedata.category(ch)[0] not in "CZ" else ch.encode("unicode_escape").decode("ascii")
        for ch in text
    )
