"""A step list the roomy timing machine (`tests/stateful/test_executor_timing.py`, copies up to two passes late)
found, as Hypothesis printed it once shrunk: in its pass 90 a victim whose resume copy was still in flight was chosen,
an earlier victim of the pass was promoted to make host room for it, and the victim could not be suspended anyway
(a copy of it was in flight): the promotion freed GPU blocks two waiting requesters had reserved, and the pass broke
WORK-CONSERVE. `replay()` runs it with every check of the machine."""

# ruff: noqa: F841, PLR0915, RUF059  (the step list exactly as Hypothesis printed it)

from __future__ import annotations

from kvstate.testing import Submission
from tests.stateful.test_executor_timing import RoomyTimingMachine


def replay() -> None:
    state = RoomyTimingMachine()
    state.conforms()
    state.submit_invalid(request=Submission(prompt=(), max_new_tokens=2, stop_token_ids=()))
    state.conforms()
    state.host_tier(present=False)
    state.conforms()
    state.host_tier(present=False)
    state.conforms()
    # submit -> request id 0
    # submit -> request id 1
    requests_0, requests_1 = state.submit_many(
        batch=[
            Submission(prompt=(12,), max_new_tokens=18, stop_token_ids=()),
            Submission(
                prompt=(
                    418,
                    622,
                    180,
                    237,
                    671,
                    334,
                    98,
                    53,
                    382,
                    335,
                    998,
                    0,
                    260,
                    102,
                    22,
                    61,
                    507,
                    57,
                    496,
                    160,
                    771,
                    114,
                    603,
                    254,
                    276,
                    62,
                    195,
                    280,
                    215,
                    656,
                    266,
                    149,
                    410,
                    0,
                    371,
                    186,
                    0,
                    25,
                    0,
                    301,
                    0,
                    80,
                    0,
                    0,
                    0,
                    0,
                    12,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    446,
                    0,
                    373,
                    0,
                ),
                max_new_tokens=6,
                stop_token_ids=(),
            ),
        ]
    )
    state.conforms()
    state.drain()
    state.conforms()
    state.host_tier(present=False)
    state.conforms()
    state.host_tier(present=False)
    state.conforms()
    state.host_tier(present=False)
    state.conforms()
    state.host_tier(present=False)
    state.conforms()
    state.host_tier(present=False)
    state.conforms()
    state.host_tier(present=False)
    state.conforms()
    state.host_tier(present=False)
    state.conforms()
    state.host_tier(present=False)
    state.conforms()
    state.host_tier(present=False)
    state.conforms()
    state.host_tier(present=False)
    state.conforms()
    state.host_tier(present=False)
    state.conforms()
    state.host_tier(present=False)
    state.conforms()
    state.host_tier(present=False)
    state.conforms()
    state.host_tier(present=False)
    state.conforms()
    state.host_tier(present=False)
    state.conforms()
    # submit -> request id 2
    requests_2 = state.submit(request=Submission(prompt=(0,), max_new_tokens=2, stop_token_ids=()))
    state.conforms()
    state.drain()
    state.conforms()
    # cancel: no request is waiting; fell back to request 0 (done)
    # cancel 0: done -> done
    state.cancel(in_state="waiting", nth=0)
    state.conforms()
    # submit -> request id 3
    # submit -> request id 4
    # submit -> request id 5
    requests_3, requests_4, requests_5 = state.submit_many(
        batch=[
            Submission(prompt=(823, 501, 872, 485, 111, 401, 528, 46), max_new_tokens=4, stop_token_ids=()),
            Submission(prompt=(0, 1, 644, 388, 106, 684, 114, 117, 16), max_new_tokens=13, stop_token_ids=()),
            Submission(prompt=(792, 0, 33, 0), max_new_tokens=1, stop_token_ids=()),
        ]
    )
    state.conforms()
    # submit -> request id 6
    # submit -> request id 7
    requests_6, requests_7 = state.submit_many(
        batch=[
            Submission(prompt=(311, 566, 311, 43), max_new_tokens=16, stop_token_ids=(177, 147)),
            Submission(prompt=(839,), max_new_tokens=13, stop_token_ids=()),
        ]
    )
    state.conforms()
    state.drain()
    state.conforms()
    state.host_tier(present=False)
    state.conforms()
    state.host_tier(present=False)
    state.conforms()
    state.submit_invalid(request=Submission(prompt=(), max_new_tokens=50, stop_token_ids=()))
    state.conforms()
    # cancel: no request is waiting; fell back to request 0 (done)
    # cancel 0: done -> done
    state.cancel(in_state="waiting", nth=0)
    state.conforms()
    state.host_tier(present=False)
    state.conforms()
    state.host_tier(present=False)
    state.conforms()
    # cancel: no request is waiting; fell back to request 0 (done)
    # cancel 0: done -> done
    state.cancel(in_state="waiting", nth=0)
    state.conforms()
    state.host_tier(present=False)
    state.conforms()
    # submit -> request id 8
    requests_8 = state.submit(request=Submission(prompt=(0,), max_new_tokens=28, stop_token_ids=()))
    state.conforms()
    state.drain()
    state.conforms()
    # cancel: no request is waiting; fell back to request 0 (done)
    # cancel 0: done -> done
    state.cancel(in_state="waiting", nth=0)
    state.conforms()
    state.host_tier(present=False)
    state.conforms()
    state.host_tier(present=False)
    state.conforms()
    state.host_tier(present=False)
    state.conforms()
    state.step_until(in_state="replaying")
    state.conforms()
    state.step_until(in_state="suspended")
    state.conforms()
    state.host_tier(present=True)
    state.conforms()
    state.host_tier(present=True)
    state.conforms()
    state.step_until(in_state="awaiting_consensus")
    state.conforms()
    state.host_tier(present=True)
    state.conforms()
    # submit -> request id 9
    # submit -> request id 10
    requests_9, requests_10 = state.submit_many(
        batch=[
            Submission(
                prompt=(
                    0,
                    1,
                    2,
                    3,
                    4,
                    5,
                    6,
                    7,
                    8,
                    9,
                    10,
                    11,
                    12,
                    13,
                    14,
                    15,
                    16,
                    17,
                    18,
                    19,
                    20,
                    21,
                    22,
                    23,
                    267,
                    233,
                    529,
                    47,
                    778,
                    183,
                    198,
                    99,
                    142,
                    319,
                    309,
                    264,
                    643,
                    20,
                    149,
                    96,
                    5,
                    451,
                    222,
                    700,
                ),
                max_new_tokens=1,
                stop_token_ids=(106,),
            ),
            Submission(
                prompt=(
                    0,
                    147,
                    353,
                    172,
                    444,
                    477,
                    104,
                    82,
                    418,
                    5,
                    479,
                    526,
                    272,
                    96,
                    241,
                    61,
                    640,
                    311,
                    52,
                    58,
                    130,
                    491,
                    232,
                    1,
                    999,
                    735,
                    246,
                    313,
                    602,
                    254,
                    115,
                    239,
                    820,
                    602,
                    237,
                    295,
                    48,
                    2,
                    492,
                    690,
                    1,
                ),
                max_new_tokens=11,
                stop_token_ids=(999, 20),
            ),
        ]
    )
    state.conforms()
    state.step_until(in_state="suspended")
    state.conforms()
    # submit -> request id 11
    # submit -> request id 12
    # submit -> request id 13
    # submit -> request id 14
    requests_11, requests_12, requests_13, requests_14 = state.submit_many(
        batch=[
            Submission(
                prompt=(
                    568,
                    1,
                    1,
                    368,
                    119,
                    126,
                    0,
                    570,
                    342,
                    113,
                    217,
                    1,
                    226,
                    82,
                    388,
                    193,
                    150,
                    792,
                    264,
                    616,
                    93,
                    46,
                    632,
                    5,
                    174,
                    43,
                    353,
                    989,
                    635,
                    1,
                    39,
                    526,
                ),
                max_new_tokens=8,
                stop_token_ids=(343,),
            ),
            Submission(
                prompt=(396, 9, 16, 943, 89, 48, 531, 998, 347, 120, 241, 645, 691, 335, 272, 276, 185),
                max_new_tokens=1,
                stop_token_ids=(106,),
            ),
            Submission(
                prompt=(174, 174, 998, 575, 293, 48, 0, 0, 280), max_new_tokens=1, stop_token_ids=(177, 201, 105)
            ),
            Submission(
                prompt=(
                    192,
                    200,
                    234,
                    347,
                    661,
                    69,
                    1,
                    413,
                    646,
                    467,
                    459,
                    635,
                    550,
                    76,
                    485,
                    17,
                    734,
                    506,
                    1,
                    304,
                    141,
                    108,
                    814,
                ),
                max_new_tokens=29,
                stop_token_ids=(160,),
            ),
        ]
    )
    state.conforms()
    state.teardown()
