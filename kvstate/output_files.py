"""Output files written whole or not at all: a report, a diagram or a TLA+ module is written under a temporary
name in its own directory, flushed to disk, and renamed onto its name only once complete.

Invariants kept: a file at a path these functions write is either its previous content (or absent) or the
whole new content, never a truncated one (a full disk, a file-size limit, an interruption); the temporary file
is removed on every failure; every failure is an `OutputError` naming the file and saying what to do.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from kvstate.errors import KVStateError

__all__ = ["OutputError", "whole_file", "write_whole"]


class OutputError(KVStateError):
    """An output file could not be written; nothing partial was left at its path."""


@contextmanager
def whole_file(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` (same directory, same suffix) for the block to write; renamed onto `path`
    when the block ends, removed if it raises. An `OSError` becomes `OutputError` naming `path`."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.partial{path.suffix}")
    try:  # created as open() creates a file (the umask applies), and never over an existing one
        os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except OSError as err:
        raise _failed(path, err) from err
    try:
        yield temporary
        _flush(temporary)
        os.replace(temporary, path)
    except OSError as err:
        raise _failed(path, err) from err
    finally:
        with suppress(OSError):
            temporary.unlink(missing_ok=True)


def write_whole(path: str | Path, content: bytes | str) -> Path:
    """Write `content` (text as UTF-8) to `path` whole or not at all (`whole_file`); returns `path`."""
    data = content.encode("utf-8") if isinstance(content, str) else content
    with whole_file(path) as temporary:
        temporary.write_bytes(data)
    return Path(path)


def _flush(path: Path) -> None:
    """Make the file's data reach the disk, so that a full disk is seen now and not after the rename."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _failed(path: Path, err: OSError) -> OutputError:
    why = err.strerror or str(err)
    return OutputError(
        f"cannot write {path}: {why}; nothing partial was left there (free some space, or pass another --out)"
    )
