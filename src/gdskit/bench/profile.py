"""Per-mount profiles: the measured direct-path cut-off, kept for the engine's ``auto`` mode.

``gdskit bench --sweep --save-profile`` stores, for the mount the benchmark
file lived on, the I/O size from which the direct path paid (:func:`save_profile`).
The store itself, and :func:`threshold_for` that the engine asks with a file's
path, live in :mod:`gdskit.engine.profiles` (the engine's own module: it reads the
store without importing the benchmark); they are re-exported here.
"""

from __future__ import annotations

import time
from typing import Any

from gdskit.bench.knee import KneeResult
from gdskit.bench.machine import MountInfo, mount_for
from gdskit.errors import ConfigError
from gdskit.engine.profiles import SCHEMA_VERSION, load, profile_for, store_entry, store_path, threshold_for
from gdskit.engine.profiles import profile_key as _key

__all__ = ["SCHEMA_VERSION", "load", "profile_for", "profile_key", "save_profile", "store_path", "threshold_for"]


def profile_key(mount: MountInfo) -> str:
    return _key(mount.mount_point, mount.dev)


def save_profile(target: str, knee: KneeResult, *, extra: dict[str, Any] | None = None,
                 path: str | None = None, mountinfo_text: str | None = None) -> dict[str, Any]:
    """Store ``knee`` as the profile of the mount holding ``target``; return the entry.

    The store is replaced atomically (temp file + rename), so a concurrent
    reader sees the old or the new store, never half of one.
    """
    mount = mount_for(target, mountinfo_text)
    if mount is None:
        raise ConfigError(f"cannot tell which mount {target} is on; no profile saved")
    if not knee.verdicts:
        raise ConfigError("the sweep has no size measured on both paths; no profile saved")
    entry = {
        "mount_point": mount.mount_point,
        "dev": mount.dev,
        "fstype": mount.fstype,
        "source": mount.source,
        "direct_threshold": knee.threshold,
        "direct_pays": knee.direct_pays,
        "knee_bytes": knee.knee,
        "compared": [knee.direct_path, knee.cpu_path],
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if extra:
        entry.update(extra)
    store_entry(profile_key(mount), entry, path)
    return entry
