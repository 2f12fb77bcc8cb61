#!/usr/bin/env python3
"""What importing gdskit costs a process that already has torch and CUDA's Python side.

Every run is a fresh interpreter. The baseline (A) runs ``import torch, torch.cuda``;
each case (B) runs the same and then ``import <module>``. Runs are interleaved
A, B1, B2, ..., A, B1, B2, ... so that the load of a shared machine hits all alike.
Two figures per run:

* ``import ms``: the child's own clock around the statement after torch (for A the
  empty statement), so torch's own import time and its noise stay out of it;
* ``process ms``: the parent's clock around the whole child, start-up included; the
  difference of the medians B - A is what a user's program pays in all.

Bytecode: a checkout run with ``PYTHONDONTWRITEBYTECODE`` compiles every module on every
import, which is not what an installed package costs. The children share a temporary
``PYTHONPYCACHEPREFIX`` that one untimed warm-up run of each command fills first.

``--tree NAME=DIR`` (repeatable) runs every case once per source tree, interleaved too, for a
before/after comparison in one run (e.g. a ``git worktree`` of the old commit).

    PYTHONPATH=src python benchmarks/import_time.py --runs 25
    PYTHONPATH=src python benchmarks/import_time.py --modules gdskit gdskit.safetensors gdskit.torch gdskit.data
    python benchmarks/import_time.py --tree before=/tmp/old/src --tree after=src --runs 25
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

BASELINE = "import torch, torch.cuda"

CHILD = """
import time
{baseline}
t0 = time.perf_counter()
{statement}
t1 = time.perf_counter()
print((t1 - t0) * 1e3)
"""


def run_once(statement: str, env: dict[str, str]) -> tuple[float, float]:
    """One fresh interpreter: (ms of ``statement`` after the baseline, ms of the whole process)."""
    code = CHILD.format(baseline=BASELINE, statement=statement or "pass")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    wall = (time.perf_counter() - t0) * 1e3
    return float(out.stdout.strip().splitlines()[-1]), wall


def spread(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "p25": q[0], "p75": q[2], "min": min(values), "max": max(values)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=25, help="fresh processes per command (default 25)")
    ap.add_argument("--modules", nargs="+", default=["gdskit.safetensors"],
                    help="modules to import after torch, one case each (default gdskit.safetensors); "
                         "'a,b' imports both in one case")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="a source tree to put first on PYTHONPATH (repeatable; default: PYTHONPATH as it is)")
    ap.add_argument("--json", help="also write the runs and the summary here")
    args = ap.parse_args()

    trees = {"": os.environ.get("PYTHONPATH", "")}
    if args.tree:
        trees = dict(t.split("=", 1) for t in args.tree)
    cases: dict[str, tuple[str, str]] = {}  # label -> (PYTHONPATH, statement)
    for tree, path in trees.items():
        where = f"[{tree}] " if tree else ""
        cases[where + "A: " + BASELINE] = (path, "")
        for spec in args.modules:
            names = [m for m in spec.split(",") if m]
            cases[where + "B: + import " + ", ".join(names)] = (path, "import " + ", ".join(names))

    with tempfile.TemporaryDirectory(prefix="gdskit-import-pyc-") as cache:
        env = dict(os.environ, PYTHONPYCACHEPREFIX=cache)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        envs = {path: dict(env, PYTHONPATH=os.path.abspath(path)) if path else env for path in trees.values()}
        for path, statement in cases.values():  # untimed: compiles the bytecode every later run reads
            run_once(statement, envs[path])
        runs: dict[str, list[tuple[float, float]]] = {label: [] for label in cases}
        for _ in range(args.runs):
            for label, (path, statement) in cases.items():
                runs[label].append(run_once(statement, envs[path]))

    summary = {}
    print(f"{args.runs} fresh processes per command, interleaved; median [p25-p75] (min-max), ms")
    print(f"{'command':<72} {'import after torch':>27}  {'whole process':>27} {'B-A':>6}")
    for label, values in runs.items():
        where = label[:label.index("A: ") if "A: " in label else label.index("B: ")]
        base_wall = statistics.median(w for _i, w in runs[where + "A: " + BASELINE])
        imp = spread([i for i, _w in values])
        wall = spread([w for _i, w in values])
        summary[label] = {"import_ms": imp, "process_ms": wall, "process_minus_baseline_ms": wall["median"] - base_wall}
        print(f"{label:<72} {imp['median']:6.1f} [{imp['p25']:5.1f}-{imp['p75']:5.1f}] ({imp['min']:4.1f}-{imp['max']:5.1f})"
              f"  {wall['median']:5.0f} [{wall['p25']:5.0f}-{wall['p75']:5.0f}] ({wall['min']:4.0f}-{wall['max']:5.0f})"
              f" {wall['median'] - base_wall:+6.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"python": sys.version, "runs": runs, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
