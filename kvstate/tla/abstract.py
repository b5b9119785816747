"""The TLA+ meaning of the abstract model's own parts (`kvstate.checker.model`), each beside the name of its Python
counterpart: the views its guards read, how a step's result becomes the next state, its own actions (arrivals,
compute steps, copy completions) and its initial state. `kvstate.tla.module` writes them into the lifecycle module
in this order; the spec's guards and effects are not here but beside their Python meanings (`kvstate.semantics`).

When `kvstate.checker.model` changes how it counts, the definition here that names the changed part changes with
it; `kvstate check --engine tlc` shows any difference left as different state counts.

Variables and records: `requests[r]` is request r's record with the fields of `AbstractRequest` (state, computed,
generated, gpu, host, deferred, prefill, in_flight) and its constants prompt_len and max_new_tokens; `counts` is the
record of `PoolCounts` (gpu_free, host_free, gpu_fenced, host_fenced). A step's result is a record [ok, request,
pool, taken]: whether the step is enabled, the request and pool after it, and the indices in `Transitions` of the
spec edges it took (as `Edge.taken`).
"""

from __future__ import annotations

from typing import NamedTuple


class Definition(NamedTuple):
    """One TLA+ definition `name(params) == body` with its comment (`note`); `recursive`: declared RECURSIVE."""

    name: str
    params: str
    body: str
    note: str = ""
    recursive: bool = False


PRELUDE = (
    Definition("Min", "a, b", "IF a < b THEN a ELSE b"),
    Definition("ceil_div", "a, b", r"(a + b - 1) \div b", "kvstate.pool.ceil_div, for a >= 0"),
    Definition(
        "Held",
        "S, field",
        r"IF S = {} THEN 0 ELSE LET r == CHOOSE x \in S : TRUE IN requests[r][field] + Held(S \ {r}, field)",
        'blocks of one tier ("gpu" or "host") held by the requests of S',
        recursive=True,
    ),
    Definition("NoReason", "", '""', "no termination reason (None in Python; kvstate.checker.model.NONE)"),
    Definition("NoPass", "", "-1", "no scheduling pass under way (None in Python)"),
    Definition(
        "Unbounded",
        "",
        "GpuBlocks * BlockSize + 1",
        "a promotion worth no pass bounds (inf in Python): more KV tokens than the GPU tier holds",
    ),
    Definition(
        "RequestView",
        "request",
        """[prefill_tokens_left |-> request.prefill - request.computed,
     num_gpu_blocks |-> request.gpu,
     num_host_blocks |-> request.host,
     final_token_produced |-> request.generated >= request.max_new_tokens,
     replay_complete |-> request.computed >= request.prefill,
     termination_reason |-> request.deferred,
     suspended_in_pass |-> 0,
     kv_tokens |-> request.computed]""",
        "kvstate.semantics.RequestView of an abstract request (kvstate.checker.model.RequestState); the abstract "
        "model has no passes: every suspension counts as one of the pass under way (pass 0)",
    ),
    Definition(
        "PoolView",
        "pool",
        """[gpu_free_blocks |-> pool.gpu_free,
     host_free_blocks |-> pool.host_free,
     has_host_tier |-> HostBlocks > 0,
     pipeline_stages |-> PipelineStages,
     block_size |-> BlockSize,
     first_chunk_limit |-> ChunkSize,
     pass_number |-> 0,
     promotion_worth |-> Unbounded]""",
        "kvstate.semantics.PoolView of the pool counts (kvstate.checker.model.PoolState)",
    ),
)

RESULTS = (
    Definition(
        "Settle",
        "q",
        r"""IF q.state \in Terminal
    THEN [q EXCEPT !.computed = 0, !.generated = 0, !.deferred = NoReason, !.prefill = 0, !.in_flight = 0]
    ELSE q""",
        "a finished request's history no longer matters, its blocks do (kvstate.checker.model RequestState.record)",
    ),
    Definition(
        "Commit",
        "r, res",
        r"""/\ res.ok
    /\ requests' = [requests EXCEPT ![r] = Settle(res.request)]
    /\ counts' = res.pool""",
        "a step of request r with result res (kvstate.checker.model.AbstractModel.apply)",
    ),
)

# The abstract model's own actions; {catch_up} and {finish} are the TLA+ names of those events' actions (the bodies
# are format strings: a TLA+ brace is written twice).
OWN_ACTIONS = (
    Definition(
        "ArriveResult",
        "q, c",
        "[ok |-> q.state = NotArrived, request |-> [q EXCEPT !.state = Initial], pool |-> c, taken |-> {{}}]",
        "a request not arrived yet enters the initial state, each at most once: arrivals stop (AbstractModel._arrive)",
    ),
    Definition(
        "Arrive",
        "r",
        r"""/\ requests[r].state = NotArrived
    /\ Commit(r, ArriveResult(requests[r], counts))""",
    ),
    Definition(
        "ComputeResult",
        "q, c",
        r"""LET landing == q.state = PendingReset /\ q.in_flight = 1
        tokens == IF landing THEN 1
                  ELSE IF q.computed < q.prefill THEN Min(ChunkSize, q.prefill - q.computed)
                  ELSE 1
        need == ceil_div(q.computed + tokens, BlockSize) - q.gpu
        grow == IF need > 0 THEN need ELSE 0
        q1 == [q EXCEPT !.in_flight = IF landing THEN 0 ELSE @, !.gpu = @ + grow, !.computed = @ + tokens]
        c1 == [c EXCEPT !.gpu_free = @ - grow]
        produced == q1.computed >= q1.prefill
        q2 == IF produced THEN [q1 EXCEPT !.generated = @ + 1] ELSE q1
        k1 == IF produced /\ q2.state = Recomputing THEN {catch_up}Edge(q2, c1) ELSE 0
        s1 == IF k1 = 0 THEN [request |-> q2, pool |-> c1] ELSE Take(k1, q2, c1)
        k2 == IF produced THEN {finish}Edge(s1.request, s1.pool) ELSE 0
        s2 == IF k2 = 0 THEN s1 ELSE Take(k2, s1.request, s1.pool)
    IN  IF /\ q.state \in Computing \/ landing
           /\ landing \/ q.computed < q.prefill \/ q.state = Active
           /\ need <= c.gpu_free
        THEN [ok |-> TRUE, request |-> s2.request, pool |-> s2.pool, taken |-> {{k1, k2}} \ {{0}}]
        ELSE [ok |-> FALSE, request |-> q, pool |-> c, taken |-> {{}}]""",
        "one forward pass of request record q (AbstractModel._compute): a prefill chunk, a decode step or a landing "
        "in-flight decode step, allocating the GPU blocks it needs; a produced token fires catch_up and finish where "
        "their guards hold",
    ),
    Definition(
        "Compute",
        "r",
        r"""/\ requests[r].state \in Computing \/ requests[r].in_flight = 1
    /\ Commit(r, ComputeResult(requests[r], counts))""",
    ),
    *(
        Definition(
            f"Complete{tier.capitalize()}",
            "",
            rf"""/\ counts.{tier}_fenced > 0
    /\ counts' = [counts EXCEPT !.{tier}_free = @ + counts.{tier}_fenced, !.{tier}_fenced = 0]
    /\ UNCHANGED requests""",
            f"the executor reports every copy out of the {tier} tier complete: its fenced blocks become free "
            "(AbstractModel._complete)",
        )
        for tier in ("gpu", "host")
    ),
)

INIT = Definition(
    "Init",
    "",
    r"""/\ requests = [r \in Requests |->
           [state |-> NotArrived, computed |-> 0, generated |-> 0, gpu |-> 0, host |-> 0,
            deferred |-> NoReason, prefill |-> PromptLen[r], in_flight |-> 0,
            prompt_len |-> PromptLen[r], max_new_tokens |-> MaxNewTokens[r]]]
    /\ counts = [gpu_free |-> GpuBlocks, host_free |-> HostBlocks, gpu_fenced |-> 0, host_fenced |-> 0]""",
    "every request not arrived yet, every block free (AbstractModel.initial)",
)
