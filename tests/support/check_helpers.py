"""Shared helpers for the `gdskit check` tests (fixture trees under tests/probe/fixtures/check)."""

from __future__ import annotations

import os
import shutil

from repo_paths import CHECK_FIXTURES

FIXTURES = str(CHECK_FIXTURES)


def fixture_root(name: str) -> str:
    path = os.path.join(FIXTURES, name)
    assert os.path.isdir(path), f"fixture tree {name} missing; run tests/probe/fixtures/check/make_fixtures.py"
    return path


def copy_fixture(name: str, dest: str) -> str:
    """A writable copy of a fixture tree (symlinks kept as symlinks)."""
    target = os.path.join(dest, name)
    shutil.copytree(fixture_root(name), target, symlinks=True)
    return target
