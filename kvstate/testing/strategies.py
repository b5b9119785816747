"""What the machine's rules draw: `Submission`, the arguments of one `submit` call, and the Hypothesis strategies of
valid and invalid submissions.

Valid submissions fit the GPU tier alone, invalid ones never do or have an empty prompt; token ids are below the
vocabulary. `from_binding` gives a rule the strategy of the machine class that runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hypothesis import strategies as st

__all__ = ["Submission", "from_binding", "invalid_submissions", "valid_submissions"]


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
    block, one block plus one token, and the largest prompt that fits; max_new_tokens 1 often; stop tokens
    that are random or taken from the reference output (so requests stop early); prompts that begin with a stem
    common to all requests (0, 1, 2, ... modulo the vocabulary), so that prefix caches get hits."""

    @st.composite
    def build(draw: st.DrawFn) -> Submission:
        new = draw(st.integers(1, max_new) | st.integers(1, max_new) | st.just(1))
        longest = capacity - new
        edges = sorted({n for n in (1, block_size, block_size + 1, longest) if 1 <= n <= longest})
        length = draw(st.sampled_from(edges) | st.integers(1, longest) | st.integers(1, min(longest, 2 * block_size)))
        stem = draw(st.just(0) | st.integers(0, length))
        tail = draw(st.lists(st.integers(0, vocab - 1), min_size=length - stem, max_size=length - stem))
        prompt = tuple(i % vocab for i in range(stem)) + tuple(tail)
        stops = draw(st.lists(st.integers(0, vocab - 1), max_size=max_stops, unique=True))
        stop_at = draw(st.none() | st.none() | st.integers(0, new - 1))
        if stop_at is not None:
            token = reference(prompt, new, ())[stop_at]
            if token not in stops:
                stops.append(token)
        return Submission(prompt, new, tuple(stops))

    return build()


def invalid_submissions(capacity: int, vocab: int) -> st.SearchStrategy:
    """Requests every scheduler must refuse: an empty prompt, or prompt + max_new_tokens over the capacity."""
    empty = st.builds(Submission, st.just(()), st.integers(1, capacity))

    @st.composite
    def too_large(draw: st.DrawFn) -> Submission:
        length = draw(st.integers(1, capacity))
        new = capacity - length + draw(st.integers(1, 3))
        prompt = tuple(draw(st.lists(st.integers(0, vocab - 1), min_size=length, max_size=length)))
        return Submission(prompt, new)

    return st.one_of(empty, too_large())


def from_binding(strategy: str) -> st.SearchStrategy:
    """Values of the strategy named `strategy` in the binding of the machine that runs the rule.

    Rules are declared once, on `ConformanceMachine`, while each subclass binds its own adapter, so a rule's
    strategy is looked up on the running machine (`st.runner()`, which draws nothing: a failing case's data and
    its printed step list are what the bound strategy alone would give)."""
    return st.runner().flatmap(lambda machine: getattr(machine.binding, strategy))
