"""Verified loading on a real GPU: the BLAKE3 kernel against the blake3 package (the published
vectors, block and tree boundaries, random sizes up to 64 MiB, a 4 GiB tensor, 20,000 tensors in
one launch, unaligned pointers, every dtype), and the loaders' checks with the kernel."""

from __future__ import annotations

import os
import random
import shutil

import blake3
import pytest

from blake3_vectors import VECTORS, vector_input

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import gdskit  # noqa: E402
import gdskit.safetensors as gs  # noqa: E402
from gdskit.engine import digest_buffers  # noqa: E402
from gdskit.errors import ChecksumMismatchError  # noqa: E402
from gdskit.formats import digest_scan  # noqa: E402
from gdskit.formats import safetensors_format as fmt  # noqa: E402

DEV = "cuda:0"


def _on_gpu(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data) or bytearray(1), dtype=torch.uint8)[:len(data)].to(DEV)


def _gpu_digests(tensors: list[torch.Tensor]) -> list[str]:
    stream = torch.cuda.current_stream().cuda_stream
    return digest_buffers([(t.data_ptr(), t.nbytes) for t in tensors], stream)


def test_the_kernel_gives_the_published_vectors():
    lengths = sorted(VECTORS)
    got = _gpu_digests([_on_gpu(vector_input(n)) for n in lengths])
    assert got == [VECTORS[n] for n in lengths]


def test_the_kernel_matches_blake3_at_boundaries_and_random_sizes_to_64_mib():
    rng = random.Random(11)
    block = 256 << 10
    lengths = [0, 1, 63, 64, 65, 1023, 1024, 1025, block - 1, block, block + 1, 2 * block - 1, 2 * block + 1,
               5 * block, 64 << 20, (64 << 20) - 1, *(rng.randrange(0, 64 << 20) for _ in range(8))]
    data = [rng.randbytes(n) for n in lengths]
    assert _gpu_digests([_on_gpu(d) for d in data]) == [blake3.blake3(d).hexdigest() for d in data]


def test_twenty_thousand_tensors_in_one_call():
    rng = random.Random(5)
    data = [rng.randbytes(rng.randrange(0, 40_000)) for _ in range(20_000)]
    flat = _on_gpu(b"".join(data))
    views, at = [], 0
    for d in data:
        views.append(flat[at:at + len(d)])
        at += len(d)
    before = gdskit.stats()
    assert _gpu_digests(views) == [blake3.blake3(d).hexdigest() for d in data]
    delta = gdskit.stats() - before
    assert delta.verified.gpu_bytes == len(flat) and delta.verified.checks == 20_000


def test_unaligned_device_pointers():
    data = os.urandom(3 << 20)
    whole = _on_gpu(data)
    for shift in (1, 2, 3, 4, 8, 15):
        assert _gpu_digests([whole[shift:]]) == [blake3.blake3(data[shift:]).hexdigest()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                                   torch.int64, torch.bool, torch.float64, torch.complex64,
                                   getattr(torch, "float8_e4m3fn", torch.float16)])
def test_every_dtype_is_hashed_as_its_bytes(dtype):
    t = (torch.randn(1001, 7, device=DEV) * 10).to(dtype)
    host = t.cpu().contiguous().view(torch.uint8).numpy().tobytes()
    assert _gpu_digests([t]) == [blake3.blake3(host).hexdigest()]


def test_a_4_gib_tensor():
    t = torch.randint(0, 256, (4 << 30,), dtype=torch.uint8, device=DEV)
    want = blake3.blake3(t.cpu().numpy(), max_threads=blake3.blake3.AUTO).hexdigest()
    assert _gpu_digests([t]) == [want]


# -- the loaders on the GPU -------------------------------------------------------------

def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return {"a": torch.randn(2048, 1024, generator=g), "b": torch.randn(77, generator=g).half(),
            "c": torch.arange(5000, dtype=torch.int64), "d": torch.empty(0), "e": torch.randn(300, 300, generator=g)}


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu") / "m.safetensors"
    gs.save_file({k: v.to(DEV) for k, v in _tensors().items()}, path, digests=True)  # digests made on the GPU
    return str(path)


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def test_gpu_loads_verified_equal_unverified_and_hash_on_the_gpu(signed):
    want = gs.load_file(signed, device=DEV)
    before = gdskit.stats()
    assert _same(gs.load_file(signed, device=DEV, verify=True), want)
    assert (gdskit.stats() - before).verified.gpu_bytes == sum(t.nbytes for t in _tensors().values())
    assert _same(dict(gs.iter_tensors(signed, device=DEV, verify=True)), want)
    target = {k: torch.zeros_like(v, device=DEV) for k, v in _tensors().items()}
    gs.load_into(target, signed, verify=True)
    assert _same(target, want)
    assert _same(_tensors(), want)


@pytest.mark.parametrize("name", ["a", "b", "c", "e"])
@pytest.mark.parametrize("reader", ["load_file", "iter_tensors", "load_into"])
def test_a_flipped_byte_is_caught_on_the_gpu(signed, tmp_path, name, reader):
    bad = str(tmp_path / "bad.safetensors")
    shutil.copyfile(signed, bad)
    header = fmt.read_header_file(bad)
    entry = next(e for e in header.entries if e.name == name)
    pos = header.data_start + entry.start + random.Random(name).randrange(entry.nbytes)
    with open(bad, "r+b") as fh:
        fh.seek(pos)
        b = fh.read(1)[0]
        fh.seek(pos)
        fh.write(bytes([b ^ 4]))
    with pytest.raises(ChecksumMismatchError) as info:
        if reader == "load_file":
            gs.load_file(bad, device=DEV, verify=True)
        elif reader == "iter_tensors":
            dict(gs.iter_tensors(bad, device=DEV, verify=True))
        else:
            gs.load_into({k: torch.zeros_like(v, device=DEV) for k, v in _tensors().items()}, bad, verify=True)
    assert info.value.tensor == name


@pytest.fixture(scope="module")
def split_signed(tmp_path_factory):
    """Twelve 8 MiB tensors and a small one: a verified GPU load hands the first over while the
    last are read (torch_io.landed_split)."""
    g = torch.Generator().manual_seed(4)
    tensors = {f"w{i:02d}": torch.randn(2 << 20, generator=g) for i in range(12)}
    tensors["bias"] = torch.randn(100, generator=g)
    path = tmp_path_factory.mktemp("split") / "m.safetensors"
    gs.save_file(tensors, path, digests=True)
    return str(path), tensors


@pytest.mark.parametrize("name", ["w00", "w05", "w10", "w11", "bias"])
@pytest.mark.parametrize("reader", ["load_file", "load_into"])
def test_a_load_hashed_while_its_last_tensors_are_read_catches_a_flip_anywhere(split_signed, tmp_path,
                                                                              monkeypatch, name, reader):
    from gdskit.formats import torch_io, verified

    monkeypatch.setattr(torch_io, "LANDED_MIN_BYTES", 1 << 20)
    path, tensors = split_signed
    started: list[list[str]] = []
    real = verified.start_tensor_digests
    monkeypatch.setattr(verified, "start_tensor_digests",
                        lambda named: started.append([n for n, _t in named]) or real(named))
    def load(p):
        if reader == "load_file":
            return gs.load_file(p, device=DEV, verify=True)
        target = {k: torch.zeros_like(v, device=DEV) for k, v in tensors.items()}
        gs.load_into(target, p, verify=True)
        return target

    out = load(path)
    assert all(torch.equal(out[k].cpu(), v) for k, v in tensors.items())
    assert started[0] == [f"w{i:02d}" for i in range(10)]  # the first 10 of 12 while the last 2 were read
    assert sorted(sum(started, [])) == sorted(tensors)
    bad = str(tmp_path / "bad.safetensors")
    shutil.copyfile(path, bad)
    header = fmt.read_header_file(bad)
    entry = next(e for e in header.entries if e.name == name)
    with open(bad, "r+b") as fh:
        fh.seek(header.data_start + entry.start + entry.nbytes // 2)
        b = fh.read(1)[0]
        fh.seek(-1, 1)
        fh.write(bytes([b ^ 16]))
    from gdskit.engine import cuda

    live: set[int] = set()

    class Counted(cuda.DeviceArray):  # the digests' scratch memory, counted while it lives
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            live.add(id(self))

        def free(self):
            live.discard(id(self))
            super().free()

    monkeypatch.setattr(cuda, "DeviceArray", Counted)
    with pytest.raises(ChecksumMismatchError) as info:
        load(bad)
    assert info.value.tensor == name
    assert not live  # no digest's scratch left behind


def test_file_read_into_device_memory_checks_chunks(tmp_path):
    path = tmp_path / "raw.bin"
    data = os.urandom(5 << 20)
    path.write_bytes(data)
    digest_scan.make_manifests([str(path)], chunk_bytes=1 << 20)
    out = torch.empty(5 << 20, dtype=torch.uint8, device=DEV)
    with gdskit.open(str(path)) as f:
        assert f.read(out, verify=True) == 5 << 20
    assert out.cpu().numpy().tobytes() == data
    st = os.stat(path)
    flipped = bytearray(data)
    flipped[(3 << 20) + 5] ^= 1
    path.write_bytes(flipped)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with gdskit.open(str(path)) as f, pytest.raises(ChecksumMismatchError) as info:
        f.read(out, verify=True)
    assert info.value.byte_range == (3 << 20, 4 << 20)
