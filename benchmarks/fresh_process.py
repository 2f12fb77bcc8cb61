"""Measurements in fresh processes: a benchmark script runs itself as a child with arguments and
reads back the one ``RESULT {json}`` line the child prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def report(result: dict) -> None:
    """What a child prints as its last word: the result for its parent."""
    print("RESULT " + json.dumps(result), flush=True)


def run_child(script: str, argv: list[str], timeout: float) -> dict:
    """Run ``script`` with ``argv`` in a fresh interpreter; its result, or ``{"error": ...}``."""
    cmd = [sys.executable, os.path.abspath(script), *argv]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
    return {"error": " | ".join(tail) or f"exit {p.returncode}"}


#: The source tree of the checkout these benchmarks belong to.
THIS_TREE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")


def add_tree_options(ap) -> None:
    """The options of a script that compares gdskit source trees in fresh processes."""
    ap.add_argument("--src", default="", help="name=path,... gdskit source trees to compare (default: this one)")
    ap.add_argument("--device", default="cuda:0", help="cpu: a smoke test of the script without a GPU")


def source_trees(spec: str) -> dict[str, str]:
    """The gdskit source trees a ``--src name=path,...`` argument names (``{"this": THIS_TREE}``
    where it names none), each compiled first, as installing a package does: bytecode made at
    install, not at import."""
    import compileall

    trees = dict(item.split("=", 1) for item in spec.split(",") if item) or {"this": THIS_TREE}
    for tree in trees.values():
        compileall.compile_dir(tree, quiet=1)
    return trees


def run_child_in_tree(script: str, argv: list[str], tree: str, timeout: float) -> dict:
    """:func:`run_child` with the gdskit source tree ``tree`` first on the child's ``PYTHONPATH``."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.path.abspath(tree) + (os.pathsep + saved if saved else "")
    try:
        return run_child(script, argv, timeout)
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def exit_status(rows) -> int:
    """A benchmark's exit status: 1 when no row measured anything (every one is an ``{"error": ...}``
    row, or there is none), else 0. A run whose rows all failed is a failed run, not a result."""
    return 0 if any("error" not in row for row in rows) else 1


def write_runs(path: str | None, runs: list[dict]) -> None:
    """Every run's result, with the command line, as JSON at ``path`` (nothing where it is None)."""
    if path:
        with open(path, "w") as fh:
            json.dump({"argv": sys.argv, "runs": runs}, fh, indent=1)
