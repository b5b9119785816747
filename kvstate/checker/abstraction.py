"""The abstraction of the scheduler refinement: the abstract spec state a world of the real scheduler stands for.

A suspended request's KV is split: its host blocks (the prefix of its table that offloads moved) and its held GPU
blocks. A request whose step is still in flight (several pipeline stages) shows as it was before that step, because
`AbstractModel` computes a step atomically: the blocks allocated for the step (the tail of its table: held GPU blocks,
or host blocks where an offload moved them, whose GPU sources an offload still in flight fences) count as free. A
request preempted while its decode step is in flight may still receive that token (suspended or awaiting consensus):
`Abstraction.variants` lists both abstract states it may stand for.
"""

from __future__ import annotations

from collections.abc import Hashable

from kvstate.checker.bounds import Bound
from kvstate.checker.model import AbstractModel
from kvstate.checker.records import ABSENT, NONE, AbstractRequest, AbstractState
from kvstate.checker.world import World
from kvstate.pool import TO_HOST


class Abstraction:
    """Maps the worlds of one bound to abstract states of its model.

    Invariants kept: `in_bound_order` puts request k in slot k (an absent request as not arrived); `of` is the same
    state with its requests sorted, as the model's canonical states are; neither changes the world.
    """

    def __init__(self, bound: Bound, model: AbstractModel) -> None:
        self.bound = bound
        self.model = model

    def of(self, world: World) -> AbstractState:
        """The abstract spec state of a world (the mapping the refinement is checked through), canonical."""
        state = self.in_bound_order(world)
        return state._replace(requests=tuple(sorted(state.requests)))

    def in_bound_order(self, world: World) -> AbstractState:
        """The abstraction of a world with its requests in bound order (slot k: request k), not canonical."""
        s = world.scheduler
        pool = s.pool
        gpu_free, host_free = pool.gpu_free_blocks, pool.host_free_blocks
        copies = self._copies(pool)
        gpu_fenced = len(pool.gpu.fenced)
        preempted = (self.model.pending_reset, self.model.offloaded)
        reqs = []
        for i in range(len(self.bound.requests)):
            group = self.bound.group_of(i)
            r = s.requests.get(i) or s.finished.get(i)
            fenced_gpu, fenced_host, incoming = copies.get(i, (0, 0, frozenset()))
            if r is None:
                reqs.append(AbstractRequest(group, ABSENT, 0, 0, 0, 0, NONE, self.bound.requests[i][0], 0))
                continue
            if r.state in self.model.terminal:
                reqs.append(
                    AbstractRequest(
                        group, r.state, 0, 0, r.num_gpu_blocks, r.num_host_blocks, NONE, 0, 0, fenced_gpu, fenced_host
                    )
                )
                continue
            gpu_table, host_table = pool.gpu_blocks(i), pool.host_blocks(i)
            gpu, host, copied = len(gpu_table), len(host_table), len(incoming)
            step = s.in_flight.get(i, 0) if gpu or host else 0  # its step's blocks: the tail of its table
            on_gpu = min(step, gpu)
            on_host = host_table[len(host_table) - (step - on_gpu) :] if step > on_gpu else ()
            moved = sum(1 for b in on_host if b in incoming)  # offloaded with the step: their sources are fenced
            gpu, gpu_free = gpu - on_gpu, gpu_free + on_gpu + moved
            host, host_free = host - len(on_host), host_free + len(on_host)
            fenced_gpu, copied, gpu_fenced = fenced_gpu - moved, copied - moved, gpu_fenced - moved
            landing = int(i in s.in_flight and r.state in preempted)  # its decode step may still land
            reqs.append(
                AbstractRequest(
                    group,
                    r.state,
                    r.num_computed_tokens,
                    len(r.generated),
                    gpu,
                    host,
                    r.termination_reason or NONE,
                    len(r.prefill_tokens),
                    landing,
                    fenced_gpu,
                    fenced_host,
                    copied,
                )
            )
        return AbstractState(tuple(reqs), gpu_free, host_free, gpu_fenced, len(pool.host.fenced))

    @staticmethod
    def _copies(pool) -> dict[Hashable, tuple[int, int, frozenset[int]]]:
        """Per request with a copy in flight: the GPU and host blocks its copy fences, and the destinations it still
        holds (the abstract model's `fenced_gpu`, `fenced_host` and, counted, `incoming`)."""
        out: dict[Hashable, tuple[int, int, frozenset[int]]] = {}
        for plan in pool.in_flight.values():
            owner = plan.request_id
            dest = pool.host if plan.direction == TO_HOST else pool.gpu
            held = set(dest.held(owner))
            fenced_gpu, fenced_host, incoming = out.get(owner, (0, 0, frozenset()))
            out[owner] = (
                fenced_gpu + len(pool.gpu.fenced_by(plan.plan_id)),
                fenced_host + len(pool.host.fenced_by(plan.plan_id)),
                incoming | {dst for _, dst in plan.pairs if dst in held},
            )
        return out

    def variants(self, state: AbstractState) -> list[AbstractState]:
        """The abstract states a world may stand for: a request awaiting consensus or suspended after a decode step
        whose step is not in the pipeline may stand for the model's request that may still receive it
        (`in_flight`: the model sets it on every such preemption with several stages, and lets it land or not)."""
        preempted = (self.model.pending_reset, self.model.offloaded)
        several = self.bound.pipeline_stages > 1
        options = [
            [r, r._replace(in_flight=1)]
            if several and r.state in preempted and not r.in_flight and r.computed >= r.prefill
            else [r]
            for r in state.requests
        ]
        out: list[tuple[AbstractRequest, ...]] = [()]
        for choice in options:
            out = [(*prefix, r) for prefix in out for r in choice]
        return [state._replace(requests=v) for v in out]  # in the order of `state`'s requests

    def describe(self, state: AbstractState) -> str:
        requests = "; ".join(self.model.describe_request(r) for r in state.requests)
        return f"{requests}; {self.model.describe_pool(state)}"
