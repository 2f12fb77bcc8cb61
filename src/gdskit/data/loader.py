"""The :class:`Loader`: batches of a dataset in GPU (or host) memory, sharded across ranks, read ahead.

How a batch travels: a reader thread plans its reads (:mod:`gdskit.data.read`) and reads it, up
to ``prefetch`` batches ahead of the caller (with ``workers``, the caller's thread plans it and a
reader process reads it: :mod:`gdskit.engine.reader_processes`): on the CPU straight into its tensor; for a GPU,
a batch of small reads into a pinned staging slot (:mod:`gdskit.data.staging`), one of large
reads straight into device memory by the engine's device paths. The caller's ``next()`` takes
the oldest batch; a staged one is then copied to the GPU in one copy: a small one (up to
``CALLER_STREAM_COPY_MAX``) on the caller's current stream itself, behind the caller's work; a
larger one on the loader's side stream, and the caller's current stream waits on an event
recorded there after the batch is complete. Either way the hand-off is stream-ordered: no
device-wide synchronisation, no host wait. At most ``prefetch`` batches are held by the loader
besides the one it hands over.
"""

from __future__ import annotations

import contextlib
import ctypes
import queue
import sys
import threading
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gdskit.data.datasets import Dataset, check_stackable
from gdskit.data.errors import StateDictMismatchError
from gdskit.data.layout import batch_view
from gdskit.data.read import (BatchPlan, FileCache, Job, abandon, check_counts, engine_view, plan_batch, read_now,
                              submit, target_device, wait)
from gdskit.data.staging import Slot, Staging
from gdskit.data.sampler import Shards, _int, epoch_of
from gdskit.errors import InvalidArgumentError
from gdskit.engine import (ReaderProcesses, ReaderProcessError, SharedSlot, add_ledger_rows,
                                    closed_at_exit, pinned_budget, settings_values, stats, stats_delta)
from gdskit.formats.progress import Progress, ProgressArg
from gdskit.threads import start_thread

__all__ = ["Loader"]

STATE_FORMAT = "gdskit.data.Loader/1"


@dataclass
class _Batch:
    """A batch whose reads are under way (``jobs``) or done (into ``slot``, or ``raw`` on the CPU)."""

    number: int        # in its epoch
    plan: BatchPlan
    raw: torch.Tensor | None = None  # its bytes, back to back (None: still in ``slot``)
    jobs: list[Job] = field(default_factory=list)
    slot: Slot | SharedSlot | None = None
    worker: int | None = None  # the reader process reading it (until collected)


class _Reader:
    """The torch side of batches for one loader: their memory and their hand-off to the caller.

    A CPU batch is read straight into its tensor. A GPU batch of small reads is read into a
    pinned staging slot (host reads) by the thread that starts it, and copied to the GPU in
    one copy on the loader's side stream when it is handed over, so that the GPU holds only
    the batches handed over; a batch of large reads is read by the engine's device paths
    straight into its tensor. With ``workers``, batches of small reads are read by reader
    processes into slots of memory shared with them (page-locked for a GPU) and handed over
    from there the same way.
    """

    def __init__(self, dataset: Dataset, device: torch.device, files: FileCache, prefetch: int,
                 workers: int = 0, batch_size: int = 1) -> None:
        self.dataset, self.device, self.files = dataset, device, files
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.staging = Staging(prefetch + 2) if device.type == "cuda" else None
        self.workers, self._prefetch = workers, prefetch
        self._procs: ReaderProcesses | None = None
        if workers:
            assert dataset.layout is not None  # the Loader refuses workers for datasets of several layouts
            self._batch_bytes = batch_size * dataset.layout.nbytes
            self._path_index = {s.path: i for i, s in enumerate(dataset.sources)}

    # -- batches read by reader processes (``workers``) ----------------------------------------
    def processes(self) -> ReaderProcesses:
        """The loader's reader processes: started with the loader, again after one died or a close."""
        p = self._procs
        if p is None or p.broken is not None:
            self._procs = None
            if p is not None:
                p.close()
            # A slot for each batch asked for ahead, the one being taken and the one handed over.
            p = self._procs = ReaderProcesses(self.workers, [s.path for s in self.dataset.sources],
                                              self.asked_ahead() + 2, self._batch_bytes,
                                              pinned=self.stream is not None, settings_values=settings_values())
        return p

    def asked_ahead(self) -> int:
        """Batches asked of the reader processes beyond the one being taken: ``prefetch`` for
        each of them (as ``DataLoader``'s ``prefetch_factor``), at least one each. Each round
        trip to a process that waits for work costs its wake-up and the answer's; enough batches
        asked ahead keep every process reading. Fewer where their slots (two more than the
        batches asked ahead) would hold more than ``settings.pinned_budget``; one at least."""
        fits = pinned_budget() // ReaderProcesses.slot_size(self._batch_bytes) - 2
        return max(1, min(max(self._prefetch, 1) * self.workers, fits))

    def start_remote(self, procs: ReaderProcesses, number: int, indices: np.ndarray, on_bytes: Any,
                     position: int) -> _Batch:
        """Plan batch ``number`` and give its reads to a reader process (on a GPU, a batch of
        large reads is started here by the engine's device paths instead)."""
        plan = plan_batch(self.dataset, indices)
        if not plan.nbytes or (self.stream is not None and not plan.staged):
            return self.start(number, indices, on_bytes, position)
        slot = procs.slot(position)
        k = position % procs.count
        procs.send(k, slot, [(self._path_index[g.source.path], g.size, g.file_offsets, g.buf_offsets)
                             for g in plan.groups])
        return _Batch(number, plan, slot=slot, worker=k)

    def collect(self, procs: ReaderProcesses, b: _Batch, on_bytes: Any) -> None:
        """Wait for the reader process reading ``b``: its ledger rows added here, its counts checked."""
        assert b.worker is not None
        k, b.worker = b.worker, None
        counts, rows = procs.receive(k)
        groups = b.plan.groups
        if len(counts) != len(groups) or any(len(c) != len(g.file_offsets) for c, g in zip(counts, groups)):
            raise ReaderProcessError(f"reader process {k} answered for other reads than it was given")
        try:
            add_ledger_rows(rows)
        except (ValueError, TypeError) as exc:
            raise ReaderProcessError(f"reader process {k} sent damaged ledger rows ({exc})") from None
        for g, c in zip(groups, counts):
            check_counts(g, c)
        if on_bytes is not None:
            on_bytes(b.plan.nbytes)

    def start(self, number: int, indices: np.ndarray, on_bytes: Any, position: int) -> _Batch:
        """Plan batch ``number`` and read it (staged or on the CPU: now, in this thread; else
        started); ``position``: its place in the pass (which staging slot it takes)."""
        plan = plan_batch(self.dataset, indices)
        if self.stream is None:
            raw = torch.empty(plan.nbytes, dtype=torch.uint8)
            read_now(self.files, plan, engine_view(raw))
            if on_bytes is not None:
                on_bytes(plan.nbytes)
            return _Batch(number, plan, raw)
        if plan.staged:
            assert self.staging is not None
            with torch.cuda.device(self.device):  # a slot's event belongs to the loader's GPU
                slot = self.staging.slot(position, plan.nbytes)
            read_now(self.files, plan, slot.view)
            if on_bytes is not None:
                on_bytes(plan.nbytes)
            return _Batch(number, plan, slot=slot)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            raw = torch.empty(plan.nbytes, dtype=torch.uint8, device=self.device)
        # Memory freed on the side stream may still be used by its own work (a copy, a byte
        # swap); memory the caller's streams used comes back only after their work
        # (record_stream). The engine writes from its own streams: let the side stream finish.
        self.stream.synchronize()
        return _Batch(number, plan, raw, submit(self.files, plan, engine_view(raw), on_bytes))

    def finish(self, b: _Batch) -> torch.Tensor:
        wait(b.jobs)
        if self.stream is None:
            raw = b.raw
            if raw is None:  # read by a reader process into the shared staging: copied out now
                assert b.slot is not None
                raw = torch.empty(b.plan.nbytes, dtype=torch.uint8)
                ctypes.memmove(raw.data_ptr(), b.slot.ptr, b.plan.nbytes)
            return batch_view(raw, b.plan.count, b.plan.layout)
        if b.raw is None and b.plan.nbytes <= CALLER_STREAM_COPY_MAX:
            return self._finish_on_callers_stream(b)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            raw = b.raw
            if raw is None:  # staged: one copy of the whole batch, ordered on the side stream
                assert b.slot is not None
                raw = torch.empty(b.plan.nbytes, dtype=torch.uint8, device=self.device)
                if b.plan.nbytes:
                    b.slot.copy_to(raw.data_ptr(), b.plan.nbytes, self.stream.cuda_stream)
            out = batch_view(raw, b.plan.count, b.plan.layout)
            done = torch.cuda.Event()
            done.record(self.stream)
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(done)
        out.record_stream(consumer)
        return out

    def _finish_on_callers_stream(self, b: _Batch) -> torch.Tensor:
        """A small staged batch: allocated on the caller's current stream and copied there, so
        that the caller's later work sees it whole and its memory comes back only after that
        work, with no side stream, event or ``record_stream`` (a third of the hand-off's cost)."""
        assert b.slot is not None
        with _on(self.device):
            raw = torch.empty(b.plan.nbytes, dtype=torch.uint8, device=self.device)
            if b.plan.nbytes:
                b.slot.copy_to(raw.data_ptr(), b.plan.nbytes, torch.cuda.current_stream(self.device).cuda_stream)
            return batch_view(raw, b.plan.count, b.plan.layout)

    @staticmethod
    def abandon(b: _Batch) -> None:
        abandon(b.jobs)

    def close(self) -> None:
        """End the reader processes and free the pinned staging (each slot once its copy has
        run); a later pass makes them again."""
        procs, self._procs = self._procs, None
        try:
            if procs is not None:
                procs.close()
        finally:
            if self.staging is not None:
                self.staging.close()


def _on(device: torch.device) -> Any:
    """``device`` made current for a block, with nothing to do where it already is."""
    return contextlib.nullcontext() if torch.cuda.current_device() == device.index else torch.cuda.device(device)


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


#: Staged batches up to this size are copied to the GPU on the caller's own stream, behind its
#: work (about 40 µs at this size, under 1 % of a 5 ms step); larger ones on the loader's side
#: stream, overlapped with the caller's work and handed over by an event.
CALLER_STREAM_COPY_MAX = 1 << 20

#: How long the exit waits for the reader thread to finish the batch it is reading.
EXIT_JOIN_S = 30.0

# Passes whose reader may still run. The exit stops them before the interpreter is torn down:
# a reader left inside torch or the engine then aborted the process ("terminate called without
# an active exception").
_live = closed_at_exit(lambda pipeline: pipeline.close(EXIT_JOIN_S))


class _Pipeline:
    """One pass's batches, started in order by one reader thread at most ``prefetch`` ahead of
    the caller (none with ``prefetch=0``: each batch is then read when asked for); the caller
    takes them in order. Holds no reference to the iterator, so that dropping the iterator
    closes it.

    One reader, not several: a batch of small reads is mostly interpreter time (planning,
    submission, the hand-off), which reader threads cannot share; on the H200 machine two
    readers gave 0.84x one reader's batches/s and four 0.46x. Reader and caller meet through
    C-level queues (``queue.SimpleQueue``: a blocked side lets go of the interpreter lock at
    once), one of batches started and one of credits, a credit for each batch taken.
    """

    def __init__(self, reader: _Reader, todo: list[tuple[int, np.ndarray]], prefetch: int, on_bytes: Any) -> None:
        self._reader, self._todo, self._on_bytes = reader, todo, on_bytes
        self._ready: queue.SimpleQueue[Any] = queue.SimpleQueue()    # _Batch or _Failed, in pass order
        self._credits: queue.SimpleQueue[bool] = queue.SimpleQueue()  # one per batch the reader may start
        self._lock = threading.Lock()  # orders the reader's hand-in against close()
        self._closed = False
        self._taken = 0  # batches handed to the caller
        self._thread: threading.Thread | None = None
        if prefetch and todo:
            for _ in range(min(prefetch, len(todo))):
                self._credits.put(True)
            _live.add(self)
            self._thread = start_thread(self._produce, "gdskit-data-prefetch")

    def _produce(self) -> None:
        for pos, (number, indices) in enumerate(self._todo):
            self._credits.get()  # a batch taken, or close()
            if self._closed:
                return
            try:
                b: Any = self._reader.start(number, indices, self._on_bytes, pos)
            except BaseException as exc:  # noqa: BLE001 - the caller's next() raises it, in its place
                b = _Failed(exc)
            with self._lock:
                closed = self._closed
                if not closed:
                    self._ready.put(b)
            if closed:
                if isinstance(b, _Batch):
                    self._reader.abandon(b)
                return
            if isinstance(b, _Failed):
                return

    def take(self) -> _Batch | None:
        """The next batch, its reads done or under way; None after the last. Raises what starting it raised."""
        pos = self._taken
        if pos >= len(self._todo):
            return None
        self._taken += 1
        if self._thread is None:
            number, indices = self._todo[pos]
            return self._reader.start(number, indices, self._on_bytes, pos)
        item = self._ready.get()
        self._credits.put(True)
        if isinstance(item, _Failed):
            raise item.exc
        return item

    def close(self, join_timeout: float | None = None) -> None:
        """Stop reading ahead: batches not started are never started, those started are
        abandoned (reads not begun are cancelled, the others waited for), the reader joined
        (for at most ``join_timeout`` seconds, where given: the exit's bound)."""
        with self._lock:
            self._closed = True
        t = self._thread
        if t is None:
            return
        self._credits.put(False)  # wakes a reader waiting for a credit
        if sys.is_finalizing():
            join_timeout = 0  # the reader can no longer run: joining it would wait for ever
        if t is not threading.current_thread():
            t.join(join_timeout)
        # Nothing is handed in once closed: what is queued now is all there will be.
        while True:
            try:
                item = self._ready.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Batch):
                self._reader.abandon(item)


class _ProcessPipeline:
    """One pass's batches read by the loader's reader processes, asked for in order up to
    :meth:`_Reader.asked_ahead` beyond the batch being taken, reader ``position % workers``
    reading each; taken in order in the caller's thread. Batches of large reads for a GPU are
    started here by the engine's device paths instead."""

    def __init__(self, reader: _Reader, todo: list[tuple[int, np.ndarray]], prefetch: int, on_bytes: Any) -> None:
        self._reader, self._todo, self._on_bytes = reader, todo, on_bytes
        self._ahead = reader.asked_ahead()
        self._procs = reader.processes() if todo else None
        self._pending: dict[int, Any] = {}  # position -> _Batch or _Failed, asked for and not taken
        self._asked = 0
        self._taken = 0
        self._failed = False
        self._closed = False

    def take(self) -> _Batch | None:
        pos = self._taken
        if pos >= len(self._todo):
            return None
        procs = self._procs
        assert procs is not None
        while not self._failed and self._asked < min(len(self._todo), pos + 1 + self._ahead):
            k = self._asked
            number, indices = self._todo[k]
            try:
                self._pending[k] = self._reader.start_remote(procs, number, indices, self._on_bytes, k)
            except BaseException as exc:  # noqa: BLE001 - raised when its turn comes
                self._pending[k] = _Failed(exc)
                self._failed = True  # nothing more is asked for after a failure
            self._asked += 1
        item = self._pending.pop(pos)
        self._taken += 1
        if isinstance(item, _Failed):
            raise item.exc
        if item.worker is not None:
            self._reader.collect(procs, item, self._on_bytes)
        return item

    def close(self) -> None:
        """Take the answers of the batches asked for and not taken (so that no reader writes into
        the staging any more, and the next pass's answers are its own), or abandon them."""
        if self._closed:
            return
        self._closed = True
        procs = self._procs
        for pos in sorted(self._pending):
            item = self._pending.pop(pos)
            if not isinstance(item, _Batch):
                continue
            if item.worker is None:
                self._reader.abandon(item)
                continue
            assert procs is not None
            if procs.broken is None:
                try:
                    procs.receive(item.worker)
                except Exception:  # noqa: BLE001 - an error of a batch no one will take
                    pass


class _Pass:
    """An iterator over the rest of one epoch of a :class:`Loader`."""

    def __init__(self, loader: Loader, epoch: int, start: int) -> None:
        self._loader = loader
        self.epoch = epoch
        todo = list(enumerate(loader._shards.batches(epoch, start), start))
        self._progress: Progress | None = None
        on_bytes = None
        if loader._progress is not None and loader._progress is not False and todo:
            total = sum(loader._batch_bytes(idx) for _, idx in todo)
            self._progress = Progress(total, loader._progress, f"epoch {epoch}")
            on_bytes = self._progress.advance
        pipeline = _ProcessPipeline if loader.workers else _Pipeline
        self._pipeline: _Pipeline | _ProcessPipeline = pipeline(loader._reader, todo, loader.prefetch, on_bytes)
        self._closed = False

    def __iter__(self) -> _Pass:
        return self

    def __next__(self) -> torch.Tensor:
        if self._closed:
            raise StopIteration
        try:
            b = self._pipeline.take()
            out = None if b is None else self._loader._reader.finish(b)
        except BaseException:
            self.close()
            raise
        if b is None or out is None:
            self.close()
            raise StopIteration
        self._loader._delivered(b.number)
        return out

    def close(self) -> None:
        """End the pass: reads ahead are cancelled or waited for, the producer thread joined."""
        if self._closed:
            return
        self._closed = True
        try:
            self._pipeline.close()
        finally:
            if self._progress is not None:
                self._progress.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing to tell at collection time
            pass


class Loader:
    """Batches of ``dataset`` in memory on ``device``, this rank's share, read ahead.

    Parameters
    ----------
    dataset : TokenDataset, RecordDataset or NpyDataset
    batch_size : samples per batch
    device : where batches go (``"cuda:0"``, ``"cpu"``, a ``torch.device`` or a GPU index)
    shuffle, seed : a new order each epoch, from ``seed`` and the epoch alone
    drop_last : drop the samples that do not divide among the ranks, and each rank's
        incomplete last batch (otherwise the order is padded, as DistributedSampler pads it)
    rank, world_size : default: ``torch.distributed``'s when it is initialised, else 0 and 1
    prefetch : batches read ahead while the caller computes (0: each read when asked for)
    workers : reader processes (as ``DataLoader``'s ``num_workers``): 0 reads in this process,
        on one reader thread; ``N`` reads batches of small reads in ``N`` processes of their
        own, started with the loader, into page-locked memory shared with this one, each batch
        one process's, ``prefetch`` batches asked of each ahead (for a dataset of one sample
        layout; docs/data.md, "Reader processes")
    progress : True for a bar per epoch on stderr, or ``callback(bytes_done, bytes_total)``
        (from I/O threads); None or False: nothing

    Iterating gives the rest of the current epoch: ``[batch, seq_len + 1]`` tensors for
    tokens, ``[batch, *shape]`` otherwise. After an epoch's last batch the loader moves on to
    the next epoch; ``set_epoch`` sets any. A new iterator continues where the last one
    stopped (and ends it); ``state_dict()`` is that position, counted in batches handed over.

    Raises
    ------
    InvalidArgumentError
        An argument out of range or of the wrong kind (``rank`` not below ``world_size``,
        ``shuffle`` not a bool...). Any ``world_size`` is planned from this rank's share alone.
    DatasetTooSmallError
        No sample, or (``drop_last``) less than one batch for each rank.
    SampleMismatchError
        Samples of different shapes or dtypes and ``batch_size > 1``.
    """

    def __init__(self, dataset: Dataset, batch_size: int, *, device: Any = "cuda:0", shuffle: bool = False,
                 seed: int = 0, drop_last: bool = False, rank: int | None = None, world_size: int | None = None,
                 prefetch: int = 2, workers: int = 0, progress: ProgressArg = None) -> None:
        if not isinstance(dataset, Dataset):
            raise InvalidArgumentError(f"dataset must be a TokenDataset, RecordDataset or NpyDataset, "
                                       f"not {type(dataset).__name__}")
        rank, world_size = _rank_and_world(rank, world_size)
        self.dataset = dataset
        self._shards = Shards(len(dataset), batch_size, world_size, rank, shuffle, seed, drop_last)
        check_stackable(dataset, self._shards.batch_size)
        self.prefetch = _int("prefetch", prefetch, 0)
        self.workers = _int("workers", workers, 0)
        if self.workers and dataset.layout is None:
            raise InvalidArgumentError("workers read datasets of one sample layout; this one's .npy files have "
                                       "several (read it with workers=0)")
        self.device = target_device(device)
        self._progress = progress
        self._epoch = 0
        self._position = 0
        self._lock = threading.Lock()
        self._files = FileCache()
        self._reader = _Reader(dataset, self.device, self._files, self.prefetch, self.workers, self.batch_size)
        if self.workers:
            self._reader.processes()  # they start while the caller sets up; the first pass finds them ready
        self._active: weakref.ref[_Pass] | None = None
        self._fingerprint: str | None = None
        self._stats_before = stats()

    # -- what it is ---------------------------------------------------------------------
    batch_size = property(lambda self: self._shards.batch_size)
    rank = property(lambda self: self._shards.rank)
    world_size = property(lambda self: self._shards.world_size)
    shuffle = property(lambda self: self._shards.shuffle)
    seed = property(lambda self: self._shards.seed)
    drop_last = property(lambda self: self._shards.drop_last)

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    def __len__(self) -> int:
        """Batches per epoch (of this rank; every rank has as many)."""
        return self._shards.num_batches

    def batch_indices(self, epoch: int | None = None) -> list[np.ndarray]:
        """The dataset indices of this rank's batches in ``epoch`` (default: the current one), in order."""
        return self._shards.batches(self._epoch if epoch is None else _int("epoch", epoch, 0))

    def _batch_bytes(self, indices: np.ndarray) -> int:
        lay = self.dataset.layout
        if lay is not None:
            return len(indices) * lay.nbytes
        return sum(self.dataset.layout_of(int(i)).nbytes for i in indices)

    # -- iteration and position ------------------------------------------------------------
    def __iter__(self) -> Iterator[torch.Tensor]:
        with self._lock:
            self._end_pass()
            it = _Pass(self, self._epoch, self._position)
            self._active = weakref.ref(it)
        return it

    def _end_pass(self) -> None:
        active = self._active() if self._active is not None else None
        self._active = None
        if active is not None:
            active.close()

    def _delivered(self, number: int) -> None:
        with self._lock:
            if number + 1 >= self._shards.num_batches:
                self._epoch += 1
                self._position = 0
            else:
                self._position = number + 1

    def set_epoch(self, epoch: int) -> None:
        """Make ``epoch`` the current epoch: its order comes from ``seed`` and ``epoch`` alone.

        Setting the current epoch again changes nothing (a position restored by
        :meth:`load_state_dict` stays); another epoch starts at its first batch and ends a
        pass under way.
        """
        epoch = epoch_of(epoch, self.seed)
        with self._lock:
            if epoch == self._epoch:
                return
            self._end_pass()
            self._epoch, self._position = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is: epoch and batches handed over in it, with what they depend on.

        Batches read ahead but not yet handed over do not count: a loader restored from this
        gives exactly the batches this one had not yet given, in the same order.
        """
        with self._lock:
            epoch, position = self._epoch, self._position
        return {"format": STATE_FORMAT, "epoch": epoch, "batches_done": position,
                "batch_size": self.batch_size, "world_size": self.world_size, "rank": self.rank,
                "shuffle": self.shuffle, "seed": self.seed, "drop_last": self.drop_last,
                "samples": len(self.dataset), "dataset": self._dataset_fingerprint()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`state_dict` of a loader of the same dataset, world size
        and batching; any rank's: they share the position). Ends a pass under way.

        Raises
        ------
        StateDictMismatchError
            ``state`` is not a loader state, or one of another dataset, world size or batching.
        """
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise StateDictMismatchError("not a gdskit.data.Loader state_dict")
        if state.get("samples") != len(self.dataset) or state.get("dataset") != self._dataset_fingerprint():
            raise StateDictMismatchError("the state is of another dataset (other files, sizes or samples)")
        for key in ("world_size", "batch_size", "shuffle", "seed", "drop_last"):
            if state.get(key) != getattr(self, key):
                raise StateDictMismatchError(f"the state is of a loader with {key}={state.get(key)!r}, "
                                             f"this one has {getattr(self, key)!r}")
        try:
            epoch = epoch_of(state.get("epoch"), self.seed)
            done = _int("batches_done", state.get("batches_done"), 0)
        except InvalidArgumentError as exc:
            raise StateDictMismatchError(f"a damaged state: {exc}") from None
        if done > len(self):
            raise StateDictMismatchError(f"the state has {done} batches done of an epoch of {len(self)}")
        with self._lock:
            self._end_pass()
            self._epoch, self._position = (epoch + 1, 0) if done == len(self) else (epoch, done)

    def _dataset_fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = self.dataset.fingerprint()
        return self._fingerprint

    # -- ledger and lifetime -----------------------------------------------------------
    def stats(self) -> Any:
        """What the ledger recorded since this loader was made: bytes, paths and reasons
        (process-wide: other reads in the meantime count too)."""
        return stats_delta(self._stats_before, stats())

    def close(self) -> None:
        """End a pass under way and close the files (a later iteration opens them again)."""
        with self._lock:
            self._end_pass()
        try:
            self._files.close()
        finally:
            self._reader.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing to tell at collection time
            pass

    def __repr__(self) -> str:
        return (f"Loader({self.dataset!r}, batch_size={self.batch_size}, device={self.device}, "
                f"rank={self.rank}/{self.world_size}, epoch={self._epoch}, batches={len(self)})")


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Each one not given: ``torch.distributed``'s when it is initialised, else 0 and 1."""
    if rank is None or world_size is None:
        dist = torch.distributed
        on = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if on else 0
        if world_size is None:
            world_size = dist.get_world_size() if on else 1
    return _int("rank", rank, 0), _int("world_size", world_size, 1)
