"""Shared helpers for the `gdskit check` tests (fixture trees under tests/fixtures/check)."""

from __future__ import annotations

import os
import shutil

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "check")


def fixture_root(name: str) -> str:
    path = os.path.join(FIXTURES, name)
    assert os.path.isdir(path), f"fixture tree {name} missing; run tests/fixtures/check/make_fixtures.py"
    return path


def copy_fixture(name: str, dest: str) -> str:
    """A writable copy of a fixture tree (symlinks kept as symlinks)."""
    target = os.path.join(dest, name)
    shutil.copytree(fixture_root(name), target, symlinks=True)
    return target
