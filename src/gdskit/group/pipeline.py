"""Run a :class:`~gdskit.group.plan.FanOutPlan` on one rank: read its share, broadcast, copy out.

Window by window, on every rank alike:

1. wait for this rank's reads of window ``j`` (a background thread ran them through
   the engine: :func:`gdskit.formats.torch_io.execute` over a read plan of the units);
2. start the reads of window ``j + 1`` (they overlap the broadcasts below);
3. agree: every rank says whether anything failed so far (:func:`failure.agree`);
4. broadcast window ``j``'s shared units from their owners, each straight into the
   receiving rank's own tensor where the unit is one range of a tensor it wants, in
   the comm device's memory; into the window's staging buffer otherwise;
5. copy the staged units' wanted parts out; record the bytes that came from peers.

A last agreement after the last window covers the copies and callbacks of that window.
Staging is one buffer per window, made when its reads start and dropped after its
copies: at most two exist at once.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from gdskit.errors import FormatError, with_path
from gdskit.formats import read_plan
from gdskit.engine import open_file, record_peer
from gdskit.formats.progress import Progress
from gdskit.formats.safetensors_format import TruncatedFileError
from gdskit.formats.torch_io import execute
from gdskit.group import exchange, failure
from gdskit.group.plan import FanOutPlan, Unit, Window
from gdskit.threads import executor

#: The engine reads units below this size together (read_plan's small-range coalescing).
_SMALL_READ = 1 << 20
_MAX_GROUP = 16 << 20


class _FirstBytes(Progress):
    """Set when a read job's first bytes land: the job is past its device-wide synchronise, so
    the main thread may queue broadcasts without making the job wait for them."""

    def __init__(self, started: threading.Event) -> None:
        super().__init__(0, False)
        self._started = started

    def advance(self, nbytes: int) -> None:
        self._started.set()


class _Window:
    """One window at this rank: where each unit's bytes go, and its staging."""

    def __init__(self, window: Window, rank: int, comm: torch.device, dests: Mapping[Hashable, torch.Tensor]) -> None:
        self.window = window
        self.targets: dict[int, torch.Tensor] = {}  # index in window.units -> where the unit lands
        self.staged: list[tuple[Unit, torch.Tensor]] = []  # units whose wanted parts are copied out
        self.wanted_bytes = 0  # bytes of tensors this rank asked for that are complete after the window
        layout: list[tuple[int, Unit]] = []
        size = 0
        for i, u in enumerate(window.units):
            if not u.shared and u.owner != rank:
                continue
            if rank in u.wanted_by:
                self.wanted_bytes += u.nbytes
            p = u.parts[0]
            whole = u.lands_whole(rank) and dests[p.key].device == comm if u.shared else True
            if whole:
                self.targets[i] = dests[p.key][p.key_offset:p.key_offset + u.nbytes]
            else:
                layout.append((i, u))
                size += u.nbytes
        self.staging = torch.empty(size, dtype=torch.uint8, device=comm) if size else None
        pos = 0
        for i, u in layout:
            view = self.staging[pos:pos + u.nbytes]  # type: ignore[index]
            self.targets[i] = view
            if rank in u.wanted_by:
                self.staged.append((u, view))
            pos += u.nbytes

    def reads(self, rank: int) -> list[tuple[int, Unit]]:
        return [(i, u) for i, u in enumerate(self.window.units) if u.owner == rank]

    def copy_out(self, dests: Mapping[Hashable, torch.Tensor]) -> None:
        for u, view in self.staged:
            for p in u.parts:
                dests[p.key][p.key_offset:p.key_offset + p.nbytes].copy_(view[p.unit_offset:p.unit_offset + p.nbytes])
        self.staging = None
        self.staged = []


class _Reader:
    """This rank's storage reads, one window at a time on a background thread."""

    def __init__(self, files: Sequence[str], sizes: Sequence[int | None]) -> None:
        self._paths = files
        self._sizes = sizes
        self._open: dict[int, Any] = {}
        self._pool = executor(1, "gdskit-group-read")

    def _file(self, index: int) -> Any:
        f = self._open.get(index)
        if f is None:
            f = self._open[index] = open_file(self._paths[index], "r")
            want = self._sizes[index]
            if want is not None and f.size != want:
                raise TruncatedFileError(f"changed size after its header was read ({want} -> {f.size} bytes)",
                                         path=self._paths[index])
        return f

    def start(self, reads: list[tuple[int, Unit]], targets: Mapping[int, torch.Tensor],
              started: threading.Event | None) -> concurrent.futures.Future[None]:
        def run() -> None:
            try:
                by_file: dict[tuple[int, torch.device], list[int]] = {}
                for i, u in reads:
                    by_file.setdefault((u.file, targets[i].device), []).append(i)
                units = dict(reads)
                for (file, device), ids in by_file.items():
                    extents = [read_plan.Extent(i, units[i].file_offset, units[i].nbytes) for i in ids]
                    rp = read_plan.plan(extents, small=_SMALL_READ, max_group=_MAX_GROUP, max_gap=0)
                    try:
                        execute(self._file(file), rp, device, dests={i: targets[i] for i in ids},
                                progress=_FirstBytes(started) if started is not None else None)
                    except FormatError as exc:
                        raise with_path(exc, self._paths[file]) from None
            finally:
                if started is not None:
                    started.set()
        return self._pool.submit(run)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for f in self._open.values():
            f.close()
        self._open.clear()


def run(plan: FanOutPlan, info: exchange.GroupInfo, comm: torch.device, files: Sequence[str],
        sizes: Sequence[int | None], dests: Mapping[Hashable, torch.Tensor], progress: Progress) -> None:
    """Fill this rank's ``dests`` (flat uint8 tensors by key) by ``plan``; raises on every rank if one fails."""
    me = info.rank
    backend = info.backends.get(comm.type, "?")
    device_index = comm.index if comm.type == "cuda" else None
    reader = _Reader(files, sizes)
    error: BaseException | None = None
    pending: tuple[_Window, concurrent.futures.Future[None]] | None = None

    def start(j: int) -> tuple[_Window, concurrent.futures.Future[None]]:
        win = _Window(plan.windows[j], me, comm, dests)
        started = threading.Event() if comm.type == "cuda" else None
        fut = reader.start(win.reads(me), win.targets, started)
        if started is not None:
            started.wait(timeout=5.0)  # only a matter of speed: see _FirstBytes
        return win, fut

    def agree(what: str) -> None:
        deadline = failure.Deadline(info.timeout_s)
        failure.agree(lambda flag: exchange.failed_ranks(info, flag, deadline, what), error, what)

    try:
        try:
            pending = start(0)
        except Exception as exc:  # noqa: BLE001 - told to the group below
            error = exc
        for j in range(len(plan.windows)):
            current, pending = pending, None
            if current is not None:
                try:
                    current[1].result()
                except Exception as exc:  # noqa: BLE001
                    error = error or exc
            if error is None and j + 1 < len(plan.windows):
                try:
                    pending = start(j + 1)
                except Exception as exc:  # noqa: BLE001
                    error = exc
            agree(f"before window {j + 1} of {len(plan.windows)}")  # raises unless every rank has its window
            win = current[0]  # type: ignore[index]
            items = [(win.targets[i], u.owner) for i, u in enumerate(win.window.units) if u.shared]
            seconds = exchange.broadcast_window(info, items, failure.Deadline(info.timeout_s),
                                                f"broadcasting window {j + 1} of {len(plan.windows)}")
            try:
                win.copy_out(dests)
                _record_received(win.window, me, info, backend, seconds, device_index)
                if win.wanted_bytes:
                    progress.advance(win.wanted_bytes)
            except Exception as exc:  # noqa: BLE001
                error = exc
        agree("the load")
    finally:
        if pending is not None:
            concurrent.futures.wait([pending[1]])
        reader.close()


def _record_received(window: Window, me: int, info: exchange.GroupInfo, backend: str, seconds: float,
                     device: int | None) -> None:
    by_source: dict[int, list[int]] = {}
    total = 0
    for u in window.units:
        if u.shared and u.owner != me:
            row = by_source.setdefault(u.owner, [0, 0])
            row[0] += u.nbytes
            row[1] += 1
            total += u.nbytes
    for owner, (nbytes, ops) in by_source.items():
        record_peer(nbytes, info.global_rank(owner), backend, seconds * nbytes / total, device, ops)
