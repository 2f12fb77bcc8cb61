"""``gdskit.safetensors.load_file(..., process_group=pg)``: each byte read once by the group.

Every rank resolves the checkpoint and parses every header (cheap), with the checks the
one-rank loader makes; then :func:`gdskit.group.load.run_load` does the rest. Each rank
returns the tensors it asked for (all of them, or its ``keys``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gdskit.errors import InvalidArgumentError, with_path
from gdskit.formats import require_torch, safetensors_format as fmt
from gdskit.engine import is_object_url, stats, stats_delta
from gdskit.formats.progress import ProgressArg
from gdskit.formats.device_memory import reserve_device_memory
from gdskit.formats.verified import check_loaded, expectations
from gdskit.group.load import LoadJob, run_load
from gdskit.group.plan import Segment
from gdskit.verify import OFF, VerifyMode


def _checkpoint(path_or_paths: Any) -> tuple[list[str], list[fmt.Header], dict[str, tuple[int, fmt.TensorEntry]]]:
    """The files, their headers, and which file holds each tensor, refused as the one-rank loader
    (:func:`gdskit.safetensors.load_file`) refuses them."""
    shards = fmt.resolve_checkpoint(path_or_paths)
    files = list(shards.files)
    headers = [fmt.read_header_file(p) for p in files]
    where: dict[str, tuple[int, fmt.TensorEntry]] = {}
    for i, h in enumerate(headers):
        for e in h.entries:
            if e.name in where:
                raise fmt.DuplicateNameError(f"tensor {e.name!r} is also in {files[where[e.name][0]]}",
                                             path=files[i])
            where[e.name] = (i, e)
    if shards.weight_map is not None:
        for name, p in shards.weight_map.items():
            if name not in where or _place(files[where[name][0]]) != _place(p):
                raise fmt.FormatError(f"the index says {name!r} is in {p}, but it is not there", path=shards.index)
    return files, headers, where


def _place(path: str) -> str:
    """Where ``path`` is, to compare: an object URL as it is (os.path would fold its ``//``)."""
    return path if is_object_url(path) else os.path.abspath(path)


def _checker(files: list[str], headers: list[fmt.Header], where: dict[str, tuple[int, fmt.TensorEntry]],
             names: Iterable[str], expect: dict[str, Any], dests: dict[Any, Any],
             empty: dict[str, Any]) -> Callable[[], None]:
    """The check of this rank's tensors, file by file, as they lie in its destinations (bytes as stored)."""
    by_file: dict[int, list[str]] = {}
    for n in names:
        by_file.setdefault(where[n][0], []).append(n)

    def check() -> None:
        for i, group in by_file.items():
            start = headers[i].data_start
            check_loaded(expect[files[i]], [(n, dests[n] if n in dests else empty[n]) for n in group],
                         {n: (start + where[n][1].start, start + where[n][1].end) for n in group})
    return check


@dataclass(frozen=True)
class OneRank:
    """What a group load takes from :mod:`gdskit.safetensors`, which passes it (that module calls
    this one, so this one does not import it): how it names a device, a header entry's torch
    type, and its empty tensors."""

    device: Callable[[Any, Any], Any]
    torch_type: Callable[[Any, Any], tuple[Any, tuple[int, ...]]]
    empty_tensor: Callable[..., Any]


def load_file(path_or_paths: Any, device: Any, *, process_group: Any, keys: Iterable[str] | None = None,
              progress: ProgressArg = None, return_stats: bool = False, st: OneRank,
              verify: VerifyMode = OFF) -> Any:
    """See :func:`gdskit.safetensors.load_file`; every rank of ``process_group`` calls it (``st``:
    what it needs of gdskit.safetensors). ``verify``: each rank checks the tensors it holds once
    the fan-out is done (:mod:`gdskit.group.checked`)."""
    torch = require_torch("gdskit.safetensors")

    types: dict[str, tuple[Any, tuple[int, ...]]] = {}
    empty: dict[str, Any] = {}  # tensors of no bytes, made as the one-rank loader makes them

    def prepare() -> LoadJob:
        if verify.whole_file:  # refused here, so that every rank hears of it
            raise InvalidArgumentError("verify='sha256:...' hashes the whole file where a group load shares its "
                                       "bytes out: give a manifest (gdskit digest) or verify=True")
        dev = st.device(torch, device)
        files, headers, where = _checkpoint(path_or_paths)
        names = fmt.select_names(where, keys)
        for n in names:  # everything that can fail does so before any rank reads anything
            i, e = where[n]
            try:
                types[n] = st.torch_type(torch, e)
                if e.nbytes == 0:
                    empty[n] = st.empty_tensor(torch, e, *types[n], dev)
            except fmt.FormatError as exc:
                raise with_path(exc, files[i]) from None
        segments = [Segment(e.name, i, h.data_start + e.start, e.nbytes)
                    for i, h in enumerate(headers) for e in h.entries]
        asked = set(names)
        reserve_device_memory(dev, [where[n][1].nbytes for n in names])
        dests = {n: torch.empty(where[n][1].nbytes, dtype=torch.uint8, device=dev) for n in names if n not in empty}
        layout = [[h.file_size, h.metadata, [[e.name, e.dtype, list(e.shape)] for e in h.entries]] for h in headers]
        check = None
        if verify.on:  # nothing to check against is refused (on every rank) before a byte is read
            expect = expectations(files, verify, {p: h.metadata for p, h in zip(files, headers)}, dev)
            check = _checker(files, headers, where, names, expect, dests, empty)
        return LoadJob(files, [h.file_size for h in headers], segments, layout,
                       [s.key in asked for s in segments], dests, {dev.type}, check=check)

    before = stats() if return_stats else None
    job = run_load(process_group, prepare, progress)
    out = {}
    for n, (dt, shape) in types.items():
        out[n] = empty[n] if n in empty else job.dests.pop(n).view(dt).reshape(shape)
    if return_stats:
        return out, stats_delta(before, stats())
    return out
