"""safetensors files straight to and from GPU (or host) memory through the gdskit engine.

>>> import gdskit.safetensors
>>> tensors = gdskit.safetensors.load_file("model.safetensors", device="cuda:0")
>>> gdskit.safetensors.save_file(tensors, "copy.safetensors")

Files written here are standard safetensors files (``safetensors.torch.load_file``
reads them) whose data section starts on a 4 KiB boundary; see docs/checkpoints.md.
Needs torch (``pip install 'gdskit[torch]'``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gdskit.errors import DeviceUnavailableError, GdskitError, InvalidArgumentError, with_path
from gdskit.formats import read_plan, require_torch, safetensors_format as fmt
from gdskit.formats._device import torch_device
from gdskit.formats._gc import collector_paused
from gdskit.formats._engine import open_file, stats, stats_delta
from gdskit.formats.progress import Progress, ProgressArg
from gdskit.formats.safetensors_format import (DuplicateNameError, HeaderError, LayoutError, MissingTensorError,
                                               TruncatedFileError, UnencodableNameError, UnknownDtypeError)

if TYPE_CHECKING:
    import torch

__all__ = ["load_file", "save_file", "read_metadata", "HeaderError", "LayoutError", "DuplicateNameError",
           "MissingTensorError", "TruncatedFileError", "UnknownDtypeError", "UnsupportedDtypeError",
           "UnsupportedShapeError", "UnsupportedTensorError", "UnencodableNameError", "DeviceUnavailableError"]

#: Tensors of at least this many bytes are read straight into their own memory;
#: smaller file-adjacent tensors are read together through a staging buffer.
SMALL_TENSOR_BYTES = 1 << 20
#: Largest single coalesced read (and the size of one staging buffer).
MAX_GROUP_BYTES = 16 << 20
_READ_SHAPE = read_plan.ReadShape(SMALL_TENSOR_BYTES, MAX_GROUP_BYTES, 0)


class UnsupportedDtypeError(fmt.FormatError):
    """The file holds a dtype the installed torch has no type for (e.g. F6_E2M3)."""


class UnsupportedShapeError(fmt.FormatError):
    """The file holds a shape torch cannot make (a dimension above ``2**63 - 1``), as
    ``safetensors.torch.load_file`` refuses it too."""


class UnsupportedTensorError(GdskitError, TypeError):
    """A tensor cannot be stored in safetensors (sparse, quantized, meta, or not a tensor)."""


def _torch() -> Any:
    return require_torch("gdskit.safetensors")


@functools.lru_cache(maxsize=2)  # built once per torch module: loads look it up per tensor
def _dtype_table(torch: Any) -> dict[str, Any]:
    names = {
        "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
        "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64",
        "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64", "C64": "complex64",
        "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
        "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz", "F4": "float4_e2m1fn_x2",
    }
    return {st: getattr(torch, tn) for st, tn in names.items() if hasattr(torch, tn)}


def _torch_type(torch: Any, entry: fmt.TensorEntry) -> tuple[Any, tuple[int, ...]]:
    """The torch dtype and shape of a safetensors entry."""
    dt = _dtype_table(torch).get(entry.dtype)
    if dt is None:
        raise UnsupportedDtypeError(f"tensor {entry.name!r}: this torch has no dtype for {entry.dtype}")
    shape = entry.shape
    if entry.dtype == "F4":
        # safetensors counts 4-bit values; torch's float4_e2m1fn_x2 packs two per element.
        if not shape or shape[-1] % 2:
            raise UnsupportedDtypeError(f"tensor {entry.name!r}: F4 with shape {list(shape)} "
                                        "cannot be packed in pairs")
        shape = shape[:-1] + (shape[-1] // 2,)
    if any(d > _TORCH_DIM_MAX for d in shape):
        raise UnsupportedShapeError(f"tensor {entry.name!r}: shape {list(shape)} has a dimension above "
                                    f"{_TORCH_DIM_MAX}, torch's largest")
    return dt, shape


_TORCH_DIM_MAX = 2**63 - 1


def _empty_tensor(torch: Any, entry: fmt.TensorEntry, dt: Any, shape: tuple[int, ...], dev: Any) -> Any:
    """A tensor of no elements, made as the reference makes it (a reshape of an empty one, which
    accepts shapes ``torch.empty`` refuses, e.g. ``[0, 2**63 - 1, 2**63 - 1]``). Tried first on
    the meta device, which allocates nothing: any refusal is the shape's."""
    try:
        torch.empty(0, dtype=dt, device="meta").reshape(shape)
    except (RuntimeError, TypeError, ValueError, OverflowError) as exc:
        raise UnsupportedShapeError(f"tensor {entry.name!r}: torch cannot make shape {list(shape)}: "
                                    f"{str(exc).splitlines()[0]}") from None
    return torch.empty(0, dtype=dt, device=dev).reshape(shape)


def _st_type(torch: Any, name: str, t: Any) -> tuple[str, tuple[int, ...]]:
    """The safetensors dtype and shape of a torch tensor."""
    rev = {v: k for k, v in _dtype_table(torch).items()}
    st = rev.get(t.dtype)
    if st is None:
        raise UnsupportedTensorError(f"tensor {name!r}: dtype {t.dtype} has no safetensors type")
    shape = tuple(t.shape)
    if st == "F4":
        if not shape:
            raise UnsupportedTensorError(f"tensor {name!r}: a 0-d float4_e2m1fn_x2 has no safetensors shape")
        shape = shape[:-1] + (shape[-1] * 2,)
    return st, shape


def _device(torch: Any, device: Any) -> Any:
    dev = torch_device(torch, device)
    if dev.type not in ("cpu", "cuda"):
        raise DeviceUnavailableError(f"gdskit.safetensors loads into CPU or CUDA memory, not {dev}")
    return dev


def read_metadata(path: str | os.PathLike[str]) -> dict[str, str] | None:
    """The ``__metadata__`` strings of a safetensors file (None when it has none)."""
    return fmt.read_header_file(path).metadata


def load_file(path_or_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
              device: Any = "cuda:0", *, keys: Iterable[str] | None = None,
              progress: ProgressArg = None, return_stats: bool = False, process_group: Any = None) -> Any:
    """Load a safetensors checkpoint into memory on ``device``.

    Parameters
    ----------
    path_or_paths : path, list of paths, directory or ``*.safetensors.index.json``
        One file, shards, or a Hugging Face sharded checkpoint.
    device : str, int or torch.device
        Where the tensors go (``"cpu"`` works too, through the engine's host path).
    keys : iterable of str, optional
        Load only these tensors; only their bytes are read.
    progress : bool, callable or None
        See :class:`gdskit.formats.progress.Progress`.
    return_stats : bool
        Also return the ledger delta of this load (``(tensors, stats)``).
    process_group : torch.distributed ProcessGroup, optional
        Every rank of the group calls ``load_file`` alike (``keys`` may differ): each byte is
        read from storage by one rank and reaches the others over the group (docs/multigpu.md).

    Returns
    -------
    dict[str, torch.Tensor]
        Each tensor owns its own memory.

    Raises
    ------
    gdskit.errors.FormatError
        The file is not valid safetensors (a subclass says how); ``.path`` names the file
        at fault (the shard, or the index).
    MissingTensorError
        A name in ``keys`` is not in the checkpoint.
    DeviceUnavailableError
        ``device`` is a CUDA device this process cannot use (no CUDA: pass ``device="cpu"``).
    gdskit.errors.GroupError
        With ``process_group``: another rank failed, or did not answer in time.
    """
    if process_group is not None:
        from gdskit.group.load_safetensors import OneRank, load_file as group_load_file
        return group_load_file(path_or_paths, device, process_group=process_group, keys=keys,
                               progress=progress, return_stats=return_stats,
                               st=OneRank(_device, _torch_type, _empty_tensor))
    with collector_paused():
        return _load_file(path_or_paths, device, keys, progress, return_stats)


def _load_file(path_or_paths: Any, device: Any, keys: Iterable[str] | None, progress: ProgressArg,
               return_stats: bool) -> Any:
    torch = _torch()
    dev = _device(torch, device)
    shards = fmt.resolve_checkpoint(path_or_paths)
    headers = [(p, fmt.read_header_file(p)) for p in shards.files]

    where: dict[str, tuple[str, fmt.Header, fmt.TensorEntry]] = {}
    for p, h in headers:
        for e in h.entries:
            if e.name in where:
                raise DuplicateNameError(f"tensor {e.name!r} is also in {where[e.name][0]}", path=p)
            where[e.name] = (p, h, e)
    if shards.weight_map is not None:
        for name, p in shards.weight_map.items():
            if name not in where or os.path.abspath(where[name][0]) != os.path.abspath(p):
                raise fmt.FormatError(f"the index says {name!r} is in {p}, but it is not there", path=shards.index)

    names = fmt.select_names(where, keys)
    types = {}
    empty = {}   # tensors of no bytes are made here, not read
    for n in names:  # everything that can fail does so before anything is read
        p, _h, e = where[n]
        try:
            types[n] = _torch_type(torch, e)
            if e.nbytes == 0:
                empty[n] = _empty_tensor(torch, e, *types[n], dev)
        except fmt.FormatError as exc:
            raise with_path(exc, p) from None

    by_file: dict[str, list[fmt.TensorEntry]] = {}
    for n in names:
        if n not in empty:
            by_file.setdefault(where[n][0], []).append(where[n][2])
    total = sum(where[n][2].nbytes for n in names)

    from gdskit.formats.torch_io import execute

    def alloc(e: read_plan.Extent) -> Any:  # each tensor made once, in its final dtype and shape
        dt, shape = types[e.key]
        return torch.empty(shape, dtype=dt, device=dev)

    before = stats() if return_stats else None
    raw: dict[str, Any] = {}
    with Progress(total, progress, "loading") as prog:
        for p, h in headers:
            entries = by_file.get(p)
            if not entries:
                continue
            plan = read_plan.plan(fmt.extents(h, entries), small=SMALL_TENSOR_BYTES,
                                  max_group=MAX_GROUP_BYTES, max_gap=0)
            with open_file(p, "r") as f:
                if f.size != h.file_size:
                    raise TruncatedFileError(f"changed size after its header was read "
                                             f"({h.file_size} -> {f.size} bytes)", path=p)
                try:
                    raw.update(execute(f, plan, dev, alloc=alloc, progress=prog))
                except fmt.FormatError as exc:
                    raise with_path(exc, p) from None
    out = {}
    for n, (dt, shape) in types.items():
        if n in empty:
            out[n] = empty[n]
            continue
        t = raw.pop(n)
        if t.dtype is not dt:  # bytes read into host memory
            t = t.view(dt)
        out[n] = t if t.shape == shape else t.reshape(shape)
    if return_stats:
        return out, stats_delta(before, stats())
    return out


def save_file(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str],
              metadata: Mapping[str, str] | None = None, *, progress: ProgressArg = False) -> None:
    """Write ``tensors`` to a standard safetensors file whose data section starts 4 KiB-aligned.

    CPU and GPU tensors are accepted (non-contiguous ones too); GPU bytes go
    through the engine without a stop in pageable host memory. The write is
    atomic: a temporary file beside ``path`` is fsynced and renamed.
    """
    torch = _torch()
    from gdskit.formats.torch_io import flat_bytes, has_plain_bytes  # noqa: PLC0415 - needs torch

    if not isinstance(tensors, Mapping):
        raise InvalidArgumentError("tensors must be a mapping of names to tensors")
    specs = []
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise UnsupportedTensorError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor")
        if not has_plain_bytes(t):
            raise UnsupportedTensorError(f"tensor {name!r} ({t.layout}, {t.device}) has no plain bytes to store")
        st, shape = _st_type(torch, name, t)
        specs.append(fmt.TensorSpec(name, st, shape))
    lay = fmt.layout(specs, metadata)

    for d in {t.device for t in tensors.values() if t.device.type == "cuda"}:
        torch.cuda.synchronize(d)  # the engine reads the bytes outside torch's streams
    prog = Progress(lay.file_size - lay.data_start, progress, "saving")
    futures: list[Any] = []
    with open_file(os.fspath(path), "w", atomic=True) as f, prog:
        try:
            f.write(bytearray(lay.header), file_offset=0)
            for e in lay.entries:
                if e.nbytes == 0:
                    continue
                t = tensors[e.name]
                copied = not t.is_contiguous()
                src = flat_bytes(t)
                if copied and src.device.type == "cuda":
                    torch.cuda.synchronize(src.device)  # the copy was made on torch's stream
                fut = f.pwrite(src, size=e.nbytes, file_offset=lay.file_offset(e))
                fut.add_done_callback(lambda _f, n=e.nbytes: prog.advance(n))
                if copied:
                    fut.result()  # bound the extra memory to one temporary copy
                futures.append(fut)
            for fut in futures:
                fut.result()
        except BaseException:
            import concurrent.futures
            concurrent.futures.wait(futures)
            raise


# -- into existing tensors, and streaming (gdskit.formats.into_exec, gdskit.formats.stream) --

# load_into's errors live with its planning, which loads with the first use of one of them
# (or of load_into): a program that only loads files does not import it.
_INTO_PLAN_ERRORS = ("DtypeMismatchError", "KeyMismatchError", "OverlappingTargetsError", "PartialLoadError",
                     "ShapeMismatchError", "UnsupportedTargetError")

if TYPE_CHECKING:
    from gdskit.formats.into_plan import (DtypeMismatchError, KeyMismatchError, OverlappingTargetsError,
                                          PartialLoadError, ShapeMismatchError, UnsupportedTargetError)


def __getattr__(name: str) -> Any:
    if name in _INTO_PLAN_ERRORS:
        from gdskit.formats import into_plan  # noqa: PLC0415

        return getattr(into_plan, name)
    raise AttributeError(f"module 'gdskit.safetensors' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_INTO_PLAN_ERRORS})


__all__ += ["load_into", "iter_tensors", "DtypeMismatchError", "KeyMismatchError", "OverlappingTargetsError",
            "PartialLoadError", "ShapeMismatchError", "UnsupportedTargetError"]


def load_into(target: Any, path_or_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
              strict: bool = True, cast: bool = False, progress: ProgressArg = None,
              return_stats: bool = False) -> Any:
    """Fill the tensors ``target`` already has from a safetensors checkpoint, in place.

    Parameters
    ----------
    target : torch.nn.Module or mapping of str to torch.Tensor
        A module (its ``state_dict()`` tensors: parameters and persistent buffers) or a
        dict of tensors, on CPU and CUDA devices (mixed too). Each tensor keeps its memory
        (``data_ptr()`` unchanged); tensors sharing memory (tied weights) are filled once.
    path_or_paths
        As for :func:`load_file`: a file, shards, a directory or an index file.
    strict : bool
        True: names that do not pair up raise :class:`KeyMismatchError` before anything
        is read. False: they are returned.
    cast : bool
        Convert tensors whose dtype differs from their target's on the target's device
        (otherwise :class:`DtypeMismatchError`).
    progress, return_stats
        As for :func:`load_file` (``return_stats`` returns ``(result, stats)``).

    Returns
    -------
    LoadResult
        ``(missing_keys, unexpected_keys)``, as ``Module.load_state_dict`` returns them.

    Raises
    ------
    ShapeMismatchError, DtypeMismatchError, KeyMismatchError, UnsupportedTargetError, OverlappingTargetsError,
    gdskit.errors.FormatError
        Before any byte is read: the target is untouched.
    PartialLoadError
        A failure while bytes were moving; it names the tensors already filled.
    """
    _torch()
    from gdskit.formats.into_exec import load_safetensors_into
    return load_safetensors_into(target, path_or_paths, torch_type=_torch_type, shape=_READ_SHAPE, strict=strict,
                                 cast=cast, progress=progress, return_stats=return_stats)


def iter_tensors(path_or_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
                 device: Any = "cuda:0", *, keys: Iterable[str] | None = None,
                 max_inflight_bytes: int | None = None) -> Any:
    """Yield ``(name, tensor)`` in file order as each tensor lands on ``device``, within a memory budget.

    Every yielded tensor owns its memory. The iterator reads ahead only while the tensors
    it has made and that are still alive (being read, waiting to be yielded, or yielded
    and still referenced, views included) total at most ``max_inflight_bytes``: a tensor
    counts as consumed once its memory is freed. Default budget: the larger of 1 GiB and
    twice the largest tensor (so a ``for`` loop, which holds the previous tensor while it
    asks for the next, always has room for one more). See docs/models.md.

    Returns
    -------
    gdskit.formats.stream.TensorStream
        An iterator (and context manager: leaving it stops the reads under way).

    Raises
    ------
    gdskit.errors.InvalidArgumentError
        ``max_inflight_bytes`` is smaller than the largest tensor asked for.
    MissingTensorError
        A name in ``keys`` is not in the checkpoint.
    """
    torch = _torch()
    from gdskit.formats.stream import TensorStream
    return TensorStream(path_or_paths, _device(torch, device), keys=keys, max_inflight_bytes=max_inflight_bytes,
                        torch_type=_torch_type, shape=_READ_SHAPE)
