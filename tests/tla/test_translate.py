"""TLC's traces in our terms: each TLC state read as an abstract state, each step matched to one action of our model
(up to the order of interchangeable requests), the trace written as lifecycle trace lines that parse as a trace."""

from __future__ import annotations

import json

import pytest

from kvstate.checker import AbstractModel
from kvstate.checker.bounds import Bound
from kvstate.spec import load_spec
from kvstate.tla.models import request_name
from kvstate.tla.tlc import TlcState
from kvstate.tla.translate import TraceMismatch, tlc_steps, trace_lines
from kvstate.tla.values import ModelValue
from kvstate.trace import parse_line

BOUND = Bound(
    "twins", ((2, 2), (2, 2), (1, 1)), gpu_blocks=4, host_blocks=2, block_size=1, chunk_size=2, cancel=False
)  # no cancel: every request of a run that ends them all computes and finishes
MODEL = AbstractModel(BOUND, load_spec(), symmetry=False)  # states in bound order, as TLC prints them


def as_tlc(state, number: int) -> TlcState:
    """An abstract state (requests in bound order) printed as the exported module's variables."""
    requests = {}
    for i, r in enumerate(state.requests):
        prompt, new = BOUND.requests[i]
        fields = r._asdict()
        del fields["group"]
        requests[ModelValue(request_name(i))] = {**fields, "prompt_len": prompt, "max_new_tokens": new}
    counts = dict(zip(("gpu_free", "host_free", "gpu_fenced", "host_fenced"), state[1:], strict=True))
    return TlcState(number, "" if number == 1 else "Commit", {"requests": requests, "counts": counts})


def a_run_that_ends_everything():
    """The states of a shortest run of ours (breadth first) from the initial state to one where every request is done
    and no copy is in flight."""
    parents, frontier = {MODEL.initial(): None}, [MODEL.initial()]
    while frontier:
        nxt = []
        for state in frontier:
            if MODEL.is_final(state) and state.gpu_fenced + state.host_fenced == 0:
                path = [state]
                while parents[path[-1]] is not None:
                    path.append(parents[path[-1]])
                return path[::-1]
            for edge in MODEL.successors(state):
                after = MODEL.canonical(edge.after_requests, edge.after_pool)
                if after not in parents:
                    parents[after] = state
                    nxt.append(after)
        frontier = nxt
    raise AssertionError("no run ends every request")


PATH = a_run_that_ends_everything()


def test_a_run_of_ours_printed_as_tlc_prints_it_translates_back_step_by_step():
    trace = [as_tlc(s, n) for n, s in enumerate(PATH, 1)]
    steps = tlc_steps(MODEL, trace)
    assert len(steps) == len(PATH) - 1
    for step, after in zip(steps, PATH[1:], strict=True):
        assert (step.edge.after_requests, *step.edge.after_pool) == tuple(after)
    lines, cut = trace_lines(MODEL, steps)
    assert cut == ""
    for n, line in enumerate(lines, 1):
        assert parse_line(json.dumps(line), n) == line  # every line is a trace line
    ended = {line["request_id"] for line in lines if line["to"] in MODEL.terminal}
    assert ended == set(range(len(BOUND.requests)))  # every request ends, under its bound index


def test_interchangeable_requests_printed_in_the_other_order_keep_their_ids():
    swapped = []
    for state in PATH:
        r0, r1, *rest = state.requests
        swapped.append(state._replace(requests=(r1, r0, *rest)))
    steps = tlc_steps(MODEL, [as_tlc(s, n) for n, s in enumerate(swapped, 1)])
    lines, _ = trace_lines(MODEL, steps)
    straight, _ = trace_lines(MODEL, tlc_steps(MODEL, [as_tlc(s, n) for n, s in enumerate(PATH, 1)]))
    relabel = {0: 1, 1: 0, 2: 2}
    assert [{**line, "request_id": relabel[line["request_id"]]} for line in lines] == straight


def test_a_tlc_step_our_model_does_not_take_is_a_mismatch():
    doctored = list(PATH)
    k = next(i for i, s in enumerate(doctored) if s.gpu_free < BOUND.gpu_blocks)
    doctored[k] = doctored[k]._replace(gpu_free=doctored[k].gpu_free + 1)
    with pytest.raises(TraceMismatch, match=f"TLC's step to state {k + 1} .* is no step of our abstract model"):
        tlc_steps(MODEL, [as_tlc(s, n) for n, s in enumerate(doctored, 1)])


def test_a_state_the_module_does_not_write_is_a_mismatch():
    state = as_tlc(PATH[0], 1)
    del state.values["counts"]
    with pytest.raises(TraceMismatch, match="TLC's state 1 is not a state of bound twins"):
        tlc_steps(MODEL, [state])
