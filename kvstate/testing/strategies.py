"""What the machine's rules draw: `Submission`, the arguments of one `submit` call, and the Hypothesis strategies of
valid and invalid submissions.

Valid submissions fit the GPU tier alone, invalid ones never do or have an empty prompt; token ids are below the
vocabulary. `from_binding` gives a rule the strategy of the machine class that runs it.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hypothesis import strategies as st

__all__ = ["TOKEN_SEEDS", "Submission", "from_binding", "invalid_submissions", "seeded_tokens", "valid_submissions"]


@dataclass(frozen=True, slots=True)
class Submission:
    """The arguments of one `submit` call, printed as-is in failing step lists."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Its worst case: prompt plus every token it may generate."""
        return len(self.prompt) + self.max_new_tokens

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        """One line in Hypothesis' step lists (its pretty printer would put each prompt token on a line)."""
        printer.text(repr(self))


def valid_submissions(
    capacity: int,
    block_size: int,
    vocab: int,
    max_new: int,
    max_stops: int,
    reference: Callable[[Sequence[int], int, Sequence[int]], list[int]],
) -> st.SearchStrategy:
    """Requests that fit the GPU tier alone, with edge sizes over-represented: one-token prompts, exactly one
    block, one block plus one token, and the largest prompt that fits; stop tokens
    that are random or taken from the reference output (so requests stop early); prompts that begin with a stem
    common to all requests (0, 1, 2, ... modulo the vocabulary), so that prefix caches get hits. The rest of a
    prompt and the random stop tokens come from one drawn seed (`seeded_tokens`): a submission is seven choices to
    generate and shrink, not one per token. The strategies a draw uses are built once per size."""

    news = st.integers(1, max_new)
    stop_counts = st.integers(0, max_stops)

    @functools.cache
    def lengths(new: int) -> st.SearchStrategy[int]:
        longest = capacity - new
        edges = sorted({n for n in (1, block_size, block_size + 1, longest) if 1 <= n <= longest})
        return st.sampled_from(edges) | st.integers(1, longest)

    @functools.cache
    def stop_positions(new: int) -> st.SearchStrategy[int]:
        return st.integers(-2 * new, new - 1)  # negative (two times in three): no stop taken from the reference

    @st.composite
    def build(draw: st.DrawFn) -> Submission:
        new = draw(news)
        length = draw(lengths(new))
        stem = draw(st.integers(0, length))
        seed, stop_count = draw(TOKEN_SEEDS), draw(stop_counts)
        tokens = seeded_tokens(seed, length - stem + stop_count, vocab)
        prompt = tuple(i % vocab for i in range(stem)) + tokens[: length - stem]
        stops = list(dict.fromkeys(tokens[length - stem :]))
        stop_at = draw(stop_positions(new))
        if stop_at >= 0:
            token = reference(prompt, new, ())[stop_at]
            if token not in stops:
                stops.append(token)
        return Submission(prompt, new, tuple(stops))

    return build()


TOKEN_SEEDS = st.integers(0, 2**16)


def seeded_tokens(seed: int, count: int, vocab: int) -> tuple[int, ...]:
    """`count` token ids below `vocab`, a pure function of `seed`: seed 0 gives zeros, others a seeded stream."""
    if seed == 0:
        return (0,) * count
    generator = random.Random(seed)
    return tuple(generator.randrange(vocab) for _ in range(count))


def invalid_submissions(capacity: int, vocab: int) -> st.SearchStrategy:
    """Requests every scheduler must refuse: an empty prompt, or prompt + max_new_tokens over the capacity."""
    empty = st.builds(Submission, st.just(()), st.integers(1, capacity))

    @st.composite
    def too_large(draw: st.DrawFn) -> Submission:
        length = draw(st.integers(1, capacity))
        new = capacity - length + draw(st.integers(1, 3))
        return Submission(seeded_tokens(draw(TOKEN_SEEDS), length, vocab), new)

    return st.one_of(empty, too_large())


def from_binding(strategy: str) -> st.SearchStrategy:
    """Values of the strategy named `strategy` in the binding of the machine that runs the rule.

    Rules are declared once, on `ConformanceMachine`, while each subclass binds its own adapter, so a rule's
    strategy is looked up on the running machine (`st.runner()`, which draws nothing: a failing case's data and
    its printed step list are what the bound strategy alone would give)."""
    return st.runner().flatmap(lambda machine: getattr(machine.binding, strategy))
