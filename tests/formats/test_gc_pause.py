"""Checkpoint loads hold off cyclic garbage collection while they run and give it back as they found it."""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")

import gdskit.safetensors as gs  # noqa: E402
import gdskit.torch as gt  # noqa: E402
from gdskit.errors import FormatError  # noqa: E402
from gdskit.formats.gc_pause import collector_paused  # noqa: E402


@pytest.fixture
def files(tmp_path):
    tensors = {f"t{i}": torch.full((10,), float(i)) for i in range(5)}
    st, pt = tmp_path / "a.safetensors", tmp_path / "a.pt"
    gs.save_file(tensors, st)
    gt.save(tensors, pt)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    return st, pt, bad


@pytest.fixture
def restore_gc():
    was = gc.isenabled()
    yield
    gc.enable() if was else gc.disable()


def test_paused_inside_and_restored_after(restore_gc):
    gc.enable()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError), collector_paused():
        raise KeyError("x")
    assert gc.isenabled()


def test_a_caller_that_turned_it_off_keeps_it_off(restore_gc):
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()


@pytest.mark.parametrize("enabled", [True, False])
def test_loads_leave_the_collector_as_they_found_it(files, restore_gc, enabled):
    st, pt, bad = files
    gc.enable() if enabled else gc.disable()
    seen = []
    out = gs.load_file(st, device="cpu", progress=lambda done, total: seen.append(gc.isenabled()))
    assert torch.equal(out["t3"], torch.full((10,), 3.0))
    assert gc.isenabled() is enabled
    assert seen and not any(seen)  # the load itself ran with collections held off
    assert torch.equal(gt.load(pt, map_location="cpu")["t4"], torch.full((10,), 4.0))
    assert gc.isenabled() is enabled
    with pytest.raises(FormatError):
        gs.load_file(bad, device="cpu")
    assert gc.isenabled() is enabled
