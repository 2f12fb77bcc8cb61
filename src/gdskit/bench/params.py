"""The parameters of one ``gdskit bench`` invocation, parsed and checked once.

Sizes follow gdsio's spelling (``4K``, ``1M``, ``1G``, binary units); an I/O
size may also be a ``min:max`` range, which sweeps every power of two from
``min`` to ``max``. Everything wrong with the arguments is reported here, before
any file is touched, as :class:`gdskit.errors.InvalidArgumentError`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os

from gdskit.errors import ConfigError, InvalidArgumentError
from gdskit.settings import parse_size
from gdskit.vocabulary import Reason

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

#: Every I/O must be a whole number of these (the direct path and O_DIRECT need it).
IO_ALIGNMENT = 4 * KiB

#: ``--sweep`` without a range: 4 KiB to 16 MiB, every power of two.
SWEEP_MIN = 4 * KiB
SWEEP_MAX = 16 * MiB

#: The order paths appear in when every available path is compared.
PATH_NAMES = ("cufile", "bounce", "host")
#: The paths whose buffers are GPU memory (the host path reads into host memory).
GPU_PATHS = frozenset({"cufile", "bounce"})

#: gdsio's numeric ``-I`` values, accepted so its users' muscle memory works.
_GDSIO_OPS = {"0": "read", "1": "write", "2": "randread", "3": "randwrite"}


class PathUnavailableError(InvalidArgumentError):
    """A path asked for on the command line cannot run on this machine.

    ``path`` is the bench path name, ``reason`` a :class:`gdskit.Reason`.
    """

    def __init__(self, message: str, path: str, reason: Reason | str) -> None:
        super().__init__(message)
        self.path = path
        self.reason = reason


class Op(str, enum.Enum):
    """The I/O pattern of a run."""

    READ = "read"
    WRITE = "write"
    RANDREAD = "randread"
    RANDWRITE = "randwrite"

    def __str__(self) -> str:
        return self.value

    @property
    def is_read(self) -> bool:
        return self in (Op.READ, Op.RANDREAD)

    @property
    def is_random(self) -> bool:
        return self in (Op.RANDREAD, Op.RANDWRITE)


class Cache(str, enum.Enum):
    """Page-cache policy before each run."""

    COLD = "cold"  # evict the file's pages (posix_fadvise) and use O_DIRECT
    DROP = "drop"  # as cold, and drop the whole page cache (root only)
    HOT = "hot"    # leave the page cache alone: measures memory-speed paths

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class BenchParams:
    """What to measure. Build with :func:`make_params` (it validates).

    Attributes
    ----------
    file : str | None
        One target file shared by all workers (``-f``); each worker owns a slice.
    directory : str | None
        A directory holding one file per worker (``-D``).
    device : int
        GPU index for device buffers (``-d``).
    size : int
        Data set size in bytes: the file size with ``-f``, each worker's file with ``-D``.
    io_sizes : tuple[int, ...]
        One I/O size, or the sizes of a sweep (ascending).
    workers : int
        Worker threads issuing I/O concurrently (``-w``).
    paths : tuple[str, ...]
        Paths to compare, from :data:`PATH_NAMES`; empty means every available one.
    op : Op
        I/O pattern (``-I``).
    duration : float | None
        Seconds per run (``-T``); workers wrap around their region until it elapses.
    total_bytes : int | None
        Bytes per run; without it and without ``duration`` a run makes one pass.
    verify : bool
        Check every byte against a known pattern (``-V``).
    cache : Cache
        Page-cache policy.
    repeat : int
        Repetitions per path (and per I/O size in a sweep).
    sweep : bool
        Whether ``io_sizes`` is a sweep (knee finding applies).
    seed : int
        Seed of the random offsets, so runs of different paths do the same I/O.
    processes : bool
        Each worker in its own process (``--processes``), as fio's jobs are, instead of a
        thread of this one: small I/O then measures the storage, not the interpreter lock.
    huge_pages : bool
        Host buffers on 2 MiB transparent huge pages (``--huge-pages``). Where a buffer's
        pages lie in physical memory changes how the kernel splits an O_DIRECT request into
        device requests; huge pages make that the same for every run (and for fio given
        huge pages), ordinary pages leave it to chance.
    force : bool
        Allow writing into an existing target file (``--force``): ``-V``'s pattern, a write
        run, or filling a read target smaller than ``size``. Without it an existing file is
        only ever read, as it is.
    engine : bool
        Also measure the engine's own rate on the file (``File.read`` into GPU memory at the
        engine's settings) after the runs of a read benchmark with a GPU path (``--no-engine``: not).
    """

    file: str | None
    directory: str | None
    device: int
    size: int
    io_sizes: tuple[int, ...]
    workers: int
    paths: tuple[str, ...]
    op: Op
    duration: float | None
    total_bytes: int | None
    verify: bool
    cache: Cache
    repeat: int
    sweep: bool
    seed: int = 0
    processes: bool = False
    huge_pages: bool = False
    force: bool = False
    engine: bool = True

    @property
    def paths_explicit(self) -> bool:
        """True when the user named the paths (then an unavailable one is an error)."""
        return bool(self.paths)

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form (enums as their names)."""
        out = dataclasses.asdict(self)
        out["op"] = self.op.value
        out["cache"] = self.cache.value
        out["io_sizes"] = list(self.io_sizes)
        out["paths"] = list(self.paths)
        return out


# -- parsing -----------------------------------------------------------------
def parse_bytes(text: str | int, what: str) -> int:
    """Parse a gdsio-style size (``4K``, ``1M``, ``2G``, ``4096``) into bytes."""
    try:
        value = parse_size(text.strip() if isinstance(text, str) else text)
    except ConfigError as exc:
        raise InvalidArgumentError(f"{what}: {exc}") from None
    return value


def parse_io_sizes(text: str) -> tuple[tuple[int, ...], bool]:
    """Parse ``-i``: one size, or ``min:max`` (every power of two in between).

    Returns the sizes and whether it is a range. Range ends need not be powers
    of two: the sweep starts at ``min`` and doubles while it stays <= ``max``,
    and ``max`` itself is always included.
    """
    text = str(text).strip()
    if ":" not in text:
        return (parse_bytes(text, "I/O size (-i)"),), False
    parts = text.split(":")
    if len(parts) != 2 or not parts[0] or not parts[1]:
        raise InvalidArgumentError(f"I/O size range must be MIN:MAX (e.g. 4K:16M), got {text!r}")
    lo = parse_bytes(parts[0], "I/O size range minimum (-i)")
    hi = parse_bytes(parts[1], "I/O size range maximum (-i)")
    if lo <= 0 or hi <= 0:
        raise InvalidArgumentError(f"I/O sizes must be positive, got {text!r}")
    if lo > hi:
        raise InvalidArgumentError(f"I/O size range minimum {lo} is above its maximum {hi}")
    return sweep_sizes(lo, hi), True


def sweep_sizes(lo: int, hi: int) -> tuple[int, ...]:
    """``lo, 2*lo, 4*lo, ...`` up to ``hi``, with ``hi`` always last."""
    sizes = []
    s = lo
    while s < hi:
        sizes.append(s)
        s *= 2
    sizes.append(hi)
    return tuple(sizes)


def parse_paths(text: str | None) -> tuple[str, ...]:
    """Parse ``-x cufile,bounce,host`` (order kept, duplicates dropped); None: every path."""
    if text is None:
        return ()
    out: list[str] = []
    for raw in str(text).split(","):
        name = raw.strip().lower()
        if not name:
            continue
        if name not in PATH_NAMES:
            raise InvalidArgumentError(
                f"unknown path {raw.strip()!r} for -x; known: {', '.join(PATH_NAMES)}")
        if name not in out:
            out.append(name)
    if not out:
        raise InvalidArgumentError("-x names no path")
    return tuple(out)


def parse_op(text: str | Op) -> Op:
    """Parse ``-I``: ``read|write|randread|randwrite`` or gdsio's ``0|1|2|3``."""
    if isinstance(text, Op):
        return text
    key = _GDSIO_OPS.get(str(text).strip(), str(text).strip().lower())
    try:
        return Op(key)
    except ValueError:
        raise InvalidArgumentError(
            f"unknown operation {text!r} for -I; use read, write, randread or randwrite") from None


def parse_cache(text: str | Cache) -> Cache:
    if isinstance(text, Cache):
        return text
    try:
        return Cache(str(text).strip().lower())
    except ValueError:
        raise InvalidArgumentError(f"unknown cache policy {text!r}; use cold, drop or hot") from None


def make_params(
    *,
    file: str | None = None,
    directory: str | None = None,
    device: int = 0,
    size: str | int = "1G",
    io_size: str | int | None = None,
    workers: int = 4,
    paths: str | tuple[str, ...] | None = None,
    op: str | Op = Op.READ,
    duration: float | None = None,
    total: str | int | None = None,
    verify: bool = False,
    cache: str | Cache = Cache.COLD,
    repeat: int = 3,
    sweep: bool = False,
    seed: int = 0,
    processes: bool = False,
    huge_pages: bool = False,
    force: bool = False,
    engine: bool = True,
) -> BenchParams:
    """Parse and validate; raise :class:`InvalidArgumentError` on anything wrong."""
    if file and directory:
        raise InvalidArgumentError("give either a file (-f) or a directory (-D), not both")
    if directory is not None and os.path.exists(directory) and not os.path.isdir(directory):
        raise InvalidArgumentError(f"-D {directory!r} is not a directory")
    if directory is not None and not os.path.exists(directory):
        parent = os.path.dirname(os.path.abspath(directory))
        if not os.path.isdir(parent):
            raise InvalidArgumentError(
                f"-D {directory!r} does not exist, nor does its parent {parent!r}: gdskit bench makes only "
                f"the last directory of -D's path")
    if file is not None and not file.strip():
        raise InvalidArgumentError("-f names no file")
    if directory is not None and not directory.strip():
        raise InvalidArgumentError("-D names no directory")
    if file is not None and os.path.isdir(file):
        raise InvalidArgumentError(f"-f {file!r} is a directory; use -D for one file per worker")
    if isinstance(device, bool) or int(device) < 0:
        raise InvalidArgumentError(f"GPU index (-d) must be >= 0, got {device}")
    if int(workers) < 1:
        raise InvalidArgumentError(f"workers (-w) must be at least 1, got {workers}")
    if int(workers) > 1024:
        raise InvalidArgumentError(f"workers (-w) must be at most 1024, got {workers}")
    if int(repeat) < 1:
        raise InvalidArgumentError(f"--repeat must be at least 1, got {repeat}")
    if duration is not None and not 0 < float(duration) < math.inf:
        raise InvalidArgumentError(f"duration (-T) must be a positive number of seconds, got {duration}")
    if isinstance(seed, bool) or int(seed) < 0:
        raise InvalidArgumentError(f"--seed must be >= 0, got {seed}")

    nbytes = parse_bytes(size, "data set size (-s)")
    if nbytes <= 0:
        raise InvalidArgumentError("data set size (-s) must be positive")

    if io_size is None and sweep:
        sizes, is_range = sweep_sizes(SWEEP_MIN, SWEEP_MAX), True
    elif io_size is None:
        sizes, is_range = (1 * MiB,), False
    else:
        sizes, is_range = parse_io_sizes(str(io_size))
    for s in sizes:
        if s <= 0 or s % IO_ALIGNMENT:
            raise InvalidArgumentError(
                f"I/O size {s} is not a positive multiple of {IO_ALIGNMENT} bytes (4 KiB)")

    biggest = max(sizes)
    per_worker = nbytes if directory else nbytes // int(workers)
    if nbytes < biggest:
        raise InvalidArgumentError(
            f"data set size (-s) {nbytes} is smaller than the I/O size (-i) {biggest}")
    if per_worker < biggest:
        raise InvalidArgumentError(
            f"data set size (-s) {nbytes} split over {workers} workers leaves {per_worker} bytes "
            f"each, less than one I/O of {biggest}; use fewer workers or a larger -s")

    total_bytes = None if total is None else parse_bytes(total, "total bytes")
    if total_bytes is not None and total_bytes < biggest:
        raise InvalidArgumentError(f"total bytes {total_bytes} is less than one I/O of {biggest}")

    path_names = paths if isinstance(paths, tuple) else parse_paths(paths)
    for p in path_names:
        if p not in PATH_NAMES:
            raise InvalidArgumentError(f"unknown path {p!r}; known: {', '.join(PATH_NAMES)}")

    return BenchParams(
        file=file, directory=directory, device=int(device), size=nbytes, io_sizes=tuple(sizes),
        workers=int(workers), paths=tuple(path_names), op=parse_op(op),
        duration=None if duration is None else float(duration), total_bytes=total_bytes,
        verify=bool(verify), cache=parse_cache(cache), repeat=int(repeat),
        sweep=bool(sweep or is_range), seed=int(seed), processes=bool(processes),
        huge_pages=bool(huge_pages), force=bool(force), engine=bool(engine),
    )
