"""Check that the test suite catches the bugs listed in tests/mutations.toml.

For each mutation: copy the tree (src/, tests/, pyproject.toml) to a temporary directory,
apply the mutation there (the working tree is never touched), run the mutation's tests in
that copy, and count the mutation as caught only if they fail (pytest exit status 1). The
same tests are first run unmutated in a copy: a mutation "caught" by tests that fail
anyway proves nothing.

Usage: ``python tests/check_mutations.py [--only NAME ...] [--list]``. Exits 1 if a
mutation survives, 2 if the list is stale (a snippet not found exactly once) or the
unmutated tests fail.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIST = ROOT / "tests" / "mutations.toml"
COPIED = ("src", "tests", "pyproject.toml")
PER_RUN_TIMEOUT_S = 300  # a mutation that hangs the suite counts as caught, but must not hang this script


@dataclass(frozen=True)
class Mutation:
    name: str
    why: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]


def load(path: Path = LIST) -> list[Mutation]:
    with open(path, "rb") as fh:
        raw = tomllib.load(fh)["mutation"]
    out = [Mutation(m["name"], m["why"], m["file"], m["original"], m["replacement"], tuple(m["tests"])) for m in raw]
    names = [m.name for m in out]
    if len(set(names)) != len(names):
        raise SystemExit(f"{path}: mutation names must be unique")
    return out


def copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", ".hypothesis")
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, symlinks=True, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, dest / name)


def mutated(m: Mutation, tree: Path) -> str:
    """``m.file`` of ``tree`` with the mutation applied; LookupError if the snippet is not there once."""
    text = (tree / m.file).read_text()
    count = text.count(m.original)
    if count != 1:
        raise LookupError(f"{m.name}: the original snippet occurs {count} times in {m.file}, not once: "
                          "update tests/mutations.toml")
    return text.replace(m.original, m.replacement)


def run_tests(tree: Path, tests: tuple[str, ...]) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--timeout", "120", *tests]
    try:
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=PER_RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return 124, "timed out"
    lines = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode, lines[-1] if lines else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="check only these mutations")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = ap.parse_args(argv)
    mutations = load()
    if args.only:
        unknown = set(args.only) - {m.name for m in mutations}
        if unknown:
            ap.error(f"no such mutation: {', '.join(sorted(unknown))}")
        mutations = [m for m in mutations if m.name in args.only]
    if args.list:
        for m in mutations:
            print(f"{m.name}: {m.file} ({m.why}); caught by {' '.join(m.tests)}")
        return 0

    with tempfile.TemporaryDirectory(prefix="gdskit-mutations-") as tmp:
        base = Path(tmp) / "unmutated"
        copy_tree(base)
        stale = []
        for m in mutations:  # every snippet must apply before anything runs
            try:
                mutated(m, base)
            except LookupError as exc:
                stale.append(str(exc))
        if stale:
            print("\n".join(stale), file=sys.stderr)
            return 2
        all_tests = tuple(dict.fromkeys(t for m in mutations for t in m.tests))
        rc, tail = run_tests(base, all_tests)
        if rc != 0:
            print(f"the unmutated tests fail ({tail}): fix them first", file=sys.stderr)
            return 2
        survivors = []
        for m in mutations:
            tree = Path(tmp) / m.name
            copy_tree(tree)
            (tree / m.file).write_text(mutated(m, tree))
            rc, tail = run_tests(tree, m.tests)
            caught = rc in (1, 124)  # tests failed, or the mutation hung them
            print(f"{'caught  ' if caught else 'SURVIVED'} {m.name}: {tail}", flush=True)
            if not caught:
                survivors.append(m.name)
            shutil.rmtree(tree, ignore_errors=True)
    if survivors:
        print(f"{len(survivors)} mutation(s) survived: {', '.join(survivors)}", file=sys.stderr)
        return 1
    print(f"all {len(mutations)} mutations caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
