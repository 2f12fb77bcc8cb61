"""Routed reads: from storage into the GPU nearest it, then device to device into the target.

:mod:`gdskit.engine.gpu_routing` decides that a read goes through GPU ``via``; this module moves the
bytes. A ring of two staging slots of device memory on ``via`` takes turns: the engine's
normal path for ``via`` (direct where it exists) fills one slot while the other's bytes are
copied peer to peer (``cuMemcpyPeerAsync`` on a stream of ``via``) into the target; an event
per slot says when its copy is done, and only then is the slot filled again. The reads of
many small items share a slot, so they are read as one job, side by side.

The ledger records the bytes under their storage path and reason, on the target's per-GPU
figures, and in its ``routed`` rows with the GPU they went through.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import gdskit.engine.cuda as cuda
from gdskit.shutdown import FREE_MEMORY, at_exit
from gdskit.engine.buffers import BufferView
from gdskit.engine.cuda import MemoryKind
from gdskit.errors import CudaError
from gdskit.engine.ledger import ledger
from gdskit.engine.plan import align_up
from gdskit.engine.gpu_routing import RouteDecision

#: The largest staging slot; a ring holds two on the GPU it reads through. A slot holds one
#: chunk per worker (``threads * chunk_size``, 128 MiB at the defaults), so every worker reads
#: into it side by side, and never more than this.
SLOT_BYTES = 256 << 20
_MIN_SLOT = 256 << 10

#: One staged read: (slot view, bytes, file offset, offset in the slot) -> the byte count of each.
ReadStaged = Callable[[list[tuple[BufferView, int, int, int]]], list[int]]


class _Ring:
    """Two staging slots of device memory on one GPU (halves of one allocation, so both have
    the same alignment), the stream the peer copies run on, and an event per slot recorded
    after the copies out of it."""

    def __init__(self, device: int, slot_bytes: int) -> None:
        self.device = device
        self.slot_bytes = slot_bytes
        self.memory: cuda.DeviceArray | None = None
        self.events: list[cuda.Event] = []
        self.stream: cuda.Stream | None = None
        try:
            with cuda.on_device(device):
                self.stream = cuda.Stream(device)
                self.memory = cuda.DeviceArray(2 * slot_bytes, device)
                self.events = [cuda.Event(), cuda.Event()]
        except BaseException:
            self.free()
            raise

    def ptr(self, i: int) -> int:
        assert self.memory is not None
        return self.memory.ptr + i * self.slot_bytes

    def view(self, i: int) -> BufferView:
        return BufferView(self.ptr(i), self.slot_bytes, MemoryKind.DEVICE, self.device, False, owner=self.memory)

    def drain(self) -> None:
        for ev in self.events:
            ev.wait()
        if self.stream is not None:
            self.stream.synchronize()

    def free(self) -> None:
        # Copies still queued read the slots: they end before the memory goes.
        if self.stream is not None:
            try:
                self.stream.synchronize()
            except Exception:  # noqa: BLE001 - a stream in error runs nothing more
                pass
        for ev in self.events:
            ev.destroy()
        if self.memory is not None:
            self.memory.free()
        if self.stream is not None:
            self.stream.destroy()
        self.events, self.memory, self.stream = [], None, None


class _Rings:
    """Idle rings by (device, slot size), reused: device memory and streams are slow to make."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[tuple[int, int], list[_Ring]] = {}

    def acquire(self, device: int, slot_bytes: int) -> _Ring:
        with self._lock:
            idle = self._idle.get((device, slot_bytes))
            if idle:
                return idle.pop()
        return _Ring(device, slot_bytes)

    def release(self, ring: _Ring) -> None:
        with self._lock:
            self._idle.setdefault((ring.device, ring.slot_bytes), []).append(ring)

    def held(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._idle.values())

    def release_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for rings in idle.values():
            for ring in rings:
                ring.free()


rings = _Rings()
cuda.on_driver_change(rings.release_idle)  # the rings are the leaving driver's memory and streams
at_exit(FREE_MEMORY, rings.release_idle)


@dataclass(frozen=True, slots=True)
class _Piece:
    item: int          # which job
    file_offset: int
    size: int
    buf_offset: int    # where it goes in the target's view
    slot_offset: int   # where its first byte lands in the slot


def _slot_size(total: int, threads: int, chunk_size: int, alignment: int) -> int:
    """Bytes of one slot: room for a power of two of at least 256 KiB that holds ``total``, up
    to a chunk per worker or :data:`SLOT_BYTES`, plus alignment slack."""
    cap = max(_MIN_SLOT, min(SLOT_BYTES, threads * chunk_size))
    room = _MIN_SLOT
    while room < total and room < cap:
        room *= 2
    return align_up(min(room, cap) + 2 * alignment, alignment)


def _pack(jobs: Sequence[tuple[BufferView, int, int, int]], slot_base: int, slot_bytes: int,
          alignment: int) -> list[list[_Piece]]:
    """The jobs' bytes as slot loads, in order: a job larger than a slot is split, small ones
    share a slot. Each piece lands at a slot offset with the file offset's alignment, so the
    direct path can read it in place (``slot_base``: the slot's address)."""
    room = slot_bytes - 2 * alignment
    loads: list[list[_Piece]] = []
    current: list[_Piece] = []
    cursor = 0
    for k, (_view, size, file_offset, buf_offset) in enumerate(jobs):
        done = 0
        while done < size:
            n = min(room, size - done)
            fo = file_offset + done
            at = cursor + (fo - slot_base - cursor) % alignment
            if at + n > slot_bytes:
                loads.append(current)
                current, cursor = [], 0
                at = (fo - slot_base) % alignment
            current.append(_Piece(k, fo, n, buf_offset + done, at))
            cursor = align_up(at + n, alignment)
            done += n
    if current:
        loads.append(current)
    return loads


def _copy_out(ring: _Ring, slot: int, piece: _Piece, n: int, target: BufferView, target_gpu: int) -> None:
    """Queue the peer copies of ``n`` bytes of ``piece`` from the slot into the target's memory."""
    assert ring.stream is not None
    src = ring.ptr(slot) + piece.slot_offset
    if target.scatter is None:
        ring.stream.copy_peer(target.ptr + piece.buf_offset, target_gpu, src, ring.device, n)
        return
    for dst, skip, k in target.scatter.pieces(piece.buf_offset, n):
        ring.stream.copy_peer(dst, target_gpu, src + skip, ring.device, k)


def _open_peer_access(via: int, target: int) -> None:
    """Open the way between the two GPUs both ways; where the driver refuses, its copies still
    land (staged through host memory), only slower."""
    for a, b in ((via, target), (target, via)):
        try:
            cuda.enable_peer_access(a, b)
        except CudaError:
            pass


def read_routed(jobs: Sequence[tuple[BufferView, int, int, int]], decision: RouteDecision,
                read_staged: ReadStaged, threads: int, chunk_size: int, alignment: int,
                on_bytes: Callable[[int], None] | None = None) -> list[int]:
    """Read ``jobs`` (target view, size, file offset, offset in the view), all into GPU
    ``decision.target``, through GPU ``decision.via``; the byte count of each (short only at end
    of file). ``read_staged`` is the engine's own read into the via GPU's memory.

    The calling thread's current CUDA context is the same on return as before.
    """
    via, target = decision.via, decision.target
    assert via is not None and via != target
    counts = [0] * len(jobs)
    total = sum(size for _v, size, _fo, _bo in jobs)
    if total == 0:
        return counts
    ring = rings.acquire(via, _slot_size(total, threads, chunk_size, alignment))
    ok = False
    try:
        with cuda.on_device(via):
            if decision.peer is None or decision.peer.access is not False:
                _open_peer_access(via, target)
            stopped: set[int] = set()     # jobs that met the end of the file
            for turn, load in enumerate(_pack(jobs, ring.ptr(0), ring.slot_bytes, alignment)):
                slot = turn % 2
                ring.events[slot].wait()  # the copies out of this slot are done: refill it
                pieces = [p for p in load if p.item not in stopped]
                if not pieces:
                    continue
                view = ring.view(slot)
                with ledger.routing(via, target):
                    got = read_staged([(view, p.size, p.file_offset, p.slot_offset) for p in pieces])
                moved = 0
                for p, n in zip(pieces, got):
                    if p.item in stopped:
                        continue
                    if n:
                        _copy_out(ring, slot, p, n, jobs[p.item][0], target)
                        counts[p.item] += n
                        moved += n
                    if n < p.size:
                        stopped.add(p.item)
                assert ring.stream is not None
                ring.events[slot].record(ring.stream)
                if on_bytes is not None and moved:
                    on_bytes(moved)
            ring.drain()
        ok = True
    finally:
        if ok:
            rings.release(ring)
        else:
            ring.free()
    return counts
