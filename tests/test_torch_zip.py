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
