"""The resident loader: a process that keeps the engine warm (modules imported, pinned lanes
registered, worker threads started) and reads checkpoints into other processes' GPU memory, so
that a fresh program's first load runs at a warm one's rate (docs/resident.md).

- :mod:`~gdskit.engine.resident.wire`: who may talk to the socket, the messages;
- :mod:`~gdskit.engine.resident.ipc`: the few driver calls a client needs to share its memory;
- :mod:`~gdskit.engine.resident.client`: a load's side (light: no engine, no bindings);
- :mod:`~gdskit.engine.resident.server`: ``gdskit serve``'s side.

Here: where the sockets live, and whether a load asks at all, answered without importing the
rest where no loader's socket exists (the common case, paid by every first GPU load).
"""

from __future__ import annotations

import os
import re
import stat
import sys
import tempfile
from collections.abc import Sequence

from gdskit.engine.objects.url import is_object_url
from gdskit.errors import InvalidArgumentError
from gdskit.settings import settings
from gdskit.vocabulary import Resident

#: Reads below this that touch in the file are read by the loader as one, scattered on the GPU
#: (as a load in the process groups small tensors). Under ``auto``, a load whose bytes are mostly
#: in such reads stays in the process: only loads of large tensors were measured faster through
#: the loader (docs/resident.md).
SMALL_READ = 1 << 20
#: A GPU's UUID as sockets are named by it (``nvidia-smi -L``'s, without ``GPU-``).
GPU_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
#: Where no GPU is served (host memory only: tests, machines without one).
HOST = "host"


def socket_dir() -> str:
    """The directory of this user's loaders' sockets: ``$XDG_RUNTIME_DIR/gdskit``, else
    ``<tmp>/gdskit-<uid>``."""
    run = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(run):
        return os.path.join(run, "gdskit")
    return os.path.join(tempfile.gettempdir(), f"gdskit-{os.getuid()}")


def socket_path(gpu: str) -> str:
    """The socket of the loader of GPU ``gpu`` (its UUID, or :data:`HOST`)."""
    if gpu != HOST and not GPU_UUID.match(gpu):
        raise InvalidArgumentError(f"not a GPU UUID: {gpu!r}")
    return os.path.join(socket_dir(), f"resident-{gpu}.sock")


def worth_asking(device: int, sizes: Sequence[int] = (), paths: Sequence[str] = ()) -> bool:
    """Whether a load onto GPU ``device`` of ``paths`` should make its destinations for the
    resident loader before reading: the setting requires it (the client then says why it cannot,
    an object in a store say), or the files are local, a socket is there for that GPU (one
    stat), this process has no staging of its own for it yet, and at most half the bytes of the
    load's reads (``sizes``) are in reads below :data:`SMALL_READ`. Costs one directory listing where
    no loader's socket exists, a few driver calls where one does, never the bindings' import."""
    mode = settings.snapshot().resident  # a bad GDSKIT_RESIDENT raises here, as for every request
    if mode is Resident.OFF:
        return False
    if mode is Resident.REQUIRE:
        return True
    if any(is_object_url(p) for p in paths):  # read by ranged GETs in the process
        return False
    total = sum(sizes)
    if total and sum(n for n in sizes if n < SMALL_READ) > total / 2:
        return False
    # A process whose own engine has staging for this GPU already loads at the warm rate, with
    # no mapping of its memory into another process: it reads itself.
    # Looked up, never imported: importing the engine is what a first load avoids here.
    pool = sys.modules.get("gdskit.engine.pool")
    if pool is not None and pool.lanes.holds(device):
        return False
    try:  # no loader's socket at all (the common case): no driver call
        if not any(name.startswith("resident-") for name in os.listdir(socket_dir())):
            return False
    except OSError:
        return False
    from gdskit.engine.resident import ipc  # noqa: PLC0415 - import time

    try:
        where = socket_path(ipc.ordinal_uuid(device))
    except ipc.IpcUnavailable:
        return False
    try:
        return stat.S_ISSOCK(os.lstat(where).st_mode)
    except OSError:
        return False
