"""One typed settings object, ``GDSKIT_*`` environment overrides, temporary changes.

>>> import gdskit
>>> gdskit.settings.threads
16
>>> with gdskit.settings.set(mode="bounce", threads=8):
...     pass  # inside: bounce path, 8 threads; restored on exit

``settings.set(...)`` also works without ``with``: the change then stays.
Every field can be set from the environment before import, e.g.
``GDSKIT_MODE=bounce GDSKIT_CHUNK_SIZE=16MiB``. docs/engine.md ("Settings") lists them all.
An invalid value does not break the import: the first request (and
``settings.check_environment()``) raises :class:`~gdskit.errors.EnvironmentVariableError`,
which names the variable and what it takes.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import threading
from collections.abc import Callable
from typing import Any

from gdskit.errors import ConfigError, EnvironmentVariableError
from gdskit.vocabulary import CufileBatch, IoUring, Mode, ODirectPolicy, PinnedAlloc, Resident, Routing

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

_SIZE_UNITS = {"": 1, "b": 1, "k": KiB, "kb": KiB, "kib": KiB, "m": MiB, "mb": MiB, "mib": MiB,
               "g": GiB, "gb": GiB, "gib": GiB, "t": 1024 * GiB, "tb": 1024 * GiB, "tib": 1024 * GiB}


def parse_size(text: str | int) -> int:
    """Parse ``"8MiB"``, ``"512k"``, ``"1G"`` or a plain integer into bytes (units are binary)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(f"not a size: {text!r} (examples: 4096, 64KiB, 8MiB, 1GiB)")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]


def format_size(n: float, digits: int = 0) -> str:
    """``n`` bytes for people: ``"80 GiB"`` (``digits`` after the point), ``"512 B"``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 1 << shift:
            return f"{n / (1 << shift):.{digits}f} {unit}"
    return f"{int(n)} B"


_STATS_WORDS = {"on": 1, "true": 1, "yes": 1, "off": 0, "false": 0, "no": 0}

# Settings whose variable is not GDSKIT_<NAME>: ``GDSKIT_STATS=1`` reads better than GDSKIT_STATS_LEVEL.
_ENV_NAMES = {"stats_level": "GDSKIT_STATS"}


def env_name(setting: str) -> str:
    """The environment variable that sets ``setting``."""
    return _ENV_NAMES.get(setting, "GDSKIT_" + setting.upper())


def _stats_level(value: Any) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, str) and value.strip().lower() in _STATS_WORDS:
        return _STATS_WORDS[value.strip().lower()]
    level = int(value)
    if not 0 <= level <= 3:
        raise ConfigError(f"stats_level (GDSKIT_STATS) must be 0, 1, 2 or 3, got {value!r}")
    return level


def _one_of(values: Any) -> str:
    words = [v.value for v in values]
    return ", ".join(words[:-1]) + " or " + words[-1]


#: The settings that take one of an enum's values (a name, in any case).
_CHOICES: dict[str, type[enum.Enum]] = {"mode": Mode, "pinned_alloc": PinnedAlloc, "odirect": ODirectPolicy,
                                        "routing": Routing, "cufile_batch": CufileBatch, "io_uring": IoUring,
                                        "resident": Resident}

#: What each setting's variable takes, in words, for the error an invalid value raises.
_ACCEPTS = {
    **{name: _one_of(choice) for name, choice in _CHOICES.items()},
    "threads": "a whole number from 1 to 1024",
    "chunk_size": "a size that is a multiple of 4 KiB and at least 64 KiB, e.g. 8MiB",
    "pinned_budget": "a size of at least 1 MiB, e.g. 512MiB",
    "direct_threshold": "a size, e.g. 1MiB (0: no threshold)",
    "alignment": "a power of two of at least 512 bytes, e.g. 4KiB",
    "cufile_stats": "1, 0, true, false, yes, no, on or off",
    "stats_level": "0, 1, 2 or 3 (on, yes, true: 1; off, no, false: 0)",
    "stats_interval": "seconds from 0.05 to 3600",
    "s3_part_size": "a size from 5 MiB to 5 GiB, e.g. 64MiB",
    "s3_concurrency": "a whole number from 1 to 256",
    "s3_max_retries": "a whole number from 0 to 100",
    "s3_backoff": "seconds from 0.001 to 60",
    "s3_coalesce_gap": "a size from 0 to 64 MiB, e.g. 1MiB",
}


#: Whole-number settings and their bounds (inclusive).
_COUNTS = {"s3_concurrency": (1, 256), "s3_max_retries": (0, 100)}


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ConfigError(f"{name} must be a whole number, got {value!r}")
    n = int(value)
    lo, hi = _COUNTS[name]
    if not lo <= n <= hi:
        raise ConfigError(f"{name} must be between {lo} and {hi}, got {n}")
    return n


def _default_threads() -> int:
    return max(4, min(16, os.cpu_count() or 4))


@dataclasses.dataclass
class Settings:
    """gdskit's settings. Change them through :meth:`set`; read them as attributes.

    Attributes
    ----------
    mode : Mode
        ``auto`` picks a path per request and records why; ``cufile``, ``bounce``
        and ``host`` force one (``GDSKIT_MODE``).
    threads : int
        I/O worker threads per process (``GDSKIT_THREADS``).
    chunk_size : int
        Bytes one worker moves per step (``GDSKIT_CHUNK_SIZE``); a multiple of 4 KiB.
    pinned_budget : int
        Most pinned host memory the bounce ring may hold (``GDSKIT_PINNED_BUDGET``).
    pinned_alloc : PinnedAlloc
        How the ring's pinned memory is made (``GDSKIT_PINNED_ALLOC``): ``register``
        (huge pages faulted in by each worker at once, then registered with CUDA;
        falls back to ``hostalloc`` where that fails) or ``hostalloc``.
    direct_threshold : int
        Device requests smaller than this skip cuFile in ``auto`` mode: fixed
        set-up cost makes small direct I/O slower (``GDSKIT_DIRECT_THRESHOLD``).
    odirect : ODirectPolicy
        When the CPU paths use O_DIRECT (``GDSKIT_ODIRECT``).
    alignment : int
        The alignment O_DIRECT and the direct path need (``GDSKIT_ALIGNMENT``).
    cufile_stats : bool
        Turn on cuFile's level-3 counters so the ledger can prove which path
        cuFile took (``GDSKIT_CUFILE_STATS``).
    stats_level : int
        Publish this process's ledger live for ``gdskit stats`` (``GDSKIT_STATS``):
        0 off, 1 bytes, ops, latency and busy time per path and reason, 2 adds
        an I/O size histogram, 3 adds per-GPU figures and cuFile's own counters.
    stats_interval : float
        Seconds between two published snapshots (``GDSKIT_STATS_INTERVAL``).
    routing : Routing
        Reads into a GPU far from the file's storage go through a GPU nearer it and a
        device-to-device copy (``GDSKIT_ROUTING``): ``auto`` where that GPU is strictly
        nearer and reaches the target peer to peer, ``off`` never, ``force`` through the
        nearest other GPU whenever there are two (for testing the routed path).
    cufile_batch : CufileBatch
        Whether many small cuFile reads go through cuFile's batch API
        (``GDSKIT_CUFILE_BATCH``): ``auto`` at the entry sizes where batches measured
        faster, ``always`` whenever a batch can take them, ``never``.
    io_uring : IoUring
        Whether a batch of small reads into host memory (:meth:`gdskit.File.read_batch`) is
        submitted through io_uring in one system call (``GDSKIT_IO_URING``): ``auto`` where
        the kernel offers it, ``never`` (one ``preadv`` per read).
    s3_part_size : int
        Bytes of one ranged GET from an object store, and of one part of a multipart upload
        (``GDSKIT_S3_PART_SIZE``); 5 MiB to 5 GiB, S3's limits on a part.
    s3_concurrency : int
        Ranged GETs (or part uploads) of one request in flight at once (``GDSKIT_S3_CONCURRENCY``).
    s3_max_retries : int
        Retries of one GET after throttling (503 SlowDown), a server error or a dropped
        connection, before the read fails (``GDSKIT_S3_MAX_RETRIES``).
    s3_backoff : float
        Seconds before the first retry; each later one waits twice as long, with jitter, up to
        64 times this (``GDSKIT_S3_BACKOFF``).
    s3_coalesce_gap : int
        Reads of one request (``read_many``, ``read_batch``), into host memory or into one GPU's,
        whose bytes lie at most this far apart in an object are served by one ranged GET, the
        bytes between them read and dropped (``GDSKIT_S3_COALESCE_GAP``); 0 to 64 MiB, 0 merges only reads that touch.
    resident : Resident
        Whether a checkpoint's load onto a GPU goes through this user's resident loader
        (``gdskit serve``, docs/resident.md; ``GDSKIT_RESIDENT``): ``auto`` where one is
        listening for that GPU, ``off`` never, ``require`` always (or an error saying why not).
    """

    mode: Mode = Mode.AUTO
    threads: int = dataclasses.field(default_factory=_default_threads)
    chunk_size: int = 8 * MiB
    pinned_budget: int = 512 * MiB
    pinned_alloc: PinnedAlloc = PinnedAlloc.REGISTER
    direct_threshold: int = 1 * MiB
    odirect: ODirectPolicy = ODirectPolicy.AUTO
    alignment: int = 4 * KiB
    cufile_stats: bool = True
    stats_level: int = 0
    stats_interval: float = 0.5
    routing: Routing = Routing.AUTO
    cufile_batch: CufileBatch = CufileBatch.AUTO
    io_uring: IoUring = IoUring.AUTO
    s3_part_size: int = 64 * MiB
    s3_concurrency: int = 16
    s3_max_retries: int = 5
    s3_backoff: float = 0.1
    s3_coalesce_gap: int = 1 * MiB
    resident: Resident = Resident.AUTO

    def __post_init__(self) -> None:
        self._lock = threading.RLock()
        self._version = 0
        self._snapshot: Settings | None = None
        self._env_problem: tuple[str, str, str] | None = None  # (variable, value, accepts) of a bad one
        self._subscribers: list[Callable[[frozenset[str]], None]] = []

    # -- validation -------------------------------------------------------
    @staticmethod
    def _coerce(name: str, value: Any) -> Any:
        try:
            choice = _CHOICES.get(name)
            if choice is not None:
                return choice(str(value).lower())
            if name == "cufile_stats":
                if isinstance(value, str):
                    low = value.strip().lower()
                    if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                        raise ValueError(value)
                    return low in ("1", "true", "yes", "on")
                return bool(value)
            if name == "stats_level":
                return _stats_level(value)
            if name == "stats_interval":
                seconds = float(value)
                if not 0.05 <= seconds <= 3600:
                    raise ConfigError(f"stats_interval must be between 0.05 and 3600 seconds, got {value!r}")
                return seconds
            if name == "threads":
                n = int(value)
                if n < 1 or n > 1024:
                    raise ConfigError(f"threads must be between 1 and 1024, got {n}")
                return n
            if name in _COUNTS:
                return _count(name, value)
            if name == "s3_backoff":
                seconds = float(value)
                if not 0.001 <= seconds <= 60:  # also refuses nan
                    raise ConfigError(f"s3_backoff must be between 0.001 and 60 seconds, got {value!r}")
                return seconds
            size = parse_size(value)
        except ConfigError:
            raise
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"invalid value {value!r} for setting {name!r}") from exc
        if name == "alignment" and (size < 512 or size & (size - 1)):
            raise ConfigError(f"alignment must be a power of two >= 512, got {size}")
        if name == "chunk_size" and (size < 64 * KiB or size % (4 * KiB)):
            raise ConfigError(f"chunk_size must be a multiple of 4 KiB and >= 64 KiB, got {size}")
        if name == "pinned_budget" and size < 1 * MiB:
            raise ConfigError(f"pinned_budget must be at least 1 MiB, got {size}")
        if name == "s3_part_size" and not 5 * MiB <= size <= 5 * GiB:
            raise ConfigError(f"s3_part_size must be between 5 MiB and 5 GiB, got {size}")
        if name == "s3_coalesce_gap" and not 0 <= size <= 64 * MiB:
            raise ConfigError(f"s3_coalesce_gap must be between 0 and 64 MiB, got {size}")
        if name == "direct_threshold" and size < 0:
            raise ConfigError("direct_threshold must be >= 0")
        return size

    def _names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self)]

    # -- public -----------------------------------------------------------
    def set(self, **changes: Any) -> _Restorer:
        """Change settings now; use as a context manager to restore them on exit."""
        unknown = set(changes) - set(self._names())
        if unknown:
            raise ConfigError(f"unknown setting(s): {', '.join(sorted(unknown))}; "
                              f"known: {', '.join(self._names())}")
        coerced = {k: self._coerce(k, v) for k, v in changes.items()}
        with self._lock:
            before = {k: getattr(self, k) for k in coerced}
            for k, v in coerced.items():
                object.__setattr__(self, k, v)
            self._version += 1
        self._changed(frozenset(coerced))
        return _Restorer(self, before)

    def subscribe(self, callback: Callable[[frozenset[str]], None]) -> None:
        """Call ``callback(names)`` after every change of these settings: by :meth:`set`, by the
        end of a ``with settings.set(...)`` block, and by :meth:`reset`. ``names`` are the
        settings the change touched (their values may be unchanged). Layers above the engine
        follow settings this way (live statistics follow ``stats_level``) instead of the
        settings calling them."""
        with self._lock:
            if callback not in self._subscribers:
                self._subscribers.append(callback)

    def _changed(self, names: frozenset[str]) -> None:
        for callback in list(self._subscribers):
            callback(names)

    def as_dict(self) -> dict[str, Any]:
        """A plain, JSON-ready copy of the current values."""
        out: dict[str, Any] = {}
        for k in self._names():
            v = getattr(self, k)
            out[k] = v.value if isinstance(v, enum.Enum) else v
        return out

    def snapshot(self) -> Settings:
        """A copy for one request: later changes do not affect it. Do not modify it.

        Requests call this on every I/O, so the copy is cached until the next change.
        Raises :class:`~gdskit.errors.EnvironmentVariableError` while a ``GDSKIT_*``
        variable read at import holds an invalid value.
        """
        if self._env_problem is not None:
            self.check_environment()
        snap = self._snapshot
        if snap is not None and snap._version == self._version:
            return snap
        with self._lock:
            snap = dataclasses.replace(self)
            snap._version = self._version
            self._snapshot = snap
            return snap

    def reset(self) -> None:
        """Back to the defaults, then the environment overrides."""
        fresh = Settings()
        with self._lock:
            for k in self._names():
                object.__setattr__(self, k, getattr(fresh, k))
            self._version += 1
            self._env_problem = None
            self._apply_env(os.environ)
        self._changed(frozenset(self._names()))

    def check_environment(self) -> None:
        """Raise :class:`~gdskit.errors.EnvironmentVariableError` if a ``GDSKIT_*`` variable
        read into these settings (at import, or by :meth:`reset`) holds an invalid value."""
        if self._env_problem is not None:
            raise EnvironmentVariableError(*self._env_problem)

    def _apply_env(self, environ: Any) -> None:
        for k in self._names():
            key = env_name(k)
            if key in environ and environ[key] != "":
                try:
                    self.set(**{k: environ[key]})
                except ConfigError:
                    self._env_problem = (key, str(environ[key]), _ACCEPTS[k])
                    raise EnvironmentVariableError(*self._env_problem) from None


class _Restorer:
    """Returned by :meth:`Settings.set`; restores the old values when used with ``with``."""

    def __init__(self, owner: Settings, before: dict[str, Any]) -> None:
        self._owner = owner
        self._before = before

    def __enter__(self) -> Settings:
        return self._owner

    def __exit__(self, *exc: object) -> None:
        with self._owner._lock:
            for k, v in self._before.items():
                object.__setattr__(self._owner, k, v)
            self._owner._version += 1
        self._owner._changed(frozenset(self._before))


ENV_VARS = {env_name(f.name): f.name for f in dataclasses.fields(Settings)}


def _load() -> Settings:
    s = Settings()
    try:
        s._apply_env(os.environ)
    except EnvironmentVariableError:
        pass  # kept in s: raised by the first request, so that importing gdskit (and its CLI) still works
    return s


settings: Settings = _load()

