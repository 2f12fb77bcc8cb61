"""The I/O engine's one door: what every layer above it (``gdskit``'s own API, the formats, the
data loaders, the checkpoint layers, the probes) calls to move bytes.

Call order, for a loader:

1. Plan with the engine's figures: :func:`worker_threads`, :func:`pinned_budget`,
   :func:`can_scatter`, :func:`first_page_cached`, :func:`whole_file_limit`.
2. Optionally :func:`start_warm_up` once the destination's size is known (pinned lanes,
   streams, worker threads come up while the caller allocates); wait with what it returns.
3. Describe destinations (:data:`BufferView`, :data:`ScatterList`, :func:`adapt`, the
   synchronized device views), then read: :func:`open_file` and the :class:`File` methods
   (``read``, ``pread``, ``read_many``, ``read_batch``), :func:`read_files` for many files as one
   job, :func:`read_whole_files` for small files whole.
4. Account: :func:`stats` before and after, :func:`stats_delta` between; rows another process
   recorded come in through :func:`add_ledger_rows`.

Inside, a request goes ``File`` -> :mod:`~gdskit.engine.plan` (chunks) ->
:mod:`~gdskit.engine.read_route` (which backend serves each piece, and why) ->
:mod:`~gdskit.engine.gpu_routing` (through which GPU) -> a backend (``engine/backends/``) on the
worker pool's pinned lanes (:mod:`~gdskit.engine.pool`) -> :mod:`~gdskit.engine.ledger`.

Each entry below imports the module that does the work when it is first called: a program that
imports a loader does not pay for the CUDA layer and the backends before its first read
(import time; docs/architecture.md).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gdskit.settings import settings
from gdskit.vocabulary import Mode

if TYPE_CHECKING:
    from gdskit.engine.buffers import (BufferView, ScatterList, adapt, scattered_device_view,  # noqa: F401
                                synchronized_device_view, synchronized_device_views)
    from gdskit.engine.file import File, open  # noqa: F401
    from gdskit.engine.gpu_routing import RouteDecision, RouteWhy, decide  # noqa: F401
    from gdskit.engine.reader_processes import ReaderProcesses, ReaderProcessError, SharedSlot  # noqa: F401

# The destinations the formats hand the engine: loaded with the first of them a loader uses,
# not with the loaders' modules (the buffers module imports the CUDA layer).
_BUFFERS = ("BufferView", "ScatterList", "adapt", "scattered_device_view", "synchronized_device_view",
            "synchronized_device_views")
# Reads made by reader processes (the dataset loader's ``workers``): loaded by a loader that has them.
_READERS = ("ReaderProcesses", "ReaderProcessError", "SharedSlot")
# The file facade itself (``gdskit.File``, ``gdskit.open``).
_FILES = ("File", "open")
# The routing decision, for ``gdskit check``'s route table (which shows the engine's own choice).
_ROUTING = ("RouteDecision", "RouteWhy", "decide")


def __getattr__(name: str) -> Any:
    if name in _BUFFERS:
        import gdskit.engine.buffers as buffers  # noqa: PLC0415 - import time

        return getattr(buffers, name)
    if name in _READERS:
        import gdskit.engine.reader_processes as reader_processes  # noqa: PLC0415 - import time

        return getattr(reader_processes, name)
    if name in _ROUTING:
        import gdskit.engine.gpu_routing as gpu_routing  # noqa: PLC0415 - import time

        return getattr(gpu_routing, name)
    if name in _FILES:
        import gdskit.engine.file as file  # noqa: PLC0415 - import time

        return getattr(file, name)
    raise AttributeError(f"module 'gdskit.engine' has no attribute {name!r}")


def open_file(path: str | os.PathLike[str], mode: str = "r", *, atomic: bool = False) -> Any:
    """Open ``path`` through the engine: a :class:`gdskit.File`."""
    from gdskit.engine.file import open as engine_open  # noqa: PLC0415 - import time
    return engine_open(path, mode, atomic=atomic)


def is_object_url(path: Any) -> bool:
    """Whether ``path`` names an object in a store (``s3://bucket/key``) rather than a local file
    (:func:`open_file` opens both)."""
    from gdskit.engine.objects.url import is_object_url as is_url  # noqa: PLC0415 - import time
    return is_url(path)


def list_objects(prefix: str) -> list[tuple[str, int]]:
    """``(url, size)`` of every object under the URL ``prefix`` (``s3://bucket/dir/``), by key."""
    from gdskit.engine.objects.store import bucket_for  # noqa: PLC0415 - import time
    from gdskit.engine.objects.url import parse_url  # noqa: PLC0415 - import time
    from gdskit.settings import settings  # noqa: PLC0415 - import time

    url = parse_url(prefix)
    found = bucket_for(url).list(url.key, settings.snapshot())
    return [(f"{url.scheme}://{url.bucket}/{key}", size) for key, size in found]


def list_objects_bounded(prefix: str, limit: int) -> tuple[list[tuple[str, int]], bool]:
    """``(url, size)`` of the first ``limit`` objects under the URL ``prefix``, listed a page at a
    time and no further; and whether more exist past them."""
    from gdskit.engine.objects.store import bucket_for  # noqa: PLC0415 - import time
    from gdskit.engine.objects.url import parse_url  # noqa: PLC0415 - import time
    from gdskit.engine.plan import nonnegative_int  # noqa: PLC0415 - import time
    from gdskit.errors import InvalidArgumentError  # noqa: PLC0415 - import time

    if nonnegative_int("limit", limit) < 1:
        raise InvalidArgumentError(f"limit must be at least 1; got {limit}")
    url = parse_url(prefix)
    found, more = bucket_for(url).list_bounded(url.key, settings.snapshot(), limit)
    return [(f"{url.scheme}://{url.bucket}/{key}", size) for key, size in found], more


def object_exists(url: str) -> bool:
    """Whether the object at ``url`` (``s3://bucket/key``) exists: one HEAD, a 404 is False; any
    other failure raises as reads do (:class:`~gdskit.errors.GdskitPermissionError`,
    :class:`~gdskit.errors.ObjectStoreError`...)."""
    from gdskit.engine.objects.store import bucket_for  # noqa: PLC0415 - import time
    from gdskit.engine.objects.url import parse_url  # noqa: PLC0415 - import time
    from gdskit.errors import GdskitFileNotFoundError, InvalidArgumentError  # noqa: PLC0415 - import time

    parsed = parse_url(url)
    if parsed.is_prefix:
        raise InvalidArgumentError(f"{parsed} names a prefix, not an object")
    try:
        bucket_for(parsed).head(parsed, settings.snapshot())
    except GdskitFileNotFoundError:
        return False
    return True


def sweep_uploads(prefix: str, older_than_s: float, abort: bool = False, **options: Any) -> Any:
    """The multipart uploads under way under ``prefix``, those older than ``older_than_s``
    aborted with ``abort``: an ``UploadSweep`` (``gdskit.engine.objects.uploads``)."""
    from gdskit.engine.objects.uploads import sweep_uploads as sweep  # noqa: PLC0415 - import time
    return sweep(prefix, older_than_s, abort, **options)


def delete_object(url: str) -> None:
    """Remove the object at ``url`` (``s3://bucket/key``); nothing happens where there is none."""
    from gdskit.engine.objects.store import bucket_for  # noqa: PLC0415 - import time
    from gdskit.engine.objects.url import parse_url  # noqa: PLC0415 - import time
    from gdskit.errors import InvalidArgumentError  # noqa: PLC0415 - import time

    parsed = parse_url(url)
    if parsed.is_prefix:
        raise InvalidArgumentError(f"{parsed} names a prefix, not an object")
    bucket_for(parsed).delete(parsed, settings.snapshot())


def object_endpoint_name() -> str:
    """The object store endpoint the environment names now (``AWS_ENDPOINT_URL``, the profile's
    ``endpoint_url``, else ``aws:<region>``), as the ledger names it."""
    from gdskit.engine.objects.store import endpoint_now  # noqa: PLC0415 - import time
    return endpoint_now().name


def open_object_stream(url: str) -> Any:
    """The object at ``url`` as a buffered, seekable binary stream of ranged GETs (for readers
    that take a file object)."""
    from gdskit.engine.objects.source import open_object_stream as open_stream  # noqa: PLC0415 - import time
    return open_stream(url)


def forget_object_clients() -> None:
    """Make the next object store request build its client anew, with the endpoint and credentials
    the environment names then."""
    from gdskit.engine.objects.store import forget_clients  # noqa: PLC0415 - import time
    forget_clients()


def read_files(jobs: list[tuple[str, list[tuple[Any, ...]]]],
               on_bytes: Callable[[int], None] | None = None) -> list[list[int]]:
    """Many files' reads as one engine job (``gdskit.engine.many_files``): ``(path, reads)`` pairs,
    each read as :meth:`gdskit.File.read_many` takes it; each file's byte counts."""
    from gdskit.engine.many_files import FileReads, read_files as engine_read_files  # noqa: PLC0415 - import time
    return engine_read_files([FileReads(p, r) for p, r in jobs], on_bytes=on_bytes)


def whole_file_limit(device: int) -> int:
    """The largest file :func:`read_whole_files` takes into ``device``'s memory now; 0 where
    its reads must be routed file by file (cuFile may serve some)."""
    import gdskit.engine.whole_files as whole_files  # noqa: PLC0415 - import time
    return whole_files.limit(device)


def read_whole_files(paths: list[str], sizes: list[int], device: int, place: Callable[[int, memoryview], Any],
                     on_bytes: Callable[[int], None] | None = None) -> None:
    """Small files read whole into pinned stages and landed on ``device`` where ``place`` says
    (``gdskit.engine.whole_files``)."""
    import gdskit.engine.whole_files as whole_files  # noqa: PLC0415 - import time
    whole_files.read_whole_files(paths, sizes, device, place, on_bytes=on_bytes)


def spread(n: int, k: int) -> list[int]:
    """Up to ``k`` indices of ``range(n)`` spread evenly over it, the first and last included
    (:func:`gdskit.engine.plan.spread`: what a job samples to judge all of it)."""
    from gdskit.engine.plan import spread as engine_spread  # noqa: PLC0415 - import time
    return engine_spread(n, k)


def resident_worth_asking(device: int, sizes: Any = (), paths: Any = ()) -> bool:
    """Whether a load onto GPU ``device`` of reads of ``sizes`` bytes from ``paths`` should go to
    the resident loader (``gdskit serve``): ``settings.resident`` requires it, or one is listening
    for it and the load is of large tensors from local files (docs/resident.md)."""
    from gdskit.engine.resident import worth_asking  # noqa: PLC0415 - import time
    return worth_asking(device, sizes, paths)


def read_through_resident(files: Any, targets: Any, on_bytes: Callable[[int], None] | None = None) -> str | None:
    """Read ``(pointer, bytes, file, file offset)`` of GPU memory each from ``files`` (``(path,
    bytes as its header said)`` each; ``file`` indexes them) through the resident loader, in one
    request for each ``MAX_FILES`` files; None once all landed, else why it did not serve (the
    caller reads every byte itself).
    :func:`gdskit.engine.resident.client.read_to_gpu` says what it raises."""
    from gdskit.engine.resident.client import read_to_gpu  # noqa: PLC0415 - import time
    return read_to_gpu(files, targets, on_bytes=on_bytes)


def stats() -> Any:
    """A snapshot of the engine's ledger."""
    from gdskit.engine.ledger import stats as ledger_stats  # noqa: PLC0415 - import time
    return ledger_stats()


def stats_delta(before: Any, after: Any) -> Any:
    """What the ledger recorded between two snapshots."""
    from gdskit.engine.ledger import stats_delta as delta  # noqa: PLC0415 - import time
    return delta(before, after)


def settings_values() -> dict[str, Any]:
    """The engine's settings as plain values (for a process that is to read as this one does)."""
    return settings.as_dict()


def add_ledger_rows(rows: list[list[Any]]) -> None:
    """Add ledger rows another process recorded for this one's reads: ``[path, reason, op,
    bytes, ops, busy_s, requests, [[bucket, count], ...]]`` each."""
    from gdskit.engine.ledger_inbox import take  # noqa: PLC0415 - import time
    take(rows)


def record_peer(nbytes: int, source_rank: int, transport: str, busy_s: float = 0.0,
                device: int | None = None, ops: int = 1) -> None:
    """Count bytes that arrived from rank ``source_rank`` of a process group over ``transport``
    ("nccl", "gloo") in the ledger: path ``peer``, reason ``fan_out``."""
    from gdskit.engine.ledger import ledger  # noqa: PLC0415 - import time
    ledger.record_peer(nbytes, source_rank, transport, busy_s, device, ops)


def digest_buffers(buffers: list[tuple[int, int]], stream: int = 0, device: int | None = None) -> list[str]:
    """BLAKE3 digests (hex) of ``(address, nbytes)`` buffers where they lie: device memory by a
    GPU kernel on ``stream`` (the stream the bytes landed on), host memory on the CPU; counted
    in the ledger's ``verified`` figures (:mod:`gdskit.engine.digests`). ``device``: all of them
    are memory of that GPU."""
    from gdskit.engine.digests import digest_buffers as engine_digest_buffers  # noqa: PLC0415 - import time
    return engine_digest_buffers(buffers, stream, device)


def start_digest_buffers(buffers: list[tuple[int, int]], stream: int = 0, device: int | None = None) -> Any:
    """:func:`digest_buffers` started, not waited for: host buffers are hashed now, device
    buffers' kernels are queued on ``stream`` and run while the caller goes on. Returns an
    object whose ``result()`` gives the digests (and counts them in the ledger) and whose
    ``abandon()`` drops them; the buffers must stay alive until one of the two has returned."""
    from gdskit.engine.digests import start_digests  # noqa: PLC0415 - import time
    return start_digests(buffers, stream, device)


def prepare_gpu_digests(device: int) -> None:
    """Compile (or find in the cache) and load the BLAKE3 kernels for GPU ``device`` in the
    background: a verified load calls it before its reads, so its first digest does not wait."""
    from gdskit.engine.gpu_hash import prepare  # noqa: PLC0415 - import time
    prepare(device)


def pinned_budget() -> int:
    """The most page-locked memory the engine's staging may hold (``settings.pinned_budget``)."""
    return settings.pinned_budget


def worker_threads() -> int:
    """The engine's I/O worker threads (``settings.threads``)."""
    return settings.threads


def first_page_cached(path: str) -> bool | None:
    """Whether the page cache holds the first page of the file at ``path``; None where it
    cannot say or the file cannot be opened (the read that follows reports that)."""
    from gdskit.engine.residency import Residency, path_residency  # noqa: PLC0415 - import time

    held = path_residency(path, 0, 4096)
    return None if held is None else held is Residency.ALL


def cuda_layer() -> Any:
    """The engine's thin CUDA driver layer (:mod:`gdskit.engine.cuda`): pinned host memory, events and
    copies queued on a caller's stream (the data loader's pinned staging uses them)."""
    import gdskit.engine.cuda as cuda  # noqa: PLC0415 - import time
    return cuda


def closed_at_exit(close: Callable[[Any], None], *, free_memory: bool = False) -> Any:
    """A weak set whose objects are each closed by ``close(obj)`` at exit, where the engine stops
    its worker threads (or, with ``free_memory``, where it frees its pinned memory); ``.add(obj)``."""
    from gdskit.shutdown import FREE_MEMORY, STOP_WORK, ClosedAtExit  # noqa: PLC0415 - import time
    return ClosedAtExit(FREE_MEMORY if free_memory else STOP_WORK, close)


def cufile_counters(device: int) -> dict[str, int] | None:
    """cuFile's own operation counters of GPU ``device``, or None where cuFile or its statistics
    are not available (``gdskit check --probe`` reads them around its probe)."""
    from gdskit.engine.backends.cufile import counters_now  # noqa: PLC0415 - import time
    return counters_now(device)


def io_uring_availability() -> Any:
    """Whether io_uring reads work in this process (``.usable``, ``.detail``); never raises."""
    from gdskit.engine.backends.uring import availability  # noqa: PLC0415 - import time
    return availability()


def can_scatter() -> bool:
    """Whether a read's bytes may be scattered into several device allocations: on every
    path but ``mode="cufile"``, which reads into one buffer per request."""
    return settings.mode is not Mode.CUFILE


def scattered_hot_workers() -> int:
    """How many workers the engine gives a job of scattered reads the page cache holds."""
    from gdskit.engine.backends.bounce import SCATTERED_HOT_WORKERS  # noqa: PLC0415 - import time
    return SCATTERED_HOT_WORKERS


def no_wait() -> None:
    """What waiting for a warm-up that never started does: nothing."""


_warm_ups: dict[int, threading.Thread] = {}
_warm_ups_lock = threading.Lock()


def _join_warm_ups() -> None:
    # A warm-up still making pinned stages at exit would call CUDA while it is torn down.
    with _warm_ups_lock:
        running = list(_warm_ups.values())
    for worker in running:
        worker.join(timeout=30)


def start_warm_up(device: int, nbytes: int, workers: int | None = None) -> Callable[[], None]:
    """Set the engine up for a read of ``nbytes`` onto GPU ``device`` by ``workers`` workers
    (default: all) in the background (as ``gdskit.prepare``: pinned stages, streams, worker
    threads, the direct-route facts) while the caller allocates the destinations; returns the
    function that waits for it.

    Nothing starts once the ring exists, or for a read too small to use every worker's lane;
    a call while a warm-up of the device is under way waits for that one. Start it after a
    large header is parsed, not before: its worker threads would wait for the interpreter the
    parse holds, and take several times longer (docs/engine.md, "Measurements behind the
    defaults"). A failure here is left for the read itself to report.
    """
    import gdskit.engine.pool as pool  # noqa: PLC0415 - import time

    workers = settings.threads if workers is None else min(workers, settings.threads)
    if nbytes < workers * settings.chunk_size or pool.lanes.holds(device):
        return no_wait

    def run() -> None:
        try:
            pool.set_up(device, workers)
        except Exception:  # noqa: BLE001 - the read that follows meets the same error and raises it
            pass

    from gdskit.shutdown import STOP_WORK, at_exit  # noqa: PLC0415 - import time
    from gdskit.threads import start_thread  # noqa: PLC0415 - import time

    at_exit(STOP_WORK, _join_warm_ups)
    with _warm_ups_lock:
        worker = _warm_ups.get(device)
        if worker is None or not worker.is_alive():
            worker = _warm_ups[device] = start_thread(run, "gdskit-warm-up")
    return worker.join


__all__ = [
    # files and jobs
    "File", "open", "open_file", "read_files", "is_object_url", "list_objects", "list_objects_bounded",
    "object_exists", "delete_object", "sweep_uploads", "open_object_stream", "object_endpoint_name",
    "forget_object_clients", "read_whole_files", "whole_file_limit", "start_warm_up", "no_wait",
    # destinations and reader processes
    *_BUFFERS, *_READERS,
    # the ledger
    "stats", "stats_delta", "add_ledger_rows", "record_peer", "cufile_counters",
    # digests of bytes where they landed (verified loading)
    "digest_buffers", "start_digest_buffers", "prepare_gpu_digests",
    # figures a loader plans with
    "settings_values", "pinned_budget", "worker_threads", "first_page_cached", "can_scatter", "scattered_hot_workers",
    "spread", "io_uring_availability",
    # the driver layer, the exit order, the routing decision (for gdskit check)
    "cuda_layer", "closed_at_exit", *_ROUTING,
]
