"""`kvstate diagram`: write the diagrams generated from the spec, or check the committed ones.

Writes `lifecycle.dot`, `lifecycle.mmd`, `transitions.md` and, where Graphviz `dot` is installed,
`lifecycle.svg`. `--check` compares only the byte-stable text sources: it writes nothing, prints a unified
diff per file that differs (a missing file differs) and exits 1 when any does, 0 when all match.
"""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path

from kvstate.diagrams import DOT_FILE, DOT_MISSING, SVG_FILE, render_sources, render_svg
from kvstate.errors import KVStateError
from kvstate.spec import load_spec

DEFAULT_OUT = Path("diagrams")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "diagram",
        help="generate the lifecycle diagrams (DOT, Mermaid, SVG, transition table) from the spec",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--spec", type=Path, default=None, help="spec TOML file (default: the packaged spec)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default: ./diagrams)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; diff the text sources in --out against the spec and exit 1 if any differ",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    sources = render_sources(load_spec(args.spec))
    if args.check:
        return check(sources, args.out)
    write(sources, args.out)
    return 0


def write(sources: dict[str, str], out: Path) -> None:
    """Write every text source, then the SVG where `dot` is installed; one line per file written."""
    for name, text in sources.items():
        write_file(out / name, text.encode("utf-8"))
    svg = render_svg(sources[DOT_FILE])
    if svg is None:
        print(f"skipped {out / SVG_FILE}: {DOT_MISSING}")
    else:
        write_file(out / SVG_FILE, svg)


def write_file(path: Path, content: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    except OSError as err:
        raise KVStateError(f"cannot write {path}: {err.strerror}; pass a writable directory with --out") from err
    print(f"wrote {path}")


def check(sources: dict[str, str], out: Path) -> int:
    """Print `ok` or a unified diff for each text source against its file in `out`; 1 if any differs."""
    stale = 0
    for name, expected in sources.items():
        path = out / name
        diff = diff_against(path, expected)
        if diff:
            stale += 1
            print(f"DIFFERS: {path}")
            print(diff, end="")
        else:
            print(f"ok: {path}")
    if stale:
        print(f"{stale} diagram file(s) differ from the spec; run `kvstate diagram --out {out}` to regenerate them")
    return 1 if stale else 0


def diff_against(path: Path, expected: str) -> str:
    """The unified diff from the file at `path` (empty when missing) to `expected`; "" when they are equal."""
    try:
        actual = path.read_bytes().decode("utf-8", errors="replace")
        state = "on disk"
    except FileNotFoundError:
        actual, state = "", "missing"
    except OSError as err:
        raise KVStateError(f"cannot read {path}: {err.strerror}; pass the diagrams directory with --out") from err
    if state == "on disk" and actual == expected:
        return ""
    return "".join(
        difflib.unified_diff(
            actual.splitlines(keepends=True),
            expected.splitlines(keepends=True),
            fromfile=f"{path} ({state})",
            tofile=f"{path} (generated from the spec)",
        )
    )
