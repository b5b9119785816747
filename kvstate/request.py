"""Request records: what the scheduler knows of one request.

Invariants kept:
* `state` changes only through the lifecycle machine (`kvstate.lifecycle`), which writes it under the name
  `STATE_ATTRIBUTE`; here that name is a second name of the slot of the plain attribute `state`, so the hot loops
  read a request's state as one attribute load (no call) on every request of every step;
* `generated` is append-only (GEN-APPEND): `append_tokens` (for one request: `append_token`) is its only writer,
  and keeps `final_token_produced` (whether its last token ends the request) and `last_token` (it, as the
  one-token input of the next decode step: planning a step allocates nothing per decoding request, which keeps
  large batches clear of the garbage collector) with it;
* `num_prefill_tokens` = `len(prefill_tokens)`: `prefill_tokens` is a property whose setter keeps both (an
  immutable tuple, so the count cannot go stale);
* after `reset_for_replay`, `prefill_tokens` = original prompt + every generated token, the remaining budget
  is `max_new_tokens - len(generated)`, and every KV-derived counter is zero (RESET-*); its admission number is
  kept (a replay is not the newest admission, so it does not become the next tail victim);
* `copy_in_flight` is True from the migrate effect that plans a copy of its KV until the executor reports that copy
  complete or failed (the scheduler clears it): meanwhile it is neither suspended nor resumed again (the guards) nor
  scheduled (a resumed request computes once its KV is back), so a request has at most one copy in flight;
* `replay_high_water` is the furthest position any replay of the current replay prompt reached (0 until a replay
  computes, and again whenever a reset makes a longer replay prompt): a replay chunk that does not pass it recomputes
  work an earlier pause threw away, which is no progress (A4).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

# The attribute in which every request object the lifecycle drives keeps its state (the `transitions` machine's
# `model_attribute`; `kvstate.lifecycle` writes it, and the model checker's and the executor's requests carry it too).
STATE_ATTRIBUTE = "_lifecycle_state"


@dataclass(eq=False, slots=True)
class Request:
    """One request. Compares by identity. Satisfies `kvstate.RequestView`.

    `num_gpu_blocks`/`num_host_blocks` mirror the pool's block tables; the scheduler's effect hooks are their
    only writers, and `Scheduler.check_invariants` compares them with the pool (RES-STATE).
    """

    request_id: Hashable
    prompt: tuple[int, ...]
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    arrival: int = 0
    block_size: int = 16
    generated: list[int] = field(default_factory=list, init=False)  # written by `append_tokens` only (GEN-APPEND)
    _prefill_tokens: tuple[int, ...] = field(default=(), init=False)  # read and written as `prefill_tokens`
    num_prefill_tokens: int = field(default=0, init=False)  # `len(prefill_tokens)`, kept by its setter
    num_computed_tokens: int = 0
    admission: int = -1
    num_gpu_blocks: int = 0
    num_host_blocks: int = 0
    num_suspensions: int = 0
    num_recompute_pauses: int = 0
    num_recomputed_tokens: int = 0
    termination_reason: str | None = None
    done_reason: str | None = None
    suspended_in_pass: int | None = None
    copy_in_flight: bool = False  # a migration of its KV is issued and not reported complete or failed (FENCE)
    step_in_flight: bool = False  # a step of it is in the pipeline, not landed (kept by the scheduler's `in_flight`)
    replay_high_water: int = 0
    state: str = field(default="", init=False)  # written only by the lifecycle, as `STATE_ATTRIBUTE` below
    final_token_produced: bool = field(default=False, init=False)  # `append_token`'s verdict on `generated[-1]`
    last_token: tuple[int, ...] = field(default=(), init=False)  # `(generated[-1],)`: a decode step's input

    def __post_init__(self) -> None:
        self.prompt = tuple(self.prompt)
        self.prefill_tokens = self.prompt
        self.stop_token_ids = frozenset(self.stop_token_ids)

    @property
    def prefill_tokens(self) -> tuple[int, ...]:
        """The tokens its (re)prefill computes: the prompt, or after a reset the replay prompt."""
        return self._prefill_tokens

    @prefill_tokens.setter
    def prefill_tokens(self, tokens: tuple[int, ...]) -> None:
        self._prefill_tokens = tokens = tuple(tokens)
        self.num_prefill_tokens = len(tokens)  # the walk over every resident request on every step reads the count
        # alone: the request's own slot, not the tuple (one memory access fewer per request, where caches are cold)

    @property
    def end_reason(self) -> str:
        """Why an ended request ended (`done_reason`: finished, cancelled or aborted); an error before it ended."""
        if self.done_reason is None:
            raise RuntimeError(
                f"request {self.request_id!r} has not ended (state {self.state!r}): it has no end reason"
            )
        return self.done_reason

    # ---- token accounting
    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt) + len(self.generated)

    @property
    def all_tokens(self) -> tuple[int, ...]:
        return self.prompt + tuple(self.generated)

    @property
    def remaining_tokens(self) -> int:
        """How many more tokens it may generate (the budget after every reset for replay)."""
        return self.max_new_tokens - len(self.generated)

    @property
    def is_prefilling(self) -> bool:
        """Its prefill tokens (prompt, or replay prompt) are not all computed yet."""
        return self.num_computed_tokens < self.num_prefill_tokens

    @property
    def next_step_tokens(self) -> int:
        """Tokens its next step computes at most: the rest of its prefill, or one decode token."""
        return self.num_prefill_tokens - self.num_computed_tokens if self.is_prefilling else 1

    @property
    def about_to_finish(self) -> bool:
        """Its next decode step produces its final token by budget (never a victim, VICTIM-NOT-FINAL)."""
        return self.remaining_tokens <= 1 and not self.is_prefilling

    @property
    def kv_tokens(self) -> int:
        """KV tokens it holds: what recomputing it would cost."""
        return self.num_computed_tokens

    def advance(self, tokens: int, replaying: bool) -> bool:
        """Count `tokens` more computed tokens; True when that is progress (A4): not a replay chunk, or a replay
        chunk that reaches further than every earlier replay of the same replay prompt. (`complete_step` counts a
        decode step's one token itself: never a replay chunk, so always progress.)"""
        self.num_computed_tokens += tokens
        if not replaying:
            return True
        if self.num_computed_tokens <= self.replay_high_water:
            return False
        self.replay_high_water = self.num_computed_tokens
        return True

    def append_token(self, token: int) -> bool:
        """Append a sampled token; True when it is the final one: a stop token, or the last of its budget. The
        verdict stays readable as `final_token_produced` (a `RequestView` property, here a plain attribute)."""
        return bool(append_tokens((self,), {self.request_id: token}))

    # ---- RequestView
    @property
    def prefill_tokens_left(self) -> int:
        return self.num_prefill_tokens - self.num_computed_tokens

    @property
    def replay_complete(self) -> bool:
        return not self.is_prefilling

    @property
    def mid_replay(self) -> bool:
        return bool(self.generated) and self.is_prefilling

    def reset_for_replay(self) -> None:
        """Make the replay prompt prompt + generated and clear every KV-derived counter (RESET-*)."""
        replay_prompt = self.all_tokens
        if len(replay_prompt) != self.num_prefill_tokens:
            self.replay_high_water = 0  # tokens were generated since the last reset: a new replay prompt
        self.prefill_tokens = replay_prompt
        self.num_computed_tokens = 0
        self.num_gpu_blocks = self.num_host_blocks = 0
        self.num_recompute_pauses += 1


# The lifecycle's name for a request's state (`STATE_ATTRIBUTE`, the `transitions` machine's `model_attribute`) is,
# on a Request, a second name for the slot of the plain attribute `state` (the same descriptor): the lifecycle's reads
# and writes are those of `state`, with no call in between.
setattr(Request, STATE_ATTRIBUTE, vars(Request)["state"])


def append_tokens(requests: Iterable[Request], sampled: Mapping[Hashable, int], *, computed: int = 0) -> list[Request]:
    """Append each request's sampled token `sampled[request_id]` (an int, or anything `int()` takes), each first
    counting `computed` more computed tokens (1: the decode step that sampled it); returns the requests whose token
    is final (a stop token, or the last of its budget), in order. `generated`'s only writer (GEN-APPEND): one loop
    without a call per request, through which the scheduler lands every decode step of every pass."""
    finals = []
    for request in requests:
        token = sampled[request.request_id]
        if token.__class__ is not int:
            token = int(token)
        request.num_computed_tokens += computed
        generated = request.generated
        generated.append(token)
        request.last_token = (token,)
        if token in request.stop_token_ids or len(generated) >= request.max_new_tokens:
            request.final_token_produced = True
            finals.append(request)
        else:
            request.final_token_produced = False
    return finals


def new_request(
    request_id: Hashable,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    stop_token_ids: Sequence[int] = (),
    arrival: int = 0,
    block_size: int = 16,
) -> Request:
    """A request record with its prompt copied into an immutable tuple."""
    return Request(request_id, tuple(prompt), max_new_tokens, frozenset(stop_token_ids), arrival, block_size)
