"""Plan a load into tensors that already exist: which checkpoint record fills which target, and how.

No torch and no I/O (numpy sorts the addresses): the caller describes each target tensor and each
checkpoint record with the small records below, and :func:`plan_into` decides
(the one place that does):

- which target is filled from which record, by name;
- which targets are one tensor under several names (tied weights: the same memory,
  dtype, shape and strides), filled once;
- which fills land straight in the target's memory (contiguous target and record of
  the same dtype) and which go through a staging buffer and a copy (a non-contiguous
  target or record, or a dtype conversion);
- the missing and unexpected names, as ``Module.load_state_dict`` reports them;
- what is refused before any byte moves: a shape mismatch, a dtype mismatch without
  ``cast``, and targets to be filled whose memory overlaps without being the same tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from gdskit.errors import GdskitError, InvalidArgumentError

#: How many names an error message lists before it says how many more there are.
_LISTED = 8


class KeyMismatchError(GdskitError, KeyError):
    """``strict=True`` and the checkpoint's names differ from the target's.

    ``missing_keys``: target names the checkpoint does not hold; ``unexpected_keys``:
    checkpoint names the target has no tensor for. Nothing was read.
    """

    def __init__(self, message: str, missing_keys: Sequence[str], unexpected_keys: Sequence[str]) -> None:
        super().__init__(message)
        self.message = message
        self.missing_keys = list(missing_keys)
        self.unexpected_keys = list(unexpected_keys)

    def __str__(self) -> str:  # KeyError would quote the message
        return self.message


class ShapeMismatchError(GdskitError, ValueError):
    """A checkpoint tensor's shape differs from its target's. Nothing was read."""


class DtypeMismatchError(GdskitError, TypeError):
    """A checkpoint tensor's dtype differs from its target's and ``cast`` is off (or the
    conversion is not one torch can make). Nothing was read."""


class UnsupportedTargetError(GdskitError, TypeError):
    """A target cannot be filled in place: not a tensor, no plain memory (meta, sparse,
    quantized), on a device gdskit does not read onto, or not a module or mapping."""


class OverlappingTargetsError(InvalidArgumentError):
    """Two targets to be filled share memory without being the same tensor (a view of
    another, say): filling one would change the other. Nothing was read."""


class PartialLoadError(GdskitError, RuntimeError):
    """A load failed while bytes were moving (after every check passed).

    ``filled``: target names whose tensors hold the checkpoint's values; ``unfilled``:
    target names whose memory may hold anything (partly written or untouched). The
    original error is the ``__cause__``.
    """

    def __init__(self, message: str, filled: Sequence[str], unfilled: Sequence[str]) -> None:
        super().__init__(message)
        self.filled = tuple(filled)
        self.unfilled = tuple(unfilled)


class TargetInfo(NamedTuple):
    """One tensor to be filled, as :func:`plan_into` needs it.

    ``dtype`` and ``device`` are any hashable values that name them consistently with the
    records (the executor passes ``torch.dtype`` and ``str(torch.device)``; this module only
    compares them). ``shape`` is any tuple (a ``torch.Size`` too). ``ptr`` is the address of its
    first element and ``span`` the bytes from there to one past its last element
    (``nbytes`` for a contiguous tensor). ``stride`` is None for contiguous tensors.
    """

    name: str
    dtype: Hashable
    shape: tuple[int, ...]
    device: str
    ptr: int
    nbytes: int
    span: int
    stride: tuple[int, ...] | None

    @property
    def contiguous(self) -> bool:
        return self.stride is None


class SourceInfo(NamedTuple):
    """One checkpoint record: its name, dtype, shape, and whether its bytes are one
    contiguous run holding its values in order (torch.save files may hold strided views).

    :func:`plan_into` reads only ``dtype``, ``shape`` and ``contiguous``: any record with
    those attributes will do (the executor passes its own).
    """

    name: str
    dtype: Hashable
    shape: tuple[int, ...]
    contiguous: bool = True


class Fill(NamedTuple):
    """Fill target ``target`` (also known by ``aliases``) from record ``source``.

    ``staged``: the record's bytes are read into a staging buffer on the target's device
    and copied in (a non-contiguous target or record, or ``cast``); otherwise they land
    straight in the target's memory. ``cast``: the copy converts the dtype.
    """

    target: str
    source: str
    aliases: tuple[str, ...]
    staged: bool
    cast: bool


@dataclasses.dataclass(frozen=True)
class IntoPlan:
    """Every fill of one load, and the names that did not pair up.

    ``missing_keys`` are in the target's order, ``unexpected_keys`` in the checkpoint's.
    A target that shares its memory with a filled one (a tied weight) is filled with it,
    so it is not missing even when the checkpoint lacks its name; a record whose target
    is such an alias is not read (the tensor is filled once) and not unexpected.
    """

    fills: tuple[Fill, ...]
    missing_keys: tuple[str, ...]
    unexpected_keys: tuple[str, ...]

    def filled_names(self, fills: Sequence[Fill] | None = None) -> list[str]:
        """The target names that ``fills`` (default: all) write, aliases included."""
        out: list[str] = []
        for f in self.fills if fills is None else fills:
            out.append(f.target)
            out.extend(f.aliases)
        return out


def _listing(items: Sequence[str], *, quote: bool = True) -> str:
    shown = ", ".join(repr(n) if quote else n for n in items[:_LISTED])
    return shown + (f" and {len(items) - _LISTED} more" if len(items) > _LISTED else "")


def key_mismatch(missing: Sequence[str], unexpected: Sequence[str]) -> KeyMismatchError:
    """The strict-mode error for these names (what ``Module.load_state_dict`` would list)."""
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {_listing(missing)}")
    if unexpected:
        parts.append(f"not in the target: {_listing(unexpected)}")
    return KeyMismatchError("the checkpoint does not match the target (strict=True); "
                            + "; ".join(parts), missing, unexpected)


def plan_into(targets: Sequence[TargetInfo], records: Mapping[str, Any], *, cast: bool,
              record_names: Iterable[str] | None = None) -> IntoPlan:
    """Pair ``targets`` (in the target's order) with ``records`` (in the checkpoint's order).

    ``record_names``: every name the checkpoint holds, in its order, where ``records`` holds
    only those a target asks for (the others are unexpected and never looked at);
    default: the keys of ``records``.

    Raises
    ------
    ShapeMismatchError, DtypeMismatchError, OverlappingTargetsError
        Listing every offending name (the first few), before anything is read.
    """
    fills: list[Fill] = []
    filled_targets: list[TargetInfo] = []
    missing: list[str] = []
    shape_errors: list[str] = []
    dtype_errors: list[str] = []

    def check(m: TargetInfo, src: Any) -> None:
        if src.shape != m.shape:
            shape_errors.append(f"{m.name!r}: checkpoint {list(src.shape)}, target {list(m.shape)}")
        elif src.dtype != m.dtype and not cast:
            dtype_errors.append(f"{m.name!r}: checkpoint {src.dtype}, target {m.dtype}")

    add_fill, add_target, get = fills.append, filled_targets.append, records.get
    make = tuple.__new__  # a named tuple without its Python-level __new__: a third of the cost, per target
    for group in _tied_groups(targets):
        if type(group) is list:
            present = [m for m in group if m.name in records]
            if not present:
                missing.extend(m.name for m in group)
                continue
            for m in present:
                check(m, records[m.name])
            first = present[0]
            aliases = tuple(m.name for m in group if m is not first)
            src = records[first.name]
        else:
            first = group
            src = get(first.name)
            if src is None:
                missing.append(first.name)
                continue
            aliases = ()
            if src.shape != first.shape or src.dtype != first.dtype:
                check(first, src)
        converts = src.dtype != first.dtype
        add_fill(make(Fill, (first.name, first.name, aliases,
                             converts or first.stride is not None or not src.contiguous, converts)))
        add_target(first)
    if shape_errors:
        raise ShapeMismatchError(f"{len(shape_errors)} tensors differ in shape: "
                                 f"{_listing(shape_errors, quote=False)}")
    if dtype_errors:
        raise DtypeMismatchError(f"{len(dtype_errors)} tensors differ in dtype (pass cast=True to convert them "
                                 f"on their device): {_listing(dtype_errors, quote=False)}")
    _refuse_overlaps(filled_targets)

    names = {t.name for t in targets}
    unexpected = tuple(n for n in (records if record_names is None else record_names) if n not in names)
    return IntoPlan(tuple(fills), tuple(missing), unexpected)


def _tied_groups(targets: Sequence[TargetInfo]) -> Sequence[TargetInfo | list[TargetInfo]]:
    """The targets, one tensor under several names made one group (a list, in the targets'
    order) and placed where its first name is.

    One tensor under several names has one address, dtype, shape and strides on one device;
    a tensor without bytes shares nothing. Most checkpoints have no such names, or a handful:
    the addresses are counted first, and only tensors at an address shared with another are
    told apart by the rest.
    """
    ptrs = [t.ptr for t in targets if t.nbytes]
    if len(set(ptrs)) == len(ptrs):
        return targets
    by_ptr: dict[object, TargetInfo | list[TargetInfo]] = {}
    for t in targets:
        key = t.ptr if t.nbytes else t.name
        found = by_ptr.get(key)
        if found is None:
            by_ptr[key] = t
        elif type(found) is list:
            found.append(t)
        else:
            by_ptr[key] = [found, t]
    groups: list[TargetInfo | list[TargetInfo]] = []
    for found in by_ptr.values():
        if type(found) is not list:
            groups.append(found)
            continue
        same: dict[tuple[object, ...], list[TargetInfo]] = {}
        for t in found:
            same.setdefault((t.device, t.dtype, t.shape, t.stride), []).append(t)
        groups.extend(g if len(g) > 1 else g[0] for g in same.values())
    return groups


def _refuse_overlaps(targets: list[TargetInfo]) -> None:
    """Distinct tensors to be filled must not share a byte of memory (one device at a time).

    Sorted by device and address, any overlap shows between neighbours; the sort runs in
    numpy (a load of 20,000 tensors sorted their tuples in Python for a tenth of its checks).
    """
    spans = [t for t in targets if t.span]
    if len(spans) < 2:
        return
    import numpy as np  # noqa: PLC0415 - import time

    n = len(spans)
    devices: dict[str, int] = {}
    try:
        lo = np.fromiter((t.ptr for t in spans), dtype=np.uint64, count=n)
        hi = lo + np.fromiter((t.span for t in spans), dtype=np.uint64, count=n)
    except OverflowError:  # not addresses of this machine; only a test makes them
        lo = hi = None
    if lo is None or bool((hi < lo).any()):
        order = sorted(range(n), key=lambda i: (spans[i].device, spans[i].ptr, spans[i].ptr + spans[i].span))
        bad = [k for k, (i, j) in enumerate(zip(order, order[1:]))
               if spans[i].device == spans[j].device and spans[j].ptr < spans[i].ptr + spans[i].span]
    else:
        dev = np.fromiter((devices.setdefault(t.device, len(devices)) for t in spans), dtype=np.int64, count=n)
        order = np.lexsort((hi, lo, dev))
        lo, hi, dev = lo[order], hi[order], dev[order]
        bad = np.flatnonzero((dev[1:] == dev[:-1]) & (lo[1:] < hi[:-1])).tolist()
    if bad:
        a, b = spans[int(order[bad[0]])], spans[int(order[bad[0] + 1])]
        raise OverlappingTargetsError(
            f"targets {a.name!r} and {b.name!r} share memory without being the same tensor "
            "(one is a view of the other?); filling one would change the other")
