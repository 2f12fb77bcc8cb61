"""One reader for every file gdskit inspects under /proc, /sys, /etc and /run.

All probes go through :class:`SystemRoot`, so a test (or an operator analysing a
tree captured on another machine) points the whole inspection at a directory
that mimics the real one. Facts that do not live in files (NVML, the cuFile
library) come from sources passed in: ``gdskit check`` passes the live queries
(:func:`gdskit.machine.gpus.query_nvml`, :func:`gdskit.machine.gds.query_cufile_library`)
for the real root; under a fixture root they are read from
``<root>/.gdskit-fixture/*.json``. This module imports no other probe.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from typing import IO, Any

from gdskit.durable import open_file_fd

FIXTURE_DIR = ".gdskit-fixture"

FactSource = Callable[[], "dict[str, Any] | None"]


class SystemRoot:
    """Read-only view of a machine's /proc, /sys, /etc and /run under ``prefix``.

    Parameters
    ----------
    prefix:
        Directory that stands for ``/``. ``"/"`` inspects the running machine.
    env:
        Environment variables the inspection honours (``CUFILE_ENV_PATH_JSON``...).
        Defaults to ``os.environ`` on the real root and to the fixture's
        ``env.json`` (or nothing) elsewhere.
    nvml, cufile:
        Callables returning GPU facts / cuFile library facts as plain dicts
        (``None`` when the source is absent). Defaults: ``nvml.json`` /
        ``cufile.json`` from the fixture directory; none on the real root, whose
        live sources the caller passes (:meth:`with_sources`).
    """

    def __init__(
        self,
        prefix: str = "/",
        *,
        env: Mapping[str, str] | None = None,
        nvml: FactSource | None = None,
        cufile: FactSource | None = None,
    ) -> None:
        self.prefix = os.path.abspath(prefix)
        self.is_live = self.prefix == "/"
        if env is None:
            env = dict(os.environ) if self.is_live else (self._fixture_json("env.json") or {})
        self.env: dict[str, str] = {str(k): str(v) for k, v in env.items()}
        self._nvml = nvml
        self._cufile = cufile

    def with_sources(self, *, nvml: FactSource | None = None, cufile: FactSource | None = None) -> SystemRoot:
        """This root, taking its NVML and cuFile facts from ``nvml`` and ``cufile`` where it
        was given none of its own."""
        return SystemRoot(self.prefix, env=self.env, nvml=self._nvml or nvml, cufile=self._cufile or cufile)

    # -- paths -------------------------------------------------------------
    def host_path(self, path: str) -> str:
        """Where the machine path ``path`` (absolute) lives on this host."""
        if not path.startswith("/"):
            raise ValueError(f"machine paths are absolute: {path!r}")
        if self.is_live:
            return path
        return os.path.join(self.prefix, path.lstrip("/"))

    def machine_path(self, host_path: str) -> str:
        """Inverse of :meth:`host_path` (for resolved symlinks)."""
        if self.is_live:
            return host_path
        rel = os.path.relpath(host_path, self.prefix)
        if rel == ".":
            return "/"
        if rel.startswith(".."):
            # A symlink escaped the tree; keep it visible rather than guessing.
            return host_path
        return "/" + rel

    # -- reads (never raise for missing files: inspection reports absence) --
    def exists(self, path: str) -> bool:
        return os.path.lexists(self.host_path(path))

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(self.host_path(path))

    def _open(self, path: str, binary: bool = False) -> IO[Any]:
        """``path`` opened for reading; a FIFO is refused (an OSError), never waited on: the
        paths come from the environment too (``CUFILE_ENV_PATH_JSON``)."""
        fd, _st = open_file_fd(self.host_path(path), os.O_RDONLY)
        try:
            return os.fdopen(fd, "rb") if binary else os.fdopen(fd, encoding="utf-8", errors="replace")
        except BaseException:
            os.close(fd)
            raise

    def read_text(self, path: str, default: str | None = None) -> str | None:
        try:
            with self._open(path) as fh:
                return fh.read()
        except OSError:
            return default

    def read_value(self, path: str) -> str | None:
        """First line of a one-value sysfs/procfs file, stripped."""
        text = self.read_text(path)
        if text is None:
            return None
        return text.strip()

    def read_bytes(self, path: str, limit: int = 4096) -> bytes | None:
        """Up to ``limit`` bytes of ``path`` (-1: all of it); None when it cannot be read."""
        try:
            with self._open(path, binary=True) as fh:
                return fh.read(limit)
        except OSError:
            return None

    def iter_lines(self, path: str) -> Iterator[str]:
        """Lines of a (possibly huge, like /proc/kallsyms) file, streamed."""
        try:
            with self._open(path) as fh:
                yield from fh
        except OSError:
            return

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self.host_path(path)))
        except OSError:
            return []

    def realpath(self, path: str) -> str:
        """Resolve symlinks (sysfs links are relative, so this stays in the tree)."""
        return self.machine_path(os.path.realpath(self.host_path(path)))

    def readlink(self, path: str) -> str | None:
        try:
            return os.readlink(self.host_path(path))
        except OSError:
            return None

    def readable(self, path: str) -> bool:
        return os.access(self.host_path(path), os.R_OK)

    # -- non-file facts ----------------------------------------------------
    def _fixture_json(self, name: str) -> dict[str, Any] | None:
        try:
            with open(os.path.join(self.prefix, FIXTURE_DIR, name), encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError, RecursionError):  # a captured tree is anyone's files
            return None
        return data if isinstance(data, dict) else None

    def nvml_facts(self) -> dict[str, Any] | None:
        """GPU facts (see :mod:`gdskit.machine.gpus` for the shape)."""
        if self._nvml is not None:
            return self._nvml()
        return None if self.is_live else self._fixture_json("nvml.json")

    def cufile_facts(self) -> dict[str, Any] | None:
        """cuFile library facts (see :mod:`gdskit.machine.gds` for the shape)."""
        if self._cufile is not None:
            return self._cufile()
        return None if self.is_live else self._fixture_json("cufile.json")

    def odirect_results(self) -> dict[str, Any] | None:
        """Injected O_DIRECT probe results for a fixture (mountpoint -> bool)."""
        if self.is_live:
            return None
        return self._fixture_json("odirect.json")

    def peer_facts(self) -> dict[str, Any] | None:
        """Injected GPU peer-access facts for a fixture (``peers.json``; shape in
        :mod:`gdskit.probe.routes`); the live machine's come from the driver."""
        if self.is_live:
            return None
        return self._fixture_json("peers.json")

    def __repr__(self) -> str:
        return f"SystemRoot({self.prefix!r})"
