"""Digests of existing files for ``gdskit digest``: where each tensor's bytes lie in a file of a
format gdskit reads (safetensors, torch.save archives, ``.npy``; any other file is raw bytes),
the BLAKE3 digests of the file, its chunks and its tensors, and the check of a file against
its manifest.

Hashing here is the CPU's (the ``blake3`` package, multithreaded), or a GPU's (``device=``): each
file is read once, in pieces, every file in parallel on the CPU.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from gdskit.durable import is_temp_name, open_file_fd
from gdskit.errors import CudaError, FormatError, InvalidArgumentError, from_os_error
from gdskit.threads import executor
from gdskit.verify import (DEFAULT_CHUNK_BYTES, DIRECTORY_MANIFEST, MANIFEST_SUFFIX, SPREAD_BYTES, FileDigests,
                           Manifest, TensorDigest, chunk_ranges, hasher, manifest_path_for, read_manifest,
                           relative_name, write_manifest)

#: How ``gdskit digest`` calls a file by its format.
KINDS = ("safetensors", "torch", "npy", "raw")
_ZIP_MAGIC = b"PK\x03\x04"


@dataclass(frozen=True)
class Span:
    """One tensor's (or storage record's) bytes in a file."""

    name: str
    offset: int
    nbytes: int


def file_kind(path: str) -> str:
    """The format a file is digested as, from its name and first bytes."""
    lower = path.lower()
    if lower.endswith(".safetensors"):
        return "safetensors"
    if lower.endswith(".npy"):
        return "npy"
    if lower.endswith((".pt", ".pth", ".bin", ".ckpt")):
        fd, _st = open_file_fd(path, os.O_RDONLY)
        try:
            head = os.pread(fd, 4, 0)
        finally:
            os.close(fd)
        if head == _ZIP_MAGIC:
            return "torch"
    return "raw"


def tensor_spans(path: str, kind: str) -> list[Span]:
    """Where the tensors of ``path`` (a file of ``kind``) lie: safetensors tensors by name, the
    ``.npy`` array as ``"array"``, a torch.save archive's storage records as ``"data/<key>"``
    (the bytes views of a storage share); none for raw files.

    Raises
    ------
    FormatError
        The file is not the format its name says.
    """
    if kind == "safetensors":
        from gdskit.formats import safetensors_format as fmt  # noqa: PLC0415 - import time

        header = fmt.read_header_file(path)
        return [Span(e.name, header.data_start + e.start, e.nbytes) for e in header.entries]
    if kind == "npy":
        from gdskit.formats.npy_format import read_header  # noqa: PLC0415 - import time

        npy, size = read_header(path)
        if npy.data_offset + npy.nbytes > size:
            raise FormatError(f"the array's {npy.nbytes} bytes run past the end of the file", path=path)
        return [Span("array", npy.data_offset, npy.nbytes)]
    if kind == "torch":
        return _torch_spans(path)
    return []


def _torch_spans(path: str) -> list[Span]:
    try:
        import torch  # noqa: PLC0415 - optional dependency (torch)
    except ImportError:
        return []  # digested as raw bytes without torch
    from gdskit.formats.torch_zip import StorageRecords  # noqa: PLC0415 - optional dependency (torch)

    records = StorageRecords.open(torch, path, os.stat(path).st_size, path)
    try:
        spans = records.spans()
    finally:
        records.close()
    if spans is None:
        raise FormatError("a storage record of the archive cannot be placed", path=path)
    return [Span("data/" + key, offset, nbytes) for key, offset, nbytes in spans]


def readers_for(files_at_once: int) -> int:
    """Reading threads for each of ``files_at_once`` files digested together on the CPU: two where
    one file has a machine of 8 cores or more to itself, else one. On 16 cores two readers took
    an 8 GiB file from 5.2–6.2 to 8.4–9.8 GB/s; four or eight were slower than two, their copies
    competing with the hashing threads (``benchmarks/digest_rate.py``, benchmarks/RESULTS.md)."""
    return max(1, min(2, (os.cpu_count() or 1) // (4 * max(1, files_at_once))))


def digest_file(path: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES, spans: Iterable[Span] = (),
                on_bytes: Callable[[int], None] | None = None, device: int | None = None,
                readers: int | None = None) -> FileDigests:
    """The digests of the file at ``path``: of all its bytes, of each ``chunk_bytes`` piece, and of
    each span. ``on_bytes(n)`` is called as pieces are done (a progress bar). ``device``: read the
    file into that GPU's memory through the engine and hash it there (one launch pair for the
    file, its chunks and its spans) instead of on the CPU. ``readers``: threads reading ahead on
    the CPU (default: as for one file alone, :func:`readers_for`)."""
    if device is not None:
        return _digest_on_gpu(path, chunk_bytes, list(spans), on_bytes, device)
    fd, st = open_file_fd(path, os.O_RDONLY)
    try:
        return _digest_fd(fd, st, path, chunk_bytes, sorted(spans, key=lambda s: (s.offset, s.nbytes)), on_bytes,
                          readers_for(1) if readers is None else readers)
    finally:
        os.close(fd)


#: Bytes read at a time: each piece is hashed into the file's, its chunk's and its spans' digests.
READ_PIECE = 16 << 20


class RunningDigests:
    """The digests of one file's bytes fed in file order, in pieces of any size: of all of them,
    of each ``chunk_bytes`` piece, and of each span; what ``gdskit digest`` records. A span whose
    digest was taken elsewhere (a device tensor's, on its GPU) is :meth:`given` before its bytes
    come, which then feed only the file's and chunks' digests."""

    def __init__(self, chunk_bytes: int, spans: Iterable[Span]) -> None:
        self._all = list(spans)
        self._spans = sorted(self._all, key=lambda s: (s.offset, s.nbytes))
        self._given: dict[str, str] = {}
        self._chunk_bytes = chunk_bytes
        self._whole = hasher(spread=True)
        self._chunk = hasher(spread=True)
        self._chunks: list[str] = []
        self._span_digests = {s.name: hasher(spread=s.nbytes >= SPREAD_BYTES) for s in self._spans}
        self._active: list[Span] = []
        self._next_span = 0
        self.at = 0  # bytes fed so far

    def feed(self, data: Any) -> None:
        """The next bytes of the file (any object exposing a contiguous buffer)."""
        view = memoryview(data).cast("B")
        while view:
            room = self._chunk_bytes - self.at % self._chunk_bytes
            piece, view = view[:room], view[room:]
            self._feed_within_chunk(piece)

    def given(self, name: str, digest: str) -> None:
        """Span ``name``'s digest, taken elsewhere; before any of its bytes are fed."""
        if any(s.name == name for s in self._active) or self._span_digests.pop(name, None) is None:
            raise InvalidArgumentError(f"span {name!r} is unknown, or its bytes are being hashed already")
        self._given[name] = digest

    def feed_zeros(self, n: int) -> None:
        """``n`` zero bytes (a hole the file was written around)."""
        zeros = bytes(min(n, 1 << 20))
        while n:
            self.feed(memoryview(zeros)[:min(n, len(zeros))])
            n -= min(n, len(zeros))

    def _feed_within_chunk(self, piece: memoryview) -> None:
        at, end = self.at, self.at + len(piece)
        self._whole.update(piece)
        self._chunk.update(piece)
        spans = self._spans
        while self._next_span < len(spans) and spans[self._next_span].offset < end:
            if spans[self._next_span].name in self._span_digests:  # not given
                self._active.append(spans[self._next_span])
            self._next_span += 1
        for s in self._active:
            lo, hi = max(at, s.offset), min(end, s.offset + s.nbytes)
            if lo < hi:
                self._span_digests[s.name].update(piece[lo - at:hi - at])
        self._active = [s for s in self._active if s.offset + s.nbytes > end]
        self.at = end
        if end % self._chunk_bytes == 0:
            self._end_chunk()

    def _end_chunk(self) -> None:
        self._chunks.append(self._chunk.hexdigest())
        self._chunk = hasher(spread=True)

    def result(self, mtime_ns: int) -> FileDigests:
        """The digests of the :attr:`at` bytes fed (the whole file; ``mtime_ns`` its modification time).

        Raises
        ------
        FormatError
            A span reaches past the bytes fed.
        """
        past = [s.name for s in self._all if s.offset + s.nbytes > self.at]
        if past:
            raise FormatError(f"span {past[0]!r} reaches past the {self.at} bytes digested")
        if self.at % self._chunk_bytes:
            self._end_chunk()
        digests = {**{n: h.hexdigest() for n, h in self._span_digests.items()}, **self._given}
        tensors = {s.name: TensorDigest(s.offset, s.nbytes, digests[s.name]) for s in self._all}
        return FileDigests(self.at, mtime_ns, self._whole.hexdigest(), tuple(self._chunks), tensors)


def _digest_fd(fd: int, st: os.stat_result, path: str, chunk_bytes: int, spans: list[Span],
               on_bytes: Callable[[int], None] | None, readers: int = 1) -> FileDigests:
    """One pass over the file: every piece read once (positional reads, never a memory map, which a
    file shrinking under it would turn into a crash) and fed to the running digests in file order.
    ``readers`` threads read the next pieces while this one is hashed, each into its own buffer
    (``readers + 1`` buffers): one reading thread copies from the page cache at a few GB/s, a
    fraction of what the hashing threads of a many-core machine take in."""
    size = st.st_size
    running = RunningDigests(chunk_bytes, spans)
    piece = min(READ_PIECE, chunk_bytes, max(size, 1))
    depth = max(1, min(max(readers, 1) + 1, -(-size // piece)))  # pieces read or being hashed at once
    buffers = [memoryview(bytearray(piece)) for _ in range(depth)]

    def read(into: memoryview, at: int) -> int:
        return _read_fully(fd, into[:min(piece, size - at)], at, path)

    def feed(view: memoryview) -> None:
        running.feed(view)
        if on_bytes is not None:
            on_bytes(len(view))

    if size <= piece:  # one read: nothing to overlap, no thread to start (directories of small files)
        feed(buffers[0][:read(buffers[0], 0)])
        return running.result(st.st_mtime_ns)
    with executor(depth - 1, "gdskit-digest-read") as pool:  # leaving waits for the reads in flight
        # Piece k lands in buffer k % depth: that buffer's last piece was hashed before k is asked for.
        pending: deque[Future[int]] = deque()
        asked = done = 0
        while done * piece < size:
            while asked * piece < size and len(pending) < depth:
                pending.append(pool.submit(read, buffers[asked % depth], asked * piece))
                asked += 1
            feed(buffers[done % depth][:pending.popleft().result()])
            done += 1
    return running.result(st.st_mtime_ns)


def _read_fully(fd: int, into: memoryview, offset: int, path: str) -> int:
    done = 0
    while done < len(into):
        try:
            n = os.preadv(fd, [into[done:]], offset + done)
        except OSError as exc:
            raise from_os_error(exc, path) from exc
        if n == 0:
            raise FormatError(f"shrank while it was digested (read {offset + done} bytes)", path=path)
        done += n
    return done


def _digest_on_gpu(path: str, chunk_bytes: int, spans: list[Span], on_bytes: Callable[[int], None] | None,
                   device: int) -> FileDigests:
    from gdskit.engine import cuda_layer, digest_buffers, open_file  # noqa: PLC0415 - import time

    st = os.stat(path)
    if st.st_size == 0:
        return digest_file(path, chunk_bytes, spans, on_bytes)
    try:
        buffer = cuda_layer().DeviceArray(st.st_size, device)
    except CudaError as exc:
        if exc.code != "CUDA_ERROR_OUT_OF_MEMORY":
            raise
        raise CudaError(f"{path} ({st.st_size} bytes) does not fit in GPU {device}'s memory, which holds the "
                        "whole file to hash it: digest it on the CPU (without --device)", code=exc.code) from None
    try:
        with open_file(path, "r") as f:
            got = f.read(buffer, st.st_size, 0)
            if got != st.st_size or f.size != st.st_size:
                raise FormatError(f"changed size while it was read ({st.st_size} -> {f.size} bytes)", path=path)
        pieces = [(0, st.st_size)] + list(chunk_ranges(st.st_size, chunk_bytes)) + \
            [(s.offset, s.offset + s.nbytes) for s in spans]
        digests = digest_buffers([(buffer.ptr + a, b - a) for a, b in pieces], 0, device)
    finally:
        buffer.free()
    if on_bytes is not None:
        on_bytes(st.st_size)
    n_chunks = len(pieces) - 1 - len(spans)
    chunks = tuple(digests[1:1 + n_chunks])
    tensors = {s.name: TensorDigest(s.offset, s.nbytes, d) for s, d in zip(spans, digests[1 + n_chunks:])}
    return FileDigests(st.st_size, st.st_mtime_ns, digests[0], chunks, tensors)


def files_under(root: str) -> list[str]:
    """The regular files under directory ``root`` (sorted, ``/``-separated relative names), less
    manifests and gdskit's temporary files. A link to a file counts as that file (a Hugging Face
    snapshot is links into its blobs); links to directories are not followed."""
    out = []
    for folder, dirs, names in os.walk(root):
        dirs.sort()
        for name in names:
            if name == DIRECTORY_MANIFEST or name.endswith(MANIFEST_SUFFIX) or is_temp_name(name):
                continue
            full = os.path.join(folder, name)
            if os.path.isfile(full):
                out.append(os.path.relpath(full, root).replace(os.sep, "/"))
    return sorted(out)


@dataclass(frozen=True)
class Target:
    """One PATH of ``gdskit digest``: its manifest and the files it lists (relative to the manifest)."""

    path: str
    manifest: str
    files: tuple[str, ...]

    @property
    def folder(self) -> str:
        return os.path.dirname(self.manifest)


def target_of(path: str) -> Target:
    """A file (its manifest beside it) or a directory (its manifest inside it, every file under it)."""
    manifest = manifest_path_for(path)
    if os.path.isdir(path):
        return Target(path, manifest, tuple(files_under(path)))
    return Target(path, manifest, (os.path.basename(path),))


@dataclass(frozen=True)
class FileResult:
    """One file digested or checked: ``status`` ``"written"``, ``"ok"``, ``"mismatch"``, ``"stale"``,
    ``"missing"`` or ``"unlisted"`` (a file PATH no manifest lists); ``bad`` names what differs (tensors, ``chunk N``, ``file``)."""

    path: str
    kind: str
    size: int
    tensors: int
    digest: str
    seconds: float
    status: str
    bad: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "kind": self.kind, "size": self.size, "tensors": self.tensors,
                "digest": self.digest, "seconds": round(self.seconds, 6), "status": self.status, "bad": list(self.bad)}


def _digest_one(full: str, chunk_bytes: int, on_bytes: Callable[[int], None] | None,
                device: int | None, readers: int) -> tuple[str, FileDigests, float]:
    start = time.perf_counter()
    kind = file_kind(full)
    spans = tensor_spans(full, kind)
    digests = digest_file(full, chunk_bytes, spans, on_bytes, device, readers)
    return kind, digests, time.perf_counter() - start


def _workers(jobs: int | None, device: int | None) -> int:
    """Files digested at once: ``jobs`` (default up to 8) on the CPU, one on a GPU (each file is
    read into its memory whole)."""
    return 1 if device is not None else jobs or min(8, os.cpu_count() or 1)


def make_manifests(paths: list[str], chunk_bytes: int = DEFAULT_CHUNK_BYTES, jobs: int | None = None,
                   on_bytes: Callable[[int], None] | None = None, device: int | None = None) -> list[FileResult]:
    """Digest every file of ``paths`` (files and directories), files in parallel, and write each
    PATH's manifest. ``device``: hash on that GPU (each file read whole into its memory; files
    one at a time). Returns one result per file."""
    targets = [target_of(p) for p in paths]
    work = [(t, rel) for t in targets for rel in t.files]
    workers = _workers(jobs, device)
    readers = readers_for(min(workers, len(work)))
    with executor(workers, "gdskit-digest") as pool:
        done = list(pool.map(lambda tr: _digest_one(os.path.join(tr[0].folder, tr[1]), chunk_bytes, on_bytes,
                                                    device, readers), work))
    results = []
    by_target: dict[str, dict[str, FileDigests]] = {t.manifest: {} for t in targets}
    for (t, rel), (kind, digests, seconds) in zip(work, done):
        by_target[t.manifest][rel] = digests
        results.append(FileResult(os.path.join(t.folder, rel), kind, digests.size, len(digests.tensors),
                                  digests.digest, seconds, "written"))
    for t in targets:
        write_manifest(Manifest(chunk_bytes, by_target[t.manifest]), t.manifest)
    return results


def _compare(full: str, want: FileDigests, chunk_bytes: int, on_bytes: Callable[[int], None] | None,
             readers: int, device: int | None) -> tuple[str, FileDigests, float, str, tuple[str, ...]]:
    start = time.perf_counter()
    st = os.stat(full)
    if st.st_size != want.size:
        return "raw", want, 0.0, "stale", ("size",)
    spans = [Span(n, t.offset, t.nbytes) for n, t in want.tensors.items()]
    got = digest_file(full, chunk_bytes, spans, on_bytes, device, readers)
    bad = [f"tensor {n}" for n, t in want.tensors.items() if got.tensors[n].digest != t.digest]
    bad += [f"chunk {i}" for i, (a, b) in enumerate(zip(got.chunks, want.chunks)) if a != b]
    if got.digest != want.digest:
        bad.append("file")
    status = "ok" if not bad else ("stale" if st.st_mtime_ns != want.mtime_ns else "mismatch")
    return file_kind(full), got, time.perf_counter() - start, status, tuple(bad)


def check_manifests(paths: list[str], jobs: int | None = None, on_bytes: Callable[[int], None] | None = None,
                    device: int | None = None) -> list[FileResult]:
    """Check every file each PATH's manifest lists against it (a file PATH: its own manifest, or the
    directory manifest above it that lists it). ``device``: hash on that GPU, as
    :func:`make_manifests` does. Returns one result per file."""
    work = []
    unlisted: list[FileResult] = []
    for p in paths:
        manifest_path = manifest_path_for(p)
        if not os.path.isdir(p) and not os.path.exists(manifest_path):
            manifest_path = _directory_manifest_listing(p) or manifest_path
        manifest = read_manifest(manifest_path)
        folder = os.path.dirname(manifest_path)
        names = list(manifest.files)
        if not os.path.isdir(p):
            listed = relative_name(manifest_path, p)
            names = [n for n in names if n in listed][:1]
            if not names:  # no manifest describes this file (new, or renamed since): nothing vouches for it
                size = os.path.getsize(p) if os.path.isfile(p) else 0
                unlisted.append(FileResult(os.path.abspath(p), file_kind(p), size, 0, "", 0.0, "unlisted", ("file",)))
                continue
        work += [(os.path.join(folder, n), manifest.files[n], manifest.chunk_bytes) for n in names]

    def one(item: tuple[str, FileDigests, int]) -> FileResult:
        full, want, chunk_bytes = item
        if not os.path.isfile(full):
            return FileResult(full, "raw", want.size, len(want.tensors), "", 0.0, "missing", ("file",))
        kind, got, seconds, status, bad = _compare(full, want, chunk_bytes, on_bytes, readers, device)
        return FileResult(full, kind, want.size, len(want.tensors), got.digest, seconds, status, bad)

    workers = _workers(jobs, device)
    readers = readers_for(min(workers, len(work)))
    with executor(workers, "gdskit-digest") as pool:
        return unlisted + list(pool.map(one, work))


def _directory_manifest_listing(path: str) -> str | None:
    folder = os.path.dirname(os.path.abspath(path))
    for _ in range(4):
        candidate = os.path.join(folder, DIRECTORY_MANIFEST)
        if os.path.isfile(candidate):
            return candidate
        folder = os.path.dirname(folder)
    return None


def total_bytes(paths: list[str]) -> int:
    """Bytes the files of ``paths`` hold (for a progress bar)."""
    total = 0
    for p in paths:
        t = target_of(p)
        for rel in t.files:
            try:
                total += os.path.getsize(os.path.join(t.folder, rel))
            except OSError:
                pass
    return total
