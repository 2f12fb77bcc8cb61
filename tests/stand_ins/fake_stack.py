"""Helpers that put gdskit on the stand-in libcufile (tests/stand_ins/fake_cufile.py); the fixtures
``fake_cuda`` and ``compat_cufile`` live in conftest.py."""

from __future__ import annotations

import pytest

from gdskit.engine.backends import cufile as cufile_backend

from fake_cufile import FakeCufile


def use_cufile(monkeypatch: pytest.MonkeyPatch, fake: FakeCufile) -> cufile_backend.CufileLibrary:
    """Make ``fake`` the libcufile gdskit's cuFile backend loads."""
    lib = cufile_backend.CufileLibrary(loader=lambda: fake)
    monkeypatch.setattr(cufile_backend, "cufile_library", lambda: lib)
    return lib
