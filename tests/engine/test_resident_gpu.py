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


@pytest.fixture
def shards(runtime_dir):
    """A checkpoint of three shards and its index (the second shard all small tensors)."""
    import json

    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(6)
    parts = [{f"a.{i}": torch.randn(2_000_000 + i, generator=g).to(torch.bfloat16) for i in range(3)},
             {f"b.{i}": torch.randint(-9, 9, (50 + i,), generator=g, dtype=torch.int16) for i in range(40)},
             {"c.w": torch.randn(700, 900, generator=g), "c.empty": torch.empty(0, 3)}]
    weight_map = {}
    for k, part in enumerate(parts):
        name = f"model-{k + 1:05d}-of-00003.safetensors"
        save_file(part, os.path.join(runtime_dir, name))
        weight_map.update(dict.fromkeys(part, name))
    index = os.path.join(runtime_dir, "model.safetensors.index.json")
    with open(index, "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh)
    return index, [os.path.join(runtime_dir, f"model-{k + 1:05d}-of-00003.safetensors") for k in range(3)]


def test_a_sharded_checkpoint_goes_to_the_loader_in_one_request(server, shards):
    """load_file and load_into each send every shard in one request, and get the reference's bytes."""
    import torch
    import gdskit.safetensors as gst
    from safetensors.torch import load_file as reference

    index, files = shards
    want = {n: t for f in files for n, t in reference(f).items()}
    with settings.set(resident="require"):
        got = gst.load_file(index, device="cuda:0")
        target = {n: torch.full_like(t, 3, device="cuda:0") for n, t in want.items()}
        assert gst.load_into(target, index) == ([], [])
    assert sorted(got) == sorted(want)
    for n, t in want.items():
        assert got[n].dtype == t.dtype and got[n].shape == t.shape and torch.equal(got[n].cpu(), t), n
        assert torch.equal(target[n].cpu(), t), n
    server.stop()
    served = [e for e in server.events if e["event"] == "served"]
    nbytes = sum(t.nbytes for t in want.values())
    assert [(e["files"], e["bytes"]) for e in served] == [(3, nbytes), (3, nbytes)]


@pytest.fixture
def npy_files(runtime_dir):
    """``.npy`` files of over 1 MiB (read by the loader: plain, Fortran order, big-endian), a raw
    file, and a small ``.npy`` file (read whole in this process)."""
    import numpy as np

    rng = np.random.default_rng(8)
    arrays = {"plain.npy": rng.standard_normal((1000, 300)).astype(np.float32),
              "fortran.npy": np.asfortranarray(rng.integers(-999, 999, (700, 900)).astype(np.int16)),
              "swapped.npy": rng.standard_normal((400, 1000)).astype(">f4"),
              "small.npy": np.arange(25, dtype=np.int64)}
    paths = []
    for name, a in arrays.items():
        paths.append(os.path.join(runtime_dir, name))
        np.save(paths[-1], a)
    raw = os.path.join(runtime_dir, "raw.bin")
    with open(raw, "wb") as fh:
        fh.write(rng.integers(0, 256, 3_000_001, dtype=np.uint8).tobytes())
    return paths + [raw]


def _same_as_numpy(got, paths):
    import numpy as np
    import torch

    for p in paths:
        t = got[p]
        assert t.device.type == "cuda", p
        if p.endswith(".npy"):
            want = np.load(p)
            assert tuple(t.shape) == want.shape and t.stride() == tuple(s // want.itemsize for s in want.strides), p
            assert np.array_equal(t.cpu().numpy(), want.astype(want.dtype.newbyteorder("="))), p
        else:
            with open(p, "rb") as fh:
                assert t.dtype == torch.uint8 and bytes(t.cpu().numpy()) == fh.read(), p


def test_preload_reads_its_larger_files_through_the_loader_in_one_request(server, npy_files):
    import gdskit.data

    with settings.set(resident="require"):
        got, stats = gdskit.data.preload(npy_files, "cuda:0", progress=False, return_stats=True)
    _same_as_numpy(got, npy_files)
    large = [p for p in npy_files if os.path.getsize(p) > 1 << 20]
    assert len(large) == 4
    small = [p for p in npy_files if p not in large]  # read whole here: header and array
    assert sum(e.bytes for e in stats.entries) == (sum(os.path.getsize(p) for p in small)
                                                   + sum(got[p].nbytes for p in large))
    server.stop()
    served = [e for e in server.events if e["event"] == "served"]
    assert [(e["files"], e["bytes"]) for e in served] == [(4, sum(got[p].nbytes for p in large))]


def test_a_verified_preload_reads_in_this_process(server, npy_files):
    import gdskit.data

    subprocess.run([sys.executable, "-m", "gdskit", "digest", *npy_files], check=True, capture_output=True)
    _same_as_numpy(gdskit.data.preload(npy_files, "cuda:0", progress=False, verify=True), npy_files)
    server.stop()
    assert "served" not in server.kinds()


_LIGHT_PRELOAD = """
import sys, torch
torch.empty(1, device="cuda")
import gdskit.data
got = gdskit.data.preload(sys.argv[1:], "cuda:0", progress=False)
heavy = sorted(m for m in ("gdskit.formats.torch_io", "gdskit.engine.pool", "gdskit.engine.ledger",
                           "gdskit.engine.backends", "gdskit.engine.whole_files") if m in sys.modules)
print("HEAVY", heavy, sum(t.nbytes for t in got.values()))
"""


def test_a_preload_the_loader_serves_imports_none_of_the_engines_reading_modules(server, npy_files):
    large = [p for p in npy_files if os.path.getsize(p) > 1 << 20]
    env = {**os.environ, "GDSKIT_RESIDENT": "require"}
    out = subprocess.run([sys.executable, "-c", _LIGHT_PRELOAD, *large], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split(" ", 2)[:2] == ["HEAVY", "[]"], out.stdout
    server.stop()
    assert [e["files"] for e in server.events if e["event"] == "served"] == [4]


@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_placements_are_read_by_the_loader_into_their_parameters(server, runtime_dir, tp):
    """Stand-in vLLM layers on the GPU (fused QKV and gate-up): at tp=1 the loader's reads into
    the parameters give the bytes an in-process read gives, every file in one request; at tp=2,
    whose row-parallel shards are a run per row, the plan is read in this process."""
    import pathlib
    import torch
    import vllm_fake_layers as fake
    from vllm_llama_shapes import Cfg, save_checkpoint
    from gdskit.formats.placement_exec import plan_model, read_placements
    from gdskit.formats.shard_index import index_checkpoint

    cfg = Cfg(hidden=64, heads=8, kv_heads=2, head_size=8, v_head_size=8, intermediate=96, vocab=100, tied=False,
              dtype="BF16", layers=2)
    root = pathlib.Path(runtime_dir) / f"ckpt-{tp}"
    root.mkdir()
    index = index_checkpoint(str(save_checkpoint(root, cfg)))
    sizes = {p: h.file_size for p, h in index.headers}
    got = {}
    for mode in ("off", "require"):
        model = fake.LlamaForCausalLM(cfg, 0, tp).to("cuda:0")
        for p in model.parameters():
            p.data.fill_(7)
        plan, params = plan_model(model, index)
        assert plan.placements
        with settings.set(resident=mode):
            read = read_placements(plan, params, sizes)
        assert read == sum(pl.nbytes for pl in plan.placements)
        got[mode] = {n: t.detach().cpu().view(-1).view(torch.uint8) for n, t in params.items()}
    assert sorted(got["off"]) == sorted(got["require"])
    for n, want in got["off"].items():
        assert torch.equal(got["require"][n], want), n
    server.stop()
    assert [e["files"] for e in server.events if e["event"] == "served"] == ([2] if tp == 1 else [])
