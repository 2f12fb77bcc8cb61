"""The route of a read or write: which backend serves each of its pieces and why, and whether a
read into GPU memory goes through another GPU. The one place both are decided
(:func:`route_read`); one type (:class:`ReadRoute`) carries the answer.

The backend of each piece is recorded in the ledger as the request's reason, in the words of
:class:`gdskit.Reason`. Only device memory (cudaMalloc-style) is ever sent to cuFile; managed and
host memory never are. Whether to pass through another GPU is :mod:`gdskit.engine.gpu_routing`'s
rule, asked here with what the backends decided (only a direct read is routed in ``auto``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import gdskit.engine.cuda as cuda
from gdskit.engine.backends.base import OpenFile
from gdskit.engine.buffers import BufferView
from gdskit.engine.cuda import MemoryKind
from gdskit.engine.direct_path import direct_route
from gdskit.engine.gpu_routing import RouteDecision, route_for_read
from gdskit.errors import DirectPathUnavailable, InvalidArgumentError
from gdskit.engine.plan import split_aligned
from gdskit.settings import Settings
from gdskit.vocabulary import Mode, Reason, Routing


class BackendKind(str, enum.Enum):
    """The engine's backends, by what they do (``engine/backends/``)."""

    CUFILE = "cufile"   # cuFile: direct where the platform has a direct path, its compat mode where not
    BOUNCE = "bounce"   # gdskit's pinned-bounce ring: storage -> pinned host lanes -> GPU
    HOST = "host"       # plain parallel I/O into host memory

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class BackendChoice:
    """Where one piece of a request goes: which backend serves it, and why (the ledger's reason)."""

    backend: BackendKind
    reason: Reason
    file_offset: int
    buf_offset: int
    size: int


@dataclass(frozen=True, slots=True)
class ReadRoute:
    """How one request goes: its pieces, each with its backend and reason, in file order; and
    ``via``, the decision to read it through another GPU (:mod:`gdskit.engine.via_gpu` moves those
    bytes, and the pieces are then routed again for the GPU it names), or None to read it here."""

    pieces: tuple[BackendChoice, ...]
    via: RouteDecision | None = None

    @property
    def through_other_gpu(self) -> bool:
        return self.via is not None

    @property
    def uses_cufile(self) -> bool:
        return any(p.backend is BackendKind.CUFILE for p in self.pieces)

    @property
    def bounce_reason(self) -> Reason | None:
        """The reason where the whole request is one piece through the bounce ring, read here; else None."""
        if self.via is None and len(self.pieces) == 1 and self.pieces[0].backend is BackendKind.BOUNCE:
            return self.pieces[0].reason
        return None


def route_read(f: OpenFile, buf: BufferView, size: int, file_offset: int, buf_offset: int, cfg: Settings, *,
               other_gpu: bool = True) -> ReadRoute:
    """The route of one request of ``size`` bytes at ``file_offset`` of ``f`` into (or from) ``buf``
    at ``buf_offset``. ``other_gpu``: whether it may go through another GPU (reads only; False
    for writes, stream-ordered I/O and the staged part of a read already routed). Raises when a
    forced mode cannot serve it."""
    route = ReadRoute(tuple(choose_backends(f, buf, size, file_offset, buf_offset, cfg)))
    if not other_gpu or not buf.on_device:
        return route
    decision = route_for_read(f, buf, route.uses_cufile, cfg.routing)
    return ReadRoute(route.pieces, decision) if decision is not None and decision.routed else route


def refuse_device_memory_in_host_mode(cfg: Settings) -> None:
    """:class:`InvalidArgumentError` for GPU memory under ``mode='host'`` (files and objects alike)."""
    if cfg.mode is Mode.HOST:
        raise InvalidArgumentError("mode='host' serves host memory only; this buffer is in GPU memory "
                                   "(use mode='auto' or 'bounce')")


def host_reason() -> Reason:
    return Reason.NO_GPU if cuda.device_count() == 0 else Reason.HOST_MEMORY


def _direct_threshold(f: OpenFile, cfg: Settings) -> int:
    """The measured cut-off for this file's mount (``gdskit bench --save-profile``), else the setting."""

    def lookup() -> int | None:
        from gdskit.engine.profiles import threshold_for  # noqa: PLC0415 - test seam

        return threshold_for(f.path)

    measured = f.threshold.get(lookup)
    return cfg.direct_threshold if measured is None else measured


def bounce_for_any_file(cfg: Settings) -> Reason | None:
    """Why every read of device memory (cudaMalloc-style) goes through the bounce ring under
    ``cfg`` whatever file it reads, or None where the router must see each file (cuFile may serve
    some, or routing through another GPU may be forced): the one answer for jobs that read many
    files without asking about each."""
    if cfg.routing is Routing.FORCE and cuda.device_count() > 1:
        return None
    if cfg.mode is Mode.BOUNCE:
        return Reason.FORCED_BY_SETTING
    return _no_direct_route() if cfg.mode is Mode.AUTO else None


def _no_direct_route() -> Reason | None:
    """Why this machine has no direct route for device memory, or None where it has one."""
    route = direct_route()
    return (route.reason or Reason.NVIDIA_FS_MISSING) if route.route is None else None


def choose_backends(f: OpenFile, buf: BufferView, size: int, file_offset: int, buf_offset: int,
                    cfg: Settings) -> list[BackendChoice]:
    """Split one request into pieces and choose each piece's backend (see :func:`route_read`)."""
    whole = (file_offset, buf_offset, size)
    if not buf.on_device:
        return [BackendChoice(BackendKind.HOST, host_reason(), *whole)]
    refuse_device_memory_in_host_mode(cfg)
    if buf.kind is MemoryKind.MANAGED:
        if cfg.mode is Mode.CUFILE:
            raise DirectPathUnavailable("managed memory cannot take the cuFile path", Reason.MANAGED_MEMORY)
        return [BackendChoice(BackendKind.BOUNCE, Reason.MANAGED_MEMORY, *whole)]
    if cfg.mode is Mode.BOUNCE:
        return [BackendChoice(BackendKind.BOUNCE, Reason.FORCED_BY_SETTING, *whole)]
    # A scattered destination is several separate small allocations: cuFile takes one buffer per
    # request, and each of these would be a request below the direct cut-off.
    if cfg.mode is Mode.CUFILE and buf.scatter is not None:
        raise DirectPathUnavailable("a scattered destination cannot take the cuFile path", Reason.BELOW_THRESHOLD)
    if cfg.mode is Mode.CUFILE:
        from gdskit.engine.backends.cufile import registered_handle  # noqa: PLC0415 - import time

        registered_handle(f)  # raises where cuFile cannot serve this file
        return [BackendChoice(BackendKind.CUFILE, Reason.FORCED_BY_SETTING, *whole)]
    # auto
    missing = _no_direct_route()
    if missing is not None:
        return [BackendChoice(BackendKind.BOUNCE, missing, *whole)]
    if buf.scatter is not None or size < _direct_threshold(f, cfg):
        return [BackendChoice(BackendKind.BOUNCE, Reason.BELOW_THRESHOLD, *whole)]
    from gdskit.engine.backends.cufile import register  # noqa: PLC0415 - test seam

    reg = register(f)
    if reg.handle is None:
        return [BackendChoice(BackendKind.BOUNCE, reg.reason or Reason.HANDLE_REGISTER_FAILED, *whole)]
    if f.compat_seen:
        return [BackendChoice(BackendKind.BOUNCE, Reason.CUFILE_COMPAT_OBSERVED, *whole)]
    # The direct path needs 4 KiB-aligned file offsets, sizes and memory: send the aligned body there
    # and the ragged edges through the bounce ring.
    align = cfg.alignment
    if (buf.ptr + buf_offset - file_offset) % align:
        return [BackendChoice(BackendKind.BOUNCE, Reason.UNALIGNED, *whole)]
    parts = split_aligned(file_offset, buf_offset, size, align)
    out = []
    if parts.head:
        out.append(BackendChoice(BackendKind.BOUNCE, Reason.UNALIGNED, parts.head.file_offset, parts.head.buf_offset, parts.head.size))
    if parts.body:
        out.append(BackendChoice(BackendKind.CUFILE, Reason.DIRECT, parts.body.file_offset, parts.body.buf_offset, parts.body.size))
    if parts.tail:
        out.append(BackendChoice(BackendKind.BOUNCE, Reason.UNALIGNED, parts.tail.file_offset, parts.tail.buf_offset, parts.tail.size))
    return out


def object_reason(buf: BufferView, cfg: Settings) -> Reason:
    """The reason recorded for bytes of an object store (path ``object``) landing in ``buf``:
    host memory's reason, or ``object_store`` for GPU memory (an object store's bytes cross host
    memory, through a pinned lane). Raises where a forced mode cannot serve it."""
    if not buf.on_device:
        return host_reason()
    refuse_device_memory_in_host_mode(cfg)
    if cfg.mode is Mode.CUFILE:
        raise DirectPathUnavailable("an object store's bytes cannot take the cuFile path", Reason.OBJECT_STORE)
    return Reason.OBJECT_STORE
