"""The GPU digest's host side on the stand-in driver: the table upload, the two launches and
their parameters, the scratch memory and the read-back, with the kernels' own C source (compiled
for the CPU) doing the stand-in GPU's work on its "device" memory."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import random
import struct

import blake3
import pytest
from cpu_kernel import build_with_harness

import gdskit
from gdskit.engine import cuda, digest_buffers
from gdskit.engine.gpu_hash import digest_device, provide_image
from gdskit.engine.gpu_hash_kernel import BLOCK_CHUNKS
from gdskit.errors import ChecksumMismatchError, CudaError

from fake_cuda import FakeDriver

# Each kernel's body, thread block by thread block and thread by thread (a __syncthreads between
# phases on the GPU: here every thread of a phase runs before the next phase).
_HARNESS = r"""
#include <vector>
#define __device__
#define __forceinline__ inline
#define __global__
struct uint4 { unsigned x, y, z, w; };
#define BLAKE3_HOST_TEST
#include "kernel.cu"
extern "C" void run_blocks(u64 grid, u64 items, int n_items, u64 block_base, u64 block_cvs, u64 roots) {
    const Item* it = (const Item*)items; const u64* base = (const u64*)block_base;
    u32* cvs = (u32*)block_cvs; u32* out = (u32*)roots;
    std::vector<u32> nodes(8 * BLOCK_CHUNKS);
    for (u64 b = 0; b < grid; ++b) {
        int item = item_of(base, n_items, b);
        u32 k = 0;
        for (u32 t = 0; t < BLOCK_CHUNKS; ++t) k = block_chunks(it, base, item, b, t, nodes.data());
        int single = base[item + 1] - base[item] == 1;
        for (u32 level = 0; level < 8; ++level)
            for (u32 t = 0; t < BLOCK_CHUNKS; ++t) block_level(k, level, t, single, nodes.data());
        for (u32 t = 0; t < 8; ++t) {
            cvs[8 * b + t] = nodes[t * BLOCK_CHUNKS];
            if (single) out[8 * item + t] = nodes[t * BLOCK_CHUNKS];
        }
    }
}
extern "C" void run_tree(u64 grid, int n_items, u64 block_base, u64 block_cvs, u64 roots) {
    const u64* base = (const u64*)block_base; u32* cvs = (u32*)block_cvs; u32* out = (u32*)roots;
    for (u64 item = 0; item < grid; ++item) {
        u64 b0 = base[item], m = base[item + 1] - b0;
        if (m <= 1) continue;
        for (u64 stride = 1; stride < m; stride <<= 1) {
            u64 pairs = ((m + stride - 1) / stride) / 2;
            for (u64 p = 0; p < pairs; ++p) tree_pair(cvs, b0, m, stride, p, out + 8 * item);
        }
    }
}
"""


def _fake_cubin(*names: str, arch: int = 90) -> bytes:
    """A minimal cubin as the driver checks one: an ELF64 header for EM_CUDA naming ``arch`` (ELF
    ABI version 8: the architecture in bits 8-15 of the flags), the kernels' names, and a section
    table of the null section alone that ends the image."""
    body = b"\0".join(n.encode() for n in names) + b"\0"
    shoff = 64 + len(body)
    head = bytearray(64)
    head[:9] = b"\x7fELF\x02\x01\x01\x41\x08"
    struct.pack_into("<HHI", head, 0x10, 2, 190, 1)
    struct.pack_into("<Q", head, 0x28, shoff)
    struct.pack_into("<IH", head, 0x30, arch << 8, 64)
    struct.pack_into("<HH", head, 0x3A, 64, 1)
    return bytes(head) + body + bytes(64)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    return build_with_harness(tmp_path_factory.mktemp("kernels"), _HARNESS)


def _with_kernels(fake: FakeDriver, kernels) -> FakeDriver:
    """``fake`` running the kernels' C source for the two launches (what the GPU would do)."""
    u64, i32 = ctypes.c_uint64, ctypes.c_int32

    def blocks(grid, block, items, n, base, cvs, roots):
        assert block == (BLOCK_CHUNKS, 1, 1) and grid[1:] == (1, 1)
        table = (ctypes.c_uint64 * (2 * n)).from_address(items)
        for i in range(n):  # the kernel reads only device memory: each item, its table, its outputs
            assert table[2 * i + 1] == 0 or fake.is_device_memory(table[2 * i], table[2 * i + 1])
        assert all(fake.is_device_memory(p, 8) for p in (items, base, cvs, roots))
        kernels.run_blocks(u64(grid[0]), u64(items), i32(n), u64(base), u64(cvs), u64(roots))

    def tree(grid, block, n, base, cvs, roots):
        assert block == (BLOCK_CHUNKS, 1, 1) and grid[0] == n
        kernels.run_tree(u64(grid[0]), i32(n), u64(base), u64(cvs), u64(roots))

    fake.register_kernel("blake3_blocks", [u64, i32, u64, u64, u64], blocks)
    fake.register_kernel("blake3_tree", [i32, u64, u64, u64], tree)
    return fake


@pytest.fixture()
def gpu(kernels, stand_in_gpus):
    fake = stand_in_gpus(_with_kernels(FakeDriver(), kernels))
    provide_image(fake.compute_capability, _fake_cubin("blake3_blocks", "blake3_tree"))
    return fake


def _device_copy(data: bytes) -> cuda.DeviceArray:
    arr = cuda.DeviceArray(len(data), 0)
    arr.copy_from_host(data)
    return arr


def test_many_buffers_in_one_launch_pair(gpu):
    rng = random.Random(3)
    data = [rng.randbytes(n) for n in (0, 1, 1024, 1025, 262144, 262145, 600_000, 3 << 20)]
    arrays = [_device_copy(d) for d in data]
    try:
        before = gpu.calls.get("cuLaunchKernel", 0)
        got = digest_device([(a.ptr, len(d)) for a, d in zip(arrays, data)], 0)
        assert got == [blake3.blake3(d).hexdigest() for d in data]
        assert gpu.calls["cuLaunchKernel"] - before == 2
    finally:
        for a in arrays:
            a.free()
    assert gpu.live_allocations() == 0  # the scratch memory is freed


def test_host_and_device_buffers_are_each_hashed_where_they_lie(gpu):
    on_host = bytearray(os.urandom(5000))
    dev_data = os.urandom(300_000)
    arr = _device_copy(dev_data)
    try:
        host_ptr = ctypes.addressof(ctypes.c_char.from_buffer(on_host))
        before = gdskit.stats()
        got = digest_buffers([(host_ptr, len(on_host)), (arr.ptr, len(dev_data))])
        assert got == [blake3.blake3(bytes(on_host)).hexdigest(), blake3.blake3(dev_data).hexdigest()]
        assert (gdskit.stats() - before).verified.gpu_bytes == len(dev_data)
    finally:
        arr.free()


def test_a_failed_launch_is_a_cuda_error_and_frees_its_scratch(gpu):
    data = os.urandom(10_000)
    arr = _device_copy(data)
    gpu.fail["cuLaunchKernel"] = gpu.CUresult.CUDA_ERROR_LAUNCH_FAILED
    try:
        with pytest.raises(CudaError):
            digest_device([(arr.ptr, len(data))], 0)
    finally:
        gpu.fail.pop("cuLaunchKernel")
        arr.free()
    assert gpu.live_allocations() == 0


def test_file_read_into_device_memory_is_checked(gpu, tmp_path):
    from gdskit.formats import digest_scan

    path = tmp_path / "raw.bin"
    data = bytearray(os.urandom(50_000))
    path.write_bytes(data)
    digest_scan.make_manifests([str(path)], chunk_bytes=16 << 10)
    out = cuda.DeviceArray(len(data), 0)
    try:
        with gdskit.open(str(path)) as f:
            assert f.read(out, verify=True) == len(data)
        assert out.to_numpy().tobytes() == bytes(data)
        st = os.stat(path)
        data[40_000] ^= 2
        path.write_bytes(data)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        with gdskit.open(str(path)) as f, pytest.raises(ChecksumMismatchError) as info:
            f.read(out, verify=True)
        assert info.value.byte_range == (32 << 10, 48 << 10)
    finally:
        out.free()


def test_gdskit_digest_on_a_gpu_writes_the_cpu_digests(gpu, tmp_path):
    from gdskit.formats import digest_scan

    np = pytest.importorskip("numpy")
    np.save(tmp_path / "x.npy", np.arange(70_000, dtype=np.int64))
    (tmp_path / "r.bin").write_bytes(os.urandom(300_001))
    on_gpu = {os.path.basename(r.path): r for r in digest_scan.make_manifests([str(tmp_path)], 64 << 10, device=0)}
    from gdskit.verify import read_manifest

    gpu_manifest = read_manifest(tmp_path / "gdskit-digest.json")
    digest_scan.make_manifests([str(tmp_path)], 64 << 10)
    assert read_manifest(tmp_path / "gdskit-digest.json") == gpu_manifest
    assert on_gpu["r.bin"].digest == blake3.blake3((tmp_path / "r.bin").read_bytes()).hexdigest()
    assert gpu.live_allocations(gpu.CUmemorytype.CU_MEMORYTYPE_DEVICE) == 0  # the engine's pinned lanes stay


def test_gdskit_digest_check_on_a_gpu_finds_what_the_cpu_finds(gpu, tmp_path):
    from gdskit.formats import digest_scan

    good, bad = tmp_path / "good.bin", tmp_path / "bad.bin"
    for p in (good, bad):
        p.write_bytes(os.urandom(200_000))
    digest_scan.make_manifests([str(tmp_path)], 64 << 10)
    data = bytearray(bad.read_bytes())
    st = os.stat(bad)
    data[150_000] ^= 1  # chunk 2 of 64 KiB; the size and time the manifest records kept
    bad.write_bytes(data)
    os.utime(bad, ns=(st.st_atime_ns, st.st_mtime_ns))
    on_gpu = {os.path.basename(r.path): r for r in digest_scan.check_manifests([str(tmp_path)], device=0)}
    on_cpu = {os.path.basename(r.path): r for r in digest_scan.check_manifests([str(tmp_path)])}
    assert on_gpu == {name: dataclasses.replace(r, seconds=on_gpu[name].seconds) for name, r in on_cpu.items()}
    assert on_gpu["good.bin"].status == "ok"
    assert (on_gpu["bad.bin"].status, on_gpu["bad.bin"].bad) == ("mismatch", ("chunk 2", "file"))
    assert gpu.live_allocations(gpu.CUmemorytype.CU_MEMORYTYPE_DEVICE) == 0


def test_a_file_the_gpu_cannot_hold_is_refused_by_name_with_the_cpu_as_the_way_out(gpu, tmp_path):
    from gdskit.formats import digest_scan

    path = tmp_path / "big.bin"
    path.write_bytes(os.urandom(100_000))
    gpu.fail["cuMemAlloc"] = gpu.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    try:
        with pytest.raises(CudaError, match=r"big\.bin \(100000 bytes\) does not fit in GPU 0's memory.*CPU") as info:
            digest_scan.make_manifests([str(path)], device=0)
    finally:
        gpu.fail.pop("cuMemAlloc")
    assert info.value.code == "CUDA_ERROR_OUT_OF_MEMORY"
    assert not os.path.exists(str(path) + ".gdskit-digest.json")
    assert gpu.live_allocations(gpu.CUmemorytype.CU_MEMORYTYPE_DEVICE) == 0


def _image_or_none(major: int, minor: int) -> bytes | None:
    from gdskit.engine.gpu_hash import image_for
    from gdskit.errors import MissingDependencyError

    try:
        return image_for(major, minor)
    except (MissingDependencyError, CudaError):  # nothing cached, and no NVRTC (or none for this GPU) here
        return None


def test_a_cached_image_is_used_only_where_it_is_this_users_alone(tmp_path, monkeypatch):
    from gdskit.engine.gpu_hash import cache_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    image = _fake_cubin("blake3_blocks", "blake3_tree")
    # A capability no other test provides an image for: each case starts from the cache alone.
    shared = cache_path(3, 1)
    os.makedirs(os.path.dirname(shared), mode=0o700)
    with open(shared, "wb") as fh:
        fh.write(image)
    os.chmod(shared, 0o620)  # writable by its group: never run
    assert _image_or_none(3, 1) != image
    private = cache_path(3, 2)
    with open(private, "wb") as fh:
        fh.write(image)
    os.chmod(private, 0o600)
    assert _image_or_none(3, 2) == image
    in_open_folder = cache_path(3, 3)
    with open(in_open_folder, "wb") as fh:
        fh.write(image)
    os.chmod(in_open_folder, 0o600)
    os.chmod(os.path.dirname(private), 0o777)  # a folder others may write into: nothing in it is run
    assert _image_or_none(3, 3) != image


def test_the_kernel_cache_writes_only_into_the_folder_it_found_private(tmp_path, monkeypatch):
    """Whoever can change a folder above the cache swaps the cache folder for a link to the
    victim's folder between the check and the write: the image still lands in the folder that
    was checked, and the victim's file is untouched; a link at the folder's name is refused."""
    import os

    from gdskit import durable
    from gdskit.engine import gpu_hash

    parent = tmp_path / "shared"
    parent.mkdir()
    parent.chmod(0o777)
    kernels = parent / "kernels"
    kernels.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "blake3.cubin").write_bytes(b"the victim's own file")
    real_private = durable._private
    swapped = []

    def private_then_swap(st):
        ok = real_private(st)
        if not swapped:  # the race, won: the folder checked is replaced by a link
            swapped.append(True)
            os.rename(kernels, parent / "checked")
            os.symlink(victim, kernels)
        return ok

    monkeypatch.setattr(durable, "_private", private_then_swap)
    gpu_hash._cache_image(str(kernels / "blake3.cubin"), b"\x7fELF an image")
    assert (victim / "blake3.cubin").read_bytes() == b"the victim's own file"
    assert (parent / "checked" / "blake3.cubin").read_bytes() == b"\x7fELF an image"
    monkeypatch.setattr(durable, "_private", real_private)
    gpu_hash._cache_image(str(kernels / "blake3.cubin"), b"\x7fELF another")  # the link itself: refused
    assert (victim / "blake3.cubin").read_bytes() == b"the victim's own file"
    assert gpu_hash._cached_image(str(kernels / "blake3.cubin")) is None


def test_a_gpu_answer_short_of_a_digest_is_an_error_not_a_shorter_list(gpu, monkeypatch):
    """Every buffer gets its digest or the call fails: a list one short would pair the names after
    the gap with their neighbours' digests, and leave the last tensor unchecked."""
    from gdskit.engine import digests

    data = [os.urandom(3000), os.urandom(5000)]
    arrays = [_device_copy(d) for d in data]
    real = digests.launch_cuda_digests

    class OneShort:
        def __init__(self, pending):
            self.pending = pending

        def wait(self):
            return self.pending.wait()[:-1]

        def abandon(self):
            self.pending.abandon()

    monkeypatch.setattr(digests, "launch_cuda_digests", lambda items, device, stream: OneShort(real(items, device, stream)))
    try:
        with pytest.raises(CudaError):
            digest_buffers([(a.ptr, len(d)) for a, d in zip(arrays, data)])
        with pytest.raises(CudaError):
            digest_buffers([(a.ptr, len(d)) for a, d in zip(arrays, data)], 0, 0)
    finally:
        for a in arrays:
            a.free()
    assert gpu.live_allocations(gpu.CUmemorytype.CU_MEMORYTYPE_DEVICE) == 0  # no scratch left behind


def _nvrtc_archs() -> list[int]:
    from gdskit.engine.gpu_hash import supported_archs
    from gdskit.errors import MissingDependencyError

    try:
        return supported_archs()
    except MissingDependencyError:
        pytest.skip("no NVRTC here: pip install nvidia-cuda-nvrtc")


@pytest.fixture()
def gpu_of(kernels, stand_in_gpus, tmp_path, monkeypatch):
    """``gpu_of(major, minor)``: a stand-in GPU of that capability, for which no image is provided
    (each test takes its own: a process keeps the images it compiled), and an empty kernel cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def make(major: int, minor: int) -> FakeDriver:
        fake = _with_kernels(FakeDriver(), kernels)
        fake.compute_capability = (major, minor)
        return stand_in_gpus(fake)

    return make


def _checks_out(fake: FakeDriver) -> None:
    data = os.urandom(300_000)
    arr = _device_copy(data)
    try:
        assert digest_device([(arr.ptr, len(data))], 0) == [blake3.blake3(data).hexdigest()]
    finally:
        arr.free()


def test_a_cached_image_the_driver_refuses_is_replaced_by_a_fresh_compile(gpu_of):
    from gdskit.engine.gpu_hash import cache_path, compile_image

    _nvrtc_archs()
    fake = gpu_of(8, 6)
    damaged = bytearray(compile_image(8, 6))
    damaged[0x12] = 0  # e_machine: no longer a CUDA image
    path = cache_path(8, 6)
    os.makedirs(os.path.dirname(path), mode=0o700)
    with open(path, "wb") as fh:
        fh.write(damaged)
    os.chmod(path, 0o600)
    before = fake.calls.get("cuModuleLoadData", 0)
    _checks_out(fake)
    assert fake.calls["cuModuleLoadData"] - before == 2  # the damaged image, then the fresh one
    with open(path, "rb") as fh:
        assert fh.read() == compile_image(8, 6)  # the cache holds the fresh image now


def test_an_image_refused_again_after_a_fresh_compile_is_a_cuda_error(gpu_of):
    from gdskit.engine.gpu_hash import cache_path

    _nvrtc_archs()
    fake = gpu_of(8, 9)
    fake.fail["cuModuleLoadData"] = fake.CUresult.CUDA_ERROR_INVALID_IMAGE
    data = os.urandom(5000)
    arr = _device_copy(data)
    try:
        with pytest.raises(CudaError) as info:
            digest_device([(arr.ptr, len(data))], 0)
    finally:
        arr.free()
    assert info.value.code == "CUDA_ERROR_INVALID_IMAGE"
    assert fake.calls["cuModuleLoadData"] == 2  # compiled once more, not again and again
    assert os.path.exists(cache_path(8, 9))
    assert fake.live_allocations() == 0


def test_a_provided_image_the_driver_refuses_is_not_compiled_over(gpu_of):
    fake = gpu_of(7, 7)
    provide_image((7, 7), _fake_cubin("blake3_blocks", "blake3_tree", arch=80))  # a later architecture's
    with pytest.raises(CudaError) as info:
        _checks_out(fake)
    assert info.value.code == "CUDA_ERROR_NO_BINARY_FOR_GPU"
    assert fake.calls["cuModuleLoadData"] == 1


def test_an_architecture_nvrtc_does_not_know_gets_ptx_of_the_newest_below_it():
    from gdskit.engine.gpu_hash import build_target

    archs = [75, 80, 86, 90, 100, 120]
    assert build_target(9, 0, archs) == ("cubin", 90)
    assert build_target(8, 9, archs) == ("ptx", 86)
    assert build_target(13, 0, archs) == ("ptx", 120)  # PTX runs on later major versions too
    with pytest.raises(CudaError):
        build_target(7, 0, archs)  # older than anything this NVRTC builds for


def test_a_gpu_newer_than_nvrtc_runs_the_ptx_it_builds(gpu_of):
    from gdskit.engine.gpu_hash import compile_image, is_ptx

    archs = _nvrtc_archs()
    newest = max(archs)
    major, minor = divmod(newest + 10, 10)  # a GPU of the next major version
    fake = gpu_of(major, minor)
    image = compile_image(major, minor)
    assert is_ptx(image) and f".target sm_{newest}".encode() in image
    _checks_out(fake)


def test_a_cached_image_is_found_without_loading_nvrtc(tmp_path):
    """A verified load's first digest finds the cached kernels without importing or loading NVRTC
    (tens of milliseconds of a first call, on a thread that shares the interpreter with the reads);
    only a compile needs it."""
    import subprocess
    import sys

    script = (
        "import os, sys\n"
        "from gdskit.engine.gpu_hash import cache_path, image_for\n"
        "path = cache_path(9, 0)\n"
        "os.makedirs(os.path.dirname(path), mode=0o700)\n"
        "fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)\n"
        "os.write(fd, b'\\x7fELF' + bytes(60)); os.close(fd)\n"
        "assert image_for(9, 0) == b'\\x7fELF' + bytes(60)\n"
        "print(sorted(m for m in sys.modules if 'nvrtc' in m))\n")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_started_digests_run_on_the_stream_while_the_caller_goes_on(gpu):
    """The kernels are queued, not waited for: the caller's thread is back before the stream has
    run them; the result reads them back in order, and counts the check once."""
    from gdskit.engine import start_digest_buffers

    data = [os.urandom(70_000), os.urandom(3), os.urandom(1 << 20)]
    arrays = [_device_copy(d) for d in data]
    try:
        before = gdskit.stats()
        started = start_digest_buffers([(a.ptr, len(d)) for a, d in zip(arrays, data)], 0, 0)
        assert gpu.live_allocations(gpu.CUmemorytype.CU_MEMORYTYPE_DEVICE) == len(arrays) + 1  # the scratch
        assert (gdskit.stats() - before).verified.checks == 0
        assert started.result() == [blake3.blake3(d).hexdigest() for d in data]
        assert (gdskit.stats() - before).verified.checks == len(data)
    finally:
        for a in arrays:
            a.free()
    assert gpu.live_allocations(gpu.CUmemorytype.CU_MEMORYTYPE_DEVICE) == 0


def test_abandoned_digests_free_their_scratch_and_give_no_answer(gpu):
    from gdskit.engine import start_digest_buffers

    data = os.urandom(50_000)
    arr = _device_copy(data)
    try:
        started = start_digest_buffers([(arr.ptr, len(data))], 0, 0)
        started.abandon()
        assert gpu.live_allocations(gpu.CUmemorytype.CU_MEMORYTYPE_DEVICE) == 1  # the buffer alone
        with pytest.raises(CudaError):
            started.result()  # never a digest of memory that was freed
    finally:
        arr.free()


def test_a_failed_read_back_frees_the_scratch(gpu):
    from gdskit.engine import start_digest_buffers

    data = os.urandom(20_000)
    arr = _device_copy(data)
    started = start_digest_buffers([(arr.ptr, len(data))], 0, 0)
    gpu.fail["cuMemcpyDtoHAsync"] = gpu.CUresult.CUDA_ERROR_LAUNCH_FAILED
    try:
        with pytest.raises(CudaError):
            started.result()
    finally:
        gpu.fail.pop("cuMemcpyDtoHAsync")
        arr.free()
    assert gpu.live_allocations(gpu.CUmemorytype.CU_MEMORYTYPE_DEVICE) == 0
