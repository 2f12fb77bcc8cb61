"""Fill tensors that already exist from a checkpoint, through the engine.

The torch side of :func:`gdskit.safetensors.load_into` and :func:`gdskit.torch.load_into`
(imports torch; only those functions import it). :mod:`gdskit.formats.into_plan` decides
what fills what; this module describes the targets to it, locates the records' bytes, and
runs the reads with :func:`gdskit.formats.torch_io.execute`:

- a direct fill hands the target's own memory to the engine as the destination: no
  allocation, no copy, ``data_ptr()`` unchanged (on the GPU small neighbours are read as
  one request scattered straight into each target; into host memory, and with
  ``mode="cufile"``, they pass through the engine's bounded staging ring);
- a staged fill (non-contiguous target or record, or ``cast``) reads the record into a
  fresh buffer on the target's device and copies it in with ``Tensor.copy_``, which
  converts the dtype there; staged buffers are made :data:`STAGING_BATCH_BYTES` at a time.

Every check (headers, file sizes, names, shapes, dtypes, conversions, overlaps) runs
before the first read, so a refused load leaves the target untouched. A failure once
bytes are moving raises :class:`~gdskit.formats.into_plan.PartialLoadError`, which names
the tensors already filled.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from gdskit.errors import FormatError, NothingToVerifyError, from_os_error
from gdskit.formats import read_plan, through_resident
from gdskit.formats.read_plan import ReadShape
from gdskit.engine import can_scatter, open_file, stats, stats_delta
from gdskit.formats.gc_pause import collector_paused
from gdskit.formats.verified import (LoadChecks, Sha256Check, StartedTensorDigests, expectations, merged,
                                    tensor_digests)
from gdskit.verify import OFF, Expectation, VerifyMode, blake3_hex, mismatch, verify_mode
from gdskit.formats.into_plan import (DtypeMismatchError, Fill, IntoPlan, PartialLoadError,
                                      TargetInfo, UnsupportedTargetError, key_mismatch, plan_into)
from gdskit.formats.progress import Progress, ProgressArg
from gdskit.formats.safetensors_format import TruncatedFileError
from gdskit.formats.shard_index import index_checkpoint
from gdskit.formats.torch_io import execute

if TYPE_CHECKING:
    from gdskit.formats.shard_index import ShardIndex

#: Most bytes of staged fills (conversions, non-contiguous targets) read at once: their
#: buffers are the only memory a load into existing tensors makes.
STAGING_BATCH_BYTES = 256 << 20
#: How runs of small tensors reach targets on a GPU: ``"scatter"``, the engine copies each
#: run's bytes from its pinned stages straight into every target; ``"ring"``, each run is read
#: into a staging ring on the device (at most :data:`SMALL_RING_BYTES`) and split there with
#: one batched copy, which leaves the engine one copy per chunk instead of one per tensor.
GPU_SMALL_READS = "scatter"
#: Most device memory the staging ring of ``GPU_SMALL_READS = "ring"`` takes.
SMALL_RING_BYTES = 64 << 20
#: Devices the engine reads onto.
_READ_DEVICES = ("cpu", "cuda")


class LoadResult(NamedTuple):
    """What ``load_into`` could not pair up, as ``Module.load_state_dict`` reports it."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class Source(NamedTuple):
    """A checkpoint record: where its bytes lie, and how they read as a tensor: ``nbytes``
    bytes at ``file_offset`` of ``path``, viewed as ``dtype`` and then ``shape`` (with
    ``stride`` relative to the first byte, for a strided record of a torch.save file). It is
    also the record :func:`~gdskit.formats.into_plan.plan_into` pairs (``dtype``, ``shape``,
    ``contiguous``). ``held``: the record's bytes already in memory (a deflated record of a
    torch.save archive, inflated while the load was checked); ``file_offset`` then counts
    from their start."""

    path: str
    file_offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...] | None = None
    held: bytearray | None = None

    @property
    def contiguous(self) -> bool:
        return self.stride is None


# -- targets --------------------------------------------------------------------

def target_tensors(target: Any) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of ``target``: a module's ``state_dict()`` (parameters and
    persistent buffers; entries that are not tensors, such as extra state, are left out)
    or a mapping of names to tensors."""
    if isinstance(target, torch.nn.Module):
        return [(k, v) for k, v in module_state(target).items() if isinstance(v, torch.Tensor)]
    if isinstance(target, Mapping):
        out = []
        for k, v in target.items():
            if not isinstance(k, str):
                raise UnsupportedTargetError(f"target names must be strings, got {type(k).__name__}")
            if not isinstance(v, torch.Tensor):
                raise UnsupportedTargetError(f"target {k!r} is a {type(v).__name__}, not a torch.Tensor")
            out.append((k, v))
        return out
    raise UnsupportedTargetError(f"the target must be a torch.nn.Module or a mapping of names to tensors, "
                                 f"not a {type(target).__name__}")


_Module = torch.nn.Module
#: Module classes whose state dict is ``Module``'s own: their parameters and persistent buffers.
_plain_state: dict[type, bool] = {}


def _saves_plainly(cls: type) -> bool:
    found = _plain_state.get(cls)
    if found is None:
        found = _plain_state[cls] = (
            cls.state_dict is _Module.state_dict and cls._save_to_state_dict is _Module._save_to_state_dict
            and getattr(cls, "get_extra_state", _Module.get_extra_state) is _Module.get_extra_state)
    return found


def module_state(root: torch.nn.Module) -> dict[str, Any]:
    """``root.state_dict(keep_vars=True)``, the same names in the same order with the same objects,
    made without ``state_dict``'s per-module Python where a module has nothing of its own to add
    (a module of 20,000 submodules spent most of its checks there).

    A module whose class changes what it saves (``state_dict``, ``_save_to_state_dict``,
    ``get_extra_state``) or that has state-dict hooks has its part made by its own
    ``state_dict``, as the parent's would call it.
    """
    d = root.__dict__
    if not _saves_plainly(type(root)) or d.get("_state_dict_hooks", True) or d.get("_state_dict_pre_hooks", True):
        return root.state_dict(keep_vars=True)
    out: dict[str, Any] = OrderedDict()
    out._metadata = OrderedDict()  # type: ignore[attr-defined] # what a module's own state_dict hooks may read
    todo: list[tuple[str, torch.nn.Module]] = [("", root)]
    pop, push = todo.pop, todo.extend
    while todo:
        prefix, m = pop()
        d = m.__dict__
        if (d.get("_state_dict_hooks", True) or d.get("_state_dict_pre_hooks", True)
                or not _saves_plainly(type(m))):
            m.state_dict(destination=out, prefix=prefix, keep_vars=True)
            continue
        for k, v in d["_parameters"].items():
            if v is not None:
                out[prefix + k] = v
        buffers = d["_buffers"]
        if buffers:
            skip = d["_non_persistent_buffers_set"]
            for k, v in buffers.items():
                if v is not None and k not in skip:
                    out[prefix + k] = v
        children = d["_modules"]
        if children:  # depth first, in order: pushed last to first
            push([(f"{prefix}{k}.", c) for k, c in reversed(children.items()) if c is not None])
    return out


#: Dtypes only quantized tensors have: checked before asking each tensor ``is_quantized``.
_QUANTIZED = frozenset(getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
                       if hasattr(torch, n))


def describe(items: Sequence[tuple[str, torch.Tensor]]) -> list[TargetInfo]:
    """What :func:`~gdskit.formats.into_plan.plan_into` needs of each target; refuses
    targets that cannot be filled in place. Each tensor is asked each thing once (a
    module of 20,000 tensors makes every call count)."""
    device_names: dict[torch.device, str] = {}
    strided = torch.strided
    quantized = _QUANTIZED
    out: list[TargetInfo] = []
    append = out.append
    make = tuple.__new__  # a named tuple without its Python-level __new__: a third of the cost, per tensor
    for name, t in items:
        dev = t.device
        dn = device_names.get(dev)
        if dn is None:
            if dev.type == "meta":
                raise UnsupportedTargetError(f"target {name!r} is on the meta device and has no memory to fill; "
                                             "materialise the module first (Module.to_empty(device=...))")
            if dev.type not in _READ_DEVICES:
                raise UnsupportedTargetError(f"target {name!r} is on {dev}; gdskit reads into CPU and CUDA memory")
            dn = device_names[dev] = str(dev)
        dtype = t.dtype
        if t.layout is not strided or dtype in quantized:  # a quantized tensor has a quantized dtype
            raise UnsupportedTargetError(f"target {name!r} ({t.layout}{', quantized' if t.is_quantized else ''}) "
                                         "has no plain memory to fill")
        nbytes = t.nbytes
        if t.is_contiguous():
            append(make(TargetInfo, (name, dtype, t.shape, dn, t.data_ptr(), nbytes, nbytes, None)))
            continue
        shape = t.shape
        stride = tuple(t.stride())
        span = (sum((n - 1) * s for n, s in zip(shape, stride)) + 1) * t.element_size() if nbytes else 0
        if span < nbytes:
            raise UnsupportedTargetError(f"target {name!r}: several of its elements share memory "
                                         "(an expanded view?); it cannot be filled")
        append(TargetInfo(name, dtype, shape, dn, t.data_ptr(), nbytes, span, stride))
    return out


def _check_conversions(plan: IntoPlan, tensors: Mapping[str, torch.Tensor], sources: Mapping[str, Source]) -> None:
    """Refuse, before any read, a conversion ``Tensor.copy_`` cannot make."""
    pairs = {(sources[f.source].dtype, tensors[f.target].dtype) for f in plan.fills if f.cast}
    for src, dst in pairs:
        try:
            torch.empty(1, dtype=dst).copy_(torch.empty(1, dtype=src))
        except (RuntimeError, TypeError) as exc:
            raise DtypeMismatchError(f"torch cannot convert {src} to {dst}: {exc}") from None


# -- execution ------------------------------------------------------------------

def _fill_direct(f: Any, device: torch.device, fills: Sequence[Fill], tensors: Mapping[str, torch.Tensor],
                 sources: Mapping[str, Source], shape: ReadShape, prog: Progress,
                 digesting: Digesting | None = None) -> bool:
    """Whether copies into the targets were queued on torch's stream (out of a staging ring on
    a GPU): the caller waits for them at the end."""
    # The targets themselves are the destinations (the engine, or the copies out of the
    # staging ring, take their addresses): no view is made of them.
    dests = {}
    extents = []
    Extent, make = read_plan.Extent, tuple.__new__  # named tuples made without their Python __new__
    for fl in fills:
        name = fl.target
        s = sources[fl.source]
        dests[name] = tensors[name]
        extents.append(make(Extent, (name, s.file_offset, s.nbytes)))
    plan = read_plan.plan(extents, small=shape.small, max_group=shape.max_group, max_gap=shape.max_gap)
    if device.type == "cuda" and plan.groups and (GPU_SMALL_READS == "ring" or not can_scatter()):
        depth = max(1, min(8, SMALL_RING_BYTES // max(plan.staging_bytes, 1)))
        execute(f, plan, device, dests=dests, progress=prog, scatter=False, depth=depth)
        return True
    landed = None
    if digesting is not None and digesting.checks.hashes_when_landed(device):
        source_of = {fl.target: fl.source for fl in fills}

        def landed(filled: dict[Any, torch.Tensor]) -> None:  # hashed on the GPU while the last reads run
            digesting.landed_early([(source_of[name], t) for name, t in filled.items()], device)

    execute(f, plan, device, dests=dests, progress=prog, landed=landed)
    return False


class Digesting:
    """``verify=``: the digests of the records' bytes as stored, by record name, gathered while the
    fills run (on the hashing threads of :class:`~gdskit.formats.verified.LoadChecks` for host
    targets, as each run lands; where they lie for the others)."""

    def __init__(self, checks: LoadChecks) -> None:
        self.checks = checks
        self._found: list[concurrent.futures.Future[dict[str, str]] | StartedTensorDigests] = []

    def landed(self, named: Sequence[tuple[str, torch.Tensor]], device: torch.device) -> None:
        """``named`` (records' bytes in contiguous tensors on ``device``) have landed: hash them."""
        self._found.append(self.checks.hash(named, device))

    def landed_early(self, named: Sequence[tuple[str, torch.Tensor]], device: torch.device) -> None:
        """``named`` landed on a GPU while later reads are in flight: their kernels are queued now."""
        self._found.append(self.checks.begin(named, device))

    def digests(self) -> dict[str, str]:
        """Every digest so far (waits for the hashing threads)."""
        return merged(self._found)


def _fill_staged(f: Any, device: torch.device, fills: Sequence[Fill], tensors: Mapping[str, torch.Tensor],
                 sources: Mapping[str, Source], shape: ReadShape, prog: Progress,
                 digesting: Digesting | None = None) -> None:
    extents = [read_plan.Extent(fl.target, sources[fl.source].file_offset, sources[fl.source].nbytes)
               for fl in fills]
    plan = read_plan.plan(extents, small=shape.small, max_group=shape.max_group, max_gap=shape.max_gap)
    staged = execute(f, plan, device, progress=prog)  # fresh uint8 buffers on the device
    if digesting is not None:  # the bytes as stored, before a copy converts or scatters them
        digesting.landed([(fl.source, staged[fl.target]) for fl in fills], device)
    with torch.no_grad():
        for fl in fills:
            s = sources[fl.source]
            values = staged.pop(fl.target).view(s.dtype)
            values = values.view(s.shape) if s.stride is None else values.as_strided(s.shape, s.stride)
            tensors[fl.target].copy_(values)  # converts on the target's device where dtypes differ


def _fill_through_resident(by_file: dict[str, dict[torch.device, tuple[list[Fill], list[Fill]]]],
                           file_sizes: Mapping[str, int], tensors: Mapping[str, torch.Tensor],
                           sources: Mapping[str, Source], prog: Progress) -> list[Fill]:
    """The direct fills of each GPU through the resident loader (``gdskit serve``), every file in
    one request (or one per ``MAX_FILES`` files), where it serves them: the fills it served, each
    taken out of ``by_file`` once every byte of its GPU's request has landed."""
    served: list[Fill] = []
    devices = dict.fromkeys(dev for per_device in by_file.values() for dev, (direct, _s) in per_device.items()
                            if direct)
    for dev in devices:
        paths = [p for p, per_device in by_file.items() if dev in per_device and per_device[dev][0]]
        fills = [(k, fl) for k, p in enumerate(paths) for fl in by_file[p][dev][0]]
        if not through_resident.worth_asking(torch, dev, [sources[fl.source].nbytes for _k, fl in fills], paths):
            continue
        targets = [(tensors[fl.target].data_ptr(), sources[fl.source].nbytes, k, sources[fl.source].file_offset)
                   for k, fl in fills]
        if through_resident.fill(torch, dev, [(p, file_sizes[p]) for p in paths], targets, prog):
            served.extend(fl for _k, fl in fills)
            for p in paths:
                by_file[p][dev] = ([], by_file[p][dev][1])
    return served


def _direct_runs(direct: Sequence[Fill], sources: Mapping[str, Source], device: torch.device,
                 digesting: Digesting | None) -> list[Sequence[Fill]]:
    """The direct fills of one file and device, as the runs read one after another: in file order,
    cut where a verified load hashes each run while the next is read."""
    if not direct:
        return []
    if digesting is None or not digesting.checks.overlaps(device):
        return [direct]
    in_order = sorted(direct, key=lambda fl: sources[fl.source].file_offset)
    return digesting.checks.runs(in_order, lambda fl: sources[fl.source].nbytes, device)


def _staged_batches(fills: Sequence[Fill], sources: Mapping[str, Source]) -> Iterable[list[Fill]]:
    batch: list[Fill] = []
    held = 0
    for fl in fills:
        n = sources[fl.source].nbytes
        if batch and held + n > STAGING_BATCH_BYTES:
            yield batch
            batch, held = [], 0
        batch.append(fl)
        held += n
    if batch:
        yield batch


def _mark_modified(ts: Iterable[torch.Tensor]) -> None:
    """Tell autograd that the engine wrote these tensors' memory (as an in-place op would).
    Inference tensors have no version counter: newer torch skips them, older refuses the
    call, and then they are left out (bumping a counter twice is harmless)."""
    ts = list(ts)
    if not ts:
        return
    try:
        torch.autograd.graph.increment_version(ts)
    except RuntimeError:
        tracked = [t for t in ts if not t.is_inference()]
        if tracked:
            torch.autograd.graph.increment_version(tracked)


def _fill_from_memory(fills: Sequence[Fill], tensors: Mapping[str, torch.Tensor], sources: Mapping[str, Source],
                      prog: Progress) -> None:
    """Copy the records held in memory (``Source.held``) into their targets."""
    with torch.no_grad():
        for fl in fills:
            s = sources[fl.source]
            if s.nbytes:
                assert s.held is not None
                values = torch.frombuffer(s.held, dtype=torch.uint8)[s.file_offset:s.file_offset + s.nbytes]
                values = values.view(s.dtype)
                values = values.view(s.shape) if s.stride is None else values.as_strided(s.shape, s.stride)
                tensors[fl.target].copy_(values)  # converts where dtypes differ
            prog.advance(s.nbytes)


def run_fills(plan: IntoPlan, tensors: Mapping[str, torch.Tensor], sources: Mapping[str, Source],
              file_sizes: Mapping[str, int], shape: ReadShape, progress: ProgressArg,
              device: torch.device | None = None, held: bool = False,
              digesting: Digesting | None = None, resident: bool = True) -> None:
    """Read every fill of ``plan``, file by file (in ``file_sizes``' order) and device by device
    (``device``: the one device of every target, where the caller knows there is one).
    ``held``: whether some sources hold their bytes in memory (they are copied in first).
    ``digesting``: with ``verify=``, where the records read are hashed (the direct fills into host
    memory run by run as they land; staged records before their copy). ``resident``: whether
    direct fills onto a GPU may go through the resident loader (not for a verified load).

    Raises
    ------
    PartialLoadError
        A read, a file that changed size, or a copy failed; the error names what was filled.
    """
    by_file: dict[str, dict[torch.device, tuple[list[Fill], list[Fill]]]] = {p: {} for p in file_sizes}
    from_file, from_memory = plan.fills, ()
    if held:
        from_memory = tuple(fl for fl in plan.fills if sources[fl.source].held is not None)
        from_file = tuple(fl for fl in plan.fills if sources[fl.source].held is None)
    if len(file_sizes) == 1 and from_file and device is not None:
        # One file, one device (most loads): no lookups per fill to sort them.
        (path,), dev = file_sizes, device
        direct = [fl for fl in from_file if not fl.staged]
        staged = [fl for fl in from_file if fl.staged]
        if direct or staged:
            by_file[path][dev] = (direct, staged)
        total = sum([sources[fl.source].nbytes for fl in plan.fills])
    else:
        total = 0
        for fl in from_memory:
            total += sources[fl.source].nbytes
        for fl in from_file:
            s = sources[fl.source]
            total += s.nbytes
            per_device = by_file[s.path]
            dev = tensors[fl.target].device
            lists = per_device.get(dev)
            if lists is None:
                lists = per_device[dev] = ([], [])
            lists[fl.staged].append(fl)  # [0]: direct, [1]: staged
    done: list[Fill] = []
    copying: set[torch.device] = set()  # GPUs with copies queued on torch's stream
    queued: set[str] = set()  # the targets of those copies
    syncing = False
    try:
        with Progress(total, progress, "loading") as prog:
            if from_memory:
                _fill_from_memory(from_memory, tensors, sources, prog)
                done.extend(from_memory)
            if resident and digesting is None:  # verified loads are checked here, where the bytes land
                done.extend(_fill_through_resident(by_file, file_sizes, tensors, sources, prog))
            for path, per_device in by_file.items():
                if not any(direct or staged for direct, staged in per_device.values()):
                    continue
                with open_file(path, "r") as f:
                    if f.size != file_sizes[path]:
                        raise TruncatedFileError(f"{path} changed size after its header was read "
                                                 f"({file_sizes[path]} -> {f.size} bytes)")
                    for dev, (direct, staged) in per_device.items():
                        for run in _direct_runs(direct, sources, dev, digesting):
                            if _fill_direct(f, dev, run, tensors, sources, shape, prog, digesting):
                                copying.add(dev)
                                queued.update(fl.target for fl in run)
                            done.extend(run)
                            if digesting is not None and digesting.checks.overlaps(dev):
                                digesting.landed([(fl.source, tensors[fl.target]) for fl in run], dev)
                        for batch in _staged_batches(staged, sources):
                            _fill_staged(f, dev, batch, tensors, sources, shape, prog, digesting)
                            if dev.type == "cuda":
                                copying.add(dev)
                                queued.update(fl.target for fl in batch)
                            done.extend(batch)
        syncing = True
        for dev in copying:  # a copy that failed on the GPU says so here
            torch.cuda.current_stream(dev).synchronize()
    except Exception as exc:
        if syncing:  # which queued copy failed is unknown
            done = [d for d in done if d.target not in queued]
        filled = plan.filled_names(done)
        known = set(filled)
        unfilled = [n for n in plan.filled_names() if n not in known]
        raise PartialLoadError(f"the load failed after it had started filling the target ({type(exc).__name__}: "
                               f"{exc}); {len(filled)} tensors are filled, {len(unfilled)} may hold anything "
                               "(see .filled and .unfilled)", filled, unfilled) from exc
    finally:
        _mark_modified(tensors[n] for n in plan.filled_names(done))


def _finish(items: Sequence[tuple[str, torch.Tensor]], infos: Sequence[TargetInfo],
            records: Mapping[str, Any], sources: Mapping[str, Source], file_sizes: Mapping[str, int],
            shape: ReadShape, *, strict: bool, cast: bool, progress: ProgressArg, return_stats: bool,
            extra_unexpected: Sequence[str] = (), record_names: Iterable[str] | None = None,
            held: bool = False, expect: Mapping[str, Expectation] | None = None, resident: bool = True) -> Any:
    plan = plan_into(infos, records, cast=cast, record_names=record_names)
    unexpected = list(plan.unexpected_keys) + [n for n in extra_unexpected if n not in plan.unexpected_keys]
    if strict and (plan.missing_keys or unexpected):
        raise key_mismatch(plan.missing_keys, unexpected)
    tensors = dict(items)
    _check_conversions(plan, tensors, sources)
    before = stats() if return_stats else None
    devices = {t.device for t in infos}
    one_device = tensors[infos[0].name].device if len(devices) == 1 else None
    with LoadChecks(bool(expect)) as checks:
        digesting = Digesting(checks) if expect else None
        run_fills(plan, tensors, sources, file_sizes, shape, progress, one_device, held, digesting, resident)
        digests = digesting.digests() if digesting is not None else {}
    if expect:
        _verify_fills(plan, tensors, sources, expect, digests)
    result = LoadResult(list(plan.missing_keys), unexpected)
    if return_stats:
        return result, stats_delta(before, stats())
    return result


def _verify_fills(plan: IntoPlan, tensors: Mapping[str, torch.Tensor], sources: Mapping[str, Source],
                  expect: Mapping[str, Expectation], digests: dict[str, str]) -> None:
    """Check every fill's bytes against its file's digests (``digests``: those hashed while the
    fills ran; the other targets filled straight from the file are hashed where they lie now).

    Raises
    ------
    ChecksumMismatchError
        Naming the first record that differs; ``filled`` the targets whose bytes match, ``unfilled``
        those that do not (their memory holds what was read).
    """
    direct = [fl for fl in plan.fills
              if not fl.staged and sources[fl.source].held is None and fl.source not in digests]
    if direct:
        digests.update(tensor_digests([(fl.source, tensors[fl.target]) for fl in direct]))
    for fl in plan.fills:
        s = sources[fl.source]
        if fl.source not in digests and s.held is not None:
            digests[fl.source] = blake3_hex(memoryview(s.held)[s.file_offset:s.file_offset + s.nbytes])
    bad = []
    for fl in plan.fills:
        exp = expect[sources[fl.source].path]
        want = exp.tensors.get(fl.source)
        if want is None:
            raise NothingToVerifyError(f"{exp.path}: {exp.source} records no digest of tensor {fl.source!r}",
                                       path=exp.path)
        if digests[fl.source] != want:
            bad.append(fl)
    if bad:
        good = [fl for fl in plan.fills if fl not in bad]
        first, s = bad[0], sources[bad[0].source]
        exp = expect[s.path]
        raise mismatch(exp, first.source, (s.file_offset, s.file_offset + s.nbytes), exp.tensors[first.source],
                       digests[first.source], filled=plan.filled_names(good), unfilled=plan.filled_names(bad))


# -- safetensors ----------------------------------------------------------------

#: ``torch_type(torch, entry)``: the torch dtype and shape of a safetensors header entry.
TorchType = Callable[[Any, Any], tuple[Any, tuple[int, ...]]]


def load_safetensors_into(target: Any, path_or_paths: Any, *, torch_type: TorchType, shape: ReadShape,
                          strict: bool, cast: bool, progress: ProgressArg, return_stats: bool,
                          index: ShardIndex | None = None, verify: Any = False) -> Any:
    """:func:`gdskit.safetensors.load_into`, which passes its dtype table (``torch_type``) and
    read shape: this module never imports the API modules above it. ``index``: the
    checkpoint's headers where the caller has read them already (each file's size is still
    checked against its header when it is opened)."""
    with collector_paused():  # the function's objects are gone when the collector comes back
        return _load_safetensors_into(target, path_or_paths, torch_type, shape, strict, cast, progress,
                                      return_stats, index, verify_mode(verify))


def _load_safetensors_into(target: Any, path_or_paths: Any, torch_type: TorchType, shape: ReadShape, strict: bool,
                           cast: bool, progress: ProgressArg, return_stats: bool, index: ShardIndex | None,
                           mode: VerifyMode = OFF) -> Any:
    items = target_tensors(target)
    infos = describe(items)
    if index is None:
        index = index_checkpoint(path_or_paths)
    located = index.tensors
    sources: dict[str, Source] = {}  # only the records a target asks for: the others are only reported
    dtypes: dict[str, torch.dtype] = {}  # safetensors dtype -> torch dtype, looked up once each
    make = tuple.__new__  # a named tuple without its Python-level __new__, per record
    for name, _t in items:
        loc = located.get(name)
        if loc is None:
            continue
        e = loc.entry
        dt = dtypes.get(e.dtype)
        if dt is None or e.dtype == "F4":  # F4 also halves the last dimension
            dt, shp = torch_type(torch, e)  # UnsupportedDtypeError for F6_*
            dtypes[e.dtype] = dt
        else:
            shp = e.shape
        sources[name] = make(Source, (loc.path, loc.file_offset, e.end - e.start, dt, shp, None, None))
    file_sizes = {p: h.file_size for p, h in index.headers}
    expect = None
    sha256 = None
    if mode.whole_file:
        sha256 = Sha256Check([p for p, _h in index.headers], mode)
    elif mode.on:  # nothing to check against is refused before a byte is read
        devices = {t.device for _n, t in items if t.device.type == "cuda"}
        expect = expectations([p for p, _h in index.headers], mode, {p: h.metadata for p, h in index.headers},
                              next(iter(devices)) if len(devices) == 1 else None)
    result = _finish(items, infos, sources, sources, file_sizes, shape, strict=strict, cast=cast,
                     progress=progress, return_stats=return_stats, record_names=located, expect=expect,
                     resident=not mode.on)
    if sha256 is not None:
        sha256.wait()
    return result


# -- torch.save archives --------------------------------------------------------

#: ``unpickle(torch, data, persistent_load, weights_only, map_location, where)``: gdskit.torch's
#: unpickler (``where``: the file its errors name).
Unpickle = Callable[[Any, bytes, Callable[[Any], Any], bool, Any, str], Any]


def _torch_records(path: str, weights_only: bool, file_kind: Callable[[str], tuple[str, int]],
                   unpickle: Unpickle, wanted: set[str],
                   whole: dict[str, str] | None = None) -> tuple[dict[str, Source], list[str], int]:
    """The tensors of the state dict in torch.save archive ``path`` (where their bytes lie),
    the names of entries that are not tensors, and the archive's size.

    The archive is read as :func:`gdskit.torch.load` reads it (the same checks, the same
    records, through :class:`~gdskit.formats.torch_zip.StorageRecords`), and closed before
    this returns. The pickle is unpickled onto storages on the meta device, which gives every
    tensor's storage, offset, shape and strides without reading or allocating any data; the
    records of ``wanted`` tensors that are not stored as they are (deflated) are inflated here,
    so that a record that does not inflate is refused before anything is filled.
    """
    from gdskit.formats.torch_zip import StorageRecords  # noqa: PLC0415 - import time

    try:
        kind, archive_size = file_kind(path)
    except OSError as exc:
        raise from_os_error(exc, path) from None
    if kind != "zip":
        raise FormatError(f"{path}: load_into reads torch.save zip archives (torch 1.6 and later); load this "
                          "one with gdskit.torch.load and Module.load_state_dict")
    archive = StorageRecords.open(torch, path, archive_size, path)
    try:
        why = archive.not_ours()
        if why == "torchscript":
            raise FormatError(f"{path}: a TorchScript archive or no data.pkl; load_into reads torch.save state dicts")
        if why is not None:
            raise FormatError(f"{path}: saved on a machine of the other byte order; load it with gdskit.torch.load")
        where, others = _state_records(archive, path, weights_only, unpickle, wanted, whole)
    finally:
        archive.close()
    return where, others, archive_size


def _state_records(archive: Any, path: str, weights_only: bool, unpickle: Unpickle,
                   wanted: set[str], whole: dict[str, str] | None = None) -> tuple[dict[str, Source], list[str]]:
    """``whole``, where given, receives for each tensor that covers all of its storage record
    (contiguous, from the record's first byte to its last) that record's name."""
    storages: dict[int, tuple[Any, Any]] = {}   # id(meta storage) -> (storage, record)

    def meta_storage(rec: Any) -> Any:
        storage = torch.UntypedStorage(rec.nbytes, device="meta")
        storages[id(storage)] = (storage, rec)
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=rec.dtype, _internal=True)

    # as gdskit.torch.load: a storage without bytes is not shared
    persistent_load = archive.persistent_loader(meta_storage, lambda rec, _typed: rec.nbytes > 0)
    obj = unpickle(torch, archive.record("data.pkl"), persistent_load, weights_only, None, path)
    # A meta storage grows to fit a tensor that reaches past it, where gdskit.torch.load's storages
    # (which cannot grow) refuse it: any tensor of the pickle, a state dict's entry or not.
    if any(storage.nbytes() > rec.nbytes for storage, rec in storages.values()):
        raise FormatError(f"{path}: a tensor of the checkpoint reaches past the end of its storage record")
    if not isinstance(obj, Mapping):
        raise FormatError(f"{path}: holds a {type(obj).__name__}, not a state dict (a mapping of names to tensors)")
    where: dict[str, Source] = {}
    others: list[str] = []
    inflated: dict[str, bytearray] = {}  # record name -> its bytes
    for name, t in obj.items():
        if not isinstance(name, str):
            raise FormatError(f"{path}: state dict names must be strings, got {type(name).__name__}")
        if not isinstance(t, torch.Tensor):
            others.append(name)
            continue
        found = storages.get(id(t.untyped_storage()))
        if found is None or t.layout is not torch.strided:
            raise FormatError(f"{path}: tensor {name!r} is not stored as plain bytes of the archive")
        _storage, rec = found
        es = t.element_size()
        start = t.storage_offset() * es
        if t.is_contiguous():
            nbytes, stride = t.numel() * es, None
        else:
            stride = tuple(t.stride())
            nbytes = (sum((n - 1) * s for n, s in zip(t.shape, stride)) + 1) * es if t.numel() else 0
        if whole is not None and start == 0 and nbytes == rec.nbytes and stride is None:
            whole[name] = rec.name
        if rec.raw:
            where[name] = Source(path, rec.offset + start, nbytes, t.dtype, tuple(t.shape), stride)
            continue
        held = None
        if name in wanted:  # the same decision as gdskit.torch.load's: StorageRecord.raw
            held = inflated.get(rec.name)
            if held is None:
                held = inflated[rec.name] = bytearray(archive.read(rec))
        where[name] = Source(path, start, nbytes, t.dtype, tuple(t.shape), stride, held)
    for _storage, rec in storages.values():  # gdskit.torch.load refuses any the pickle names that does not inflate
        if not rec.raw and rec.name not in inflated:
            archive.read(rec)
    return where, others


def load_torch_into(target: Any, path: str | os.PathLike[str], *, file_kind: Callable[[str], tuple[str, int]],
                    unpickle: Unpickle, shape: ReadShape, strict: bool, cast: bool, progress: ProgressArg,
                    return_stats: bool, weights_only: bool, verify: Any = False) -> Any:
    """:func:`gdskit.torch.load_into`, which passes its archive check (``file_kind``), its
    unpickler and its read shape: this module never imports the API modules above it."""
    path = os.fspath(path)
    mode = verify_mode(verify)
    with collector_paused():  # the function's objects are gone when the collector comes back
        if not mode.whole_file:
            return _load_torch_into(target, path, file_kind, unpickle, shape, strict, cast, progress, return_stats,
                                    weights_only, mode)
        check = Sha256Check([path], mode)
        try:
            result = _load_torch_into(target, path, file_kind, unpickle, shape, strict, cast, progress,
                                      return_stats, weights_only)
        finally:
            check.wait()
        return result


def _load_torch_into(target: Any, path: str, file_kind: Callable[[str], tuple[str, int]], unpickle: Unpickle, shape: ReadShape,
                     strict: bool, cast: bool, progress: ProgressArg, return_stats: bool, weights_only: bool,
                     mode: VerifyMode = OFF) -> Any:
    items = target_tensors(target)
    infos = describe(items)
    wanted = {name for name, _ in items}
    whole: dict[str, str] | None = {} if mode.on else None
    records, others, size = _torch_records(path, weights_only, file_kind, unpickle, wanted, whole)
    sources = {n: s for n, s in records.items() if n in wanted}  # the others are only reported
    held = any(s.held is not None for s in sources.values())
    expect = None
    if whole is not None:
        expect = {path: _record_digests(path, mode, sources, whole)}
    return _finish(items, infos, records, sources, {path: size}, shape, strict=strict, cast=cast,
                   progress=progress, return_stats=return_stats, extra_unexpected=others, held=held, expect=expect)


def _record_digests(path: str, mode: VerifyMode, sources: Mapping[str, Source], whole: Mapping[str, str]) -> Expectation:
    """The manifest's digests of a torch.save archive's storage records, by the state-dict names of
    the tensors that cover their records whole. A tensor that is part of its record is refused."""
    (exp,) = expectations([path], mode).values()
    partial = sorted(n for n in sources if n not in whole)
    if partial:
        raise NothingToVerifyError(f"{path}: tensor {partial[0]!r} is part of a storage record, whose digest covers "
                                   "the whole record: load the file with gdskit.torch.load(verify=...) to check it",
                                   path=path)
    return dataclasses.replace(exp, tensors={n: exp.tensors[r] for n, r in whole.items() if r in exp.tensors})
