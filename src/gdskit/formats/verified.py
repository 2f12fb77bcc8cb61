"""Checking loaded tensors against their digests, where their bytes landed: the loaders'
one step for ``verify=`` (a GPU kernel for device tensors on the stream they landed on, the
CPU for host tensors; both through the engine's door, which counts them in the ledger)."""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Iterable, Mapping, Sequence
import threading
import weakref
from typing import TYPE_CHECKING, Any

from gdskit.engine import prepare_gpu_digests, start_digest_buffers
from gdskit.errors import InvalidArgumentError
from gdskit.threads import executor, start_thread
from gdskit.verify import VerifyMode

if TYPE_CHECKING:
    from gdskit.verify import Expectation


class StartedTensorDigests:
    """Digests of tensors under way (:func:`start_tensor_digests`); holds the tensors until
    :meth:`result` or :meth:`abandon` has returned, so none is freed while a kernel reads it."""

    def __init__(self, names: list[list[str]], started: list[Any], tensors: list[Any]) -> None:
        self._names, self._started, self._tensors = names, started, tensors

    def result(self) -> dict[str, str]:
        """The digests by name (waits for the GPU's)."""
        out: dict[str, str] = {}
        try:
            for names, started in zip(self._names, self._started):
                for name, digest in zip(names, started.result(), strict=True):
                    out[name] = digest
        except BaseException:
            self.abandon()
            raise
        self._tensors = []
        return out

    def abandon(self) -> None:
        """Drop the digests not yet read back (the GPU's work is let finish first)."""
        for started in self._started:
            started.abandon()
        self._tensors = []


def start_tensor_digests(named: Sequence[tuple[str, Any]]) -> StartedTensorDigests:
    """Start the BLAKE3 digests of the bytes of contiguous torch tensors, each hashed where it
    lies: host tensors now; all of one GPU's tensors in one launch pair queued on torch's current
    stream of that GPU (after the work queued there), which runs while the caller goes on."""
    by_device: dict[Any, list[tuple[str, Any]]] = {}
    for name, t in named:
        by_device.setdefault(t.device, []).append((name, t))
    names: list[list[str]] = []
    started: list[Any] = []
    try:
        for device, items in by_device.items():
            stream, gpu = 0, None
            if device.type == "cuda":
                import torch  # noqa: PLC0415 - optional dependency (torch)

                stream = int(torch.cuda.current_stream(device).cuda_stream)
                gpu = device.index if device.index is not None else torch.cuda.current_device()
            started.append(start_digest_buffers([(t.data_ptr(), t.nbytes) for _n, t in items], stream, gpu))
            names.append([n for n, _t in items])
    except BaseException:
        for s in started:
            s.abandon()
        raise
    return StartedTensorDigests(names, started, [t for _n, t in named])


def tensor_digests(named: Sequence[tuple[str, Any]]) -> dict[str, str]:
    """The BLAKE3 digests of the bytes of contiguous torch tensors, by name, each hashed where it
    lies (:func:`start_tensor_digests`), waiting for them."""
    return start_tensor_digests(named).result()


def expectations(paths: Iterable[str], mode: VerifyMode,
                 metadata: Mapping[str, Mapping[str, str] | None] | None = None,
                 device: Any = None) -> dict[str, Expectation]:
    """What each file is checked against (``mode`` auto or manifest), found before anything is read:
    a file with nothing to check against is refused before its bytes move. ``device``: where the
    bytes will land; for a GPU, its kernels are made ready in the background meanwhile."""
    from gdskit.verify import find_expectation  # noqa: PLC0415 - import time

    metadata = metadata or {}
    found = {p: find_expectation(p, mode, metadata.get(p)) for p in paths}
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch  # noqa: PLC0415 - optional dependency (torch)

        prepare_gpu_digests(device.index if device.index is not None else torch.cuda.current_device())
    return found


def check_loaded(expectation: Expectation, named: Sequence[tuple[str, Any]],
                 ranges: Mapping[str, tuple[int, int]] | None = None) -> None:
    """Raise :class:`~gdskit.errors.ChecksumMismatchError` for the first of ``named`` (contiguous
    tensors holding a file's bytes as stored) whose digest differs from the expected one."""
    from gdskit.verify import check_tensors  # noqa: PLC0415 - import time

    check_tensors(expectation, tensor_digests(named), ranges)


#: Bytes of host tensors read as one batch before it is handed to a hashing thread: small enough
#: that hashing trails the reads closely, large enough that each batch's reads keep the engine busy.
HOST_BATCH_BYTES = 64 << 20
#: Threads hashing landed batches (each spreads a large tensor over the blake3 package's own threads).
HOST_HASH_WORKERS = 2


def hashes_while_reading(verifying: bool, device: Any) -> bool:
    """Whether a verified load reads in batches and hashes each batch on worker threads as soon as
    it has landed, while the next one is read: for host memory (the CPU's hashing is the cost to
    hide). Device memory is hashed by the GPU kernel, at most a few launch pairs a load, without
    cutting the reads into runs (:meth:`LoadChecks.start`). Every reader asks this, and only this."""
    return verifying and getattr(device, "type", device) == "cpu"


def hashes_when_landed(verifying: bool, device: Any) -> bool:
    """Whether a verified load starts the digests of tensors that have landed while its later reads
    are still in flight (``execute(landed=...)``, :meth:`LoadChecks.start`): for GPU memory, where
    the kernels run beside those reads. Every reader asks this, and only this."""
    return verifying and str(getattr(device, "type", device)).partition(":")[0] == "cuda"


def batches(items: Sequence[Any], nbytes: Any, limit: int = HOST_BATCH_BYTES) -> list[list[Any]]:
    """``items`` (in file order) cut into consecutive runs of about ``limit`` bytes (``nbytes(item)``)."""
    out: list[list[Any]] = []
    size = 0
    for item in items:
        if not out or (size and size + nbytes(item) > limit):
            out.append([])
            size = 0
        out[-1].append(item)
        size += nbytes(item)
    return out


def _done(value: Any) -> concurrent.futures.Future[Any]:
    fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
    fut.set_result(value)
    return fut


class LoadChecks:
    """``verify=`` of one load, overlapped with its reads where it can be.

    Host memory (:func:`hashes_while_reading`): the reader reads the :meth:`runs` it is given
    one after another and hands each run's tensors to :meth:`hash` (or :meth:`check`) once they
    have landed; a worker thread hashes them (the blake3 package lets go of the GIL) while the
    next run is read. Device memory: a reader that learns of tensors landed while later reads
    are in flight hands them to :meth:`start`, whose kernels run on the GPU meanwhile; everything
    else is hashed where it lies when handed in. Use as a context manager: the threads end
    with it and digests not read back are dropped, whatever happened, so no thread or kernel
    outlives the load or reads a freed tensor."""

    def __init__(self, verifying: bool, workers: int = HOST_HASH_WORKERS) -> None:
        self.verifying = verifying
        self._workers = workers
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[tuple[Expectation, Any, Mapping[str, tuple[int, int]] | None]] = []
        self._begun: list[StartedTensorDigests] = []

    def __enter__(self) -> LoadChecks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, wait: bool = True) -> None:
        """End the hashing threads (``wait``: once the hashing under way has ended; what was not
        started is dropped) and drop the GPU digests not read back."""
        for started in self._begun:  # read back already, or dropped here
            started.abandon()
        self._begun.clear()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel_futures=True)

    def overlaps(self, device: Any) -> bool:
        """Whether tensors landing on ``device`` are hashed while later runs are read."""
        return hashes_while_reading(self.verifying, device)

    def hashes_when_landed(self, device: Any) -> bool:
        """Whether tensors landing on ``device`` have their digests started while later reads run."""
        return hashes_when_landed(self.verifying, device)

    def runs(self, items: Sequence[Any], nbytes: Any, device: Any) -> list[list[Any]]:
        """``items`` (in file order) as the runs to read one after another onto ``device``:
        batches of about :data:`HOST_BATCH_BYTES` where the hashing overlaps the reads, else all
        of them at once."""
        return batches(items, nbytes) if self.overlaps(device) else [list(items)]

    def batch_limit(self, limit: int, device: Any) -> int:
        """The most bytes of one run onto ``device`` for a reader that cuts its own runs (``limit``
        its own most): :data:`HOST_BATCH_BYTES` at most where the hashing overlaps the reads."""
        return min(limit, HOST_BATCH_BYTES) if self.overlaps(device) else limit

    def hash(self, named: Sequence[tuple[str, Any]], device: Any) -> concurrent.futures.Future[dict[str, str]]:
        """The digests of ``named`` (contiguous tensors on ``device``, kept alive until hashed), by
        name: on a worker thread where the hashing overlaps the reads, else now."""
        if not self.overlaps(device):
            return _done(tensor_digests(named))
        if self._pool is None:
            self._pool = executor(self._workers, "gdskit-verify")
        return self._pool.submit(tensor_digests, list(named))

    def check(self, expectation: Expectation, named: Sequence[tuple[str, Any]], device: Any,
              ranges: Mapping[str, tuple[int, int]] | None = None) -> None:
        """Hash ``named`` (:meth:`hash`) and compare the digests with ``expectation``: at
        :meth:`finish` where the hashing overlaps the reads, else now."""
        if not self.overlaps(device):
            check_loaded(expectation, named, ranges)
            return
        self._pending.append((expectation, self.hash(named, device), ranges))

    def begin(self, named: Sequence[tuple[str, Any]], device: Any) -> StartedTensorDigests:
        """The digests of ``named`` (contiguous tensors on GPU ``device``, landed while later reads
        are in flight), started: kernels queued now on torch's current stream. Dropped at
        :meth:`close` if not read back by then."""
        started = start_tensor_digests(named)
        self._begun.append(started)
        return started

    def start(self, expectation: Expectation, named: Sequence[tuple[str, Any]], device: Any,
              ranges: Mapping[str, tuple[int, int]] | None = None) -> None:
        """Start hashing ``named`` (landed while later reads are in flight) and compare the
        digests with ``expectation`` at :meth:`finish`: on the GPU, kernels queued now on
        torch's current stream (:meth:`begin`); in host memory, as :meth:`check`."""
        if not self.hashes_when_landed(device):
            self.check(expectation, named, device, ranges)
            return
        self._pending.append((expectation, self.begin(named, device), ranges))

    def finish(self) -> None:
        """Wait for every digest; raise for the first batch with a tensor that differs."""
        if not self._pending:
            return
        from gdskit.verify import check_tensors  # noqa: PLC0415 - import time

        while self._pending:
            expectation, found, ranges = self._pending[0]
            digests = found.result()
            self._pending.pop(0)
            check_tensors(expectation, digests, ranges)


def merged(found: Iterable[concurrent.futures.Future[dict[str, str]] | StartedTensorDigests]) -> dict[str, str]:
    """The digests of several :meth:`LoadChecks.hash` or :meth:`LoadChecks.begin` calls, by name
    (waits for each)."""
    out: dict[str, str] = {}
    for fut in found:
        out.update(fut.result())
    return out


class Sha256Check:
    """``verify="sha256:<hex>"``: the whole file's sha256, computed on a CPU thread while the
    load runs (the file is read a second time, through the page cache). A load that fails and
    drops this object stops the hashing at its next piece: the thread closes the file and ends."""

    def __init__(self, paths: Sequence[str], mode: VerifyMode) -> None:
        if len(paths) != 1:
            raise InvalidArgumentError(f"verify='sha256:...' checks one file; this checkpoint has {len(paths)}: "
                                       "give a manifest (gdskit digest) or verify=True")
        from gdskit.verify import check_sha256  # noqa: PLC0415 - import time

        assert mode.sha256 is not None
        path, want = os.fspath(paths[0]), mode.sha256
        if "://" in path:
            raise InvalidArgumentError(f"{path}: verify='sha256:...' checks a local file; an object is checked "
                                       "against the digests in its safetensors header (verify=True)")
        stop = threading.Event()
        outcome: list[BaseException | None] = []

        def run() -> None:
            try:
                check_sha256(path, want, stop)
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller by wait()
                outcome.append(exc)

        self._outcome = outcome
        self._thread = start_thread(run, "gdskit-sha256")
        weakref.finalize(self, stop.set)

    def wait(self) -> None:
        """Raise what the check found (a mismatch, an I/O error)."""
        self._thread.join()
        if self._outcome and self._outcome[0] is not None:
            raise self._outcome[0]


__all__ = ["LoadChecks", "Sha256Check", "StartedTensorDigests", "batches", "check_loaded", "expectations",
           "hashes_when_landed", "hashes_while_reading", "merged", "start_tensor_digests", "tensor_digests"]
