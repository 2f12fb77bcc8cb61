"""Stream-ordered reads and writes on a real GPU with torch: kernels and I/O on one stream, no
host-side sync between them. Run with ``bash scripts/gpu_test.sh tests/engine/test_stream_io_gpu.py``
(or the whole suite) so that cuFile can register files and the cufile route runs, in compat
mode where the machine has no direct path."""

from __future__ import annotations

import os

import pytest

from cufile_probe import cufile_unusable_reason

import gdskit

pytestmark = [pytest.mark.gpu, pytest.mark.torch]


@pytest.fixture(params=["bounce", "cufile", "auto"])
def mode(request, tmp_path):
    if request.param == "cufile":
        why = cufile_unusable_reason(tmp_path)
        if why:
            pytest.skip(why)
    with gdskit.settings.set(mode=request.param, chunk_size="1MiB", direct_threshold=0):
        yield request.param


def _file(tmp_path, nbytes):
    p = tmp_path / "t.bin"
    data = os.urandom(nbytes)
    p.write_bytes(data)
    return str(p), data


@pytest.mark.parametrize("side_stream", [False, True], ids=["current", "side"])
def test_a_kernel_fills_a_tensor_and_the_write_on_its_stream_saves_it(tmp_path, mode, side_stream):
    import torch

    n = (16 << 20) // 4
    s = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    target = tmp_path / "w.bin"
    with torch.cuda.stream(s):
        t = torch.empty(n, dtype=torch.float32, device="cuda")
        t.copy_(torch.arange(n, dtype=torch.float32, device="cuda") * 3 + 1)  # kernels, queued on s
        with gdskit.open(str(target), "w") as f:
            fut = f.pwrite(t, stream=s)  # no sync between the kernels and the write
            assert fut.result() == n * 4
    expected = (torch.arange(n, dtype=torch.float32) * 3 + 1).numpy().tobytes()
    assert target.read_bytes() == expected


@pytest.mark.parametrize("side_stream", [False, True], ids=["current", "side"])
def test_a_read_then_add_on_the_same_stream_sees_the_data(tmp_path, mode, side_stream):
    import torch

    path, data = _file(tmp_path, (8 << 20) + 4096 * 5)
    s = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(s):
        t = torch.zeros(len(data), dtype=torch.uint8, device="cuda")
        with gdskit.open(path) as f:
            fut = f.pread(t, stream=s)
            t.add_(1)  # queued after the read on the same stream, no sync between
            assert fut.result() == len(data)
        got = t.cpu()  # ordered after the add on s
    want = (torch.frombuffer(bytearray(data), dtype=torch.uint8) + 1)
    assert torch.equal(got, want)


def test_several_torch_streams_at_once(tmp_path, mode):
    import torch

    k, each = 6, 4 << 20
    path, data = _file(tmp_path, k * each)
    streams = [torch.cuda.Stream() for _ in range(k)]
    outs = []
    with gdskit.open(path) as f:
        futs = []
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                t = torch.empty(each, dtype=torch.uint8, device="cuda")
                futs.append(f.pread(t, each, i * each, stream=s))
                outs.append(t.add(0))  # a kernel on s reading what the read left
        assert [fut.result() for fut in futs] == [each] * k
    torch.cuda.synchronize()
    for i, t in enumerate(outs):
        assert t.cpu().numpy().tobytes() == data[i * each:(i + 1) * each]


def test_close_waits_for_stream_ordered_writes_and_nothing_is_left(tmp_path, mode):
    import torch

    from gdskit.engine import cuda, stream_ordered

    s = torch.cuda.Stream()
    n = 6 << 20
    target = tmp_path / "c.bin"
    with torch.cuda.stream(s):
        t = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
        f = gdskit.open(str(target), "w", atomic=True)
        fut = f.pwrite(t, stream=s)
        f.close()
    assert fut.done() and fut.result() == n
    assert target.read_bytes() == t.cpu().numpy().tobytes()
    assert stream_ordered.in_flight() == 0 and cuda.host_funcs_pending() == 0
