"""What the engine checks of a request before it reaches the scheduler, and what it keeps of it (`Submission`).

What it keeps true:
* a prompt or stop token id outside the model's vocabulary is refused (`InvalidTokenId`);
* a request whose prompt and budget exceed the model's positions, whose sampling is not a `SamplingParams`, or
  whose id the trace format could not carry is refused (`RequestRejected`);
* a refused request changes nothing; the scheduler checks the rest when the request is submitted to it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from executor.engine_errors import InvalidTokenId
from executor.model import ModelConfig
from executor.sampler import SamplingParams
from kvstate.config import RequestRejected, normalize_stop_token_ids
from kvstate.trace import request_id_problem


@dataclass(frozen=True, slots=True)
class Submission:
    """A request as it was submitted: what a reference run of it needs, and its sampling."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    sampling: SamplingParams


def checked_request(
    prompt_token_ids: Sequence[int],
    max_new_tokens: int,
    stop_token_ids: Iterable[int],
    sampling: SamplingParams,
    request_id: Hashable | None,
    model: ModelConfig,
) -> tuple[Sequence[int], tuple[int, ...]]:
    """(prompt, stop token ids) of a request for `model`, as the scheduler takes them (tensors and arrays as lists);
    raises `InvalidTokenId` or `RequestRejected` for what the engine refuses before the scheduler sees it."""
    if hasattr(prompt_token_ids, "tolist"):
        prompt_token_ids = prompt_token_ids.tolist()
    if hasattr(stop_token_ids, "tolist"):
        stop_token_ids = stop_token_ids.tolist()
    stop = normalize_stop_token_ids(stop_token_ids)
    vocab = model.vocab_size
    for what, ids in (("prompt", prompt_token_ids), ("stop_token_ids", stop)):
        if isinstance(ids, (list, tuple)):
            bad = [t for t in ids if isinstance(t, int) and not isinstance(t, bool) and t >= vocab]
            if bad:
                raise InvalidTokenId(
                    f"{what} has token id {bad[0]} but the model's vocabulary has {vocab} ids "
                    f"(0..{vocab - 1}); tokenize with the model's tokenizer"
                )
    if not isinstance(sampling, SamplingParams):
        raise RequestRejected(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    limit = model.max_position_embeddings
    if (
        isinstance(prompt_token_ids, (list, tuple))
        and isinstance(max_new_tokens, int)
        and not isinstance(max_new_tokens, bool)
        and len(prompt_token_ids) + max_new_tokens > limit
    ):
        raise RequestRejected(
            f"prompt ({len(prompt_token_ids)}) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's max_position_embeddings={limit}; shorten the request"
        )
    # an id of another type (bool, float, ...) is the scheduler's to refuse; int and str subclasses are ids
    is_id = isinstance(request_id, (int, str)) and not isinstance(request_id, bool)
    if is_id and (problem := request_id_problem(request_id)) is not None:
        raise RequestRejected(f"{problem}; the trace format (spec/TRACE.md) could not carry it")
    return prompt_token_ids, stop
