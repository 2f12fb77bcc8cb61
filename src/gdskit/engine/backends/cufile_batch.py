"""Many small cuFile reads submitted through cuFile's batch API.

``cuFileBatchIOSetUp`` makes a batch of up to ``io_batchsize`` entries, ``cuFileBatchIOSubmit``
hands it a group of reads at once, ``cuFileBatchIOGetStatus`` reports the entries that finished
(in any order) and ``cuFileBatchIODestroy`` releases it. One call per read pays libcufile's fixed
cost per call; a batch pays it once per group.

Two decisions live here, and nowhere else:

* which reads of a cuFile job are batched (:func:`batch_chosen`): ``settings.cufile_batch``
  (``never``, ``always``, or ``auto``: the measured table :data:`BATCH_WINS`);
* whether :meth:`gdskit.File.read_batch` hands its device reads to the engine as one job
  (:func:`read_batch_as_one_job`), which is what lets them reach a batch.

The rules every batch keeps: entries are 4 KiB-aligned device memory (what the direct path
needs); a short count that is a multiple of the alignment is read on, as one call per read
would; one that is not is the end of the file; a failed entry raises the error one call per
read raises, after the group's other entries have finished; the batch is destroyed on every
way out (errors and ``KeyboardInterrupt`` included), after its entries have finished or been
cancelled; and a batch that stops making progress is cancelled and raises
``GdskitIOError(ETIMEDOUT)`` instead of waiting forever.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gdskit.engine.direct_path import direct_route
from gdskit.errors import GdskitIOError
from gdskit.vocabulary import CufileBatch, Path

KiB = 1024

#: Which entry sizes batch submission wins at, against one ``cuFileRead`` per entry run side by
#: side on the workers: measured on the H200 machine (cuFile compat mode; docs/engine.md,
#: "Batched submission", has the run). ``auto`` batches an entry when the row of the smallest
#: size at or above it says True; entries larger than every row take one call each.
#: Until measured, no row wins: ``auto`` behaves as before batches existed.
BATCH_WINS: dict[int, bool] = {4 * KiB: False, 8 * KiB: False, 16 * KiB: False, 32 * KiB: False, 64 * KiB: False}

#: ``auto`` batches a job only from this many entries on (a batch of one is one call, dearer).
MIN_ENTRIES = 2

#: cufile.json's default ``io_batchsize``: the limit where libcufile names none.
DEFAULT_IO_BATCHSIZE = 128

_CU_FILE_BATCH = 1      # CUfileBatchMode_t CUFILE_BATCH
_READ = 0               # CUfileOpcode_t CUFILE_READ
_WAITING, _PENDING, _INVALID, _CANCELED, _COMPLETE, _TIMEOUT, _FAILED = 1, 2, 4, 8, 16, 32, 64  # CUfileStatus_t
_TERMINAL = _INVALID | _CANCELED | _COMPLETE | _TIMEOUT | _FAILED


def _params_dtype() -> Any:
    """``CUfileIOParams_t`` as cufile.h lays it out (the bindings' ``io_params_dtype``)."""
    import numpy as np  # noqa: PLC0415 - import time

    batch = np.dtype([("dev_ptr_base", "<i8"), ("file_offset", "<i8"), ("dev_ptr_offset", "<i8"), ("size", "<u8")])
    return np.dtype({"names": ["mode", "u", "fh", "opcode", "cookie"],
                     "formats": ["<i4", batch, "<i8", "<i4", "<i8"],
                     "offsets": [0, 8, 40, 48, 56], "itemsize": 64})


def _events_dtype() -> Any:
    """``CUfileIOEvents_t``: cookie, status, bytes moved (``ret``, a ``size_t``)."""
    import numpy as np  # noqa: PLC0415 - import time

    return np.dtype({"names": ["cookie", "status", "ret"], "formats": ["<i8", "<i4", "<u8"],
                     "offsets": [0, 8, 16], "itemsize": 24})


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


# -- the decisions ---------------------------------------------------------------------------------

def batch_wins(size: int) -> bool:
    """Whether the measured table says a batch beats one call per entry at ``size`` bytes."""
    rows = [s for s in sorted(BATCH_WINS) if s >= size]
    return bool(rows) and BATCH_WINS[rows[0]]


def batches_possible(policy: CufileBatch) -> bool:
    """Whether ``policy`` may batch any read at all (``auto`` with no winning row may not)."""
    return policy is CufileBatch.ALWAYS or (policy is CufileBatch.AUTO and any(BATCH_WINS.values()))


def batch_chosen(policy: CufileBatch, size: int, entries: int) -> bool:
    """Whether an entry of ``size`` bytes, in a cuFile read job of ``entries`` entries that could
    be batched, goes into a batch."""
    if policy is CufileBatch.NEVER or entries < 1:
        return False
    if policy is CufileBatch.ALWAYS:
        return True
    return entries >= MIN_ENTRIES and batch_wins(size)


def read_batch_as_one_job(policy: CufileBatch, size: int, places: Sequence[int]) -> bool:
    """Whether :meth:`gdskit.File.read_batch`'s reads of ``size`` bytes into ``places`` may run
    as one job (where a batch can take them) instead of one after another: only when a batch
    could be chosen for them and no two destinations overlap (entries finish in any order, so
    overlapping ones would leave the bytes of whichever finished last)."""
    if len(places) < 2 or not batch_chosen(policy, size, len(places)):
        return False
    ordered = sorted(places)
    return all(a + size <= b for a, b in zip(ordered, ordered[1:]))


def batchable(ptr: int, buf_offset: int, file_offset: int, size: int, alignment: int) -> bool:
    """Whether one read can be a batch entry: its file offset, memory and size aligned."""
    return size > 0 and not (file_offset % alignment or (ptr + buf_offset) % alignment or size % alignment)


# -- what libcufile allows ---------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchSupport:
    """What one libcufile allows: ``limit`` entries per batch; ``refused``: why it would not set
    one up (``None``: it did, or was not asked yet), after which its reads take one call each."""

    limit: int
    refused: str | None = None


_support: weakref.WeakKeyDictionary[Any, BatchSupport] = weakref.WeakKeyDictionary()
_support_lock = threading.Lock()


def _limit_of(mod: Any, props_limit: int) -> int:
    """The most entries one batch may hold: libcufile's ``io_batchsize`` (its parameter, where the
    library answers) and the driver's ``max_batch_io_size``, the smaller of those known."""
    known = [props_limit] if props_limit > 0 else []
    try:
        param = mod.SizeTConfigParameter.PROPERTIES_IO_BATCHSIZE
        value = int(mod.get_parameter_size_t(int(param)))
        if value > 0:
            known.append(value)
    except Exception:  # older libcufile or bindings: no parameter API
        pass
    return min(known) if known else DEFAULT_IO_BATCHSIZE


def batch_support(lib: Any) -> BatchSupport:
    """What ``lib`` (a :class:`~gdskit.engine.backends.cufile.CufileLibrary`) allows, worked out once."""
    with _support_lock:
        found = _support.get(lib)
    if found is None:
        props = lib.properties()
        found = BatchSupport(_limit_of(lib.module, props.max_batch_io_size if props is not None else 0))
        route = direct_route()
        if route.route is None:
            # In compat mode libcufile 1.15's cuFileBatchIOSubmit blocked and never returned on the
            # H200 machine (docs/engine.md, "Batched submission"); one call per read there.
            found = replace(found, refused=f"no direct route ({route.reason.value if route.reason else 'unknown'}): "
                                           "cuFile's batch API is used only where its reads are direct")
        with _support_lock:
            found = _support.setdefault(lib, found)
    return found


def _refuse(lib: Any, why: str) -> None:
    with _support_lock:
        _support[lib] = replace(_support.get(lib) or BatchSupport(DEFAULT_IO_BATCHSIZE), refused=why)


@dataclass(frozen=True)
class BatchActivity:
    """What batch submission did in this process: batches set up, groups submitted, entries read,
    and cuFile read jobs that fell back to one call per read because a batch was refused."""

    batches: int = 0
    submits: int = 0
    entries: int = 0
    fallbacks: int = 0

    def __sub__(self, other: BatchActivity) -> BatchActivity:
        return BatchActivity(self.batches - other.batches, self.submits - other.submits,
                             self.entries - other.entries, self.fallbacks - other.fallbacks)


_activity = BatchActivity()
_activity_lock = threading.Lock()


def activity() -> BatchActivity:
    """A snapshot of :class:`BatchActivity` (snapshots subtract: ``after - before``)."""
    return _activity


def _note(**more: int) -> None:
    global _activity
    with _activity_lock:
        _activity = replace(_activity, **{k: getattr(_activity, k) + v for k, v in more.items()})


# -- how long a batch may go without progress --------------------------------------------------------

@dataclass(frozen=True)
class Timeouts:
    """``poll_s``: the longest one ``cuFileBatchIOGetStatus`` waits; ``stall_s``: how long a batch
    may go without an entry finishing before it is cancelled and the read fails with ETIMEDOUT;
    ``drain_s``: how long cancelled entries (after an error or an interrupt) may take to be
    reported before the batch is destroyed anyway."""

    poll_s: float = 0.1
    stall_s: float = 60.0
    drain_s: float = 5.0


_timeouts = Timeouts()


@contextlib.contextmanager
def timeouts(*, poll_s: float | None = None, stall_s: float | None = None,
             drain_s: float | None = None) -> Iterator[Timeouts]:
    """Other :class:`Timeouts` until the block ends (a seam for tests of a hung device)."""
    global _timeouts
    before = _timeouts
    changes = {"poll_s": poll_s, "stall_s": stall_s, "drain_s": drain_s}
    _timeouts = replace(before, **{k: v for k, v in changes.items() if v is not None})
    try:
        yield _timeouts
    finally:
        _timeouts = before


# -- evidence of the path (libcufile's batch counters) -----------------------------------------------

_L1_PATHS = ((Path.CUFILE_COMPAT, "batch_posix_processed_ops"), (Path.CUFILE_NVFS, "batch_nvfs_submit_ops"),
             (Path.CUFILE_P2PDMA, "batch_p2p_submit_ops"))


def batch_counters(lib: Any) -> dict[str, int] | None:
    """libcufile's process-wide batch counters (level 1), or None where statistics are off."""
    if not lib.stats_enabled:
        return None
    try:
        mod = lib.module
        s = mod.StatsLevel1()
        mod.get_stats_l1(s.ptr)
        return {name: int(getattr(s, name)) for _path, name in _L1_PATHS}
    except Exception:
        return None


def batch_evidence(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[Path, int] | None:
    """Entries per path from two :func:`batch_counters` snapshots (None: no evidence)."""
    if before is None or after is None:
        return None
    seen = {path: after[name] - before[name] for path, name in _L1_PATHS}
    return {p: n for p, n in seen.items() if n > 0} or None


# -- running a batch ------------------------------------------------------------------------------------

class BatchRefused(Exception):
    """libcufile would not set up a batch; the job takes one call per read instead."""


@dataclass
class _Entry:
    ptr: int
    file_offset: int
    buf_offset: int
    size: int
    done: int = 0


def read_batched(lib: Any, handle: int, entries: Sequence[tuple[int, int, int, int]], alignment: int,
                 fail: Callable[[int], BaseException], path: str,
                 on_bytes: Callable[[int], None] | None = None) -> list[int]:
    """Read ``entries`` (``(ptr, size, file_offset, buf_offset)``, each :func:`batchable`) through
    batches of ``handle``; the byte count of each, short only at end of file.

    ``fail(code)``: the error one ``cuFileRead`` returning ``-code`` raises. ``on_bytes`` is
    called with each entry's count once it is complete. Raises :class:`BatchRefused` (before
    anything is read) where libcufile will not set up a batch.
    """
    import numpy as np  # noqa: PLC0415 - import time

    if not entries:
        return []
    mod = lib.module
    support = batch_support(lib)
    if support.refused is not None:
        _note(fallbacks=1)
        raise BatchRefused(support.refused)
    todo = [_Entry(ptr, off, bo, size) for ptr, size, off, bo in entries]
    cap = min(support.limit, len(todo))
    run = _Run(mod, handle, todo, cap, alignment, fail, path, on_bytes, _timeouts, np)  # before the batch exists
    try:
        batch_id = run.batch_id = int(mod.batch_io_set_up(cap))
    except Exception as exc:  # cuFileError (e.g. no batches in this mode), or bindings without batches
        _refuse(lib, f"cuFileBatchIOSetUp({cap}) failed: {type(exc).__name__}: {exc}")
        _note(fallbacks=1)
        raise BatchRefused(str(exc)) from exc
    _note(batches=1)
    try:
        run.all()
    except BaseException:
        run.stop()  # cancel what is in flight and wait (bounded) until it is reported
        try:
            mod.batch_io_destroy(batch_id)
        except Exception:
            pass  # the error under way is the one to raise
        raise
    mod.batch_io_destroy(batch_id)
    return [e.done for e in todo]


class _Run:
    """One batch's life: groups submitted one after another, each reaped to its last entry."""

    def __init__(self, mod: Any, handle: int, todo: list[_Entry], cap: int, alignment: int,
                 fail: Callable[[int], BaseException], path: str, on_bytes: Callable[[int], None] | None,
                 limits: Timeouts, np: Any) -> None:
        self.mod, self.todo, self.cap, self.alignment = mod, todo, cap, alignment
        self.batch_id = 0  # set once the batch is set up
        self.fail, self.path, self.on_bytes, self.limits = fail, path, on_bytes, limits
        self.params = np.zeros(cap, dtype=_params_dtype())
        self.events = np.zeros(cap, dtype=_events_dtype())
        self.nr = ctypes.c_uint(0)
        self.timeout = _Timespec(int(limits.poll_s), int((limits.poll_s % 1) * 1e9))
        self.queue: deque[int] = deque(range(len(todo)))
        self.outstanding: set[int] = set()
        self.error: BaseException | None = None
        self.params["mode"] = _CU_FILE_BATCH
        self.params["opcode"] = _READ
        self.params["fh"] = handle

    def all(self) -> None:
        while self.queue and self.error is None:
            self._submit([self.queue.popleft() for _ in range(min(self.cap, len(self.queue)))])
            self._reap()
        if self.error is not None:
            raise self.error

    def _submit(self, group: list[int]) -> None:
        m, u, todo = len(group), self.params["u"], self.todo
        u["dev_ptr_base"][:m] = [todo[k].ptr for k in group]
        u["file_offset"][:m] = [todo[k].file_offset + todo[k].done for k in group]
        u["dev_ptr_offset"][:m] = [todo[k].buf_offset + todo[k].done for k in group]
        u["size"][:m] = [todo[k].size - todo[k].done for k in group]
        self.params["cookie"][:m] = [k + 1 for k in group]  # the entry's index; 0 would be a NULL cookie
        try:
            self.mod.batch_io_submit(self.batch_id, m, self.params.ctypes.data, 0)
        except Exception as exc:
            raise GdskitIOError(errno.EIO, f"cuFile batch submit failed: {exc}", self.path) from exc
        self.outstanding = set(group)
        _note(submits=1, entries=m)

    def _poll(self) -> int:
        """One ``cuFileBatchIOGetStatus``: how many events it wrote."""
        self.nr.value = len(self.outstanding)
        try:
            self.mod.batch_io_get_status(self.batch_id, len(self.outstanding), ctypes.addressof(self.nr),
                                         self.events.ctypes.data, ctypes.addressof(self.timeout))
        except Exception as exc:
            raise GdskitIOError(errno.EIO, f"cuFile batch status failed: {exc}", self.path) from exc
        return min(int(self.nr.value), len(self.events))

    def _reap(self) -> None:
        """Collect every entry of the group submitted last; read on short entries later."""
        last = time.monotonic()
        while self.outstanding:
            n = self._poll()
            now = time.monotonic()
            if n:
                last = now
            elif now - last > self.limits.stall_s:
                raise GdskitIOError(errno.ETIMEDOUT, f"cuFile batch: no entry finished in {self.limits.stall_s:g} s "
                                    f"({len(self.outstanding)} in flight)", self.path)
            for cookie, status, ret in self.events[:n].tolist():
                k = cookie - 1
                if k not in self.outstanding or not status & _TERMINAL:
                    continue  # not ours, reported already, or not finished
                self.outstanding.discard(k)
                if status == _COMPLETE:
                    self._complete(k, ret)
                elif self.error is None:
                    self.error = self._entry_error(status, ret)

    def _complete(self, k: int, ret: int) -> None:
        e = self.todo[k]
        left = e.size - e.done
        got = min(ret, left)
        e.done += got
        if got == left or got == 0 or got % self.alignment:
            # Done, or the end of the file: a count short of an aligned size stops there.
            if self.on_bytes is not None and self.error is None:
                try:
                    self.on_bytes(e.done)
                except BaseException as exc:  # abandons the job once this group has finished
                    self.error = exc
        else:
            self.queue.append(k)  # a short count: read the rest, as one call per read would

    def _entry_error(self, status: int, ret: int) -> BaseException:
        signed = ret - (1 << 64) if ret >= 1 << 63 else ret
        if status == _FAILED and signed < 0:
            return self.fail(-signed)
        if status == _TIMEOUT:
            return GdskitIOError(errno.ETIMEDOUT, "cuFile batch entry timed out", self.path)
        name = {_FAILED: "failed", _INVALID: "was refused as invalid", _CANCELED: "was cancelled"}.get(status, "failed")
        return GdskitIOError(errno.EIO, f"cuFile batch entry {name} (status {status})", self.path)

    def stop(self) -> None:
        """After an error or an interrupt: cancel the entries in flight and wait until libcufile
        has reported each (at most ``drain_s``), so no DMA into the caller's memory outlives the call."""
        if not self.outstanding:
            return
        try:
            self.mod.batch_io_cancel(self.batch_id)
        except Exception:
            pass  # still reap what finishes
        deadline = time.monotonic() + self.limits.drain_s
        while self.outstanding and time.monotonic() < deadline:
            try:
                n = self._poll()
            except BaseException:
                return
            for cookie, status, _ret in self.events[:n].tolist():
                if status & _TERMINAL:
                    self.outstanding.discard(cookie - 1)
