from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

# What gdskit keeps between processes (compiled kernels, parsed headers) goes to a folder of
# this test session's own, never into the caches of whoever runs the tests; child processes
# the tests start inherit it.
_CACHE_HOME = tempfile.mkdtemp(prefix="gdskit-test-cache-")
os.environ["XDG_CACHE_HOME"] = _CACHE_HOME
atexit.register(shutil.rmtree, _CACHE_HOME, True)


def _gpu_present() -> bool:
    try:
        from gdskit.engine import cuda
        return cuda.device_count() > 0
    except Exception:
        return False


def _torch_present() -> bool:
    try:
        import torch  # noqa: F401
        return True
    except Exception:
        return False


HAS_GPU = _gpu_present()
HAS_TORCH = _torch_present()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_torch = pytest.mark.skip(reason="needs torch")
    skip_stand_in = pytest.mark.skip(reason="a real GPU is present: the test_gpu_* tests cover it")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        if "stand_in_gpu" in item.keywords:
            if HAS_GPU:
                item.add_marker(skip_stand_in)
            else:
                item.fixturenames.insert(0, "fake_cuda")  # every such test runs on the stand-in driver
        if "torch" in item.keywords and not HAS_TORCH:
            item.add_marker(skip_torch)


# -- the stand-in CUDA driver and libcufile (tests/stand_ins/fake_cuda.py, tests/stand_ins/fake_cufile.py) --------------

_STAND_INS: list = []  # the stand-in drivers in use now (each test checks they saw no breach)


def _breaches(fake) -> list[str]:
    found = fake.take_violations()
    if fake.pending():
        found.append(f"{fake.pending()} copies still queued when the test ended: gdskit returned "
                     "before waiting for them")
    return found


@pytest.fixture(autouse=True)
def _stand_in_rules():
    """Fail a test during which the stand-in CUDA driver saw CUDA's ordering rules broken, even
    where the engine swallowed the exception the driver raised."""
    yield
    for fake in _STAND_INS:
        found = _breaches(fake)
        if found:
            pytest.fail("the stand-in CUDA driver saw CUDA's rules broken:\n  " + "\n  ".join(found), pytrace=False)


@pytest.fixture(scope="module")
def fake_cuda():
    """gdskit on a stand-in CUDA driver with one device, for every test of the module."""
    from gdskit.engine import cuda

    from fake_cuda import FakeDriver

    fake = FakeDriver()
    with cuda.use_driver(fake):  # frees the workers and lanes of the driver before, and then the stand-in's
        _STAND_INS.append(fake)
        try:
            yield fake
        finally:
            _STAND_INS.remove(fake)
    found = _breaches(fake)
    assert not found, "the stand-in CUDA driver saw CUDA's rules broken:\n  " + "\n  ".join(found)


@pytest.fixture
def stand_in_gpus():
    """``stand_in_gpus(fake)``: gdskit on the stand-in driver ``fake`` (several devices, say) until
    the test ends, held to CUDA's rules as ``fake_cuda``'s is. Stand-in GPUs sit on no NUMA node of
    this machine: none is looked up."""
    import contextlib

    from gdskit.engine import cuda, numa

    made: list = []
    with contextlib.ExitStack() as stack:

        def use(fake):
            stack.enter_context(numa.use_facts(None))
            stack.enter_context(cuda.use_driver(fake))
            _STAND_INS.append(fake)
            made.append(fake)
            return fake

        try:
            yield use
            found = [b for fake in made for b in _breaches(fake)]
            if found:
                pytest.fail("the stand-in CUDA driver saw CUDA's rules broken:\n  " + "\n  ".join(found),
                            pytrace=False)
        finally:
            for fake in made:
                _STAND_INS.remove(fake)


@pytest.fixture
def compat_cufile(monkeypatch, fake_cuda):
    """cuFile that works only in compat mode, as on a machine without nvidia-fs or P2PDMA."""
    from fake_cufile import FakeCufile
    from fake_stack import use_cufile

    fake = FakeCufile(route="posix")
    lib = use_cufile(monkeypatch, fake)
    yield fake
    lib.close()


@pytest.fixture
def route_is():
    """``route_is(route)``: every part of gdskit sees ``route`` (a ``DirectRoute``) as this
    machine's direct route until the test ends (``gdskit.engine.direct_path.override``)."""
    from gdskit.engine import direct_path

    made = []

    def use(route):
        made.append(direct_path.override(route))
        return route

    yield use
    for o in reversed(made):
        o.__exit__(None, None, None)


@pytest.fixture
def stats_dir(tmp_path, monkeypatch):
    """Where processes publish their figures for ``gdskit stats`` (GDSKIT_STATS_DIR), private to the test."""
    d = tmp_path / "stats"
    monkeypatch.setenv("GDSKIT_STATS_DIR", str(d))
    return d

