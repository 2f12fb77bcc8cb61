"""Bad input gets the right GdskitError subclass (and built-in), never a crash or partial data."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

import gdskit
from gdskit import errors


@pytest.fixture
def small_file(tmp_path):
    p = tmp_path / "f.bin"
    data = os.urandom(10_000)
    p.write_bytes(data)
    return str(p), data


def test_missing_file():
    with pytest.raises(FileNotFoundError) as ei:
        gdskit.open("/nonexistent/dir/file.bin")
    assert isinstance(ei.value, errors.GdskitFileNotFoundError)
    assert ei.value.errno == errno.ENOENT


def test_directory(tmp_path):
    with pytest.raises(IsADirectoryError) as ei:
        gdskit.open(str(tmp_path))
    assert isinstance(ei.value, errors.GdskitError)


def test_bad_mode(small_file):
    with pytest.raises(errors.InvalidArgumentError):
        gdskit.open(small_file[0], "rb")
    with pytest.raises(ValueError):
        gdskit.open(small_file[0], "x")


def test_write_on_read_only_and_read_on_write_only(small_file, tmp_path):
    with gdskit.open(small_file[0]) as f:
        with pytest.raises(errors.UnsupportedOperationError):
            f.write(b"abc")
    with gdskit.open(str(tmp_path / "w.bin"), "w") as f:
        with pytest.raises(OSError) as ei:
            f.read(bytearray(10))
        assert isinstance(ei.value, errors.UnsupportedOperationError)


def test_closed_file(small_file):
    f = gdskit.open(small_file[0])
    f.close()
    f.close()  # idempotent
    with pytest.raises(ValueError) as ei:
        f.read(bytearray(10))
    assert isinstance(ei.value, errors.ClosedFileError)
    with pytest.raises(errors.ClosedFileError):
        f.pread(bytearray(10))


@pytest.mark.parametrize("kwargs", [
    {"size": 11}, {"buf_offset": 11}, {"size": 5, "buf_offset": 6},
])
def test_buffer_too_small(small_file, kwargs):
    buf = bytearray(10)
    with gdskit.open(small_file[0]) as f:
        with pytest.raises(errors.BufferTooSmallError):
            f.read(buf, **kwargs)
    assert buf == bytearray(10), "nothing may be written on a refused request"


@pytest.mark.parametrize("kwargs", [{"file_offset": -1}, {"buf_offset": -1}, {"size": -5}, {"size": 1.5}])
def test_negative_or_bad_numbers(small_file, kwargs):
    with gdskit.open(small_file[0]) as f:
        with pytest.raises(ValueError) as ei:
            f.read(bytearray(10), **kwargs)
    assert isinstance(ei.value, errors.InvalidArgumentError)


@pytest.mark.parametrize("obj", [object(), 12, "text", [1, 2, 3]])
def test_unsupported_buffer(small_file, obj):
    with gdskit.open(small_file[0]) as f:
        with pytest.raises(TypeError) as ei:
            f.read(obj)
    assert isinstance(ei.value, errors.UnsupportedBufferError)


def test_non_contiguous_buffer(small_file):
    arr = np.zeros((100, 20), dtype=np.uint8)[:, ::2]
    with gdskit.open(small_file[0]) as f:
        with pytest.raises(errors.UnsupportedBufferError):
            f.read(arr)


def test_read_into_read_only_buffer(small_file):
    with gdskit.open(small_file[0]) as f:
        with pytest.raises(TypeError) as ei:
            f.read(b"\0" * 100)
    assert isinstance(ei.value, errors.ReadOnlyBufferError)
    ro = np.zeros(100, np.uint8)
    ro.flags.writeable = False
    with gdskit.open(small_file[0]) as f, pytest.raises(errors.ReadOnlyBufferError):
        f.read(ro)


def test_write_from_read_only_buffer_is_fine(tmp_path):
    p = tmp_path / "ro.bin"
    with gdskit.open(str(p), "w") as f:
        assert f.write(b"hello world") == 11
    assert p.read_bytes() == b"hello world"


def test_append_with_offset_refused(tmp_path):
    with gdskit.open(str(tmp_path / "a.bin"), "a") as f, pytest.raises(errors.InvalidArgumentError):
        f.write(b"x", file_offset=3)


def test_atomic_needs_w(small_file):
    with pytest.raises(errors.InvalidArgumentError):
        gdskit.open(small_file[0], "r+", atomic=True)


def test_mode_host_refuses_nothing_on_host_memory(small_file):
    buf = bytearray(10_000)
    with gdskit.settings.set(mode="host"), gdskit.open(small_file[0]) as f:
        assert f.read(buf) == 10_000
    assert bytes(buf) == small_file[1]


def test_error_classes_subclass_builtins():
    pairs = [
        (errors.InvalidArgumentError, ValueError), (errors.BufferTooSmallError, ValueError),
        (errors.UnsupportedBufferError, TypeError), (errors.ClosedFileError, ValueError),
        (errors.GdskitFileNotFoundError, FileNotFoundError), (errors.NoSpaceError, OSError),
        (errors.DirectPathUnavailable, RuntimeError), (errors.ConfigError, ValueError),
        (errors.FormatError, ValueError), (errors.MissingDependencyError, ImportError),
        (errors.DeviceUnavailableError, RuntimeError),
    ]
    for cls, builtin in pairs:
        assert issubclass(cls, errors.GdskitError) and issubclass(cls, builtin), cls


def test_from_os_error_maps_errno():
    for code, cls in ((errno.ENOSPC, errors.NoSpaceError), (errno.EACCES, errors.GdskitPermissionError),
                      (errno.EIO, errors.GdskitIOError)):
        err = errors.from_os_error(OSError(code, os.strerror(code)), "/x")
        assert type(err) is cls and err.errno == code and err.filename == "/x"


# -- booleans are not offsets or sizes; numpy integers are ------------------------

def _int_calls(f, value):
    """Every File call that takes an offset or a size, with ``value`` in one such place."""
    buf = bytearray(16)
    return {
        "read size": lambda: f.read(buf, size=value),
        "read file_offset": lambda: f.read(buf, 1, file_offset=value),
        "read buf_offset": lambda: f.read(buf, 1, buf_offset=value),
        "write size": lambda: f.write(buf, size=value, file_offset=0),
        "write file_offset": lambda: f.write(buf, 1, file_offset=value),
        "write buf_offset": lambda: f.write(buf, 1, file_offset=0, buf_offset=value),
        "pread size": lambda: f.pread(buf, size=value).result(),
        "pread file_offset": lambda: f.pread(buf, 1, file_offset=value).result(),
        "pwrite file_offset": lambda: f.pwrite(buf, 1, file_offset=value).result(),
        "pwrite buf_offset": lambda: f.pwrite(buf, 1, file_offset=0, buf_offset=value).result(),
        "read_batch size": lambda: f.read_batch(buf, [0], value),
        "read_batch file_offsets": lambda: f.read_batch(buf, [value], 1),
        "read_batch buf_offsets": lambda: f.read_batch(buf, [0], 1, [value]),
        "read_many size": lambda: f.read_many([(buf, value, 0)]),
        "read_many file_offset": lambda: f.read_many([(buf, 1, value)]),
        "read_many buf_offset": lambda: f.read_many([(buf, 1, 0, value)]),
        "pread_many file_offset": lambda: f.pread_many([(buf, 1, value)]).result(),
        "cached file_offset": lambda: f.cached(value),
        "cached size": lambda: f.cached(0, value),
    }


CALL_NAMES = list(_int_calls(None, 0))


@pytest.mark.parametrize("call", CALL_NAMES)
@pytest.mark.parametrize("value", [True, False])
def test_booleans_are_refused_as_offsets_and_sizes(tmp_path, call, value):
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(16)))
    with gdskit.open(str(p), "r+") as f:
        with pytest.raises(errors.InvalidArgumentError):
            _int_calls(f, value)[call]()
    assert p.read_bytes() == bytes(range(16)), "a refused call changes nothing"


@pytest.mark.parametrize("call", CALL_NAMES)
@pytest.mark.parametrize("value", [np.int64(1), np.uint32(1), np.int8(1), np.array(1)])
def test_numpy_integers_are_accepted_as_offsets_and_sizes(tmp_path, call, value):
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(16)))
    with gdskit.open(str(p), "r+") as f:
        _int_calls(f, value)[call]()  # no error


def test_numpy_integer_arrays_are_accepted_by_read_batch(small_file):
    buf = bytearray(8)
    with gdskit.open(small_file[0]) as f:
        assert f.read_batch(buf, np.array([0, 100], np.int64), 4, np.array([0, 4], np.uint16)) == [4, 4]
    assert bytes(buf) == small_file[1][0:4] + small_file[1][100:104]
    with gdskit.open(small_file[0]) as f, pytest.raises(errors.InvalidArgumentError):
        f.read_batch(buf, np.array([True, False]), 4)


def test_one_device_error_for_every_loader():
    # `except gdskit.torch.DeviceUnavailableError` must also catch the safetensors loader's.
    pytest.importorskip("torch")
    import gdskit.errors
    import gdskit.safetensors
    import gdskit.torch

    assert gdskit.torch.DeviceUnavailableError is gdskit.errors.DeviceUnavailableError
    assert issubclass(gdskit.torch.DeviceUnavailableError, RuntimeError)
