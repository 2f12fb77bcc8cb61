"""Tensors of a safetensors checkpoint one by one, in file order, within a memory budget.

The torch side of :func:`gdskit.safetensors.iter_tensors` (imports torch). An inference
engine's weight loader takes each tensor, copies or slices it into its own parameters, and
drops it; what it asks of the loader is that the tensors waiting for it, and those being
read, never take more than a budget of device memory.

How the budget is kept: every tensor the stream makes is counted from the moment it is
allocated until its memory is freed (a finalizer on its storage, so a view the caller keeps
counts too). Reads are started ahead, a batch of neighbours at a time, only while that count
plus the next batch stays within ``max_inflight_bytes``. A caller that keeps tensors leaves
less room for reading ahead; one that keeps so many that the next tensor does not fit gets it
read alone when it asks (the stream never waits for memory the caller holds).

Reads run on one background thread, a batch at a time, each batch one
:func:`gdskit.formats.torch_io.execute` (so small neighbours are read together and, on a GPU,
scattered straight into their tensors).
"""

from __future__ import annotations

import concurrent.futures
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from gdskit.errors import InvalidArgumentError
from gdskit.formats import read_plan
from gdskit.engine import can_scatter, open_file
from gdskit.formats.safetensors_format import TruncatedFileError, select_names
from gdskit.formats.shard_index import Located, index_checkpoint
from gdskit.formats.verified import LoadChecks, check_loaded, expectations
from gdskit.verify import check_tensors, verify_mode
from gdskit.threads import executor

#: The default budget is the larger of this and twice the largest tensor.
DEFAULT_INFLIGHT_BYTES = 1 << 30
#: A batch of reads takes at most this share of the budget, so several are under way at once.
BATCH_SHARE = 4


class _Live:
    """Bytes of the stream's tensors still alive, and the most there ever were (thread-safe:
    finalizers run in whichever thread frees the memory)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes = 0
        self.peak = 0

    def track(self, t: torch.Tensor, nbytes: int) -> None:
        if not nbytes:
            return
        with self._lock:
            self.bytes += nbytes
            self.peak = max(self.peak, self.bytes)
        weakref.finalize(t.untyped_storage(), self._release, nbytes)

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self.bytes -= nbytes


class _Reader:
    """The reads of one stream, run on its background thread; holds no reference to the
    stream, so a stream its caller drops is closed at once (by its ``__del__``)."""

    def __init__(self, device: torch.device, sizes: dict[str, int], checks: LoadChecks) -> None:
        self.device = device
        self.sizes = sizes
        self.checks = checks
        self.files: dict[str, Any] = {}
        self.thread: int | None = None

    def read(self, path: str, plan: read_plan.ReadPlan, box: list[dict[str, torch.Tensor]],
             hashed: list[tuple[str, torch.Tensor]] | None = None) -> concurrent.futures.Future[dict[str, str]] | None:
        """Read ``plan`` into the destinations in ``box``, which it empties: the executor keeps
        a job's arguments a moment after its result is out, and the tensors must not be
        kept alive by that. ``hashed`` (a verified load into host memory): the tensors whose
        digests the result gives, hashed on the checks' threads once the read has landed."""
        from gdskit.formats.torch_io import execute  # noqa: PLC0415 - test seam
        dests = box.pop()
        self.thread = threading.get_ident()
        f = self.files.get(path)
        if f is None:
            self.close_files()  # batches come in file order: the previous shard is done
            f = self.files[path] = open_file(path, "r")
            if f.size != self.sizes[path]:
                raise TruncatedFileError(f"{path} changed size after its header was read "
                                         f"({self.sizes[path]} -> {f.size} bytes)")
        execute(f, plan, self.device, dests=dests)
        del dests
        if hashed is None:
            return None
        named = list(hashed)
        hashed.clear()  # as ``box``: only the hashing keeps the tensors now
        return self.checks.hash(named, self.device)

    def close_files(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()


class TensorStream(Iterator[tuple[str, torch.Tensor]]):
    """Iterator of ``(name, tensor)``; see :func:`gdskit.safetensors.iter_tensors`.

    ``live_bytes`` is the memory the stream's tensors hold now (being read, waiting, or
    yielded and not yet freed), ``peak_live_bytes`` the most they held at once.
    """

    def __init__(self, path_or_paths: Any, device: torch.device, *, keys: Iterable[str] | None = None,
                 max_inflight_bytes: int | None = None, torch_type: Callable[[Any, Any], tuple[Any, tuple[int, ...]]],
                 shape: read_plan.ReadShape, verify: Any = False) -> None:
        """``torch_type`` and ``shape``: :mod:`gdskit.safetensors`' dtype table and read shape
        (passed in, as this module is below it)."""
        self._shape = shape

        mode = verify_mode(verify)
        if mode.whole_file:
            raise InvalidArgumentError("iter_tensors yields each tensor before the whole file is read: it checks "
                                       "per-tensor digests (verify=True or a manifest), not a file's sha256")
        index = index_checkpoint(path_or_paths)
        # Nothing to check against is refused before a byte is read.
        self._expect = (expectations([p for p, _h in index.headers], mode, {p: h.metadata for p, h in index.headers},
                                     device) if mode.on else None)
        wanted = set(select_names(index.tensors, keys))  # yielded in file order, whatever the keys' order
        chosen = [loc for name, loc in index.tensors.items() if name in wanted]
        # Every dtype checked before anything is read.
        self._types = {loc.entry.name: torch_type(torch, loc.entry) for loc in chosen}
        largest = max((loc.entry.nbytes for loc in chosen), default=0)
        if max_inflight_bytes is None:
            budget = max(DEFAULT_INFLIGHT_BYTES, 2 * largest)
        else:
            if isinstance(max_inflight_bytes, bool) or not isinstance(max_inflight_bytes, int) \
                    or max_inflight_bytes <= 0:
                raise InvalidArgumentError(f"max_inflight_bytes must be a positive int, got {max_inflight_bytes!r}")
            if max_inflight_bytes < largest:
                name = max(chosen, key=lambda loc: loc.entry.nbytes).entry.name
                raise InvalidArgumentError(f"max_inflight_bytes={max_inflight_bytes} is smaller than tensor "
                                           f"{name!r} ({largest} bytes)")
            budget = max_inflight_bytes
        self.max_inflight_bytes = budget
        self._batch_bytes = max(budget // BATCH_SHARE, 1)
        self._device = device
        self._pending: deque[Located] = deque(chosen)
        self._jobs: deque[tuple[concurrent.futures.Future[Any], list[tuple[str, torch.Tensor]],
                                list[Located]]] = deque()
        self._ready: deque[tuple[str, torch.Tensor]] = deque()
        self._live = _Live()
        self._checks = LoadChecks(self._expect is not None)
        self._reader = _Reader(device, {p: h.file_size for p, h in index.headers}, self._checks)
        self._thread = executor(1, "gdskit-stream")
        self._closed = False

    @property
    def live_bytes(self) -> int:
        return self._live.bytes

    @property
    def peak_live_bytes(self) -> int:
        return self._live.peak

    def __iter__(self) -> TensorStream:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        if self._closed:
            raise StopIteration
        try:
            self._admit()
            if not self._ready:
                if not self._jobs:
                    self.close()
                    raise StopIteration
                job, items, batch = self._jobs.popleft()
                digests = job.result()  # raises what the read raised
                if self._expect is not None:
                    expect = self._expect[batch[0].path]
                    ranges = {loc.entry.name: (loc.file_offset, loc.file_offset + loc.entry.nbytes) for loc in batch}
                    if digests is not None:  # hashed once the read landed, while later reads ran
                        check_tensors(expect, digests.result(), ranges)
                    else:  # on the GPU, on this thread's stream
                        check_loaded(expect, items, ranges)
                self._ready.extend(items)
                del items
            return self._ready.popleft()
        except StopIteration:
            raise
        except BaseException:
            self.close()
            raise

    def _admit(self) -> None:
        """Start the reads that fit in the budget; when the caller is about to wait and none
        is under way, the next tensor's read starts whatever the caller holds."""
        while self._pending:
            room = self.max_inflight_bytes - self._live.bytes
            head = self._pending[0]
            if head.entry.nbytes > room and (self._jobs or self._ready):
                return
            limit = max(self._checks.batch_limit(min(self._batch_bytes, room), self._device), head.entry.nbytes)
            batch = [self._pending.popleft()]
            held = head.entry.nbytes
            while (self._pending and self._pending[0].path == head.path
                   and held + self._pending[0].entry.nbytes <= limit):
                held += self._pending[0].entry.nbytes
                batch.append(self._pending.popleft())
            self._submit(batch)

    def _submit(self, batch: list[Located]) -> None:
        raw = self._device.type == "cuda" and can_scatter()  # the engine scatters into the tensors themselves
        items: list[tuple[str, torch.Tensor]] = []
        dests: dict[str, torch.Tensor] = {}
        extents = []
        for loc in batch:
            name = loc.entry.name
            dt, shape = self._types[name]
            t = torch.empty(shape, dtype=dt, device=self._device)
            self._live.track(t, loc.entry.nbytes)
            items.append((name, t))
            dests[name] = t if raw else t.reshape(-1).view(torch.uint8)
            extents.append(read_plan.Extent(name, loc.file_offset, loc.entry.nbytes))
        plan = read_plan.plan(extents, small=self._shape.small, max_group=self._shape.max_group,
                              max_gap=self._shape.max_gap)
        hashed = list(items) if self._expect is not None and self._checks.overlaps(self._device) else None
        self._jobs.append((self._thread.submit(self._reader.read, batch[0].path, plan, [dests], hashed), items, batch))

    def close(self) -> None:
        """Stop: reads not yet started are dropped, the one under way is waited for, files closed."""
        if self._closed:
            return
        self._closed = True
        for job, _items, _batch in self._jobs:
            job.cancel()
        # (The reader's own thread cannot wait for itself; a stream is only closed there by
        # interpreter shutdown.)
        in_reader = self._reader.thread == threading.get_ident()
        self._thread.shutdown(wait=not in_reader)
        self._checks.close(wait=not in_reader)  # no hashing outlives the stream
        self._reader.close_files()
        self._jobs.clear()
        self._ready.clear()
        self._pending.clear()

    def __enter__(self) -> TensorStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown; nothing left to tell
            pass
