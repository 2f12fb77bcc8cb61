"""Many small cuFile reads through cuFile's batch API, on the stand-in libcufile and CUDA driver:
bytes against a plain read, the limits, short entries at the end of the file, failures, the
setting that chooses, the ledger's evidence, and nothing left behind."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

import gdskit
from gdskit.engine import cuda
from gdskit.engine import direct_path as dr
from gdskit.engine.backends import cufile_batch as cb
from gdskit.errors import ConfigError, EnvironmentVariableError, GdskitIOError, NoSpaceError
from gdskit.settings import Settings
from gdskit.vocabulary import CufileBatch, Path, Reason

from backend_conformance import BackendTests
from data_files import random_file
from fake_cufile import IO_EVENTS, IO_PARAMS, FakeCufile, OpError, cuFileError
from fake_stack import use_cufile
from leak_helpers import fd_count

pytestmark = pytest.mark.skipif(cuda.device_count() > 0, reason="a real GPU is present: test_cufile_batch_gpu.py")

PAGE = 4096
SIZE = (2 << 20) + 1000          # not a whole number of pages: the last entry is short
NVFS_ROUTE = dr.DirectRoute(Path.CUFILE_NVFS, None, True, False, True)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return random_file(tmp_path_factory, "cbatch", SIZE, seed=11)


@pytest.fixture
def stack(monkeypatch, fake_cuda, route_is):
    """The stand-ins, with batches on device memory only, on a machine with a direct route (the
    only place batches are used); checks afterwards that every batch was destroyed, the stand-in
    saw no breach of libcufile's rules and no descriptor leaked."""
    route_is(NVFS_ROUTE)
    fds = fd_count()
    fake = FakeCufile(route="posix")
    fake.configure_batch(device_of=fake_cuda.device_of, seed=3)
    lib = use_cufile(monkeypatch, fake)
    yield fake, lib
    lib.close()
    assert fake.live_batches == 0, "every batch must be destroyed"
    assert fake.violations == [], fake.violations
    assert gdskit.resources().lanes_busy == 0
    assert fd_count() == fds


def _expect(data: bytes, off: int, size: int) -> bytes:
    return data[off:off + size]


def _read_batch(path, offsets, size, places=None, **settings):
    buf = cuda.DeviceArray(max(1, (max(places) + size) if places else len(offsets) * size))
    cfg = {"mode": "cufile", "cufile_batch": "always", **settings}
    with gdskit.settings.set(**cfg), gdskit.open(path) as f:
        counts = f.read_batch(buf, offsets, size, places)
    return counts, buf.to_numpy().tobytes()


class TestBatchesOnFakes(BackendTests):
    """The conformance suite with every cuFile read that a batch can take in one."""

    settings_overrides = {"mode": "cufile", "chunk_size": "256KiB", "threads": 4, "cufile_batch": "always"}
    expected_paths = {"cufile-compat"}

    @pytest.fixture(autouse=True)
    def _fakes(self, compat_cufile, fake_cuda):
        compat_cufile.configure_batch(device_of=fake_cuda.device_of)
        yield
        assert compat_cufile.live_batches == 0 and compat_cufile.violations == []

    def make_buffer(self, nbytes):
        return cuda.DeviceArray(nbytes)

    def buffer_bytes(self, buf):
        return buf.to_numpy().tobytes()

    def fill_buffer(self, buf, data):
        buf.copy_from_host(data)


# -- bytes and counts ----------------------------------------------------------------------------------

@hsettings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pages=st.lists(st.integers(0, SIZE // PAGE + 2), min_size=1, max_size=40),
       size_pages=st.integers(1, 16))
def test_aligned_random_reads_are_batched_and_match_a_plain_read(data_file, stack, pages, size_pages):
    path, data = data_file
    fake, _lib = stack
    size = size_pages * PAGE
    offsets = [p * PAGE for p in pages]
    before = cb.activity()
    counts, got = _read_batch(path, offsets, size)
    for i, (off, n) in enumerate(zip(offsets, counts)):
        want = _expect(data, off, size)
        assert n == len(want) and got[i * size:i * size + n] == want
    assert fake.io_calls["read"] == 0, "every read went into a batch"
    assert (cb.activity() - before).entries >= len(offsets)


@hsettings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(offsets=st.lists(st.integers(0, SIZE + 5000), min_size=2, max_size=12), size=st.integers(1, 70_000))
def test_any_reads_in_auto_mode_match_a_plain_read(data_file, stack, route_is, offsets, size):
    """Unaligned heads and tails go through the ring, aligned bodies into batches."""
    path, data = data_file
    route_is(NVFS_ROUTE)
    reads = [(cuda.DeviceArray(size + 3), size, off, 3) for off in offsets]
    with gdskit.settings.set(mode="auto", direct_threshold=0, cufile_batch="always"), gdskit.open(path) as f:
        counts = f.read_many(reads)
    for (buf, _n, off, bo), n in zip(reads, counts):
        want = _expect(data, off, size)
        assert n == len(want) and buf.to_numpy().tobytes()[bo:bo + n] == want


def test_more_entries_than_one_batch_holds(data_file, stack):
    path, data = data_file
    fake, _lib = stack
    fake.configure_batch(io_batchsize=8)
    offsets = [((i * 37) % (SIZE // PAGE)) * PAGE for i in range(50)]
    before = cb.activity()
    counts, got = _read_batch(path, offsets, PAGE)
    assert counts == [PAGE] * 50
    assert all(got[i * PAGE:(i + 1) * PAGE] == _expect(data, off, PAGE) for i, off in enumerate(offsets))
    delta = cb.activity() - before
    assert delta.entries == 50 and delta.submits == 7, "groups of at most io_batchsize entries"


@pytest.mark.parametrize("parameters, props_limits, batched", [
    (False, True, True),     # an older library: the limit from the driver's properties
    (False, False, False),   # no limit known: 128 asked, refused by a library allowing 8: one call each
])
def test_the_limit_without_the_parameter_api(data_file, stack, parameters, props_limits, batched):
    path, data = data_file
    fake, lib = stack
    fake.configure_batch(io_batchsize=8, parameters=parameters, props_limits=props_limits)
    offsets = [i * 2 * PAGE for i in range(200)]
    before = cb.activity()
    counts, got = _read_batch(path, offsets, PAGE)
    assert counts == [PAGE] * 200
    assert all(got[i * PAGE:(i + 1) * PAGE] == _expect(data, off, PAGE) for i, off in enumerate(offsets))
    delta = cb.activity() - before
    if batched:
        assert delta.entries == 200 and fake.io_calls["read"] == 0
    else:
        assert delta.entries == 0 and delta.fallbacks == 1 and fake.io_calls["read"] == 200
        assert cb.batch_support(lib).refused is not None
        counts, _ = _read_batch(path, offsets[:4], PAGE)  # refused once: not asked again
        assert counts == [PAGE] * 4 and fake.batch_calls["set_up"] == 0


@pytest.mark.parametrize("max_io", [None, PAGE])
def test_short_entries_at_the_end_of_the_file_and_short_counts_before_it(data_file, stack, max_io):
    path, data = data_file
    fake, _lib = stack
    fake.max_io = max_io  # PAGE: libcufile moves a page per entry at most; the rest is read on
    last = SIZE // PAGE * PAGE
    offsets = [0, last - 2 * PAGE, last, last + PAGE, 4 * PAGE]
    size = 4 * PAGE
    counts, got = _read_batch(path, offsets, size)
    assert counts == [size, 2 * PAGE + 1000, 1000, 0, size]
    for i, (off, n) in enumerate(zip(offsets, counts)):
        assert got[i * size:i * size + n] == _expect(data, off, size)


def test_one_place_for_every_read_keeps_the_last_reads_bytes(data_file, stack):
    """Destinations that overlap are read one after another, never in one batch."""
    path, data = data_file
    fake, _lib = stack
    offsets = [0, 8 * PAGE, 3 * PAGE]
    counts, got = _read_batch(path, offsets, PAGE, [0, 0, 0])
    assert counts == [PAGE] * 3 and got[:PAGE] == _expect(data, 3 * PAGE, PAGE)
    assert fake.batch_calls["set_up"] == fake.batch_calls["entries"] == 3, "a batch of one for each read"


def test_reads_asked_for_latencies_are_timed_one_by_one(data_file, stack):
    path, data = data_file
    fake, _lib = stack
    buf = cuda.DeviceArray(4 * PAGE)
    lat: list[int] = []
    with gdskit.settings.set(mode="cufile", cufile_batch="always"), gdskit.open(path) as f:
        assert f.read_batch(buf, [0, 5 * PAGE, 9 * PAGE, 2 * PAGE], PAGE, latencies_ns=lat) == [PAGE] * 4
    assert len(lat) == 4 and buf.to_numpy().tobytes()[3 * PAGE:] == _expect(data, 2 * PAGE, PAGE)
    assert fake.batch_calls["set_up"] == 4, "one read per job"


def test_read_many_into_many_buffers_and_on_bytes(data_file, stack):
    path, data = data_file
    fake, _lib = stack
    reads = [(cuda.DeviceArray(8 * PAGE), 8 * PAGE, i * 11 * PAGE) for i in range(30)]
    reads.append((cuda.DeviceArray(4 * PAGE), 4 * PAGE, SIZE - 1000 - PAGE))  # the end of the file
    reads.append((cuda.DeviceArray(4 * PAGE), 4 * PAGE, 2 * PAGE + 5))       # unaligned: one call
    seen: list[int] = []
    with gdskit.settings.set(mode="cufile", cufile_batch="always"), gdskit.open(path) as f:
        counts = f.read_many(reads, on_bytes=seen.append)
    assert counts == [8 * PAGE] * 30 + [PAGE + 1000, 4 * PAGE]
    for (buf, size, off), n in zip(reads, counts):
        assert buf.to_numpy().tobytes()[:n] == _expect(data, off, size)
    assert sorted(seen) == sorted(counts) and sum(seen) == sum(counts)
    assert fake.io_calls["read"] == 1 and fake.batch_calls["entries"] == 31


# -- failures -------------------------------------------------------------------------------------------

def _one_call_error(path, ret):
    """What one cuFileRead per read raises where cuFile returns ``ret``."""
    mp = pytest.MonkeyPatch()
    fake = FakeCufile()
    lib = use_cufile(mp, fake)
    try:
        fake.fail_io("read", returns=ret)
        buf = cuda.DeviceArray(PAGE)
        with gdskit.settings.set(mode="cufile", cufile_batch="never"), gdskit.open(path) as f:
            with pytest.raises(GdskitIOError) as ei:
                f.read_batch(buf, [0], PAGE)
        return ei.value
    finally:
        lib.close()
        mp.undo()


@pytest.mark.parametrize("status, ret, want_errno, want_type", [
    ("FAILED", -errno.EIO, errno.EIO, GdskitIOError),                    # compat mode's -errno
    ("FAILED", -errno.ENOSPC, errno.ENOSPC, NoSpaceError),               # its errno keeps its class
    ("FAILED", -int(OpError.IO_ERROR), errno.EIO, GdskitIOError),        # -CUfileOpError
    ("INVALID", 0, errno.EIO, GdskitIOError),
    ("TIMEOUT", 0, errno.ETIMEDOUT, GdskitIOError),
])
def test_a_failed_entry_raises_what_one_call_raises_and_leaves_nothing(data_file, stack, status, ret,
                                                                       want_errno, want_type):
    path, _ = data_file
    fake, _lib = stack
    fake.configure_batch(io_batchsize=4)
    fake.fail_batch_entry(5, status=getattr(fake.Status, status), ret=ret)  # in the second group of four
    before = gdskit.stats()
    with pytest.raises(GdskitIOError) as ei:
        _read_batch(path, [i * PAGE for i in range(16)], PAGE)
    assert type(ei.value) is want_type and ei.value.errno == want_errno
    if status == "FAILED":
        same = _one_call_error(path, ret)
        assert type(same) is type(ei.value) and same.errno == ei.value.errno
    assert fake.batch_calls["entries"] == 8, "no group is submitted after the one that failed"
    assert (gdskit.stats() - before).bytes_read == 0, "a failed job claims no bytes"


def test_a_refused_submit_is_an_io_error(data_file, stack, monkeypatch):
    path, _ = data_file
    fake, _lib = stack

    def refuse(*args):
        raise cuFileError(OpError.BATCH_SUBMIT_FAILED)

    monkeypatch.setattr(fake, "batch_io_submit", refuse)
    with pytest.raises(GdskitIOError) as ei:
        _read_batch(path, [0, PAGE], PAGE)
    assert ei.value.errno == errno.EIO


def test_an_interrupt_cancels_and_destroys_the_batch(data_file, stack):
    path, _ = data_file
    fake, _lib = stack
    fake.interrupt_batch_poll(1)
    with pytest.raises(KeyboardInterrupt):
        _read_batch(path, [i * PAGE for i in range(20)], PAGE)
    # The stack fixture checks: destroyed, nothing in flight when it was, no breach.
    assert fake.batch_calls["destroy"] == 1


def test_a_hung_batch_times_out_instead_of_waiting_forever(data_file, stack):
    path, _ = data_file
    fake, _lib = stack
    fake.stall_batches()
    with cb.timeouts(poll_s=0.001, stall_s=0.05), pytest.raises(GdskitIOError) as ei:
        _read_batch(path, [i * PAGE for i in range(6)], PAGE)
    assert ei.value.errno == errno.ETIMEDOUT
    assert fake.batch_calls["destroy"] == 1


def test_a_batch_whose_cancel_never_lands_is_destroyed_all_the_same(data_file, monkeypatch, fake_cuda, route_is):
    path, _ = data_file
    route_is(NVFS_ROUTE)
    fake = FakeCufile()
    fake.configure_batch(device_of=fake_cuda.device_of)
    lib = use_cufile(monkeypatch, fake)
    fake.stall_batches(cancel_works=False)
    with cb.timeouts(poll_s=0.001, stall_s=0.02, drain_s=0.02), pytest.raises(GdskitIOError) as ei:
        _read_batch(path, [i * PAGE for i in range(3)], PAGE)
    assert ei.value.errno == errno.ETIMEDOUT and fake.live_batches == 0
    assert len(fake.violations) == 1 and "in flight" in fake.violations[0], "the one breach left: no way out"
    lib.close()


def test_on_bytes_raising_abandons_the_job_after_its_group(data_file, stack):
    path, _ = data_file
    fake, _lib = stack
    fake.configure_batch(io_batchsize=4)

    class Stop(Exception):
        pass

    def stop(_n):
        raise Stop

    reads = [(cuda.DeviceArray(PAGE), PAGE, i * PAGE) for i in range(12)]
    with gdskit.settings.set(mode="cufile", cufile_batch="always"), gdskit.open(path) as f, pytest.raises(Stop):
        f.read_many(reads, on_bytes=stop)
    assert fake.batch_calls["entries"] == 4


# -- the setting ------------------------------------------------------------------------------------------

def test_the_setting_chooses_batches_or_one_call_each(data_file, stack, monkeypatch):
    path, data = data_file
    fake, _lib = stack
    offsets = [i * 3 * PAGE for i in range(10)]
    for policy, batched in (("never", False), ("auto", False), ("always", True)):
        fake.io_calls["read"] = 0
        before = cb.activity()
        counts, got = _read_batch(path, offsets, PAGE, cufile_batch=policy)
        assert counts == [PAGE] * 10 and got[9 * PAGE:] == _expect(data, 27 * PAGE, PAGE)
        assert ((cb.activity() - before).entries == 10) is batched, policy
        assert fake.io_calls["read"] == (0 if batched else 10), policy
    # auto follows the measured table, row by row
    monkeypatch.setitem(cb.BATCH_WINS, 4 * 1024, True)
    before = cb.activity()
    _read_batch(path, offsets, PAGE, cufile_batch="auto")
    assert (cb.activity() - before).entries == 10
    before = cb.activity()
    _read_batch(path, offsets, 16 * PAGE, cufile_batch="auto")
    assert (cb.activity() - before).entries == 0


@pytest.mark.parametrize("size, entries, policy, want", [
    (4096, 10, CufileBatch.NEVER, False), (4096, 1, CufileBatch.ALWAYS, True), (1 << 30, 3, CufileBatch.ALWAYS, True),
    (4096, 10, CufileBatch.AUTO, False), (4096, 0, CufileBatch.ALWAYS, False),
])
def test_batch_chosen(size, entries, policy, want):
    assert cb.batch_chosen(policy, size, entries) is want
    assert not cb.batches_possible(CufileBatch.AUTO), "until measured, auto batches nothing"
    assert cb.batches_possible(CufileBatch.ALWAYS) and not cb.batches_possible(CufileBatch.NEVER)


def test_batch_wins_reads_the_table_by_row(monkeypatch):
    for k in list(cb.BATCH_WINS):
        monkeypatch.setitem(cb.BATCH_WINS, k, k <= 16 * 1024)
    assert cb.batch_wins(1) and cb.batch_wins(16 * 1024) and not cb.batch_wins(16 * 1024 + 1)
    assert cb.batches_possible(CufileBatch.AUTO)
    assert not cb.batch_wins(1 << 20), "larger than every row: one call each"
    assert cb.batch_chosen(CufileBatch.AUTO, 4096, 2) and not cb.batch_chosen(CufileBatch.AUTO, 4096, 1)
    assert cb.read_batch_as_one_job(CufileBatch.AUTO, 4096, [0, 4096, 8192])
    assert not cb.read_batch_as_one_job(CufileBatch.AUTO, 4096, [0, 4095])  # overlapping
    assert not cb.read_batch_as_one_job(CufileBatch.NEVER, 4096, [0, 4096])


def test_the_setting_is_validated_like_the_others(monkeypatch):
    assert Settings().cufile_batch is CufileBatch.AUTO
    with gdskit.settings.set(cufile_batch="ALWAYS") as s:
        assert s.cufile_batch is CufileBatch.ALWAYS and gdskit.settings.as_dict()["cufile_batch"] == "always"
    with pytest.raises(ConfigError):
        gdskit.settings.set(cufile_batch="sometimes")
    monkeypatch.setenv("GDSKIT_CUFILE_BATCH", "never")
    s = Settings()
    s._apply_env(os.environ)
    assert s.cufile_batch is CufileBatch.NEVER
    monkeypatch.setenv("GDSKIT_CUFILE_BATCH", "sometimes")
    with pytest.raises(EnvironmentVariableError) as ei:
        Settings()._apply_env(os.environ)
    assert ei.value.variable == "GDSKIT_CUFILE_BATCH"


# -- the ledger's evidence -----------------------------------------------------------------------------

@pytest.mark.parametrize("counts", ["l1", "l3", "both", "none"])
def test_compat_mode_is_named_whichever_counters_move(data_file, stack, counts):
    path, _ = data_file
    fake, _lib = stack
    fake.configure_batch(counts=counts)
    offsets = [i * 2 * PAGE for i in range(12)]
    before = gdskit.stats()
    _read_batch(path, offsets, PAGE)
    delta = gdskit.stats() - before
    assert set(delta.paths) == {"cufile-compat"} and delta.paths["cufile-compat"].bytes_read == 12 * PAGE
    assert delta.paths["cufile-compat"].ops_read == 12, "one operation per entry, as one call each counts"


@pytest.mark.parametrize("counts", ["l1", "l3"])
def test_direct_batches_are_named_direct_and_compat_ones_turn_auto_to_the_ring(data_file, monkeypatch,
                                                                               fake_cuda, route_is, counts):
    path, _ = data_file
    route_is(NVFS_ROUTE)
    for route, want in (("nvfs", {"cufile-nvfs"}), ("posix", {"cufile-compat"})):
        fake = FakeCufile(route=route)
        fake.configure_batch(device_of=fake_cuda.device_of, counts=counts)
        lib = use_cufile(monkeypatch, fake)
        buf = cuda.DeviceArray(12 * PAGE)
        with gdskit.settings.set(mode="auto", direct_threshold=0, cufile_batch="always"), gdskit.open(path) as f:
            before = gdskit.stats()
            f.read_batch(buf, [i * 2 * PAGE for i in range(12)], PAGE)
            first = gdskit.stats() - before
            f.read_batch(buf, [i * 2 * PAGE for i in range(12)], PAGE)
            second = gdskit.stats() - before - first
        assert set(first.paths) == want
        if route == "nvfs":
            assert set(first.reasons) == {"direct"} and set(second.paths) == want
        else:
            assert set(second.paths) <= {"bounce-cached", "bounce-direct"}
            assert set(second.reasons) == {"cufile_compat_observed"}
        lib.close()
        assert fake.violations == [] and fake.live_batches == 0


# -- the stand-in keeps libcufile's rules ----------------------------------------------------------------

def _params(fake, handle, entries):
    p = np.zeros(len(entries), dtype=IO_PARAMS)
    for i, (base, off, bo, size) in enumerate(entries):
        p[i]["mode"], p[i]["fh"], p[i]["opcode"], p[i]["cookie"] = 1, handle, 0, i + 1
        p[i]["u"] = (base, off, bo, size)
    return p


def test_the_stand_in_keeps_the_batch_rules(data_file, fake_cuda):
    import ctypes

    path, data = data_file
    fake = FakeCufile()
    fake.configure_batch(io_batchsize=4, device_of=fake_cuda.device_of, seed=1)
    fd = os.open(path, os.O_RDONLY)
    descr = fake.Descr()
    descr.handle.fd = fd
    handle = fake.handle_register(descr.ptr)
    dev = cuda.DeviceArray(8 * PAGE)
    host = np.zeros(2 * PAGE, np.uint8)
    nr = ctypes.c_uint(0)
    events = np.zeros(4, dtype=IO_EVENTS)
    ts = cb._Timespec(1, 0)

    def refused(call, status=OpError.INVALID_VALUE):
        with pytest.raises(cuFileError) as ei:
            call()
        assert ei.value.status == status

    refused(lambda: fake.batch_io_set_up(0))
    refused(lambda: fake.batch_io_set_up(5))
    b1, b2 = fake.batch_io_set_up(4), fake.batch_io_set_up(2)
    assert b1 != b2, "a batch id per set-up"
    good = _params(fake, handle, [(dev.ptr, i * PAGE, i * PAGE, PAGE) for i in range(4)])
    refused(lambda: fake.batch_io_submit(b2, 4, good.ctypes.data, 0))       # more than its set-up
    refused(lambda: fake.batch_io_submit(b1, 4, good.ctypes.data, 1))       # flags must be 0
    for bad in ([(dev.ptr, 1, 0, PAGE)], [(dev.ptr, 0, 0, 100)], [(host.ctypes.data, 0, 0, PAGE)],
                [(dev.ptr, 0, 0, 0)]):
        p = _params(fake, handle, bad)
        refused(lambda: fake.batch_io_submit(b1, 1, p.ctypes.data, 0))
    p = _params(fake, handle + 1, [(dev.ptr, 0, 0, PAGE)])
    refused(lambda: fake.batch_io_submit(b1, 1, p.ctypes.data, 0))          # no such handle
    fake.batch_io_submit(b1, 4, good.ctypes.data, 0)
    refused(lambda: fake.batch_io_submit(b1, 1, good.ctypes.data, 0), OpError.BATCH_FULL)
    refused(lambda: fake.batch_io_get_status(b1, 3, ctypes.addressof(nr), events.ctypes.data, ctypes.addressof(ts)))
    got: list[int] = []
    while len(got) < 4:
        nr.value = 2
        fake.batch_io_get_status(b1, 1, ctypes.addressof(nr), events.ctypes.data, ctypes.addressof(ts))
        assert 1 <= nr.value <= 2, "at least min_nr, never more than asked"
        for cookie, status, ret in events[:nr.value].tolist():
            assert status == fake.Status.COMPLETE and ret == PAGE
            got.append(cookie)
    assert sorted(got) == [1, 2, 3, 4]
    assert dev.to_numpy().tobytes()[:4 * PAGE] == data[:4 * PAGE]
    fake.batch_io_destroy(b1)
    fake.batch_io_destroy(b2)
    assert fake.violations == []
    for call in (lambda: fake.batch_io_destroy(b1), lambda: fake.batch_io_submit(b1, 1, good.ctypes.data, 0),
                 lambda: fake.batch_io_get_status(b1, 0, ctypes.addressof(nr), events.ctypes.data,
                                                  ctypes.addressof(ts))):
        with pytest.raises(cuFileError):
            call()
    assert len(fake.violations) == 3, "destroy twice and use after destroy are breaches"
    b3 = fake.batch_io_set_up(1)
    fake.batch_io_submit(b3, 1, good.ctypes.data, 0)
    with pytest.raises(cuFileError):
        fake.batch_io_get_status(b3, 1, ctypes.addressof(nr), events.ctypes.data, 0)  # NULL timeout
    with pytest.raises(cuFileError):
        fake.batch_io_destroy(b3)  # an entry still in flight
    assert len(fake.violations) == 5
    fake.handle_deregister(handle)
    os.close(fd)


def test_the_layouts_are_cufile_h(data_file):
    """gdskit's and the stand-in's struct layouts against the installed bindings' (where present)."""
    ours, events = cb._params_dtype(), cb._events_dtype()
    assert ours == IO_PARAMS and events == IO_EVENTS
    try:
        from cuda.bindings import cufile
    except Exception:
        pytest.skip("no cuda.bindings.cufile here")

    def layout(dt, at=0):
        """Every leaf field's (offset, size), nested structs and unions flattened."""
        out = []
        for name in dt.names:
            sub, off = dt.fields[name][:2]
            out += layout(sub, at + off) if sub.fields else [(at + off, sub.itemsize)]
        return out if at else (dt.itemsize, out)

    assert layout(ours) == layout(np.dtype(cufile.io_params_dtype))
    assert layout(events) == layout(np.dtype(cufile.io_events_dtype))
    assert [int(s) for s in (cufile.Status.WAITING, cufile.Status.PENDING, cufile.Status.INVALID,
                             cufile.Status.CANCELED, cufile.Status.COMPLETE, cufile.Status.TIMEOUT,
                             cufile.Status.FAILED)] == [1, 2, 4, 8, 16, 32, 64]
    assert int(cufile.BatchMode.BATCH) == 1 and int(cufile.Opcode.READ) == 0
    assert int(cufile.SizeTConfigParameter.PROPERTIES_IO_BATCHSIZE) == 9


def test_without_a_direct_route_no_batch_is_set_up(data_file, monkeypatch, fake_cuda, route_is):
    """Where cuFile can only run in compat mode, libcufile 1.15's batch submit blocked for good on
    the H200 machine: there even ``always`` reads one call each, with the same bytes."""
    path, data = data_file
    route_is(dr.DirectRoute(None, Reason.NVIDIA_FS_MISSING, False, False, True))
    fake = FakeCufile(route="posix")
    fake.configure_batch(device_of=fake_cuda.device_of)
    lib = use_cufile(monkeypatch, fake)
    before = cb.activity()
    offsets = [i * 2 * PAGE for i in range(12)]
    counts, got = _read_batch(path, offsets, PAGE)
    after = cb.activity()
    lib.close()
    assert counts == [PAGE] * 12
    assert got == b"".join(data[o:o + PAGE] for o in offsets)
    assert after.batches == before.batches, "no batch set up without a direct route"
    assert cb.batch_support(lib).refused is not None
    assert fake.live_batches == 0 and fake.violations == []
