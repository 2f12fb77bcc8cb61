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
