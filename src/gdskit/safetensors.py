"""safetensors files straight to and from GPU (or host) memory through the gdskit engine.

>>> import gdskit.safetensors
>>> tensors = gdskit.safetensors.load_file("model.safetensors", device="cuda:0")
>>> gdskit.safetensors.save_file(tensors, "copy.safetensors")

A drop-in for ``safetensors.torch`` (``load_file``, ``save_file``, ``load``, ``save``,
``load_model``, ``save_model``) and ``safetensors.safe_open``: the same signatures and
defaults, the same refusals (each error a :class:`gdskit.errors.GdskitError` that also is
the built-in exception the reference raises). Files written here are standard safetensors
files whose data section starts on a 4 KiB boundary; see docs/checkpoints.md for this and
every other difference. Needs torch (``pip install 'gdskit[torch]'``).
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import json
import math
import operator
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gdskit.errors import (ClosedFileError, DeviceUnavailableError, GdskitError, InvalidArgumentError,
                           UnsupportedBufferError, UnverifiableRangeError, with_path)
from gdskit.formats import read_plan, require_torch, safetensors_format as fmt, through_resident
from gdskit.formats.device import torch_device
from gdskit.formats.gc_pause import collector_paused
from gdskit.engine import open_file, stats, stats_delta
from gdskit.formats.progress import Progress, ProgressArg
from gdskit.formats.verified import LoadChecks, Sha256Check, check_loaded, expectations, tensor_digests
from gdskit.verify import HEADER_KEY, OFF, VerifyMode, verify_mode
from gdskit.formats.safetensors_format import (DuplicateNameError, HeaderError, HeaderTypeError, LayoutError,
                                               MissingTensorError, TruncatedFileError, UnencodableNameError,
                                               UnknownDtypeError)

require_torch("gdskit.safetensors")  # without torch, fail here with the install hint, as every torch-facing module

if TYPE_CHECKING:
    import torch

__all__ = ["load_file", "save_file", "load", "save", "load_model", "save_model", "safe_open", "TensorSlice",
           "read_metadata", "HeaderError", "HeaderTypeError", "LayoutError", "DuplicateNameError",
           "MissingTensorError", "TruncatedFileError", "UnknownDtypeError", "UnsupportedDtypeError",
           "UnsupportedShapeError", "UnsupportedTensorError", "NotATensorError", "SparseTensorError",
           "NonContiguousTensorError", "MetaTensorError", "UnsupportedTensorDtypeError", "SharedTensorsError",
           "StateDictMismatchError", "InvalidIndexError", "UnencodableNameError", "DeviceUnavailableError"]

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
    """A tensor cannot be stored in safetensors (sparse, quantized, meta, or not a tensor). Each
    subclass also is the built-in exception ``safetensors.torch`` raises for the same case."""


class NotATensorError(UnsupportedTensorError, ValueError):
    """A value of the mapping to save is not a ``torch.Tensor``."""


class SparseTensorError(UnsupportedTensorError, ValueError):
    """A tensor to save is not strided (sparse, ...): ``.to_dense()`` it first."""


class NonContiguousTensorError(UnsupportedTensorError, ValueError):
    """A tensor to save is not contiguous: ``.contiguous()`` it, or use ``save_model``."""


class MetaTensorError(UnsupportedTensorError, NotImplementedError):
    """A tensor to save is on the meta device: it has no bytes (a ``RuntimeError``, as torch's)."""


class UnsupportedTensorDtypeError(UnsupportedTensorError, KeyError):
    """A tensor to save has a dtype safetensors has no type for (``complex128``, quantized ...);
    a ``KeyError`` as the reference's."""

    def __str__(self) -> str:  # a message, not KeyError's repr of one
        return Exception.__str__(self)


class SharedTensorsError(GdskitError, RuntimeError):
    """Tensors to save overlap in memory (tied weights): ``save_model`` keeps one of each."""


class StateDictMismatchError(GdskitError, RuntimeError):
    """``load_model(..., strict=True)``: names of the file and the model do not pair up."""


class InvalidIndexError(GdskitError, IndexError):
    """A slice index torch refuses for the tensor's shape (out of range, too many indices)."""


class UnsupportedIndexError(GdskitError, TypeError):
    """A slice index of a type torch does not index with."""


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
    if shape and max(shape) > _TORCH_DIM_MAX:  # max, not a generator: loads ask per tensor
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
        raise UnsupportedTensorDtypeError(f"tensor {name!r}: dtype {t.dtype} has no safetensors type")
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


_BACKENDS = ("mmap", "pread")


def _check_backend(backend: str) -> None:
    if backend not in _BACKENDS:
        raise InvalidArgumentError(f"backend {backend!r} is invalid (expected one of: {', '.join(_BACKENDS)})")


def read_metadata(path: str | os.PathLike[str]) -> dict[str, str] | None:
    """The ``__metadata__`` strings of a safetensors file (None when it has none)."""
    return fmt.read_header_file(path).metadata


def load_file(filename: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
              device: Any = "cpu", *, backend: str = "mmap", keys: Iterable[str] | None = None,
              progress: ProgressArg = None, return_stats: bool = False, process_group: Any = None,
              verify: Any = False) -> Any:
    """Load a safetensors checkpoint into memory on ``device``.

    Parameters
    ----------
    filename : path, list of paths, directory or ``*.safetensors.index.json``
        One file, shards, or a Hugging Face sharded checkpoint.
    device : str, int or torch.device
        Where the tensors go: ``"cpu"`` (the default, as ``safetensors.torch.load_file``'s) or a
        CUDA device, whose bytes go straight there.
    backend : {"mmap", "pread"}
        Taken for ``safetensors.torch`` compatibility; gdskit reads through its engine either way.
    keys : iterable of str, optional
        Load only these tensors; only their bytes are read.
    progress : bool, callable or None
        See :class:`gdskit.formats.progress.Progress`.
    return_stats : bool
        Also return the ledger delta of this load (``(tensors, stats)``).
    process_group : torch.distributed ProcessGroup, optional
        Every rank of the group calls ``load_file`` alike (``keys`` may differ): each byte is
        read from storage by one rank and reaches the others over the group (docs/multigpu.md).
    verify : bool, str or path
        Check every tensor's bytes where they landed against their BLAKE3 digests (docs/verify.md):
        ``True`` (the file's header, else a manifest beside it), a manifest's path, or
        ``"sha256:<hex>"`` (the whole file, one file only, at CPU speed). Default False.

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
    gdskit.errors.ChecksumMismatchError
        With ``verify``: a tensor's bytes differ from their digest (it names the file, tensor,
        byte range and both digests). ``NothingToVerifyError``: nothing records digests of a
        file; ``StaleManifestError``: the manifest was made for another version of the file.
    """
    _check_backend(backend)
    mode = verify_mode(verify)
    path_or_paths = filename
    if process_group is not None:
        from gdskit.group.load_safetensors import OneRank, load_file as group_load_file  # noqa: PLC0415 - import time
        return group_load_file(path_or_paths, device, process_group=process_group, keys=keys,
                               progress=progress, return_stats=return_stats,
                               st=OneRank(_device, _torch_type, _empty_tensor), verify=mode)
    with collector_paused():
        return _load_file(path_or_paths, device, keys, progress, return_stats, mode)


def _load_file(path_or_paths: Any, device: Any, keys: Iterable[str] | None, progress: ProgressArg,
               return_stats: bool, mode: VerifyMode = OFF) -> Any:
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
    expect = {}
    sha256 = None
    if mode.whole_file:
        sha256 = Sha256Check([p for p, _h in headers], mode)
    elif mode.on:  # nothing to check against is refused before a byte is read
        expect = expectations([p for p, _h in headers], mode, {p: h.metadata for p, h in headers}, dev)
    types = {}
    empty = {}   # tensors of no bytes are made here, not read
    by_file: dict[str, list[fmt.TensorEntry]] = {}
    sizes = []
    for n in names:  # everything that can fail does so before anything is read
        p, _h, e = where[n]
        nbytes = e.end - e.start
        try:
            types[n] = _torch_type(torch, e)
            if nbytes == 0:
                empty[n] = _empty_tensor(torch, e, *types[n], dev)
        except fmt.FormatError as exc:
            raise with_path(exc, p) from None
        if nbytes:
            by_file.setdefault(p, []).append(e)
        sizes.append(nbytes)
    total = sum(sizes)
    new_tensor = torch.empty

    def make(name: str) -> Any:  # each tensor made once, in its final dtype and shape
        dt, shape = types[name]
        return new_tensor(shape, dtype=dt, device=dev)

    def alloc(e: read_plan.Extent) -> Any:  # make(e.key), one call fewer per tensor
        dt, shape = types[e.key]
        return new_tensor(shape, dtype=dt, device=dev)

    before = stats() if return_stats else None
    raw: dict[str, Any] = {}
    resident = not mode.on and through_resident.worth_asking(torch, dev, sizes, shards.files)
    with Progress(total, progress, "loading") as prog, LoadChecks(bool(expect)) as checks:
        # Every shard in one request; where the loader does not serve, every byte is read here.
        served = _through_resident(torch, [(p, h, by_file[p]) for p, h in headers if p in by_file], make, dev,
                                   prog) if resident else None
        if served is not None:
            raw.update(served)
        for p, h in (headers if served is None else ()):
            entries = by_file.get(p)
            if not entries:
                continue
            # Here, not above: a load the resident loader serves never imports the engine's
            # reading modules (about 12 ms).
            from gdskit.formats.torch_io import execute  # noqa: PLC0415 - import time
            spans = ({e.name: (h.data_start + e.start, h.data_start + e.end) for e in entries}
                     if p in expect else {})
            # Host tensors are hashed batch by batch as they land, while the next batch is read.
            runs = checks.runs(sorted(entries, key=_by_start), _nbytes, dev)
            with open_file(p, "r") as f:
                if f.size != h.file_size:
                    raise TruncatedFileError(f"changed size after its header was read "
                                             f"({h.file_size} -> {f.size} bytes)", path=p)
                for run in runs:
                    plan = read_plan.plan(fmt.extents(h, run), small=SMALL_TENSOR_BYTES,
                                          max_group=MAX_GROUP_BYTES, max_gap=0)
                    started: set[str] = set()
                    early = _hash_when_landed(checks, expect[p], dev, spans, started) if p in expect else None
                    try:
                        landed = execute(f, plan, dev, alloc=alloc, progress=prog, landed=early)
                    except fmt.FormatError as exc:
                        raise with_path(exc, p) from None
                    if p in expect:
                        checks.start(expect[p], [(e.name, landed[e.name]) for e in run if e.name not in started],
                                     dev, spans)
                    raw.update(landed)
        checks.finish()
    for n, t in empty.items():
        p = where[n][0]
        if p in expect:
            check_loaded(expect[p], [(n, t)])
    if sha256 is not None:
        sha256.wait()
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


_by_start = operator.attrgetter("start")
_nbytes = operator.attrgetter("nbytes")


def _through_resident(torch: Any, files: list[tuple[str, fmt.Header, list[fmt.TensorEntry]]], make: Any,
                      dev: Any, prog: Progress) -> dict[str, Any] | None:
    """Each file's ``(path, header, entries)`` read by the resident loader into tensors made here
    (``make(name)``), every file in one request (or one per ``MAX_FILES`` files); None where it
    did not serve (the caller reads them itself)."""
    wants = [(e.name, e.nbytes, k, header.data_start + e.start)
             for k, (_path, header, entries) in enumerate(files) for e in entries]
    try:
        made, served = through_resident.fill_new(torch, dev, [(p, h.file_size) for p, h, _e in files], wants,
                                                 make, prog)
    except fmt.FormatError as exc:  # the client names the file at fault; one file is named here if not
        raise (with_path(exc, files[0][0]) if len(files) == 1 else exc) from None
    return made if served else None


def _hash_when_landed(checks: LoadChecks, expectation: Any, device: Any, spans: dict[str, tuple[int, int]],
                      started: set[str]) -> Any:
    """For ``execute(landed=...)`` where the load starts digests early (a GPU): tensors landed while
    the last ones are still read have their digests started at once (the kernels run meanwhile);
    their names go to ``started``."""
    if not checks.hashes_when_landed(device):
        return None

    def landed(tensors: dict[Any, Any]) -> None:
        checks.start(expectation, list(tensors.items()), device, spans)
        started.update(tensors)

    return landed


def _savable(torch: Any, tensors: Any) -> list[fmt.TensorSpec]:
    """The specs of ``tensors`` once they pass the reference's checks, in its order (so the
    first fault found is the one it reports): a dict, tensors, strided, no two overlapping in
    memory, then each contiguous, with bytes, of a safetensors dtype."""
    if not isinstance(tensors, dict):
        raise InvalidArgumentError(f"Expected a dict of [str, torch.Tensor] but received {type(tensors)}")
    sparse = []
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise NotATensorError(f"Key `{name}` is invalid, expected torch.Tensor but received {type(t)}")
        if t.layout != torch.strided:
            sparse.append(name)
    if sparse:
        raise SparseTensorError(f"You are trying to save a sparse tensors: `{sparse}` which this library does not "
                                "support. You can make it a dense tensor before saving with `.to_dense()` but be "
                                "aware this might make a much larger file than needed.")
    overlapping = [names for names in shared_tensor_groups(tensors) if len(names) > 1]
    if overlapping:
        raise SharedTensorsError(f"Some tensors share memory, which would store them twice and load them apart: "
                                 f"{overlapping}. Save one of each (save_model does).")
    specs = []
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise NonContiguousTensorError(f"You are trying to save a non contiguous tensor: `{name}` which is not "
                                           "allowed. Call `.contiguous()` on it before saving.")
        if t.device.type == "meta":
            raise MetaTensorError(f"tensor {name!r}: Cannot copy out of meta tensor; no data!")
        st, shape = _st_type(torch, name, t)
        specs.append(fmt.TensorSpec(name, st, shape))
    return specs


def save(tensors: dict[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """The bytes of a safetensors file holding ``tensors``, exactly as ``safetensors.torch.save``
    writes them (CPU or GPU tensors, contiguous and dense)."""
    torch = _torch()
    lay = fmt.packed_layout(_savable(torch, tensors), metadata)
    out = bytearray(lay.file_size)
    out[:lay.data_start] = lay.header
    view = memoryview(out)
    for e in lay.entries:
        if e.nbytes:
            src = tensors[e.name].detach().reshape(-1).view(torch.uint8).cpu()
            view[lay.file_offset(e):lay.file_offset(e) + e.nbytes] = src.numpy().data
    return bytes(out)


def load(data: bytes) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in ``data`` (bytes), in CPU memory, each owning
    its memory (as ``safetensors.torch.load``)."""
    torch = _torch()
    if not isinstance(data, bytes):
        raise UnsupportedBufferError(f"data must be bytes, not {type(data).__name__}")
    header = fmt.parse_bytes(data)
    out = {}
    for e in header.entries:
        dt, shape = _torch_type(torch, e)
        if e.nbytes == 0:
            out[e.name] = _empty_tensor(torch, e, dt, shape, torch.device("cpu"))
            continue
        raw = bytearray(data[header.data_start + e.start:header.data_start + e.end])
        out[e.name] = torch.frombuffer(raw, dtype=torch.uint8).view(dt).reshape(shape)
    return out


def save_file(tensors: dict[str, torch.Tensor], filename: str | os.PathLike[str],
              metadata: Mapping[str, str] | None = None, *, progress: ProgressArg = False,
              digests: bool = False) -> None:
    """Write ``tensors`` to a standard safetensors file whose data section starts 4 KiB-aligned.

    Takes and refuses what ``safetensors.torch.save_file`` does (contiguous, dense tensors, none
    overlapping another in memory). CPU and GPU tensors; GPU bytes go through the engine without
    a stop in pageable host memory. The write is atomic: a temporary file beside ``filename`` is
    fsynced and renamed.

    ``digests=True`` also records each tensor's BLAKE3 digest (computed where the tensor lies: on
    its GPU for a GPU tensor) in the header's ``__metadata__`` under ``"gdskit.blake3"``, so that
    ``load_file(..., verify=True)`` checks the file with nothing beside it; the file stays one
    the ``safetensors`` library reads (docs/verify.md). Off by default: the file is then byte for
    byte what ``safetensors.torch.save_file`` writes for the same tensors, less the alignment.
    """
    torch = _torch()
    from gdskit.formats.torch_io import flat_bytes  # noqa: PLC0415 - import time

    specs = _savable(torch, tensors)
    if digests:
        metadata = _with_digests(tensors, metadata)
    lay = fmt.layout(specs, metadata)
    path = filename

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
                fut = f.pwrite(flat_bytes(tensors[e.name]), size=e.nbytes, file_offset=lay.file_offset(e))
                fut.add_done_callback(lambda _f, n=e.nbytes: prog.advance(n))
                futures.append(fut)
            for fut in futures:
                fut.result()
        except BaseException:
            concurrent.futures.wait(futures)
            raise


def _with_digests(tensors: Mapping[str, Any], metadata: Mapping[str, str] | None) -> dict[str, str]:
    """``metadata`` with each tensor's BLAKE3 digest under :data:`gdskit.verify.HEADER_KEY`."""
    meta = dict(metadata) if metadata is not None else {}
    if HEADER_KEY in meta:
        raise InvalidArgumentError(f"metadata already has the key {HEADER_KEY!r}, which digests=True writes")
    for d in {t.device for t in tensors.values() if t.device.type == "cuda"}:
        _torch().cuda.synchronize(d)  # the producer's work is done before the bytes are hashed
    named = [(n, t.detach().reshape(-1)) for n, t in tensors.items()]
    meta[HEADER_KEY] = json.dumps(tensor_digests(named), separators=(",", ":"), sort_keys=True)
    return meta


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
        from gdskit.formats import into_plan  # noqa: PLC0415 - import time

        return getattr(into_plan, name)
    raise AttributeError(f"module 'gdskit.safetensors' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)  # the API and its errors; the module's own imports are not part of it


__all__ += ["load_into", "iter_tensors", "DtypeMismatchError", "KeyMismatchError", "OverlappingTargetsError",
            "PartialLoadError", "ShapeMismatchError", "UnsupportedTargetError"]


def load_into(target: Any, path_or_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
              strict: bool = True, cast: bool = False, progress: ProgressArg = None,
              return_stats: bool = False, verify: Any = False) -> Any:
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
    verify : bool, str or path
        As for :func:`load_file`: each record's bytes are checked where they landed (in the
        target, or in the staging buffer before a cast or strided copy).

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
    gdskit.errors.ChecksumMismatchError
        With ``verify``: bytes that differ from their digest; ``.filled`` names the targets
        whose bytes match, ``.unfilled`` those that hold bytes that do not.
    """
    _torch()
    from gdskit.formats.into_exec import load_safetensors_into  # noqa: PLC0415 - import time
    return load_safetensors_into(target, path_or_paths, torch_type=_torch_type, shape=_READ_SHAPE, strict=strict,
                                 cast=cast, progress=progress, return_stats=return_stats, verify=verify)


def iter_tensors(path_or_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
                 device: Any = "cuda:0", *, keys: Iterable[str] | None = None,
                 max_inflight_bytes: int | None = None, verify: Any = False) -> Any:
    """Yield ``(name, tensor)`` in file order as each tensor lands on ``device``, within a memory budget.

    Every yielded tensor owns its memory. The iterator reads ahead only while the tensors
    it has made and that are still alive (being read, waiting to be yielded, or yielded
    and still referenced, views included) total at most ``max_inflight_bytes``: a tensor
    counts as consumed once its memory is freed. Default budget: the larger of 1 GiB and
    twice the largest tensor (so a ``for`` loop, which holds the previous tensor while it
    asks for the next, always has room for one more). See docs/models.md.

    ``verify`` (True or a manifest's path) checks each batch of tensors against their digests
    before any of it is yielded (docs/verify.md); a mismatch raises
    :class:`~gdskit.errors.ChecksumMismatchError` from the iteration.

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
    from gdskit.formats.stream import TensorStream  # noqa: PLC0415 - import time
    return TensorStream(path_or_paths, _device(torch, device), keys=keys, max_inflight_bytes=max_inflight_bytes,
                        torch_type=_torch_type, shape=_READ_SHAPE, verify=verify)


# -- tensors that share memory, and whole models (as safetensors.torch's save_model/load_model) --

def _storage_of(t: Any) -> tuple[Any, int, int] | None:
    """Which memory ``t`` lives in: (device, storage address, storage bytes); None for memory that
    is no memory (the meta device, an empty or unallocated storage)."""
    if t.device.type == "meta":
        return None
    storage = t.untyped_storage()
    if storage.data_ptr() == 0 or storage.nbytes() == 0:
        return None
    return t.device, storage.data_ptr(), storage.nbytes()


def _end_address(t: Any) -> int:
    """One past the last byte of ``t``'s last element (its start when it has none)."""
    if t.numel() == 0:
        return t.data_ptr()
    return t.data_ptr() + t.element_size() * (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())))


def shared_tensor_groups(tensors: Mapping[str, Any]) -> list[set[str]]:
    """The names of ``tensors`` in groups whose memory overlaps (a group of one: overlapping
    nothing); tensors on the meta device or without memory are in none."""
    by_storage: dict[tuple[Any, int, int], list[str]] = {}
    for name, t in tensors.items():
        key = _storage_of(t)
        if key is not None:
            by_storage.setdefault(key, []).append(name)
    groups: list[set[str]] = []
    for names in by_storage.values():
        spans = sorted((tensors[n].data_ptr(), _end_address(tensors[n]), n) for n in names)
        reach = None
        for start, end, name in spans:
            if reach is not None and start < reach:
                groups[-1].add(name)
                reach = max(reach, end)
            else:
                groups.append({name})
                reach = end
    return groups


def _covers_its_storage(t: Any) -> bool:
    return t.data_ptr() == t.untyped_storage().data_ptr() and t.nbytes == t.untyped_storage().nbytes()


def names_to_drop(state_dict: Mapping[str, Any], *, preferred_names: Iterable[str] = ()) -> dict[str, list[str]]:
    """For each group of tensors sharing memory, the name kept (one covering the whole storage:
    a preferred name if any, else the first by name) and the names dropped with it.

    Raises
    ------
    SharedTensorsError
        No tensor of a group covers its whole storage: saving one would not save the others.
    """
    preferred = set(preferred_names)
    drop: dict[str, list[str]] = {}
    for group in shared_tensor_groups(state_dict):
        if len(group) < 2:
            continue
        complete = sorted(n for n in group if _covers_its_storage(state_dict[n]))
        if not complete:
            raise SharedTensorsError(f"tensors {sorted(group)} share memory and none covers all of it: saving one "
                                     "would lose the others, saving each would store more than the model holds")
        keep = next((n for n in complete if n in preferred), complete[0])
        drop[keep] = sorted(group - {keep})
    return drop


def save_model(model: torch.nn.Module, filename: str | os.PathLike[str], metadata: Mapping[str, str] | None = None,
               force_contiguous: bool = True) -> None:
    """Save ``model.state_dict()``, each group of tied tensors once (as ``safetensors.torch.save_model``).

    A dropped name is recorded in the metadata as ``{dropped: kept}`` unless ``metadata`` already
    has that key; ``force_contiguous`` saves non-contiguous tensors as contiguous copies.
    """
    state_dict = model.state_dict()
    meta = dict(metadata) if metadata is not None else None
    for kept, dropped in names_to_drop(state_dict).items():
        for name in dropped:
            meta = {} if meta is None else meta
            meta.setdefault(name, kept)
            del state_dict[name]
    if force_contiguous:
        state_dict = {k: v.contiguous() for k, v in state_dict.items()}
    try:
        save_file(state_dict, filename, metadata=meta)
    except NonContiguousTensorError as exc:
        exc.args = (f"{exc} Or use save_model(..., force_contiguous=True).",)
        raise


def load_model(model: torch.nn.Module, filename: str | os.PathLike[str], strict: bool = True,
               device: Any = "cpu", *, backend: str = "mmap") -> tuple[set[str], list[str]]:
    """Load a file written by :func:`save_model` (or any safetensors file) into ``model``, tied
    tensors filled from whichever of their names the file holds.

    Returns
    -------
    (missing, unexpected)
        Names of the model the file did not fill, and names of the file the model did not take.

    Raises
    ------
    StateDictMismatchError
        ``strict`` and either is not empty.
    """
    state_dict = load_file(filename, device=device, backend=backend)
    tied = names_to_drop(model.state_dict(), preferred_names=state_dict.keys())
    missing_list, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = set(missing_list)
    for name in (n for names in tied.values() for n in names):
        if name in missing:
            missing.remove(name)     # filled through the name it is tied to
        else:
            unexpected.append(name)  # the file holds it, but the model fills it through another name
    if strict and (missing or unexpected):
        error = f"Error(s) in loading state_dict for {type(model).__name__}:"
        if missing:
            error += "\n    Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(missing))
        if unexpected:
            error += "\n    Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(unexpected))
        raise StateDictMismatchError(error)
    return missing, unexpected


# -- safe_open: one tensor, or one slice of one, at a time ------------------------------

_FRAMEWORKS = ("pt", "torch", "pytorch")


class safe_open:  # noqa: N801 - the name safetensors gives it
    """A safetensors file opened to read tensors, or slices of them, one at a time (as
    ``safetensors.safe_open`` with ``framework="pt"``).

    >>> with safe_open("model.safetensors", framework="pt", device="cuda:0") as f:
    ...     head = f.get_slice("lm_head.weight")[:1024]

    Parameters
    ----------
    filename : path
        One safetensors file; its header is read and checked here.
    framework : str
        ``"pt"`` (or ``"torch"``, ``"pytorch"``): gdskit makes torch tensors only.
    device : str, int or torch.device
        Where tensors go; bytes for a CUDA device go straight there.
    verify : bool, str or path
        Check each whole tensor read (``get_tensor``, ``get_tensors``, a slice that indexes all
        of a tensor) against its BLAKE3 digest, as :func:`load_file` does: ``True`` (the file's
        header, else a manifest beside it) or a manifest's path; ``NothingToVerifyError`` here
        if nothing records digests of the file. A slice of part of a tensor cannot be checked
        (the digest covers the whole tensor): indexing one raises ``UnverifiableRangeError``
        before anything is read. ``"sha256:..."`` is refused (the whole file is never read).
    """

    def __init__(self, filename: str | os.PathLike[str], framework: str, device: Any = "cpu", *,
                 backend: str = "mmap", verify: Any = False) -> None:
        torch = _torch()
        if framework not in _FRAMEWORKS:
            raise InvalidArgumentError(f"framework {framework!r} is not one gdskit.safetensors reads into "
                                       f"(it makes torch tensors: {', '.join(_FRAMEWORKS)})")
        _check_backend(backend)
        self._device = _device(torch, device)
        self._path = os.fspath(filename)
        self._header: fmt.Header | None = fmt.read_header_file(self._path)
        self._by_name = {e.name: e for e in self._header.entries}
        self._verify = verify_mode(verify)
        if self._verify.whole_file:
            raise InvalidArgumentError("safe_open reads tensors one at a time, never the whole file at once: "
                                       "verify takes True or a manifest's path")
        self._expect = (expectations([self._path], self._verify, {self._path: self._header.metadata},
                                     self._device)[self._path] if self._verify.on else None)

    def __enter__(self) -> safe_open:
        self._open_header()
        return self

    def __exit__(self, *exc: object) -> None:
        self._header = None

    def _open_header(self) -> fmt.Header:
        if self._header is None:
            raise ClosedFileError(f"{self._path}: the file is closed")
        return self._header

    def keys(self) -> list[str]:
        """The tensor names, sorted."""
        self._open_header()
        return sorted(self._by_name)

    def offset_keys(self) -> list[str]:
        """The tensor names in the order of their bytes in the file."""
        return self._open_header().names()

    def metadata(self) -> dict[str, str] | None:
        """The ``__metadata__`` strings (None when the file has none)."""
        header = self._open_header()
        return None if header.metadata is None else dict(header.metadata)

    def _entry(self, name: str) -> fmt.TensorEntry:
        self._open_header()
        if not isinstance(name, str):
            raise HeaderTypeError(f"a tensor name is a str, not {type(name).__name__}")
        entry = self._by_name.get(name)
        if entry is None:
            raise MissingTensorError(f"{self._path} does not contain tensor {name!r}")
        return entry

    def get_tensor(self, name: str) -> torch.Tensor:
        """The tensor ``name`` on the device, owning its memory; only its bytes are read."""
        return self.get_slice(name)[...]

    def get_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor, as :func:`load_file` reads them."""
        self._open_header()
        return load_file(self._path, self._device, verify=self._verify.manifest or self._verify.on)

    def get_slice(self, name: str) -> TensorSlice:
        """A handle on tensor ``name`` that reads only the part indexed from it."""
        return TensorSlice(self, self._entry(name))


class TensorSlice:
    """One tensor of a :class:`safe_open` file, read in part by indexing it (``s[:, 1:3]``):
    torch's indexing, but only the bytes of the smallest box of the tensor that holds the
    indexed part are read, straight to the device. Advanced indices (lists, tensors, bools)
    read the whole tensor."""

    def __init__(self, owner: safe_open, entry: fmt.TensorEntry) -> None:
        self._owner = owner
        self._entry = entry

    def get_shape(self) -> list[int]:
        """The shape as the file records it."""
        return list(self._entry.shape)

    def get_dtype(self) -> str:
        """The safetensors dtype (``"F32"``, ``"BF16"`` ...)."""
        return self._entry.dtype

    def __getitem__(self, index: Any) -> torch.Tensor:
        torch = _torch()
        owner = self._owner
        header = owner._open_header()
        entry = self._entry
        try:
            dt, shape = _torch_type(torch, entry)
        except fmt.FormatError as exc:
            raise with_path(exc, owner._path) from None
        items = index if isinstance(index, tuple) else (index,)
        if any(isinstance(i, slice) and i.step is not None and type(i.step) is int and i.step <= 0 for i in items):
            raise InvalidArgumentError("slice steps must be greater than zero")  # checked first, as the reference does
        meta = (torch.empty(shape, dtype=dt, device="meta") if entry.nbytes
                else torch.empty(0, dtype=dt, device="meta").reshape(shape))  # allocates nothing
        _index_torch(lambda: meta[items])  # torch's refusals, before a byte is read
        box, inside = _box(shape, items)
        whole = all(b == (0, n) for b, n in zip(box, shape))
        if owner._expect is not None and not whole:
            raise UnverifiableRangeError(f"{owner._path}: tensor {entry.name!r}: its digest covers the whole tensor, "
                                         "so part of it cannot be checked; read all of it (get_tensor) to verify, "
                                         "or open the file without verify")
        data = _read_box(torch, owner._path, header, entry, dt, shape, box, owner._device)
        if owner._expect is not None:
            start = header.data_start + entry.start
            check_loaded(owner._expect, [(entry.name, data)], {entry.name: (start, start + entry.nbytes)})
        part = _index_torch(lambda: data[inside])
        if part.data_ptr() == data.data_ptr() and part.nbytes == data.nbytes and part.is_contiguous():
            return part
        return part.clone(memory_format=torch.contiguous_format)  # its own memory, not a view on the box


def _index_torch(fn: Any) -> Any:
    """``fn()``, an indexing, with torch's refusals as gdskit errors of the same built-in classes."""
    try:
        return fn()
    except IndexError as exc:
        raise InvalidIndexError(str(exc)) from None
    except TypeError as exc:
        raise UnsupportedIndexError(str(exc)) from None
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None


def _box(shape: tuple[int, ...], items: tuple[Any, ...]) -> tuple[list[tuple[int, int]], tuple[Any, ...]]:
    """The smallest box (``[lo, hi)`` per dimension) holding what ``items`` index from a tensor of
    ``shape``, and the index that takes it from the box. ``items`` were accepted by torch."""
    full = [(0, n) for n in shape]
    if not all(type(i) is int or isinstance(i, slice) or i is None or i is Ellipsis for i in items):
        return full, items  # advanced indexing: the whole tensor
    box = list(full)
    inside: list[Any] = []
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    dim = 0
    for item in items:
        if item is None:
            inside.append(None)
        elif item is Ellipsis:
            inside.append(Ellipsis)
            dim += len(shape) - consumed
        elif isinstance(item, slice):
            start, stop, step = item.indices(shape[dim])
            count = len(range(start, stop, step))
            box[dim] = (start, start + (count - 1) * step + 1) if count else (start, start)
            inside.append(slice(0, box[dim][1] - box[dim][0], step))
            dim += 1
        else:
            at = item % shape[dim]
            box[dim] = (at, at + 1)
            inside.append(0)
            dim += 1
    return box, tuple(inside)


def _read_box(torch: Any, path: str, header: fmt.Header, entry: fmt.TensorEntry, dt: Any, shape: tuple[int, ...],
              box: list[tuple[int, int]], dev: Any) -> Any:
    """A new tensor on ``dev`` of the ``box`` of tensor ``entry``: its rows of bytes, and no
    other, read into it."""
    out = torch.empty([hi - lo for lo, hi in box], dtype=dt, device=dev)
    if out.numel() == 0:
        return out
    item = out.element_size()
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    split = len(box) - 1  # the rows: the dimensions after `split` are whole
    while split >= 0 and box[split] == (0, shape[split]):
        split -= 1
    row_start = box[split][0] * strides[split] if split >= 0 else 0
    row_bytes = out.nbytes // math.prod(hi - lo for lo, hi in box[:max(split, 0)]) if split > 0 else out.nbytes
    base = header.data_start + entry.start + row_start * item
    flat = out.view(-1).view(torch.uint8)
    extents, dests = [], {}
    for n, corner in enumerate(itertools.product(*(range(lo, hi) for lo, hi in box[:max(split, 0)]))):
        offset = base + item * sum(i * s for i, s in zip(corner, strides))
        extents.append(read_plan.Extent(n, offset, row_bytes))
        dests[n] = flat[n * row_bytes:(n + 1) * row_bytes]
    plan = read_plan.plan(extents, small=SMALL_TENSOR_BYTES, max_group=MAX_GROUP_BYTES, max_gap=0)
    from gdskit.formats.torch_io import execute  # noqa: PLC0415 - test seam
    with open_file(path, "r") as f:
        if f.size != header.file_size:
            raise TruncatedFileError(f"changed size after its header was read ({header.file_size} -> {f.size} bytes)",
                                     path=path)
        try:
            execute(f, plan, dev, dests=dests)
        except fmt.FormatError as exc:
            raise with_path(exc, path) from None
    return out
