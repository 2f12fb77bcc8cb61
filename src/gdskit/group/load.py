"""The steps every group load takes, whatever the format.

1. ``prepare()`` on every rank (parse the checkpoint, choose what this rank wants,
   make its destinations) gives a :class:`LoadJob`;
2. one exchange tells every rank what the others prepared: whether they failed, a digest
   of the checkpoint's layout and of the plan options and a fingerprint of the files'
   contents (both must agree), which segments each wants, which memory they load into;
3. every rank computes the same :func:`gdskit.group.plan.plan` and runs it
   (:func:`gdskit.group.pipeline.run`);
4. with ``verify=``, every rank checks what it holds and the ranks agree on the outcome
   (:func:`gdskit.group.checked.check_on_every_rank`).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import os
import struct
from collections.abc import Callable, Hashable
from typing import Any

import torch

from gdskit.durable import open_file_fd
from gdskit.engine import is_object_url, open_file
from gdskit.errors import GroupError, from_os_error
from gdskit.formats.gc_pause import collector_paused
from gdskit.formats.progress import Progress, ProgressArg
from gdskit.group import checked, exchange, failure, pipeline
from gdskit.group import config as group_options
from gdskit.group.plan import Segment, plan


@dataclasses.dataclass
class LoadJob:
    """What one rank prepared: the checkpoint's files and segments (the same on every rank),
    which of them this rank wants and the flat uint8 tensors they land in."""

    files: list[str]
    sizes: list[int | None]          # each file's expected size (None: not checked)
    segments: list[Segment]
    layout: list[Any]                # JSON-able description that every rank's must match
    wanted: list[bool]               # per segment
    dests: dict[Hashable, torch.Tensor]
    device_types: set[str]
    result: Any = None               # what the format makes of the filled destinations
    check: Callable[[], None] | None = None  # verify=: raises where the filled destinations differ from their digests

    @property
    def wanted_bytes(self) -> int:
        return sum(s.nbytes for s, w in zip(self.segments, self.wanted) if w)


@dataclasses.dataclass(frozen=True)
class _Told:
    """What one rank tells the others before the plan."""

    ok: bool
    error: str = ""
    layout: bytes = b""
    contents: bytes = b""
    device_types: tuple[str, ...] = ()
    wanted: bytes = b""

    def encode(self) -> bytes:
        head = json.dumps({"ok": self.ok, "error": self.error, "layout": self.layout.hex(),
                           "contents": self.contents.hex(), "device_types": list(self.device_types)}).encode()
        return struct.pack("<I", len(head)) + head + self.wanted

    @classmethod
    def decode(cls, raw: bytes) -> _Told:
        (n,) = struct.unpack_from("<I", raw)
        head = json.loads(raw[4:4 + n].decode())
        return cls(bool(head["ok"]), str(head["error"]), bytes.fromhex(head["layout"]),
                   bytes.fromhex(head["contents"]), tuple(head["device_types"]), raw[4 + n:])


def _bitmap(flags: list[bool]) -> bytes:
    out = bytearray((len(flags) + 7) // 8)
    for i, f in enumerate(flags):
        if f:
            out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def _bit(bitmap: bytes, i: int) -> bool:
    return bool(bitmap[i >> 3] >> (i & 7) & 1)


def _digest(job: LoadJob, opts: group_options.Options) -> bytes:
    # Whether the ranks check is in it: ranks that differ there would not meet at the check's exchange.
    doc = [job.layout, [list(s[1:]) for s in job.segments], [opts.window_bytes, opts.piece_bytes],
           job.check is not None]
    return hashlib.sha256(json.dumps(doc, default=repr).encode()).digest()


#: Blocks of each file's tensor bytes that every rank reads before a group load, and their size:
#: :func:`_fingerprint`. 16 x 4 KiB per file costs a few reads next to the header's.
FINGERPRINT_BLOCKS = 16
FINGERPRINT_BLOCK_BYTES = 4096


def sample_extents(ranges: list[tuple[int, int]], blocks: int = FINGERPRINT_BLOCKS,
                   block_bytes: int = FINGERPRINT_BLOCK_BYTES) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` of ``blocks`` reads spread evenly over the bytes of ``ranges``
    (``(offset, nbytes)`` pairs, taken as one run of bytes in the order given), each at most
    ``block_bytes`` and within one range; the first starts at the first byte."""
    ranges = [r for r in ranges if r[1] > 0]
    total = sum(n for _, n in ranges)
    starts = [0]
    for _, n in ranges:
        starts.append(starts[-1] + n)
    out: list[tuple[int, int]] = []
    for k in range(blocks if total else 0):
        pos = k * total // blocks
        i = bisect.bisect_right(starts, pos) - 1
        offset, n = ranges[i]
        within = pos - starts[i]
        out.append((offset + within, min(block_bytes, n - within)))
    return sorted(set(out))


def _fingerprint(job: LoadJob) -> bytes:
    """A digest of each file's size and of a sample of its tensor bytes (its whole extent where
    it has no segments), read with plain reads as the headers are.

    Files of one layout with other values (another training step, another fine-tune) differ
    here, where the layout digest cannot tell them apart. Neither the path nor the mtime is in
    it: a node-local copy of the file has its own of both and is the same checkpoint. Files that
    differ only between the samples are not told apart (docs/multigpu.md).

    An object (``s3://``) is told by its size and ETag instead, from one HEAD: the store's own
    name for its contents, under which every GET of the load is then made (a GET of a sample
    costs a request's latency). A rank loading an object and one loading a file differ here.
    """
    digest = hashlib.sha256()
    for i, path in enumerate(job.files):
        if is_object_url(path):
            with open_file(path, "r") as obj:
                digest.update(struct.pack("<QQ", i, obj.size))
                digest.update(b"etag:" + str(obj.etag).encode())
            continue
        fd, st = open_file_fd(path, os.O_RDONLY)
        try:
            mine = [(s.file_offset, s.nbytes) for s in sorted(job.segments, key=lambda s: s.file_offset)
                    if s.file == i]
            digest.update(struct.pack("<QQ", i, st.st_size))
            for offset, n in sample_extents(mine or [(0, st.st_size)]):
                digest.update(struct.pack("<QQ", offset, n))
                digest.update(os.pread(fd, n, offset))
        except OSError as exc:
            raise from_os_error(exc, path) from None
        finally:
            os.close(fd)
    return digest.digest()


def _disagreement(everyone: list[_Told]) -> str:
    """What the ranks disagree on ('' where they agree): the layout and options, or the contents."""
    for field, what in (("layout", "the same checkpoint (or not with the same gdskit.group.options)"),
                        ("contents", "the same checkpoint: the files have the same layout but other contents")):
        values = [getattr(t, field) for t in everyone]
        if len(set(values)) != 1:
            others = [r for r, v in enumerate(values) if v != values[0]]
            return (f"the ranks of the process group are not loading {what}; rank{'s' if len(others) > 1 else ''} "
                    f"{', '.join(map(str, others))} differ{'' if len(others) > 1 else 's'} from rank 0")
    return ""


def run_load(process_group: Any, prepare: Callable[[], LoadJob], progress: ProgressArg) -> LoadJob:
    """Prepare on this rank, agree with the group, read and share; the job with its destinations filled."""
    with collector_paused():
        return _run_load(process_group, prepare, progress)


def _run_load(process_group: Any, prepare: Callable[[], LoadJob], progress: ProgressArg) -> LoadJob:
    opts = group_options.current()
    info = exchange.describe(process_group, opts.timeout_s)
    job: LoadJob | None = None
    error: BaseException | None = None
    try:
        job = prepare()
        told = _Told(True, layout=_digest(job, opts), contents=_fingerprint(job),
                     device_types=tuple(sorted(job.device_types)), wanted=_bitmap(job.wanted))
    except Exception as exc:  # noqa: BLE001 - told to every rank, then raised here
        error = exc
        told = _Told(False, error=type(exc).__name__)
    what = "preparing the load"
    everyone = [_Told.decode(b) for b in exchange.all_gather_blobs(info, told.encode(),
                                                                   failure.Deadline(info.timeout_s), what)]
    if error is not None:
        raise error
    failed = tuple(r for r, t in enumerate(everyone) if not t.ok)
    if failed:
        names = ", ".join(f"{r} ({everyone[r].error})" for r in failed)
        raise GroupError(f"rank{'s' if len(failed) > 1 else ''} {names} of the process group failed {what}", failed)
    disagreement = _disagreement(everyone)
    if disagreement:
        raise GroupError(disagreement)
    assert job is not None
    types = {d for t in everyone for d in t.device_types}
    comm = info.comm_device(types) if types else info.control_device()
    wanted_by = [frozenset(r for r, t in enumerate(everyone) if _bit(t.wanted, i)) for i in range(len(job.segments))]
    fan_plan = plan(job.segments, wanted_by, info.world, piece_bytes=opts.piece_bytes,
                    window_bytes=opts.window_bytes)
    with Progress(job.wanted_bytes, progress, "loading") as prog:
        pipeline.run(fan_plan, info, comm, job.files, job.sizes, job.dests, prog)
    if job.check is not None:
        checked.check_on_every_rank(info, job.check)
    return job
