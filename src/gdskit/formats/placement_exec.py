"""The placement plan on a live model: the facts its layers carry, and reads straight into them.

The torch side of :mod:`gdskit.formats.placement` (imports torch, never vLLM). vLLM's layers
are recognised by their class name (exactly: a subclass may shard otherwise, so it is left
to the model's own loader) and read through the attributes vLLM sets on them; anything
missing, of another type, or disagreeing with the arithmetic leaves that parameter to the
model's own ``load_weights``. What is read (docs/models.md lists it):

- every planned layer: ``tp_rank`` and ``tp_size`` (ints; a layer without ``tp_rank``, as
  vLLM 0.26's embeddings, takes the rank of the parallel group the caller names, whose size
  must be the layer's ``tp_size``); its parameters' ``output_dim``,
  ``input_dim``; where a parameter carries ``tp_rank``/``tp_size`` (vLLM's
  ``BasevLLMParameter``), they equal the layer's; ``is_sharded_weight`` and ``packed_dim``
  absent or false/None;
- linear layers (``ReplicatedLinear``, ``ColumnParallelLinear``, ``RowParallelLinear``,
  ``QKVParallelLinear``, ``MergedColumnParallelLinear``): ``quant_method`` of class
  ``UnquantizedLinearMethod``; QKV: ``total_num_heads``, ``total_num_kv_heads``,
  ``head_size``, ``v_head_size`` (else ``head_size``), checked against ``num_heads``,
  ``num_kv_heads``, ``num_kv_head_replicas``; merged: ``output_sizes``;
- ``VocabParallelEmbedding``/``ParallelLMHead``: ``quant_method`` (or older vLLM's
  ``linear_method``) of class ``UnquantizedEmbeddingMethod`` or ``UnquantizedLinearMethod``,
  ``org_vocab_size``, ``num_embeddings``, ``padding_size``, checked against
  ``num_embeddings_per_partition`` and ``shard_indices.org_vocab_start_index``/``_end_index``;
- ``RMSNorm``: its ``weight``, loaded whole (its ``weight_loader`` absent or vLLM's
  ``default_weight_loader``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from gdskit.engine import adapt, open_file
from gdskit.formats import through_resident
from gdskit.formats.placement import (LayerKind, ParamFacts, Placement, PlacementPlan, QKVHeads, Record,
                                      Uncovered, VocabSplit, plan_placements, qkv_split, vocab_rows)
from gdskit.formats.safetensors_format import TruncatedFileError
from gdskit.formats.shard_index import ShardIndex

#: ``() -> (rank, size)`` of the tensor-parallel group, for layers that do not keep their rank.
ParallelRank = Callable[[], tuple[int, int]]

#: Model classes whose ``load_weights`` only maps names (``q_proj`` -> ``qkv_proj`` and so on)
#: and calls each parameter's weight loader: their tensors may be placed. Any other model
#: goes through its own ``load_weights`` whole. Each was compared byte for byte with vLLM's own
#: loader on the CPU (vLLM 0.33, tests/api/test_vllm_families.py). Mistral's own checkpoint
#: format (``layers.0.attention.wq.weight``, permuted by its ``load_weights``) names no
#: parameter, so its tensors all go to ``load_weights``.
PLAIN_MODELS = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})

_LINEAR = {"ReplicatedLinear": LayerKind.REPLICATED, "ColumnParallelLinear": LayerKind.COLUMN,
           "RowParallelLinear": LayerKind.ROW, "QKVParallelLinear": LayerKind.QKV,
           "MergedColumnParallelLinear": LayerKind.MERGED_COLUMN}
_VOCAB = frozenset({"VocabParallelEmbedding", "ParallelLMHead"})
_NORMS = frozenset({"RMSNorm"})
_UNQUANTIZED_EMBEDDING = frozenset({"UnquantizedEmbeddingMethod", "UnquantizedLinearMethod"})
_DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


class _NotPlanned(Exception):
    """A parameter left to the model's own loader (internal)."""


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What :func:`model_facts` found: ``params`` described, ``tensors`` (their memory, by
    name), ``unplanned`` (the others, with why)."""

    params: dict[str, ParamFacts]
    tensors: dict[str, torch.Tensor]
    unplanned: dict[str, str]


@dataclasses.dataclass(frozen=True)
class PlacementReport:
    """How a load's tensors went: ``placed`` straight into their parameters (``placed_bytes``
    read by this rank), ``fallback`` through the model's own ``load_weights``
    (``fallback_bytes``, their size in the checkpoint); ``reasons``: why, with how many
    tensors, most first. ``planned`` is False where the plan was off or not made (then every
    tensor is a fallback)."""

    planned: bool
    placed: int = 0
    placed_bytes: int = 0
    fallback: int = 0
    fallback_bytes: int = 0
    reasons: tuple[tuple[str, int], ...] = ()


def model_facts(model: torch.nn.Module, parallel_rank: ParallelRank | None = None) -> ModelFacts:
    """Describe every parameter of ``model`` (``named_parameters``' names: a tied one once).
    ``parallel_rank``: the tensor-parallel group's rank and size, for layers without ``tp_rank``."""
    modules = dict(model.named_modules())
    params: dict[str, ParamFacts] = {}
    tensors: dict[str, torch.Tensor] = {}
    unplanned: dict[str, str] = {}
    for name, param in model.named_parameters():
        prefix, _, attr = name.rpartition(".")
        try:
            facts = _describe(name, modules.get(prefix), attr, param, parallel_rank)
        except _NotPlanned as why:
            unplanned[name] = str(why)
            continue
        params[name] = facts
        tensors[name] = param.data
    return ModelFacts(params, tensors, unplanned)


def _int(obj: Any, attr: str) -> int:
    value = getattr(obj, attr, None)
    if type(value) is not int:
        raise _NotPlanned(f"{type(obj).__name__}.{attr} is {value!r}")
    return value


def _dims(param: Any) -> tuple[int | None, int | None]:
    out = []
    for attr in ("output_dim", "input_dim"):
        value = getattr(param, attr, None)
        if value is not None and type(value) is not int:
            raise _NotPlanned(f"{attr} is {value!r}")
        out.append(value)
    return out[0], out[1]


def _describe(name: str, module: Any, attr: str, param: torch.Tensor, parallel: ParallelRank | None) -> ParamFacts:
    dtype = _DTYPE_NAMES.get(param.dtype)
    if dtype is None:
        raise _NotPlanned(f"dtype {param.dtype}")
    if param.device.type not in ("cpu", "cuda") or param.layout is not torch.strided or not param.is_contiguous():
        raise _NotPlanned("not plain contiguous memory")
    if getattr(param, "is_sharded_weight", False) or getattr(param, "packed_dim", None) is not None:
        raise _NotPlanned("a pre-sharded or packed parameter")
    kind_name = type(module).__name__
    shape = tuple(param.shape)
    if kind_name in _NORMS:
        loader = getattr(param, "weight_loader", None)
        if attr != "weight" or (loader is not None and getattr(loader, "__name__", "") != "default_weight_loader"):
            raise _NotPlanned(f"{kind_name}.{attr} with its own weight loader")
        return ParamFacts(name, LayerKind.REPLICATED, shape, dtype)
    if kind_name in _LINEAR:
        return _describe_linear(name, module, _LINEAR[kind_name], param, shape, dtype, parallel)
    if kind_name in _VOCAB:
        return _describe_vocab(name, module, param, shape, dtype, parallel)
    raise _NotPlanned(f"layer {kind_name} is not planned")


def _rank(module: Any, param: Any, parallel: ParallelRank | None) -> tuple[int, int]:
    size = _int(module, "tp_size")
    if getattr(module, "tp_rank", None) is None and parallel is not None:
        try:
            rank, group = parallel()
        except Exception as exc:  # noqa: BLE001 - no group to ask: the layer is left to load_weights
            raise _NotPlanned(f"no tp_rank, and the parallel group's rank is unknown ({type(exc).__name__})") from None
        if type(rank) is not int or group != size:
            raise _NotPlanned(f"no tp_rank, and the parallel group ({rank!r} of {group!r}) is not the layer's {size}")
    else:
        rank = _int(module, "tp_rank")
    for attr, value in (("tp_rank", rank), ("tp_size", size)):
        own = getattr(param, attr, value)
        if own != value:
            raise _NotPlanned(f"the parameter's {attr} {own!r} is not the layer's {value}")
    return rank, size


def _describe_linear(name: str, module: Any, kind: LayerKind, param: Any, shape: tuple[int, ...],
                     dtype: str, parallel: ParallelRank | None) -> ParamFacts:
    method = type(getattr(module, "quant_method", None)).__name__
    if method != "UnquantizedLinearMethod":
        raise _NotPlanned(f"quantization method {method}")
    rank, size = _rank(module, param, parallel)
    output_dim, input_dim = _dims(param)
    heads, sizes = None, ()
    if kind is LayerKind.QKV:
        hs = _int(module, "head_size")
        v_hs = getattr(module, "v_head_size", hs)
        heads = QKVHeads(_int(module, "total_num_heads"), _int(module, "total_num_kv_heads"), hs,
                         v_hs if type(v_hs) is int else -1)
        try:
            split = qkv_split(heads, size)
        except ValueError as exc:
            raise _NotPlanned(str(exc)) from None
        if split != (_int(module, "num_heads"), _int(module, "num_kv_heads"), _int(module, "num_kv_head_replicas")):
            raise _NotPlanned("head counts disagree with the arithmetic")
    elif kind is LayerKind.MERGED_COLUMN:
        raw = getattr(module, "output_sizes", None)
        if not isinstance(raw, Sequence) or not all(type(s) is int for s in raw):
            raise _NotPlanned(f"output_sizes is {raw!r}")
        sizes = tuple(raw)
    return ParamFacts(name, kind, shape, dtype, rank, size, output_dim, input_dim, sizes, heads)


def _describe_vocab(name: str, module: Any, param: Any, shape: tuple[int, ...], dtype: str,
                    parallel: ParallelRank | None) -> ParamFacts:
    method = getattr(module, "quant_method", None) or getattr(module, "linear_method", None)
    if type(method).__name__ not in _UNQUANTIZED_EMBEDDING:
        raise _NotPlanned(f"quantization method {type(method).__name__}")
    rank, size = _rank(module, param, parallel)
    output_dim, input_dim = _dims(param)
    vocab = VocabSplit(_int(module, "org_vocab_size"), _int(module, "num_embeddings"), _int(module, "padding_size"))
    try:
        first, end, per_rank = vocab_rows(vocab, rank, size)
    except ValueError as exc:
        raise _NotPlanned(str(exc)) from None
    indices = getattr(module, "shard_indices", None)
    if (_int(module, "num_embeddings_per_partition"), _int(indices, "org_vocab_start_index"),
            _int(indices, "org_vocab_end_index")) != (per_rank, first, end):
        raise _NotPlanned("the layer's vocabulary rows disagree with the arithmetic")
    return ParamFacts(name, LayerKind.VOCAB, shape, dtype, rank, size, output_dim, input_dim, vocab=vocab)


def plan_model(model: torch.nn.Module, index: ShardIndex,
               parallel_rank: ParallelRank | None = None) -> tuple[PlacementPlan, dict[str, torch.Tensor]]:
    """The plan for ``model`` from the checkpoint ``index`` describes, and the parameters'
    memory by name (``parallel_rank``: as :func:`model_facts` takes it). A model whose class
    is not in :data:`PLAIN_MODELS` gets a plan that places nothing."""
    records = [Record(name, loc.path, loc.file_offset, loc.entry.nbytes, loc.entry.dtype, tuple(loc.entry.shape))
               for name, loc in index.tensors.items()]
    if type(model).__name__ not in PLAIN_MODELS:
        why = f"model {type(model).__name__} is not planned"
        return PlacementPlan((), tuple(Uncovered(r.name, why, r.nbytes) for r in records)), {}
    found = model_facts(model, parallel_rank)
    for alias, param in tied_names(model).items():
        if alias in index.tensors and param in found.params:
            del found.params[param]
            found.unplanned[param] = f"tied to {alias}, which the checkpoint also holds: the model's loader decides"
    packed = getattr(model, "packed_modules_mapping", None)
    if not _is_packing(packed):
        packed = {}
    return plan_placements(found.params, records, packed, found.unplanned), found.tensors


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """Each other name of a parameter reached under two names (an LM head tied to the
    embeddings), with the name ``named_parameters`` lists it by. A checkpoint tensor of such a
    name goes to the model's ``load_weights``, which skips it (vLLM 0.33 then insists on being
    given the parameter under its own name), so that parameter is left to it too."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        name_before = first.setdefault(id(param), name)
        if name_before != name:
            out[name] = name_before
    return out


def _is_packing(packed: Any) -> bool:
    return isinstance(packed, Mapping) and all(
        isinstance(k, str) and isinstance(v, Sequence) and not isinstance(v, str) and all(isinstance(x, str) for x in v)
        for k, v in packed.items())


def read_placements(plan: PlacementPlan, tensors: Mapping[str, torch.Tensor],
                    file_sizes: Mapping[str, int]) -> int:
    """Read every placement's runs straight into its parameter's memory and zero its padding;
    returns the bytes read. Per file, the single runs of all placements go to the engine as
    one job (``File.read_many``); a placement of many runs of one size (a row-parallel shard:
    one run per row) goes as one ``File.read_batch`` into its parameter.

    Where the resident loader (``gdskit serve``) is worth asking (:mod:`gdskit.formats.through_resident`)
    and no placement is a row-parallel shard, every run goes to it first, all files in one request.

    Raises
    ------
    TruncatedFileError
        A file's size is not its header's, or a read came back short.
    """
    total = _read_through_resident(plan, tensors, file_sizes)
    if total is None:
        total = _read_here(plan, tensors, file_sizes)
    with torch.no_grad():
        for pl in plan.placements:
            if pl.zero_fill:
                flat = tensors[pl.param].view(-1).view(torch.uint8)
                for start, nbytes in pl.zero_fill:
                    flat[start:start + nbytes].zero_()
    return total


def _read_through_resident(plan: PlacementPlan, tensors: Mapping[str, torch.Tensor],
                           file_sizes: Mapping[str, int]) -> int | None:
    """Every run read by the resident loader: the bytes read, or None where it was not asked or
    did not serve (the caller reads them all itself)."""
    if any(_batched(pl) for pl in plan.placements):
        # A row-parallel shard is a run per row (262,144 for a Llama-8B shape at two ranks):
        # one batched read each here, where the loader would take every row as a read.
        return None
    params = {pl.param: tensors[pl.param] for pl in plan.placements}
    devices = {t.device for t in params.values()}
    if len(devices) != 1 or not all(t.is_contiguous() for t in params.values()):
        return None
    device = devices.pop()
    sizes = [r.nbytes for pl in plan.placements for r in pl.runs]
    paths = list(dict.fromkeys(pl.path for pl in plan.placements))
    if not through_resident.worth_asking(torch, device, sizes, paths):
        return None
    index = {p: k for k, p in enumerate(paths)}
    base = {name: t.data_ptr() for name, t in params.items()}
    targets = [(base[pl.param] + r.dest_offset, r.nbytes, index[pl.path], r.file_offset)
               for pl in plan.placements for r in pl.runs]
    served = through_resident.fill(torch, device, [(p, file_sizes[p]) for p in paths], targets)
    return sum(sizes) if served else None


def _read_here(plan: PlacementPlan, tensors: Mapping[str, torch.Tensor], file_sizes: Mapping[str, int]) -> int:
    by_file: dict[str, tuple[list[tuple[Any, int, int, int]], list[tuple[Any, Placement]]]] = {}
    views: dict[str, Any] = {}
    for pl in plan.placements:
        view = views.get(pl.param)
        if view is None:
            view = views[pl.param] = adapt(tensors[pl.param])
        single, batches = by_file.setdefault(pl.path, ([], []))
        if _batched(pl):
            batches.append((view, pl))
        else:
            single.extend((view, r.nbytes, r.file_offset, r.dest_offset) for r in pl.runs)
    total = 0
    for path, (single, batches) in by_file.items():
        with open_file(path, "r") as f:
            if f.size != file_sizes[path]:
                raise TruncatedFileError(f"{path} changed size after its header was read "
                                         f"({file_sizes[path]} -> {f.size} bytes)")
            got = f.read_many(single) if single else []
            want = [r[1] for r in single]
            for view, pl in batches:
                size = pl.runs[0].nbytes
                got += f.read_batch(view, [r.file_offset for r in pl.runs], size, [r.dest_offset for r in pl.runs])
                want += [size] * len(pl.runs)
        if got != want:
            raise TruncatedFileError(f"{path}: a read came back short (the file shrank while it was read)")
        total += sum(got)
    return total


def _batched(pl: Placement) -> bool:
    """Whether ``pl`` is read as one batch: many runs of one size (a row-parallel shard, a run per row)."""
    return len(pl.runs) > 1 and len({r.nbytes for r in pl.runs}) == 1


def report(plan: PlacementPlan | None, fallback: int, fallback_bytes: int) -> PlacementReport:
    """What ``plan`` placed (None: no plan was made), and the ``fallback`` tensors
    (``fallback_bytes``) handed to the model's own ``load_weights``."""
    if plan is None:
        return PlacementReport(False, fallback=fallback, fallback_bytes=fallback_bytes)
    reasons: dict[str, int] = {}
    for u in plan.uncovered:
        reasons[u.why] = reasons.get(u.why, 0) + 1
    return PlacementReport(True, len(plan.placements), sum(p.nbytes for p in plan.placements), fallback,
                           fallback_bytes, tuple(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))))
