"""gdskit.torch.load takes what torch.load takes (a path or a file object, map_location in
every form, mmap=, weights_only True/False/None) and returns what it returns (CPU tensors)."""

from __future__ import annotations

import io
import pickle
import zipfile

import pytest

torch = pytest.importorskip("torch")

import gdskit.torch as gt  # noqa: E402
from gdskit.errors import InvalidArgumentError  # noqa: E402
from leak_helpers import fd_count  # noqa: E402
from torch_checkpoints import checkpoint, same  # noqa: E402

pytestmark = pytest.mark.torch


class Opaque:
    """An object only a full unpickle builds."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.value == self.value


class ReadSeekOnly:
    """A file object with ``read``, ``seek`` and ``tell`` and nothing else (no descriptor)."""

    def __init__(self, data: bytes) -> None:
        self._b = io.BytesIO(data)

    def read(self, n: int = -1) -> bytes:
        return self._b.read(n)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._b.seek(offset, whence)

    def tell(self) -> int:
        return self._b.tell()

    def readinto(self, b) -> int:  # torch's legacy reader asks for it
        return self._b.readinto(b)

    def readline(self) -> bytes:
        return self._b.readline()


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save(checkpoint(), path)
    return path


def deflated(path, dst):
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            method = zipfile.ZIP_DEFLATED if "/data/" in info.filename else zipfile.ZIP_STORED
            zout.writestr(info.filename, zin.read(info), compress_type=method)
    return dst


# -- file objects -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["bytesio", "read_seek_only", "open_file", "open_file_at_an_offset",
                                  "bytesio_at_an_offset", "deflated_bytesio", "legacy_bytesio"])
def test_file_objects_load_as_torch_loads_them(saved, tmp_path, kind) -> None:
    data = saved.read_bytes()
    if kind == "deflated_bytesio":
        data = deflated(saved, tmp_path / "d.pt").read_bytes()
    if kind == "legacy_bytesio":
        buf = io.BytesIO()
        torch.save({"w": torch.arange(6.0).reshape(2, 3), "i": torch.arange(4)}, buf,
                   _use_new_zipfile_serialization=False)
        data = buf.getvalue()
    prefix = b"\x00junk" * 7 if kind.endswith("at_an_offset") else b""

    def make():
        if kind == "read_seek_only":
            return ReadSeekOnly(data)
        if kind.startswith("open_file"):
            p = tmp_path / f"{kind}.bin"
            p.write_bytes(prefix + data)
            f = open(p, "rb")  # noqa: SIM115 - closed below
            f.seek(len(prefix))
            return f
        b = io.BytesIO(prefix + data)
        b.seek(len(prefix))
        return b

    ref_src, got_src = make(), make()
    ref = torch.load(ref_src, weights_only=True)
    got = gt.load(got_src)
    for f in (ref_src, got_src):
        if hasattr(f, "close"):
            f.close()
    assert same(got, ref)


def test_open_file_is_read_through_the_engine(saved) -> None:
    with open(saved, "rb") as f:
        got, delta = gt.load(f, return_stats=True)
    assert same(got, torch.load(saved, weights_only=True))
    assert delta.total_bytes > 0  # the bytes went through the engine


def test_file_objects_leave_no_descriptor_open(saved) -> None:
    data = saved.read_bytes()
    before = fd_count()
    for _ in range(20):
        gt.load(io.BytesIO(data))
        with open(saved, "rb") as f:
            gt.load(f)
        with pytest.raises(Exception):
            gt.load(io.BytesIO(data[: len(data) // 2]))
    assert fd_count() == before


def test_not_a_file_object_is_an_invalid_argument() -> None:
    with pytest.raises(InvalidArgumentError):
        gt.load(12345)


# -- map_location -----------------------------------------------------------------------------

def _to_cpu_copy(storage, location):
    return storage.cpu()


@pytest.mark.parametrize("map_location", [None, "cpu", torch.device("cpu"), {"cpu": "cpu"}, {"cuda:0": "cpu"},
                                          lambda s, loc: s, lambda s, loc: None, _to_cpu_copy],
                         ids=["none", "str", "device", "dict", "dict-other", "callable", "callable-none",
                              "callable-copy"])
def test_map_location_forms_as_torch(saved, map_location) -> None:
    ref = torch.load(saved, map_location=map_location, weights_only=True)
    assert same(gt.load(saved, map_location=map_location), ref)
    with open(saved, "rb") as f:
        assert same(gt.load(io.BytesIO(f.read()), map_location=map_location), ref)


# -- mmap -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("mmap", [None, False, True])
def test_mmap_gives_torchs_values(saved, mmap) -> None:
    ref = torch.load(saved, mmap=mmap, weights_only=True)
    assert same(gt.load(saved, mmap=mmap), ref)


def test_mmap_with_a_file_object_is_refused_as_torch_refuses_it(saved) -> None:
    data = saved.read_bytes()
    with pytest.raises(ValueError):
        torch.load(io.BytesIO(data), mmap=True, weights_only=True)
    with pytest.raises(InvalidArgumentError):
        gt.load(io.BytesIO(data), mmap=True)


# -- weights_only -------------------------------------------------------------------------------------

@pytest.fixture
def unsafe(tmp_path):
    path = tmp_path / "unsafe.pt"
    torch.save({"t": torch.arange(3), "o": Opaque(5)}, path)
    return path


@pytest.mark.parametrize("weights_only", [None, True])
def test_weights_only_none_and_true_refuse_as_torch(unsafe, weights_only) -> None:
    with pytest.raises(pickle.UnpicklingError):
        torch.load(unsafe, weights_only=weights_only)
    with pytest.raises(gt.UnsafeCheckpointError):
        gt.load(unsafe, weights_only=weights_only)
    with pytest.raises(gt.UnsafeCheckpointError):
        gt.load(io.BytesIO(unsafe.read_bytes()), weights_only=weights_only)


def test_weights_only_false_loads_as_torch(unsafe) -> None:
    ref = torch.load(unsafe, weights_only=False)
    got = gt.load(unsafe, weights_only=False)
    assert got["o"] == ref["o"] and same(got["t"], ref["t"])


def test_torch_environment_forces_weights_only_as_for_torch(unsafe, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.warns(UserWarning):
        ref = torch.load(unsafe)  # None: forced off
    assert gt.load(unsafe)["o"] == ref["o"]
    with pytest.raises(pickle.UnpicklingError):
        torch.load(unsafe, weights_only=True)  # said outright: kept
    with pytest.raises(gt.UnsafeCheckpointError):
        gt.load(unsafe, weights_only=True)
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(pickle.UnpicklingError):
        torch.load(unsafe, weights_only=False)  # forced on, whatever is passed
    with pytest.raises(gt.UnsafeCheckpointError):
        gt.load(unsafe, weights_only=False)


def test_load_into_takes_weights_only_none(unsafe, tmp_path) -> None:
    path = tmp_path / "sd.pt"
    torch.save({"t": torch.arange(3)}, path)
    target = {"t": torch.zeros(3, dtype=torch.int64)}
    gt.load_into(target, path, weights_only=None)
    assert torch.equal(target["t"], torch.arange(3))
    with pytest.raises(gt.UnsafeCheckpointError):
        gt.load_into({"t": torch.zeros(3, dtype=torch.int64)}, unsafe, weights_only=None, strict=False)
