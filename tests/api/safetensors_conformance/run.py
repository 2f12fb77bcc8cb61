"""Run safetensors' own torch tests against gdskit.safetensors (not part of the normal suite).

    python tests/api/safetensors_conformance/run.py PATH [pytest args...]

``PATH`` (or the environment variable ``GDSKIT_SAFETENSORS_TESTS``) is a checkout of
huggingface/safetensors or a directory holding its ``test_pt_comparison.py`` and
``test_pt_model.py``; nothing of it is kept here. The tests run in a fresh temporary
directory (they write ``./tests/data/...``) with ``safetensors.torch``'s public functions
and ``safetensors.safe_open`` replaced by gdskit's; the private helpers the tests call
(``_find_shared_tensors`` ...) stay the real library's.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import types

TEST_FILES = ("test_pt_comparison.py", "test_pt_model.py")
ENV = "GDSKIT_SAFETENSORS_TESTS"
#: What ``safetensors.torch`` offers that gdskit replaces.
REPLACED = ("load", "load_file", "save", "save_file", "load_model", "save_model", "safe_open")


def upstream_tests(path: str) -> list[str]:
    """The upstream test files under ``path`` (a checkout or a directory of test files)."""
    for folder in (os.path.join(path, "bindings", "python", "tests"), path):
        found = [os.path.join(folder, n) for n in TEST_FILES if os.path.isfile(os.path.join(folder, n))]
        if found:
            return found
    raise SystemExit(f"no {' or '.join(TEST_FILES)} under {path}")


def install_shim() -> None:
    """Make ``safetensors`` and ``safetensors.torch`` resolve to gdskit's functions."""
    import safetensors
    import safetensors.torch as real_torch

    import gdskit.safetensors as gs

    shim_torch = types.ModuleType("safetensors.torch")
    shim_torch.__dict__.update({k: v for k, v in vars(real_torch).items() if not k.startswith("__")})
    for name in REPLACED:
        setattr(shim_torch, name, getattr(gs, name))
    shim = types.ModuleType("safetensors")
    shim.__dict__.update({k: v for k, v in vars(safetensors).items() if not k.startswith("__")})
    shim.__path__ = safetensors.__path__  # type: ignore[attr-defined]
    shim.safe_open = gs.safe_open  # type: ignore[attr-defined]
    shim.torch = shim_torch  # type: ignore[attr-defined]
    sys.modules["safetensors"] = shim
    sys.modules["safetensors.torch"] = shim_torch


class _Shim:
    """A pytest plugin that installs the shim before any test module is imported."""

    def pytest_configure(self, config: object) -> None:
        install_shim()


def main(argv: list[str]) -> int:
    import pytest

    path = argv[0] if argv and not argv[0].startswith("-") else os.environ.get(ENV)
    if not path:
        raise SystemExit(f"usage: run.py PATH [pytest args]  (or set {ENV})")
    rest = argv[1:] if argv and argv[0] == path else argv
    files = upstream_tests(path)
    with tempfile.TemporaryDirectory(prefix="st-conformance-") as work:
        os.makedirs(os.path.join(work, "tests", "data"))
        for f in files:
            shutil.copy(f, work)
        with open(os.path.join(work, "pytest.ini"), "w") as ini:
            ini.write("[pytest]\n")
        cwd = os.getcwd()
        os.chdir(work)
        try:
            return int(pytest.main(["-p", "no:cacheprovider", "-c", "pytest.ini", "--rootdir", work,
                                    *[os.path.basename(f) for f in files], *rest], plugins=[_Shim()]))
        finally:
            os.chdir(cwd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
