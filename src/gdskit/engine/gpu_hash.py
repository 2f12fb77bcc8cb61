"""BLAKE3 digests of device memory, computed on the GPU where the bytes landed.

The kernels (:mod:`gdskit.engine.gpu_hash_kernel`) are compiled at first use with NVRTC
(``cuda.bindings.nvrtc``; its library comes with the ``nvidia-cuda-nvrtc`` wheel or a CUDA
toolkit) for the device's architecture, loaded through the driver layer (:mod:`gdskit.engine.cuda`),
and kept for the life of the process, one module per device. Many buffers go in one launch
pair: a table of ``(device pointer, length)`` items.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from collections.abc import Sequence
from typing import Any

import gdskit.engine.cuda as cuda
from gdskit.durable import cache_folder, read_private, remove_private, write_private
from gdskit.engine.gpu_hash_kernel import BLOCK_CHUNKS, CHUNK_BYTES, SOURCE
from gdskit.errors import CudaError, MissingDependencyError
from gdskit.threads import start_thread

_BLOCK_BYTES = BLOCK_CHUNKS * CHUNK_BYTES
_images: dict[tuple[int, int], bytes] = {}            # (major, minor) -> compiled image
_provided: set[tuple[int, int]] = set()               # capabilities whose image the program gave
_modules: dict[tuple[int, int], tuple[Any, Any]] = {}  # (id(driver), device) -> (blocks, tree) kernels
_lock = threading.Lock()


def _forget_modules() -> None:
    with _lock:
        _modules.clear()  # they belong to the driver being left


cuda.on_driver_change(_forget_modules)


def _nvrtc() -> Any:
    try:
        from cuda.bindings import nvrtc  # noqa: PLC0415 - import time
    except ImportError:
        raise MissingDependencyError("GPU digests need NVRTC: pip install cuda-bindings nvidia-cuda-nvrtc") from None
    return nvrtc


def _nvrtc_check(nvrtc: Any, result: Any, what: str, prog: Any = None) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        log = ""
        if prog is not None:
            _e, size = nvrtc.nvrtcGetProgramLogSize(prog)
            buf = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, buf)
            log = ": " + buf.decode(errors="replace").strip()[:2000]
        raise CudaError(f"{what} failed ({getattr(err, 'name', err)}){log}", code=str(getattr(err, "name", err)))
    return rest[0] if len(rest) == 1 else rest


def supported_archs() -> list[int]:
    """The architectures this NVRTC compiles for (``nvrtcGetSupportedArchs``: 90 for sm_90)."""
    nvrtc = _nvrtc()
    try:
        return sorted(int(a) for a in _nvrtc_check(nvrtc, nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs"))
    except RuntimeError as exc:  # the bindings found no libnvrtc
        if isinstance(exc, CudaError):
            raise
        raise MissingDependencyError(f"GPU digests need NVRTC ({exc}): pip install nvidia-cuda-nvrtc") from None


def build_target(major: int, minor: int, archs: Sequence[int]) -> tuple[str, int]:
    """What to build for compute capability ``major.minor`` given the architectures NVRTC knows
    (``archs``): ``("cubin", arch)`` where it knows this one, else ``("ptx", arch)`` for the newest
    one below it; the driver finishes PTX for the GPU at load (PTX of an architecture runs on it
    and every later one).

    Raises
    ------
    CudaError
        NVRTC knows no architecture at or below this one (a GPU older than any it builds for).
    """
    want = 10 * major + minor
    if want in archs:
        return "cubin", want
    below = [a for a in archs if a < want]
    if not below:
        raise CudaError(f"this NVRTC builds for sm_{min(archs, default=0)} to sm_{max(archs, default=0)}, nothing "
                        f"that runs on a GPU of compute capability {major}.{minor}", code="NVRTC_ERROR_INVALID_OPTION")
    return "ptx", max(below)


def compile_image(major: int, minor: int) -> bytes:
    """The kernels compiled for compute capability ``major.minor``: a cubin where this NVRTC
    knows the architecture, else PTX for the newest one below it (:func:`build_target`; the
    driver finishes it at load)."""
    kind, arch = build_target(major, minor, supported_archs())
    nvrtc = _nvrtc()
    try:
        prog = _nvrtc_check(nvrtc, nvrtc.nvrtcCreateProgram(SOURCE.encode(), b"gdskit_blake3.cu", 0, [], []),
                            "nvrtcCreateProgram")
    except RuntimeError as exc:  # the bindings found no libnvrtc
        if isinstance(exc, CudaError):
            raise
        raise MissingDependencyError(f"GPU digests need NVRTC ({exc}): pip install nvidia-cuda-nvrtc") from None
    try:
        target = f"sm_{arch}" if kind == "cubin" else f"compute_{arch}"
        opts = [f"--gpu-architecture={target}".encode(), b"-default-device", b"--std=c++17"]
        _nvrtc_check(nvrtc, nvrtc.nvrtcCompileProgram(prog, len(opts), opts), "nvrtcCompileProgram", prog)
        if kind == "ptx":
            size = _nvrtc_check(nvrtc, nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
            image = b" " * size
            _nvrtc_check(nvrtc, nvrtc.nvrtcGetPTX(prog, image), "nvrtcGetPTX")
            return image.rstrip(b"\0")  # load_module adds the NUL the driver reads PTX up to
        size = _nvrtc_check(nvrtc, nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        image = b" " * size
        _nvrtc_check(nvrtc, nvrtc.nvrtcGetCUBIN(prog, image), "nvrtcGetCUBIN")
        return image
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def is_ptx(image: bytes) -> bool:
    """Whether ``image`` is PTX text (NVRTC's output for an architecture it has no cubin for)."""
    return b"\0" not in image[:4096] and b".version" in image[:4096] and b".target" in image[:4096]


def provide_image(capability: tuple[int, int], image: bytes) -> None:
    """Use ``image`` (a compiled module holding ``blake3_blocks`` and ``blake3_tree``) for GPUs of
    compute ``capability`` instead of compiling the source: a program that ships or caches its
    build, or a test on the stand-in driver. Modules already loaded are kept."""
    key = (int(capability[0]), int(capability[1]))
    with _lock:
        _images[key] = bytes(image)
        _provided.add(key)


_OPTIONS_VERSION = "3"  # bump with compile_image's options or the cache's naming: part of the key
_MAX_IMAGE_BYTES = 16 << 20


def cache_dir() -> str:
    """Where compiled images are kept between processes: ``$XDG_CACHE_HOME/gdskit/kernels``."""
    return cache_folder("kernels")


def cache_path(major: int, minor: int) -> str:
    """The cached image's path for compute capability ``major.minor``: named by a hash of the
    source, the compile options and the capability. Not of the NVRTC that built it: finding the
    image must not load NVRTC (with it, a first kernel use took 30-38 ms on the H200 machine,
    without it 10-12, 8 of them hashing), and an image this driver refuses is compiled again
    anyway (:func:`_load_kernels`)."""
    key = hashlib.sha256(f"{SOURCE}|{_OPTIONS_VERSION}|{major}.{minor}".encode()).hexdigest()[:32]
    return os.path.join(cache_dir(), f"blake3-sm{major}{minor}-{key}.image")


def _cached_image(path: str) -> bytes | None:
    """The image cached at ``path``, where the cache and the file are this user's alone."""
    image = read_private(path, _MAX_IMAGE_BYTES)
    return image if image is not None and (image[:4] == b"\x7fELF" or is_ptx(image)) else None


def _cache_image(path: str, image: bytes) -> None:
    """Keep ``image`` for later processes (:func:`gdskit.durable.write_private`); a cache that
    cannot be written is no error."""
    write_private(path, image)


def image_for(major: int, minor: int) -> bytes:
    """The compiled kernels for compute capability ``major.minor``: from this process, the cache
    (:func:`cache_dir`), or compiled now (and cached)."""
    image = _images.get((major, minor))
    if image is not None:
        return image
    path = cache_path(major, minor)
    image = _cached_image(path)
    if image is None:
        return fresh_image(major, minor)
    _images[(major, minor)] = image
    return image


def fresh_image(major: int, minor: int) -> bytes:
    """The kernels compiled now for ``major.minor``, in place of any this process or the cache held."""
    image = compile_image(major, minor)
    _cache_image(cache_path(major, minor), image)
    _images[(major, minor)] = image
    return image


def _evict(major: int, minor: int) -> None:
    """Forget the image of ``major.minor`` that the driver refused: in this process and in the
    cache (only a file in the private cache folder, by its name there)."""
    _images.pop((major, minor), None)
    remove_private(cache_path(major, minor))


def _load_kernels(device: int) -> Any:
    """The kernels' module loaded into ``device``'s context. An image the driver refuses that came
    from this process's or the cache's store is dropped and compiled once more (a damaged file,
    or one built by another NVRTC for another driver); an image the program provided is its own."""
    capability = cuda.compute_capability(device)
    image = image_for(*capability)
    try:
        return cuda.load_module(image, device)
    except CudaError as first:
        if capability in _provided:
            raise
        _evict(*capability)
        image = fresh_image(*capability)
        try:
            return cuda.load_module(image, device)
        except CudaError as again:
            raise CudaError(f"the driver refused the BLAKE3 kernels for GPU {device} (compute capability "
                            f"{capability[0]}.{capability[1]}) as found ({first.code}) and as compiled now "
                            f"({again.code})", code=again.code) from again


def prepare(device: int) -> None:
    """Compile (or find) and load the kernels for GPU ``device`` on a background thread, so that
    a verified load's first digest does not wait for them; a failure is left for that digest."""
    def run() -> None:
        try:
            _kernels(device)
        except Exception:  # noqa: BLE001 - the digest that needs them raises it
            pass

    if (id(cuda.driver_or_none()), device) not in _modules:
        start_thread(run, "gdskit-kernels")


def _kernels(device: int) -> tuple[Any, Any]:
    driver = cuda.driver_or_none()
    key = (id(driver), device)
    with _lock:
        found = _modules.get(key)
        if found is not None:
            return found
        module = _load_kernels(device)
        found = _modules[key] = (cuda.module_function(module, "blake3_blocks"),
                                 cuda.module_function(module, "blake3_tree"))
        return found


def _blocks_of(nbytes: int) -> int:
    chunks = max(1, -(-nbytes // CHUNK_BYTES))
    return -(-chunks // BLOCK_CHUNKS)


class DeviceDigests:
    """BLAKE3 digests launched on a GPU and not yet read back (:func:`launch_digests`): the work
    runs on its stream while the caller goes on; :meth:`wait` reads the digests back. Holds the
    scratch memory until then; :meth:`abandon` (or a failed :meth:`wait`) lets the queued work
    finish before freeing it."""

    def __init__(self, scratch: Any, roots_at: int, n: int, device: int, stream: int, table: Any) -> None:
        self._scratch, self._roots_at, self._n = scratch, roots_at, n
        self._device, self._stream = device, stream
        self._table = table  # the launch's table, until its copy has surely run

    def wait(self) -> list[str]:
        """The digests (hex), in the order of the items launched; frees the scratch memory."""
        if self._scratch is None:
            raise CudaError("these GPU digests were already read back or abandoned")
        n, scratch = self._n, self._scratch
        roots = (ctypes.c_uint32 * (8 * n))()
        try:
            with cuda.on_device(self._device):
                cuda.copy_d2h_on(self._stream, ctypes.addressof(roots), scratch.ptr + self._roots_at, 32 * n)
                cuda.stream_synchronize(self._stream)
        except BaseException:
            self.abandon()
            raise
        self._scratch = self._table = None
        scratch.free()
        raw = bytes(roots)
        return [raw[32 * i:32 * i + 32].hex() for i in range(n)]

    def abandon(self) -> None:
        """Drop the digests: wait for the queued work (it uses the scratch memory), then free it."""
        scratch, self._scratch = self._scratch, None
        if scratch is None:
            return
        try:
            with cuda.on_device(self._device):
                cuda.stream_synchronize(self._stream)
        except Exception:  # noqa: BLE001 - the first error is the one the caller raises
            pass
        finally:
            scratch.free()
            self._table = None


def launch_digests(items: Sequence[tuple[int, int]], device: int, stream: int = 0) -> DeviceDigests:
    """Queue the BLAKE3 digests of ``items``, ``(device pointer, nbytes)`` pairs in GPU ``device``'s
    memory (at least one), as two kernel launches on ``stream`` (a raw handle: the stream their
    bytes landed on, so the hash follows the copies queued there); returns at once."""
    n = len(items)
    table = (ctypes.c_uint64 * (3 * n + 1))()  # n (ptr, len) items, then n + 1 block bases
    base = 0
    for i, (ptr, nbytes) in enumerate(items):
        table[2 * i], table[2 * i + 1] = int(ptr), int(nbytes)
        table[2 * n + i] = base
        base += _blocks_of(int(nbytes))
    table[3 * n] = base
    table_bytes = ctypes.sizeof(table)
    cvs_at = -(-table_bytes // 256) * 256
    roots_at = cvs_at + 32 * base
    blocks, tree = _kernels(device)
    scratch = cuda.DeviceArray(roots_at + 32 * n, device)
    pending = DeviceDigests(scratch, roots_at, n, device, stream, table)
    try:
        with cuda.on_device(device):
            cuda.copy_h2d_on(stream, scratch.ptr, ctypes.addressof(table), table_bytes)
            items_p, base_p = ctypes.c_uint64(scratch.ptr), ctypes.c_uint64(scratch.ptr + 16 * n)
            cvs_p, roots_p = ctypes.c_uint64(scratch.ptr + cvs_at), ctypes.c_uint64(scratch.ptr + roots_at)
            count = ctypes.c_int32(n)
            cuda.launch_kernel(blocks, base, BLOCK_CHUNKS, stream, [items_p, count, base_p, cvs_p, roots_p])
            cuda.launch_kernel(tree, n, BLOCK_CHUNKS, stream, [count, base_p, cvs_p, roots_p])
    except BaseException:
        pending.abandon()
        raise
    return pending


def digest_device(items: Sequence[tuple[int, int]], device: int, stream: int = 0) -> list[str]:
    """The BLAKE3 digests (hex) of ``items``, ``(device pointer, nbytes)`` pairs in GPU ``device``'s
    memory, computed by two kernel launches on ``stream`` (:func:`launch_digests`); waits for them."""
    if not items:
        return []
    return launch_digests(items, device, stream).wait()
