"""Where the tree's parts are, for tests that read files of the tree or start Python processes.

A child process does not get pytest's ``pythonpath`` (pyproject.toml): ``child_pythonpath`` gives
it src/, the stand-ins and the shared helpers, as the tests themselves see them."""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
SRC = REPO / "src"
STAND_INS = TESTS / "stand_ins"
SUPPORT = TESTS / "support"
CHECK_FIXTURES = TESTS / "probe" / "fixtures" / "check"


def child_pythonpath(*folders: Path | str, inherit: bool = True) -> str:
    """A PYTHONPATH for a child: src/, the stand-ins, the shared helpers, then ``folders`` (a test's
    own folder, for its workers), then this process's PYTHONPATH where ``inherit``."""
    parts = [str(p) for p in (SRC, STAND_INS, SUPPORT, *folders)]
    inherited = os.environ.get("PYTHONPATH", "") if inherit else ""
    return os.pathsep.join(parts + ([inherited] if inherited else []))
