"""`Comm.send_message` / `recv_message` between two gloo ranks: one frame per message when it fits in
`FRAME_BYTES`, an overflow part when it does not, the attached tensor arriving bit for bit with its shape and
dtype, and messages received in the order they were posted."""

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


def _rank(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore(LOOPBACK, port, 2, is_master=False, timeout=timedelta(seconds=60))
    init_process_group("gloo", rank, 2, 60.0, store=store)
    try:
        comm = Comm(rank, 2, torch.device("cpu"))
        if rank == 0:
            for obj, tensor in _messages():
                comm.send_message(obj, 1, tensor)
            comm.flush()
        else:
            got = [comm.recv_message(0) for _ in _messages()]
            with open(Path(out_dir) / "got.pkl", "wb") as f:
                pickle.dump(got, f)
    finally:
        dist.destroy_process_group()


def test_messages_and_attached_tensors_arrive_whole_and_in_order(tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    # The spawned ranks unpickle `_rank` by this module's name (tests.distributed...), so they need the repository
    # root on their path; spawn hands them this process's sys.path. Appended, not prepended: where the project is
    # installed non-editable, `kvstate` must still come from the installation (it maps spec/ into the package).
    monkeypatch.setattr(sys, "path", [*sys.path, str(Path(__file__).resolve().parents[2])])
    with loopback_store(2, 60.0) as port:
        mp.start_processes(_rank, args=(port, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    got = pickle.loads((tmp_path / "got.pkl").read_bytes())
    sent = _messages()
    assert [obj for obj, _ in got] == [obj for obj, _ in sent]
    for (_, tensor), (_, expected) in zip(got, sent, strict=True):
        if expected is None:
            assert tensor is None
        else:
            assert tensor.dtype == expected.dtype and tensor.shape == expected.shape and torch.equal(tensor, expected)
