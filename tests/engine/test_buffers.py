"""Buffer adaptation: numpy, bytearray, memoryview, torch CPU tensors via DLPack, CAI objects."""

from __future__ import annotations

import numpy as np
import pytest

import gdskit
from gdskit.engine.buffers import adapt
from gdskit.engine.cuda import MemoryKind
from gdskit.errors import UnsupportedBufferError


def test_numpy_and_bytearray_and_memoryview():
    a = np.arange(100, dtype=np.float32)
    v = adapt(a)
    assert v.nbytes == 400 and v.kind is MemoryKind.HOST and v.ptr == a.ctypes.data and not v.readonly
    assert adapt(bytearray(7)).nbytes == 7
    assert adapt(memoryview(bytearray(8)).cast("B")[2:6]).nbytes == 4
    assert adapt(b"abc").readonly
    assert adapt(bytearray()).nbytes == 0


def test_fortran_order_is_refused():
    with pytest.raises(UnsupportedBufferError):
        adapt(np.zeros((4, 5), order="F"))


def test_cuda_array_interface_contiguity_checked_without_gpu():
    class Fake:
        __cuda_array_interface__ = {"shape": (4, 4), "typestr": "<f4", "data": (0, False), "version": 3,
                                    "strides": (4, 16)}

    with pytest.raises(UnsupportedBufferError):
        adapt(Fake())


def test_a_version_2_cuda_array_interface_with_dlpack_is_exported_through_dlpack():
    """A v2 interface names no stream to wait for; DLPack's export (asked for stream 1, the legacy
    default stream gdskit then waits on) orders the producer's work. A v3 interface is used as is."""
    backing = np.arange(16, dtype=np.uint8)
    asked = []

    class V2:
        __cuda_array_interface__ = {"shape": (16,), "typestr": "|u1", "data": (backing.ctypes.data, False),
                                    "version": 2}

        def __dlpack_device__(self):
            return (2, 0)  # CUDA

        def __dlpack__(self, stream=None):
            asked.append(stream)
            return backing.__dlpack__()  # (host memory here: no GPU needed to see the route taken)

    v = adapt(V2())
    assert asked == [1] and v.ptr == backing.ctypes.data and v.nbytes == 16

    class V3(V2):
        __cuda_array_interface__ = {**V2.__cuda_array_interface__, "version": 3, "stream": None, "data": (0, False)}

    asked.clear()
    v = adapt(V3())
    assert asked == [] and v.on_device and not v.producer_sync


@pytest.mark.torch
def test_torch_cpu_tensor_round_trip(tmp_path):
    import torch

    t = torch.arange(1000, dtype=torch.int64)
    p = tmp_path / "t.bin"
    with gdskit.open(str(p), "w") as f:
        assert f.write(t) == 8000
    assert np.array_equal(np.fromfile(p, dtype=np.int64), np.arange(1000))
    out = torch.empty(1000, dtype=torch.bfloat16)  # a dtype the CUDA array interface cannot describe
    with gdskit.open(str(p)) as f:
        assert f.read(out) == 2000
    assert out.view(torch.int16).numpy().tobytes() == p.read_bytes()[:2000]


@pytest.mark.torch
def test_torch_non_contiguous_refused():
    import torch

    with pytest.raises(UnsupportedBufferError):
        adapt(torch.zeros(10, 10).t())


@pytest.mark.torch
def test_a_plain_cpu_tensor_is_described_without_a_dlpack_export(monkeypatch):
    """DLPack's export of a CPU tensor took ~15 µs, numpy's buffer protocol ~3: paid per tensor of
    a checkpoint, per batch of a loader. What DLPack refuses is still refused."""
    import torch

    plain = [torch.arange(1000, dtype=torch.int64), torch.zeros(7, dtype=torch.bfloat16), torch.zeros(0),
             torch.tensor(5.0), torch.zeros(3, 4, dtype=torch.complex64), torch.zeros(5, dtype=torch.bool)]

    def no_export(*a, **k):
        raise AssertionError("DLPack export")

    monkeypatch.setattr(torch.Tensor, "__dlpack__", no_export)
    for t in plain:
        v = adapt(t)
        assert (v.ptr, v.nbytes, v.on_device, v.readonly) == (t.data_ptr() if t.numel() else 0,
                                                               t.numel() * t.element_size(), False, False)
    monkeypatch.undo()
    for refused in (torch.zeros(3, requires_grad=True), torch.zeros(3, dtype=torch.complex64).conj(),
                    torch.zeros(10, 10).t(), torch.zeros(4).as_strided((2,), (2,))):
        with pytest.raises(UnsupportedBufferError):
            adapt(refused)


@pytest.mark.gpu
@pytest.mark.torch
def test_torch_tensor_filled_on_a_side_stream_is_written_after_the_fill(tmp_path):
    """torch's work on its current (non-default) stream is waited for before gdskit reads the
    tensor's memory, though torch's __cuda_array_interface__ names no stream."""
    import torch

    p = tmp_path / "side.bin"
    t = torch.zeros(4 << 20, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # keep the stream busy long enough to see a missing wait
        t.fill_(7)
        with gdskit.open(str(p), "w") as f:
            assert f.write(t) == 4 << 20
    torch.cuda.synchronize()
    assert p.read_bytes() == b"\x07" * (4 << 20)


@pytest.mark.gpu
@pytest.mark.torch
def test_a_plain_cuda_tensor_is_described_without_a_dlpack_export(monkeypatch):
    """torch itself describes a plain CUDA tensor (a DLPack export costs more than a small read),
    its producer's work being what is queued on torch's current stream; others still go through
    DLPack, and what it refuses stays refused."""
    import torch

    def no_export(*_a, **_k):
        raise AssertionError("exported through DLPack")

    side = torch.cuda.Stream()
    t = torch.zeros(1000, dtype=torch.bfloat16, device="cuda")
    monkeypatch.setattr(torch.Tensor, "__dlpack__", no_export)
    with torch.cuda.stream(side):
        v = adapt(t[10:])
    assert (v.ptr, v.nbytes, v.kind, v.device) == (t.data_ptr() + 20, 990 * 2, MemoryKind.DEVICE, 0)
    assert v.producer_sync and v.producer_stream == side.cuda_stream
    assert adapt(t).producer_stream == torch.cuda.current_stream().cuda_stream
    monkeypatch.undo()
    for refused in (torch.zeros(3, device="cuda", requires_grad=True), torch.zeros(10, 10, device="cuda").t()):
        with pytest.raises(UnsupportedBufferError):
            adapt(refused)


@pytest.mark.gpu
def test_device_kinds():
    from devbuf import DeviceBuffer

    d = DeviceBuffer(4096)
    m = DeviceBuffer(4096, managed=True)
    assert adapt(d).kind is MemoryKind.DEVICE and adapt(d).device == 0
    assert adapt(m).kind is MemoryKind.MANAGED


@pytest.mark.gpu
def test_managed_memory_never_goes_to_cufile(tmp_path):
    from devbuf import DeviceBuffer

    p = tmp_path / "m.bin"
    data = np.random.default_rng(1).integers(0, 256, 2 << 20, dtype=np.uint8).tobytes()
    p.write_bytes(data)
    m = DeviceBuffer(len(data), managed=True)
    before = gdskit.stats()
    with gdskit.open(str(p)) as f:
        assert f.read(m) == len(data)
    assert m.to_bytes() == data
    delta = gdskit.stats() - before
    assert set(delta.reasons) == {"managed_memory"}
    assert not any(k.startswith("cufile") for k in delta.paths)
    with gdskit.settings.set(mode="cufile"), gdskit.open(str(p)) as f:
        with pytest.raises(gdskit.errors.DirectPathUnavailable) as ei:
            f.read(m)
    assert ei.value.reason is gdskit.Reason.MANAGED_MEMORY


def test_import_stays_light_and_plain_buffers_need_no_numpy():
    import subprocess
    import sys

    code = ("import sys, gdskit\n"
            "assert 'numpy' not in sys.modules and 'torch' not in sys.modules, 'heavy import at import time'\n"
            "from gdskit.engine.buffers import adapt\n"
            "b = bytearray(b'abc'); v = adapt(b)\n"
            "import ctypes; assert ctypes.string_at(v.ptr, 3) == b'abc' and not v.readonly\n"
            "r = adapt(b'xyz'); assert ctypes.string_at(r.ptr, 3) == b'xyz' and r.readonly\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_an_array_of_python_objects_is_refused():
    with pytest.raises(UnsupportedBufferError):
        adapt(np.array([1, "a", None], dtype=object))


@pytest.mark.stand_in_gpu
def test_views_of_many_allocations_ask_the_driver_once(monkeypatch):
    from gdskit.engine import cuda
    from gdskit.engine.buffers import synchronized_device_view, synchronized_device_views

    arrays = [cuda.DeviceArray(n) for n in (4096, 1, 70_000)]
    asked = []
    real = cuda.pointer_info
    monkeypatch.setattr(cuda, "pointer_info", lambda ptr: asked.append(ptr) or real(ptr))
    views = synchronized_device_views([(a.ptr, a.nbytes, a) for a in arrays] + [(0, 0, None)])
    monkeypatch.undo()
    assert asked == [arrays[0].ptr]
    one_by_one = [synchronized_device_view(a.ptr, a.nbytes, a) for a in arrays]
    assert [(v.ptr, v.nbytes, v.kind, v.device, v.owner) for v in views[:3]] == \
        [(v.ptr, v.nbytes, v.kind, v.device, v.owner) for v in one_by_one]
    assert views[3].nbytes == 0 and views[3].kind is MemoryKind.DEVICE
    host = np.zeros(64, dtype=np.uint8)
    with pytest.raises(UnsupportedBufferError):
        synchronized_device_views([(host.ctypes.data, 64, host)])
