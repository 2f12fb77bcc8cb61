"""The per-mount profile store: measured direct-path cut-offs that ``bench`` writes and the router reads.

``gdskit bench --sweep --save-profile`` (:mod:`gdskit.bench.profile`) stores, for the
mount the benchmark file lived on, the I/O size from which the direct path paid.
The engine's ``auto`` mode asks :func:`threshold_for` with a file's path and uses
that cut-off instead of the global ``direct_threshold``. This module is the
engine's side of that exchange: it knows the store, not how the figure was measured.

The store is one JSON file, ``$XDG_CONFIG_HOME/gdskit/profiles.json``
(``~/.config/gdskit/profiles.json`` by default)::

    {"schema_version": 1,
     "profiles": {"<mount point>|<major:minor>": {"mount_point": ..., "dev": ..., "fstype": ...,
                   "source": ..., "direct_threshold": 65536, "direct_pays": true, ...}}}

Keys hold the device number as well as the mount point, so a different disk
later mounted at the same place does not inherit the profile.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from gdskit.durable import read_whole_file, write_text_whole
from gdskit.errors import ConfigError, from_os_error

SCHEMA_VERSION = 1

#: The profile value for "the direct path never paid on this mount".
DIRECT_NEVER = 2**62

_lock = threading.Lock()
# threshold_for runs on the engine's request path: cache the parsed store per (path, mtime)
_cache: dict[str, tuple[float, dict[str, Any]]] = {}


def store_path() -> str:
    """Where profiles live: ``$XDG_CONFIG_HOME/gdskit/profiles.json``."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "gdskit", "profiles.json")


def profile_key(mount_point: str, dev: str) -> str:
    """The store's key for the filesystem ``dev`` (``"major:minor"``) mounted at ``mount_point``."""
    return f"{mount_point}|{dev}"


def mount_key(target: str, mountinfo_text: str | None = None) -> str | None:
    """The store's key for the mount holding ``target``, or None when that cannot be told."""
    from gdskit.machine.mounts import mount_of  # noqa: PLC0415 - import time

    m = mount_of(target, mountinfo_text)
    return None if m is None else profile_key(m.mountpoint, f"{m.major}:{m.minor}")


def load(path: str | None = None) -> dict[str, Any]:
    """The whole store; an empty one when absent.

    Raises
    ------
    ConfigError
        The file exists but is not a profile store.
    """
    path = path or store_path()
    try:
        data = json.loads(read_whole_file(path).decode("utf-8"))
    except FileNotFoundError:
        return {"schema_version": SCHEMA_VERSION, "profiles": {}}
    except (OSError, ValueError, RecursionError) as exc:
        raise ConfigError(f"cannot read the profile store {path}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("profiles"), dict):
        raise ConfigError(f"{path} is not a gdskit profile store")
    return data


def store_entry(key: str, entry: dict[str, Any], path: str | None = None) -> None:
    """Put ``entry`` under ``key`` in the store, replacing it atomically (temp file + rename),
    so a concurrent reader sees the old or the new store, never half of one."""
    path = path or store_path()
    with _lock:
        store = load(path)
        store["schema_version"] = SCHEMA_VERSION
        store["profiles"][key] = entry
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            # a link to the store (a dotfiles tree) is followed, not replaced
            write_text_whole(path, json.dumps(store, indent=2, sort_keys=True) + "\n")
        except OSError as exc:
            raise from_os_error(exc, path) from exc
        _cache.pop(path, None)


def profile_for(target: str, *, path: str | None = None,
                mountinfo_text: str | None = None) -> dict[str, Any] | None:
    """The stored profile of the mount holding ``target``, or None. Never raises."""
    path = path or store_path()
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        return None
    key = mount_key(target, mountinfo_text)
    if key is None:
        return None
    with _lock:
        cached = _cache.get(path)
        if cached is None or cached[0] != mtime:
            try:
                cached = (mtime, load(path))
            except ConfigError:
                return None
            _cache[path] = cached
    entry = cached[1]["profiles"].get(key)
    return entry if isinstance(entry, dict) else None


def threshold_for(target: str, *, path: str | None = None,
                  mountinfo_text: str | None = None) -> int | None:
    """The measured direct-path cut-off (bytes) for ``target``'s mount, or None without a profile.

    Requests smaller than the value should skip the direct path. A mount where
    the direct path never paid gives :data:`DIRECT_NEVER`.
    Never raises: an unreadable store counts as no profile.
    """
    entry = profile_for(target, path=path, mountinfo_text=mountinfo_text)
    if entry is None:
        return None
    value = entry.get("direct_threshold")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return min(value, DIRECT_NEVER)
