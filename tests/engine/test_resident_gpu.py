"""The resident loader on a real GPU: ``gdskit serve --device 0`` in its own process reads into
this process's tensors through CUDA IPC; every tensor compared with the reference library's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gdskit.errors import ResidentLoaderError
from gdskit.settings import settings
from resident_server import ServerProcess, runtime_dir  # noqa: F401 - the fixture

pytestmark = [pytest.mark.gpu, pytest.mark.torch]


@pytest.fixture
def server(runtime_dir):
    s = ServerProcess(runtime_dir, "--device", "0").wait_listening(timeout=120)
    yield s
    s.stop()


@pytest.fixture
def checkpoint(runtime_dir):
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    tensors = {f"big.{i}": torch.randn(5_000_000 + 7 * i, generator=g).to(torch.bfloat16) for i in range(3)}
    tensors.update({f"small.{i}": torch.randint(-100, 100, (1 + 97 * i,), generator=g, dtype=torch.int32)
                    for i in range(300)})
    tensors["odd"] = torch.randn(3, 5, 7, generator=g, dtype=torch.float64)
    tensors["empty"] = torch.empty(0, 4)
    path = os.path.join(runtime_dir, "model.safetensors")
    save_file(tensors, path)
    return path


def _same(got, path, keys=None):
    import torch
    from safetensors.torch import load_file as reference

    want = reference(path)
    names = sorted(keys if keys is not None else want)
    assert sorted(got) == names
    for n in names:
        assert got[n].device.type == "cuda"
        assert got[n].dtype == want[n].dtype and got[n].shape == want[n].shape
        assert torch.equal(got[n].cpu().view(torch.uint8) if got[n].numel() else got[n].cpu(),
                           want[n].view(torch.uint8) if want[n].numel() else want[n]), n


def test_a_load_through_the_resident_loader_gives_the_reference_tensors(server, checkpoint):
    import gdskit.safetensors as gst
    from safetensors import safe_open

    with settings.set(resident="require"):
        got, stats = gst.load_file(checkpoint, device="cuda:0", return_stats=True)
        _same(got, checkpoint)
        keys = ["big.1", "small.5", "odd"]
        _same(gst.load_file(checkpoint, device="cuda:0", keys=keys), checkpoint, keys)
    with safe_open(checkpoint, "pt") as f:
        nbytes = sum(f.get_tensor(n).nbytes for n in f.keys())
    assert sum(e.bytes for e in stats.entries) == nbytes  # the loader's ledger rows came back
    server.stop()
    served = [e for e in server.events if e["event"] == "served"]
    assert [e["bytes"] for e in served][0] == nbytes and len(served) == 2


def test_a_verified_load_reads_in_this_process(server, checkpoint):
    import gdskit.safetensors as gst

    subprocess.run([sys.executable, "-m", "gdskit", "digest", checkpoint], check=True, capture_output=True)
    got = gst.load_file(checkpoint, device="cuda:0", verify=True)
    _same(got, checkpoint)
    server.stop()
    assert "served" not in server.kinds()


_EXPANDABLE = """
import os, sys, torch
torch.empty(1, device="cuda")
import gdskit.safetensors as gst
from gdskit.errors import ResidentLoaderError
try:
    got = gst.load_file(sys.argv[1], device="cuda:0")
except ResidentLoaderError as exc:
    print("ERROR", exc.reason)
else:
    print("LOADED", sum(t.nbytes for t in got.values()))
"""


@pytest.mark.parametrize("mode", ["auto", "require"])
def test_memory_that_cannot_be_shared_is_read_here_or_refused_by_name(server, checkpoint, mode):
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "GDSKIT_RESIDENT": mode}
    out = subprocess.run([sys.executable, "-c", _EXPANDABLE, checkpoint], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    if mode == "auto":
        assert out.stdout.startswith("LOADED")
    else:
        assert out.stdout.startswith("ERROR"), out.stdout
    server.stop()
    assert "served" not in server.kinds()


def test_require_without_a_loader_says_why(runtime_dir, checkpoint):
    import gdskit.safetensors as gst

    with settings.set(resident="require"), pytest.raises(ResidentLoaderError, match="no resident loader"):
        gst.load_file(checkpoint, device="cuda:0")


_LIGHT = """
import sys, torch
torch.empty(1, device="cuda")
import gdskit.safetensors as gst
got = gst.load_file(sys.argv[1], device="cuda:0")
heavy = sorted(m for m in ("gdskit.formats.torch_io", "gdskit.engine.pool", "gdskit.engine.ledger",
                           "gdskit.engine.backends") if m in sys.modules)
print("HEAVY", heavy, sum(t.nbytes for t in got.values()))
"""


def test_a_load_the_loader_serves_imports_none_of_the_engines_reading_modules(server, checkpoint):
    env = {**os.environ, "GDSKIT_RESIDENT": "require"}
    out = subprocess.run([sys.executable, "-c", _LIGHT, checkpoint], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split(" ", 2)[:2] == ["HEAVY", "[]"], out.stdout
    server.stop()
    assert "served" in server.kinds()


def test_load_into_fills_its_gpu_targets_through_the_loader_and_stages_the_rest_here(server, checkpoint):
    import torch
    import gdskit.safetensors as gst
    from safetensors.torch import load_file as reference

    want = reference(checkpoint)
    target = {n: torch.full_like(t, 7, device="cuda:0") for n, t in want.items()}
    strided = torch.zeros(7, 5, 3, dtype=torch.float64, device="cuda:0").transpose(0, 2)  # not contiguous
    target["odd"] = strided
    ptrs = {n: t.data_ptr() for n, t in target.items()}
    with settings.set(resident="require"):
        result, stats = gst.load_into(target, checkpoint, return_stats=True)
    assert result == ([], [])
    for n, t in want.items():
        assert target[n].data_ptr() == ptrs[n]
        assert torch.equal(target[n].cpu(), t), n
    served_bytes = sum(t.nbytes for n, t in want.items() if n != "odd")
    assert sum(e.bytes for e in stats.entries) == served_bytes + want["odd"].nbytes
    server.stop()
    served = [e for e in server.events if e["event"] == "served"]
    assert [e["bytes"] for e in served] == [served_bytes]  # the staged fill was read here


@pytest.mark.parametrize("how", ["digests", "sha256"])
def test_a_verified_load_into_reads_in_this_process(server, checkpoint, how):
    import hashlib
    import torch
    import gdskit.safetensors as gst
    from safetensors.torch import load_file as reference

    if how == "digests":
        subprocess.run([sys.executable, "-m", "gdskit", "digest", checkpoint], check=True, capture_output=True)
        verify = True
    else:
        with open(checkpoint, "rb") as fh:
            verify = "sha256:" + hashlib.sha256(fh.read()).hexdigest()
    want = reference(checkpoint)
    target = {n: torch.empty_like(t, device="cuda:0") for n, t in want.items()}
    gst.load_into(target, checkpoint, verify=verify)
    assert all(torch.equal(target[n].cpu(), t) for n, t in want.items())
    server.stop()
    assert "served" not in server.kinds()


_LARGE = """
import sys, torch
import gdskit.safetensors as gst
from safetensors.torch import load_file
got = gst.load_file(sys.argv[1], device="cuda:0")
want = load_file(sys.argv[1])
assert all(torch.equal(got[n].cpu(), t) for n, t in want.items())
print("OWN", len({t.untyped_storage().data_ptr() for t in got.values()}))
"""


def test_large_tensors_made_for_the_loader_are_one_allocation_it_maps_once(server, runtime_dir):
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(4)
    tensors = {f"w.{i}": torch.randn(6_000_000 + i, generator=g) for i in range(4)}  # 24 MB each
    path = os.path.join(runtime_dir, "large.safetensors")
    save_file(tensors, path)
    env = {**os.environ, "GDSKIT_RESIDENT": "require"}  # a fresh process: nothing cached by its allocator yet
    out = subprocess.run([sys.executable, "-c", _LARGE, path], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["OWN", "4"]  # each tensor its own memory
    server.stop()
    served = [e for e in server.events if e["event"] == "served"]
    assert [e["segments"] for e in served] == [1]
