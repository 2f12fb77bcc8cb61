"""A stand-in for ``cuda.bindings.cufile`` so the cuFile backend's logic runs in CI.

Reads and writes go straight between the file descriptor and the (fake) device memory,
and bump the per-GPU level-3 counters of the route the test chooses: ``"posix"``
(compat mode, as on a machine without nvidia-fs), ``"nvfs"`` or ``"p2p"``.
"""

from __future__ import annotations

import ctypes
import itertools
import os
from types import SimpleNamespace

import numpy as np

COUNTERS = ("n_nvfs_reads", "n_p2p_reads", "n_posix_reads", "n_nvfs_writes", "n_p2p_writes", "n_posix_writes")


class cuFileError(Exception):  # noqa: N801 - the bindings' name
    pass


class FakeCufile:
    FileHandleType = SimpleNamespace(OPAQUE_FD=1)

    def __init__(self, route: str = "posix", register_fails: bool = False) -> None:
        self.route = route
        self.register_fails = register_fails
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.handles: dict[int, int] = {}
        self.buffers: dict[int, int] = {}
        self._objects: dict[int, object] = {}
        self._ids = itertools.count(1000)
        self.opened = False
        self.stats_level = 0
        fake = self

        class Descr:
            def __init__(self) -> None:
                self.type = 0
                self.handle = SimpleNamespace(fd=-1)
                self.fs_ops = None
                self.ptr = next(fake._ids)
                fake._objects[self.ptr] = self

        class StatsLevel3:
            def __init__(self) -> None:
                self.ptr = next(fake._ids)
                self.per_gpu_stats = None
                fake._objects[self.ptr] = self

        self.Descr = Descr
        self.StatsLevel3 = StatsLevel3

    # -- driver ---------------------------------------------------------------------------------
    def driver_open(self) -> None:
        self.opened = True

    def driver_close(self) -> None:
        self.opened = False

    def get_version(self) -> int:
        return 1150

    def set_stats_level(self, level: int) -> None:
        self.stats_level = level

    def stats_start(self) -> None:
        pass

    def stats_stop(self) -> None:
        pass

    def driver_get_properties(self, addr: int) -> None:
        pass  # all zeros: no nvidia-fs

    def get_stats_l3(self, ptr: int) -> None:
        obj = self._objects[ptr]
        obj.per_gpu_stats = SimpleNamespace(**{k: np.array([v, 0]) for k, v in self.counters.items()})

    # -- handles and buffers ---------------------------------------------------------------------
    def handle_register(self, descr_ptr: int) -> int:
        if self.register_fails:
            raise cuFileError("udev property not found: ID_FS_USAGE")
        handle = next(self._ids)
        # Like cuFile's compat mode, serve any offset: a buffered twin of the (O_DIRECT) descriptor.
        fd = self._objects[descr_ptr].handle.fd
        self.handles[handle] = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        return handle

    def handle_deregister(self, handle: int) -> None:
        os.close(self.handles.pop(handle))

    def buf_register(self, ptr: int, nbytes: int, flags: int) -> None:
        self.buffers[ptr] = nbytes

    def buf_deregister(self, ptr: int) -> None:
        del self.buffers[ptr]

    # -- I/O --------------------------------------------------------------------------------------
    def read(self, fh: int, base: int, size: int, file_offset: int, buf_offset: int) -> int:
        data = os.pread(self.handles[fh], size, file_offset)
        ctypes.memmove(base + buf_offset, data, len(data))
        self.counters[f"n_{self.route}_reads"] += 1
        return len(data)

    def write(self, fh: int, base: int, size: int, file_offset: int, buf_offset: int) -> int:
        data = ctypes.string_at(base + buf_offset, size)
        n = os.pwrite(self.handles[fh], data, file_offset)
        self.counters[f"n_{self.route}_writes"] += 1
        return n
