"""The digests of a torch.save archive as ``gdskit.torch.save(digests=True)`` writes it, taken from
the memory each byte is written from, in file order, never from the file.

torch's archive writer emits the archive's own bytes (zip local headers with their alignment
padding, ``data.pkl``, the small records, data descriptors, the central directory) and leaves a
hole where each storage's bytes go; the engine fills the holes afterwards. :class:`KeptWrites`
keeps each piece torch emits (the copy the file is written from) with its offset;
:class:`ArchiveDigests` feeds those pieces and each storage's bytes, interleaved as they lie in
the file, to :class:`~gdskit.formats.digest_scan.RunningDigests`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any, BinaryIO

from gdskit.errors import GdskitError
from gdskit.formats.digest_scan import RunningDigests, Span
from gdskit.formats.verified import tensor_digests
from gdskit.verify import DEFAULT_CHUNK_BYTES, FileDigests, Manifest, manifest_path_for, write_manifest

#: Bytes of a device storage copied to host memory at a time for the file's and chunks' digests.
DEVICE_PIECE_BYTES = 64 << 20


class KeptWrites:
    """A file object for torch's archive writer: each piece it writes goes to ``fh`` from a copy
    kept here with its offset (:attr:`pieces`); a seek forward (the hole for a storage's bytes)
    is passed on. torch's writer uses ``write``, ``seek`` relative to where it is, and ``flush``."""

    def __init__(self, fh: BinaryIO) -> None:
        self._fh = fh
        self.at = 0
        self.pieces: list[tuple[int, bytes]] = []

    def write(self, data: Any) -> int:
        piece = bytes(data)  # torch's buffer is its own again once this returns
        self._fh.write(piece)
        self.pieces.append((self.at, piece))
        self.at += len(piece)
        return len(piece)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.at = self._fh.seek(offset, whence)
        return self.at

    def tell(self) -> int:
        return self.at

    def flush(self) -> None:
        self._fh.flush()

    def writable(self) -> bool:
        return True


class ArchiveDigests:
    """The running digests of one archive: the archive's own ``pieces`` (from :class:`KeptWrites`)
    and the storages' bytes, fed in file order; ``records`` are its storage records, ``(key,
    offset, nbytes)`` as ``gdskit digest`` places them, digested as ``"data/<key>"`` as it names them."""

    def __init__(self, pieces: Sequence[tuple[int, bytes]], records: Iterable[tuple[str, int, int]]) -> None:
        self._pieces = list(pieces)
        self._next = 0
        spans = [Span("data/" + key, offset, nbytes) for key, offset, nbytes in records]
        self.running = RunningDigests(DEFAULT_CHUNK_BYTES, spans)

    def give_device_digests(self, named: Sequence[tuple[str, Any]]) -> None:
        """Hash the device storages among ``named`` (record name, flat uint8 tensor) on their GPUs,
        one launch per device; their bytes then feed only the file's and chunks' digests."""
        on_device = [(name, t) for name, t in named if t.device.type != "cpu"]
        for name, digest in (tensor_digests(on_device) if on_device else {}).items():
            self.running.given(name, digest)

    def feed_storage(self, offset: int, flat: Any) -> None:
        """The archive's bytes up to ``offset``, then a storage's (a flat uint8 tensor: host memory
        as it is, device memory through host copies of it, a piece at a time)."""
        self.feed_archive_to(offset)
        if self.running.at != offset:
            raise GdskitError(f"the archive's own bytes reach {self.running.at}, past a storage at {offset}")
        if flat.device.type == "cpu":
            self.running.feed(flat.numpy())
            return
        for start in range(0, flat.numel(), DEVICE_PIECE_BYTES):
            self.running.feed(flat[start:start + DEVICE_PIECE_BYTES].cpu().numpy())

    def feed_archive_to(self, offset: int) -> None:
        """The archive's own pieces that start before ``offset``; a hole nothing was written in
        (a meta storage's) as the zeros the file reads there."""
        self._feed_pieces_before(offset)
        if self.running.at < offset:
            self.running.feed_zeros(offset - self.running.at)

    def _feed_pieces_before(self, offset: int | None) -> None:
        """The pieces that start before ``offset`` (None: all that are left), zeros before each."""
        running = self.running
        while self._next < len(self._pieces) and (offset is None or self._pieces[self._next][0] < offset):
            at, piece = self._pieces[self._next]
            if at < running.at:
                raise GdskitError(f"the archive wrote over bytes at {at} already digested")
            running.feed_zeros(at - running.at)
            running.feed(piece)
            self._pieces[self._next] = (at, b"")  # fed: its memory goes
            self._next += 1

    def result(self, fd: int) -> FileDigests:
        """The digests of the file behind ``fd``, once every write to it has completed: the rest
        of the archive fed, the file exactly the bytes fed, its modification time the one it
        keeps when renamed into place."""
        self._feed_pieces_before(None)
        st = os.fstat(fd)
        if st.st_size != self.running.at:
            raise GdskitError(f"the written archive holds {st.st_size} bytes, not the {self.running.at} written")
        return self.running.result(st.st_mtime_ns)


def write_manifest_beside(path: str, digests: FileDigests) -> None:
    """The manifest of the file at ``path`` alone, beside it, where ``gdskit digest PATH`` writes it."""
    write_manifest(Manifest(DEFAULT_CHUNK_BYTES, {os.path.basename(path): digests}), manifest_path_for(path))
