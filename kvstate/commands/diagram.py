"""`kvstate diagram`: write the diagrams generated from the spec, or check the committed ones.

Writes `lifecycle.dot`, `lifecycle.mmd`, `transitions.md`, `lifecycle-review.dot` (the reviewer view: who
decides each edge, which output list it feeds) and, where Graphviz `dot` is installed, `lifecycle.svg` and
`lifecycle-review.svg` (`dot` is stopped after --dot-timeout seconds). `--check` compares only the byte-stable
text sources: it writes nothing, prints a unified diff per file that differs (a missing file differs) and exits 1
when any does, 0 when all match.

`--diff OLD_SPEC NEW_SPEC` draws the review picture of a spec change into --out (default ./spec-diff): one
diagram (`spec-diff.dot`, `.svg` where Graphviz is installed) with added transitions green, removed ones red
dotted and changed guards, effects and destructive flags orange (old → new), the changed policy rules in its
legend, and `spec-diff.md`, a Markdown summary for a pull request, which it also prints. A broadcast event is drawn
from "any state" only where it is broadcast in both specs and none of its edges changed, so a change to one state's
edge is drawn on that edge alone; `--all-edges` draws every transition as its own arrow here too. NEW_SPEC need not
be well formed (a proposal under review): it is drawn when its structure allows (every name defined once, every
transition between declared states), its validation problems are listed in red in the picture's legend, first in
`spec-diff.md` and on stderr, and the exit status is 1. Exit 0: drawn, NEW_SPEC well formed; 1: drawn, NEW_SPEC not
well formed; 2: unusable input (a file that cannot be read or parsed, an OLD_SPEC that is not well formed, a
NEW_SPEC whose structure cannot be drawn).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvstate.commands.args import add_mkdir_option, add_spec_option, input_file, output_dir, seconds
from kvstate.diagrams import DOT_MISSING, DOT_TIMEOUT_S, SVG_FILES, render_sources, render_svg
from kvstate.diagrams.layout import LayoutTooLarge
from kvstate.errors import KVStateError, SpecError
from kvstate.output_files import write_whole
from kvstate.spec import load_spec
from kvstate.terminal import inert
from kvstate.validate import problem_listing, spec_problems, structure_problems

DEFAULT_OUT = Path("diagrams")
DEFAULT_DIFF_OUT = Path("spec-diff")
DIFF_DOT, DIFF_SVG, DIFF_MD = "spec-diff.dot", "spec-diff.svg", "spec-diff.md"
PROPOSAL_INVALID = 1  # --diff drew the change, but the new spec is not well formed


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "diagram",
        help="generate the lifecycle diagrams (DOT, Mermaid, SVG, transition table) from the spec",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_spec_option(parser)
    parser.add_argument(
        "--out", type=Path, default=None, help="output directory (default: ./diagrams; with --diff ./spec-diff)"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; diff the text sources in --out against the spec and exit 1 if any differ",
    )
    parser.add_argument(
        "--all-edges",
        action="store_true",
        help=(
            "draw every transition as its own arrow (default: a broadcast event such as cancel is one arrow "
            "from 'any state'); the committed diagrams use the default"
        ),
    )
    parser.add_argument(
        "--diff",
        nargs=2,
        type=Path,
        metavar=("OLD_SPEC", "NEW_SPEC"),
        default=None,
        help="draw what changed from OLD_SPEC to NEW_SPEC (one diagram and a Markdown summary) into --out",
    )
    parser.add_argument(
        "--dot-timeout",
        type=seconds(0.01, 86_400),  # finite: a timer of 1e300 s overflows
        default=DOT_TIMEOUT_S,
        metavar="SECONDS",
        help="stop Graphviz `dot` after this long (default %(default)g s)",
    )
    add_mkdir_option(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.diff is not None:
        return run_diff(args)
    args.out = args.out if args.out is not None else DEFAULT_OUT
    spec_path = input_file(args.spec, "--spec") if args.spec is not None else None
    if not args.check:
        output_dir(args.out, "--out", mkdir=args.mkdir)
    spec = load_spec(spec_path)
    with naming_the_spec(spec.source):
        sources = render_sources(spec, all_edges=args.all_edges)
    if args.check:
        return check(sources, args.out)
    write(sources, args.out, args.dot_timeout)
    return 0


def run_diff(args: argparse.Namespace) -> int:
    """`--diff OLD NEW`: the diagram and the Markdown summary of the change, written into --out."""
    from kvstate.diagrams.diff import diff_specs, render_diff_dot, summary_markdown

    old_path, new_path = (
        input_file(path, name) for path, name in zip(args.diff, ("OLD_SPEC", "NEW_SPEC"), strict=True)
    )
    out = output_dir(args.out if args.out is not None else DEFAULT_DIFF_OUT, "--out", mkdir=args.mkdir)
    old, new = load_spec(old_path), load_spec(new_path, validate=False)
    structure = structure_problems(new)  # what the picture cannot be drawn without
    if structure:
        raise SpecError(f"{new.source}: cannot draw the diff of this specification:\n{problem_listing(structure)}")
    problems = spec_problems(new)
    diff = diff_specs(old, new)
    summary = summary_markdown(old, new, diff, problems)
    with naming_the_spec(f"{old.source} -> {new.source}"):
        dot = render_diff_dot(old, new, diff, all_edges=args.all_edges, problems=problems)
    write_file(out / DIFF_MD, summary.encode("utf-8"))
    write_file(out / DIFF_DOT, dot.encode("utf-8"))
    svg = render_svg(dot, timeout=args.dot_timeout)
    if svg is None:
        print(inert(f"skipped {out / DIFF_SVG}: {DOT_MISSING}"))
    else:
        write_file(out / DIFF_SVG, svg)
    print(inert(summary, keep="\n"), end="")
    if problems:
        said = f"{new.source}: drawn, but the specification is not well formed:\n{problem_listing(problems)}"
        print(inert(said, keep="\n"), file=sys.stderr)
        return PROPOSAL_INVALID
    return 0


@contextmanager
def naming_the_spec(source: str) -> Iterator[None]:
    """Prefix a `LayoutTooLarge` raised inside with the spec file it was drawn from."""
    try:
        yield
    except LayoutTooLarge as err:
        raise LayoutTooLarge(f"{source}: cannot draw the diagram: {err}") from None


def write(sources: dict[str, str], out: Path, dot_timeout: float = DOT_TIMEOUT_S) -> None:
    """Write every text source, then each DOT source's SVG where `dot` is installed; one line per file."""
    for name, text in sources.items():
        write_file(out / name, text.encode("utf-8"))
    for dot_file, svg_file in SVG_FILES.items():
        svg = render_svg(sources[dot_file], timeout=dot_timeout)
        if svg is None:
            print(inert(f"skipped {out / svg_file}: {DOT_MISSING}"))
        else:
            write_file(out / svg_file, svg)


def write_file(path: Path, content: bytes) -> None:
    """Write `content` to `path` whole or not at all (`kvstate.output_files.write_whole`)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise KVStateError(f"cannot write {path}: {err.strerror}; pass a writable directory with --out") from err
    write_whole(path, content)
    print(inert(f"wrote {path}"))


def check(sources: dict[str, str], out: Path) -> int:
    """Print `ok` or a unified diff for each text source against its file in `out`; 1 if any differs."""
    stale = 0
    for name, expected in sources.items():
        path = out / name
        diff = diff_against(path, expected)
        if diff:
            stale += 1
            print(inert(f"DIFFERS: {path}"))
            print(inert(diff, keep="\n\t"), end="")
        else:
            print(inert(f"ok: {path}"))
    if stale:
        print(
            inert(f"{stale} diagram file(s) differ from the spec; run `kvstate diagram --out {out}` to regenerate them")
        )
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
