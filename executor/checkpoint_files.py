"""The files of a checkpoint, read as untrusted input without torch: regular files only, bounded.

`CheckpointError` is every refusal of a checkpoint (`executor.hf`, `executor.gguf_file`, ...): a `ValueError`
whose message starts with the file and the field or tensor. `open_regular` refuses a FIFO, a device or a
directory before reading (opening a FIFO for reading would wait for a writer forever), `read_bounded` reads no
more than one byte past its limit, and `read_checkpoint_json` parses with `kvstate.untrusted`'s checks.
Importing this module imports neither torch nor numpy, so the command line checks checkpoint paths with it.
"""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path
from typing import Any

from kvstate.untrusted import Limits, UntrustedFileError, parse_json


class CheckpointError(UntrustedFileError):
    """A checkpoint directory is missing a file, uses an unsupported feature, holds a malformed or hostile file,
    or does not match its config; `path`, `field` locate the problem."""


def open_regular(path: str | Path, what: str) -> io.BufferedReader:
    """`path` opened for reading bytes, refused (without blocking on it) unless it is a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as err:
        why = "it does not exist" if isinstance(err, FileNotFoundError) else (err.strerror or str(err))
        raise CheckpointError(f"cannot read the {what}: {why}", path=path) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(
            f"cannot read the {what}: it is not a regular file (a directory, a FIFO, a device or a socket); pass "
            "the file itself",
            path=path,
        )
    return io.BufferedReader(io.FileIO(fd, "rb"))


def read_bounded(path: str | Path, max_bytes: int, what: str) -> bytes:
    """The bytes of the regular file `path`, refused when it is larger than `max_bytes` (reads one byte more)."""
    with open_regular(path, what) as handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise CheckpointError(f"the {what} is larger than {max_bytes} bytes, far more than one needs", path=path)
    return data


def read_checkpoint_json(path: str | Path, limits: Limits, what: str) -> Any:
    """The JSON document in the regular file `path`, read and checked within `limits` (`kvstate.untrusted`)."""
    return parse_json(read_bounded(path, limits.max_bytes, what), limits, what, path=path, error=CheckpointError)
