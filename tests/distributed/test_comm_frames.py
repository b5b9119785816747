"""`Comm.send_message` / `recv_message` between two gloo ranks: one frame per message when it fits in its frame
(`FRAME_BYTES`, or `down_frame_bytes` down the pipeline), an overflow part when it does not, the attached tensor
arriving bit for bit with its shape and dtype, and messages received in the order they were posted, also when the
receiver posts each frame's receive ahead (`Comm.expect`) and the sender sends only the bytes a message fills."""

from __future__ import annotations

import pickle
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from executor.pipeline.comm import FRAME_BYTES, Comm, init_process_group
from executor.pipeline.launch import LOOPBACK, loopback_store

pytestmark = pytest.mark.distributed

TOKENS = (1, 8, 3 * FRAME_BYTES // (64 * 8))  # hidden states of 1, 8 and enough tokens to overflow one frame


def _messages() -> list[tuple[dict, torch.Tensor | None]]:
    gen = torch.Generator().manual_seed(3)
    sent = [
        ({"iteration": i, "tokens": {i: i + 1}}, torch.randn(t, 64, generator=gen, dtype=torch.float64))
        for i, t in enumerate(TOKENS)
    ]
    sent.append(({"stop": True, "pad": "x" * (2 * FRAME_BYTES)}, None))  # a large object, nothing attached
    return sent


REPLY = {"iteration": 7, "tokens": {0: 1, 1: 2}}  # a message back up the pipeline, in the small frame


def _receive_all(comm: Comm, ahead: bool) -> list[tuple[dict, torch.Tensor | None]]:
    """Rank 1: every message of `_messages`, each frame's receive posted ahead when `ahead` (as a pipeline rank
    does: before it computes, and only while another message is sure to come)."""
    got = []
    for index in range(len(_messages())):
        if ahead and index == 0:
            comm.expect(0)
        got.append(comm.recv_message(0))
        if ahead and index + 1 < len(_messages()):
            comm.expect(0)
    return got


def _rank(rank: int, port: int, out_dir: str, down_frame_bytes: int, ahead: bool) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore(LOOPBACK, port, 2, is_master=False, timeout=timedelta(seconds=60))
    init_process_group("gloo", rank, 2, 60.0, store=store)
    try:
        comm = Comm(rank, 2, torch.device("cpu"), down_frame_bytes=down_frame_bytes)
        if rank == 0:
            if ahead:
                comm.expect(1)
            for obj, tensor in _messages():
                comm.send_message(obj, 1, tensor)
            reply = comm.recv_message(1)
            comm.flush()
            with open(Path(out_dir) / "reply.pkl", "wb") as f:
                pickle.dump(reply, f)
        else:
            got = _receive_all(comm, ahead)
            comm.send_message(REPLY, 0)
            comm.flush()
            with open(Path(out_dir) / "got.pkl", "wb") as f:
                pickle.dump(got, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("down_frame_bytes", "ahead"),
    [(FRAME_BYTES, False), (2 * FRAME_BYTES, True)],
    ids=["fixed-frames", "larger-down-frames-posted-ahead"],
)
def test_messages_and_attached_tensors_arrive_whole_and_in_order(tmp_path, monkeypatch, down_frame_bytes, ahead):
    import torch.multiprocessing as mp

    # The spawned ranks unpickle `_rank` by this module's name (tests.distributed...), so they need the repository
    # root on their path; spawn hands them this process's sys.path. Appended, not prepended: where the project is
    # installed non-editable, `kvstate` must still come from the installation (it maps spec/ into the package).
    monkeypatch.setattr(sys, "path", [*sys.path, str(Path(__file__).resolve().parents[2])])
    with loopback_store(2, 60.0) as port:
        mp.start_processes(
            _rank, args=(port, str(tmp_path), down_frame_bytes, ahead), nprocs=2, join=True, start_method="spawn"
        )
    got = pickle.loads((tmp_path / "got.pkl").read_bytes())
    sent = _messages()
    assert [obj for obj, _ in got] == [obj for obj, _ in sent]
    assert pickle.loads((tmp_path / "reply.pkl").read_bytes()) == (REPLY, None)
    for (_, tensor), (_, expected) in zip(got, sent, strict=True):
        if expected is None:
            assert tensor is None
        else:
            assert tensor.dtype == expected.dtype and tensor.shape == expected.shape and torch.equal(tensor, expected)


def test_frames_down_the_pipeline_take_down_frame_bytes_and_the_rest_frame_bytes():
    comm = Comm(0, 1, torch.device("cpu"), down_frame_bytes=5 * FRAME_BYTES)
    assert comm.frame_bytes(0, 1) == comm.frame_bytes(1, 2) == 5 * FRAME_BYTES
    assert comm.frame_bytes(1, 0) == FRAME_BYTES
    assert Comm(0, 1, torch.device("cpu"), down_frame_bytes=1).frame_bytes(0, 1) == FRAME_BYTES  # never below


def test_expect_is_a_no_op_without_a_process_group():
    Comm(0, 1, torch.device("cpu")).expect(0)  # one process: no group to post on, nothing to receive
