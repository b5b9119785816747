"""The TLA+ meaning of the abstract model's own parts (`kvstate.checker.model`, its views and effects in
`kvstate.checker.effects`), each beside the name of its Python counterpart: the views its guards read, how a step's
result becomes the next state, its own actions (arrivals, compute steps, copy completions) and its initial state.
`kvstate.tla.module` writes them into the lifecycle module in this order; the spec's guards and effects are not here
but beside their Python meanings (`kvstate.semantics`).

When `kvstate.checker.model` or `kvstate.checker.effects` changes how it counts, the definition here that names the
changed part changes with it; `kvstate check --engine tlc` shows any difference left as different state counts.

Variables and records: `requests[r]` is request r's record with the fields of `AbstractRequest` (state, computed,
generated, gpu, host, deferred, prefill, in_flight, and its copy in flight: fenced_gpu, fenced_host, incoming), its
constants prompt_len and max_new_tokens, and `stopped` (`RequestState.stopped`: TRUE only inside a compute step
whose token is a stop token; FALSE in every state, which `Settle` ensures); `counts` is the record of `PoolCounts`
(gpu_free, host_free, gpu_fenced, host_fenced) and `offload_limit` (`PoolState.offload_limit`: the block count an
offload of held blocks is fired with, k only inside that step, 0 in every state, which `Commit` ensures). A step's
result is a record [ok, request, pool, taken]: whether the step is enabled, the request and pool after it, and the
indices in `Transitions` of the spec edges it took (as `Edge.taken`).

Not expressed: the chunk cuts of a bound with a token budget per pass (`max_num_tokens`, `Action.tokens`); the
export refuses such a bound (`kvstate.tla.models.unsupported`).
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
    Definition("NoReason", "", '""', "no termination reason (None in Python; kvstate.checker.records.NONE)"),
    Definition("NoPass", "", "-1", "no scheduling pass under way (None in Python)"),
    Definition(
        "Unbounded",
        "",
        "GpuBlocks * BlockSize + 1",
        "a promotion worth no pass bounds (inf in Python): more KV tokens than the GPU tier holds",
    ),
    Definition(
        "CopyInFlight",
        "q",
        "q.fenced_gpu > 0 \\/ q.fenced_host > 0 \\/ q.incoming > 0",
        "request record q has a copy in flight (kvstate.checker.effects.RequestState.copy_in_flight)",
    ),
    Definition(
        "ReleaseBlocks",
        "q, c",
        r"""LET incoming_host == IF q.fenced_gpu > 0 THEN q.incoming ELSE 0
        incoming_gpu == q.incoming - incoming_host
    IN  [request |-> [q EXCEPT !.gpu = 0, !.host = 0, !.incoming = 0,
                               !.fenced_gpu = @ + incoming_gpu, !.fenced_host = @ + incoming_host],
         pool |-> [c EXCEPT !.gpu_free = @ + q.gpu - incoming_gpu, !.host_free = @ + q.host - incoming_host,
                            !.gpu_fenced = @ + incoming_gpu, !.host_fenced = @ + incoming_host]]""",
        "request record q releases every block it holds in both tiers (SPEC.md section 4.0): the destinations its "
        "copy in flight still writes stay fenced by that copy, the others become free; the copy's direction is its "
        "own (an offload fences GPU sources and writes host blocks, a resume the reverse) "
        "(kvstate.checker.effects.AbstractEffects._release)",
    ),
    Definition(
        "RequestView",
        "request",
        """[prefill_tokens_left |-> request.prefill - request.computed,
     num_gpu_blocks |-> request.gpu,
     num_host_blocks |-> request.host,
     final_token_produced |-> request.stopped \\/ request.generated >= request.max_new_tokens,
     replay_complete |-> request.computed >= request.prefill,
     mid_replay |-> request.generated > 0 /\\ request.computed < request.prefill,
     termination_reason |-> request.deferred,
     suspended_in_pass |-> 0,
     kv_tokens |-> request.computed,
     copy_in_flight |-> CopyInFlight(request),
     step_in_flight |-> request.in_flight = 1]""",
        "kvstate.semantics.RequestView of an abstract request (kvstate.checker.effects.RequestState); the abstract "
        "model has no passes: every suspension counts as one of a pass (0) before the pass under way (1)",
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
     pass_number |-> 1,
     promotion_worth |-> Unbounded,
     offload_limit |-> pool.offload_limit,
     resume_gate_open |-> TRUE]""",
        "kvstate.semantics.PoolView of the pool counts (kvstate.checker.effects.PoolState): the pass under way is "
        "pass 1, any promotion's worth is allowed, the utilization gate is open, and the offload limit is the block "
        "count of the offload step under way (0 outside one)",
    ),
)

RESULTS = (
    Definition(
        "Settle",
        "q",
        r"""IF q.state \in Terminal
    THEN [q EXCEPT !.computed = 0, !.generated = 0, !.deferred = NoReason, !.prefill = 0, !.in_flight = 0,
                   !.incoming = 0, !.stopped = FALSE]
    ELSE [q EXCEPT !.stopped = FALSE]""",
        "a finished request's history no longer matters, its blocks and its copy's fences do (kvstate.checker.effects "
        "RequestState.record); no state keeps a stop token's mark",
    ),
    Definition(
        "Commit",
        "r, res",
        r"""/\ res.ok
    /\ requests' = [requests EXCEPT ![r] = Settle(res.request)]
    /\ counts' = [res.pool EXCEPT !.offload_limit = 0]""",
        "a step of request r with result res (kvstate.checker.model.AbstractModel.apply); no state keeps an "
        "offload's block count",
    ),
)

# The abstract model's own actions (arrivals, compute steps, a compute step with a stop token, a request's copy
# completing); {catch_up} and {finish} are the TLA+ names of those events' actions (the bodies are format strings: a
# TLA+ brace is written twice).
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
        "q, c, stop",
        r"""LET landing == q.in_flight = 1 /\ q.state \in {{PendingReset, Offloaded}}
        runs == q.state \in Computing /\ q.incoming = 0 /\ (q.computed < q.prefill \/ q.state = Active)
        tokens == IF landing THEN 1
                  ELSE IF q.computed < q.prefill THEN Min(ChunkSize, q.prefill - q.computed)
                  ELSE 1
        produces == q.computed + tokens >= q.prefill
        held == q.state = Offloaded
        in_host == held /\ q.gpu = 0 /\ q.host > 0
        copying == in_host /\ q.incoming > 0
        need == ceil_div(q.computed + tokens, BlockSize) - (IF held THEN q.gpu + q.host ELSE q.gpu)
        grow == IF need > 0 THEN need ELSE 0
        fits == /\ grow <= (IF in_host THEN c.host_free ELSE c.gpu_free)
                /\ copying => grow <= c.gpu_free
        qb == IF in_host
              THEN [q EXCEPT !.host = @ + grow, !.fenced_gpu = IF copying THEN @ + grow ELSE @,
                             !.incoming = IF copying THEN @ + grow ELSE @]
              ELSE [q EXCEPT !.gpu = @ + grow]
        cb == IF in_host
              THEN [c EXCEPT !.host_free = @ - grow, !.gpu_free = IF copying THEN @ - grow ELSE @,
                             !.gpu_fenced = IF copying THEN @ + grow ELSE @]
              ELSE [c EXCEPT !.gpu_free = @ - grow]
        dropped == q.in_flight = 1 /\ held /\ (stop \/ q.generated + 1 >= q.max_new_tokens)
        q1 == [qb EXCEPT !.in_flight = 0, !.computed = IF dropped THEN @ ELSE @ + tokens]
        made == produces /\ ~dropped
        q2 == IF made THEN [q1 EXCEPT !.generated = @ + 1, !.stopped = stop] ELSE q1
        k1 == IF made /\ q2.state = Recomputing THEN {catch_up}Edge(q2, cb) ELSE 0
        s1 == IF k1 = 0 THEN [request |-> q2, pool |-> cb] ELSE Take(k1, q2, cb)
        k2 == IF made THEN {finish}Edge(s1.request, s1.pool) ELSE 0
        s2 == IF k2 = 0 THEN s1 ELSE Take(k2, s1.request, s1.pool)
    IN  IF /\ landing \/ runs
           /\ stop => StopTokens /\ produces
           /\ fits
        THEN [ok |-> TRUE, request |-> s2.request, pool |-> s2.pool, taken |-> {{k1, k2}} \ {{0}}]
        ELSE [ok |-> FALSE, request |-> q, pool |-> c, taken |-> {{}}]""",
        "one forward pass of request record q (AbstractModel._compute), its token a stop token when stop (bounds with "
        "stop tokens only): a prefill chunk, a decode step or a landing in-flight decode step (on a request awaiting "
        "consensus, or suspended: then its blocks join the tail of its table, its held GPU blocks, or the host tier "
        "when every block it holds was offloaded, and while that offload is in flight the GPU source is fenced too; a "
        "suspended request's final token is dropped), allocating the blocks it needs; not while its resume copy is in "
        "flight; a produced token fires catch_up and finish where their guards hold",
    ),
    Definition(
        "Compute",
        "r",
        r"""/\ requests[r].state \in Computing \/ requests[r].in_flight = 1
    /\ Commit(r, ComputeResult(requests[r], counts, FALSE))""",
    ),
    Definition(
        "ComputeStop",
        "r",
        r"""/\ StopTokens
    /\ requests[r].state \in Computing \/ requests[r].in_flight = 1
    /\ Commit(r, ComputeResult(requests[r], counts, TRUE))""",
        "a compute step whose token is a stop token (AbstractModel action (compute, r, STOP))",
    ),
    Definition(
        "CompleteResult",
        "q, c",
        r"""[ok |-> CopyInFlight(q),
     request |-> [q EXCEPT !.fenced_gpu = 0, !.fenced_host = 0, !.incoming = 0],
     pool |-> [c EXCEPT !.gpu_free = @ + q.fenced_gpu, !.host_free = @ + q.fenced_host,
                        !.gpu_fenced = @ - q.fenced_gpu, !.host_fenced = @ - q.fenced_host],
     taken |-> {{}}]""",
        "the executor reports request record q's copy in flight complete, or failed: its fences end "
        "(AbstractModel._complete, AbstractEffects.complete_copy)",
    ),
    Definition(
        "Complete",
        "r",
        r"""/\ CopyInFlight(requests[r])
    /\ Commit(r, CompleteResult(requests[r], counts))""",
    ),
)

INIT = Definition(
    "Init",
    "",
    r"""/\ requests = [r \in Requests |->
           [state |-> NotArrived, computed |-> 0, generated |-> 0, gpu |-> 0, host |-> 0,
            deferred |-> NoReason, prefill |-> PromptLen[r], in_flight |-> 0,
            fenced_gpu |-> 0, fenced_host |-> 0, incoming |-> 0, stopped |-> FALSE,
            prompt_len |-> PromptLen[r], max_new_tokens |-> MaxNewTokens[r]]]
    /\ counts = [gpu_free |-> GpuBlocks, host_free |-> HostBlocks, gpu_fenced |-> 0, host_fenced |-> 0,
                  offload_limit |-> 0]""",
    "every request not arrived yet, every block free (AbstractModel.initial)",
)
