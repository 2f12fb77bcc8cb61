"""Record sizes of torch.save archives where torch's reader cannot give them (torch <= 2.11)."""

from __future__ import annotations

import io

import pytest

torch = pytest.importorskip("torch")

from gdskit.formats.torch_zip import RecordSizes  # noqa: E402


class _OldReader:
    """A PyTorchFileReader as torch 2.11 has it: offsets, no sizes."""

    def __init__(self, reader: object) -> None:
        self._reader = reader

    def get_record_offset(self, name: str) -> int:
        return self._reader.get_record_offset(name)

    def get_all_records(self) -> list[str]:
        return self._reader.get_all_records()


@pytest.mark.parametrize("as_path", [True, False])
def test_zip_directory_gives_the_reader_sizes(tmp_path, as_path: bool) -> None:
    tensors = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 7, dtype=torch.int16)}
    path = tmp_path / "ckpt.pt"
    torch.save(tensors, path)
    source = str(path) if as_path else io.BytesIO(path.read_bytes())
    reader = torch._C.PyTorchFileReader(str(path))
    new = RecordSizes(reader, str(path))
    old = RecordSizes(_OldReader(reader), source)
    names = [f"data/{k}" for k in range(len(tensors))]
    assert [old(n) for n in names] == [new(n) for n in names]
    assert sorted(old(n) for n in names) == sorted([4000, 42])
    with pytest.raises(RuntimeError):
        old("data/99")


def test_spans_list_every_storage_record(tmp_path) -> None:
    from gdskit.formats.torch_zip import StorageRecords

    tensors = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 7, dtype=torch.int16),
               "view": None}
    tensors["view"] = tensors["a"][10:20]  # shares a's storage: no record of its own
    path = tmp_path / "ckpt.pt"
    torch.save(tensors, path)
    reader = torch._C.PyTorchFileReader(str(path))
    for r in (reader, _OldReader(reader)):
        records = StorageRecords(torch, r, str(path), path.stat().st_size, str(path))
        assert sorted(n for _key, _offset, n in records.spans()) == [42, 4000]


# -- the central directory, read as torch's zip reader reads it ------------------------------

def test_directory_agrees_with_torchs_reader(tmp_path) -> None:
    import gdskit.torch as gt
    from gdskit.formats.torch_zip import _ArchiveBytes, read_directory

    sd = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 7, dtype=torch.int16),
          "empty": torch.empty(0)}
    for name, save in (("plain.pt", torch.save), ("gdskit.pt", gt.save)):
        path = tmp_path / name
        save(sd, path)
        reader = torch._C.PyTorchFileReader(str(path))
        data = _ArchiveBytes(str(path))
        try:
            prefix, entries = read_directory(data)
        finally:
            data.close()
        records = reader.get_all_records()
        assert len(entries) == len(records)
        for record in records:
            entry = entries[(prefix + b"/" + record.encode()).lower()]
            assert entry.method == 0 and not entry.is_directory
            assert entry.size == reader.get_record_size(record)
            assert entry.header_offset == reader.get_record_header_offset(record)


def test_zip64_extra_field_gives_the_wide_values() -> None:
    import struct

    from gdskit.formats.torch_zip import _zip64_values

    wide = 0xFFFFFFFF
    extra = struct.pack("<HH", 0x7075, 2) + b"xx" + struct.pack("<HHQQ", 0x0001, 16, 5 << 32, 7 << 32)
    assert _zip64_values(extra, wide, 10, wide) == (5 << 32, 10, 7 << 32)  # size and offset, in order
    assert _zip64_values(extra, 3, wide, 9) == (3, 5 << 32, 9)
    assert _zip64_values(extra[:-8], wide, wide, wide) is None  # three values announced, two there
    assert _zip64_values(b"", wide, 1, 1) is None


def test_record_named_twice_is_read_by_torchs_reader(tmp_path) -> None:
    """Which of two entries of one name (in any case) miniz finds is its own business: such a
    record is read through torch's reader, so the values are torch.load's."""
    import warnings
    import zipfile

    import gdskit.torch as gt
    from torch_checkpoints import same

    plain = tmp_path / "plain.pt"
    torch.save({"a": torch.arange(10.0)}, plain)
    twice = tmp_path / "twice.pt"
    with zipfile.ZipFile(plain) as zin, zipfile.ZipFile(twice, "w") as zout, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate name
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info))
            if info.filename.endswith("/data/0"):
                folder = info.filename.split("/", 1)[0]  # torch's reader wants every entry in it, as spelt
                zout.writestr(f"{folder}/DATA/0", torch.arange(10.0).neg().numpy().tobytes())
    ref = torch.load(twice, weights_only=True)
    for ml in (None, "cpu"):
        assert same(gt.load(twice, map_location=ml), ref)
